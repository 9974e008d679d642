//! Engine: requests, the decode loop, metrics. Plain (non-speculative) generation lives here now;
//! the speculative loop builds on the same request/stats types.

pub mod generate;
pub mod stats;

pub use generate::{generate, FinishReason, GenerationOutput, GenerationRequest};
pub use stats::{GenerationStats, LatencySummary};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] specula_model::ModelError),
    #[error(transparent)]
    Sampling(#[from] specula_kernels::sampling::SamplingError),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
}
