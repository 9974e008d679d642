//! Compute backends. `cpu` is the reference every other path is checked against: it is always built,
//! runs on rayon, and is *batch-invariant* — the value computed for one token never depends on how many
//! other tokens or sequences share the call (greedy speculative decoding is exact only because of this).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod matrix;
pub mod philox;
pub mod sampling;

pub use matrix::{Matrix, MatrixData};
