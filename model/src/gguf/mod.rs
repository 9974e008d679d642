//! GGUF v2/v3 reader (placeholder: being written in the gguf branch).
mod value;
pub use value::GgufValue;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{0}")]
    Format(String),
}
