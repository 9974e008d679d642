use std::path::PathBuf;

/// Every way loading or running a model can fail. Bad input must end here, never in a panic.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Gguf(#[from] crate::gguf::GgufError),
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
}
