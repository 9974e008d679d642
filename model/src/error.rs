use std::path::PathBuf;

/// Every way loading or running a model can fail. Bad input must end here, never in a panic.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Gguf(#[from] crate::gguf::GgufError),
    #[error("{path}: {msg}")]
    Safetensors { path: PathBuf, msg: String },
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error("bad model config: {0}")]
    Config(String),
    #[error("checkpoint lacks tensor {0}")]
    MissingTensor(String),
    #[error("tensor {name} has shape {found:?}, but the config implies {expected:?}")]
    ShapeMismatch {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{0}")]
    UnknownFormat(String),
    #[error("no tokenizer for {0}: put a tokenizer.json beside the weights, or use a GGUF that embeds one")]
    MissingTokenizer(String),
    #[error(transparent)]
    KvCache(#[from] crate::kv_cache::KvCacheError),
    #[error("token id {id} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfRange { id: u32, vocab_size: usize },
    #[error("sequence would reach {needed} positions, beyond the context limit of {limit}")]
    ContextOverflow { needed: usize, limit: usize },
    #[error("{0}")]
    InvalidRequest(String),
    #[error("GPU: {0}")]
    Gpu(String),
}

#[cfg(feature = "cuda")]
impl From<specula_kernels::cuda::CudaError> for ModelError {
    fn from(e: specula_kernels::cuda::CudaError) -> Self {
        ModelError::Gpu(e.to_string())
    }
}
