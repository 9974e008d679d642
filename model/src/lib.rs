//! Model runtime: configs, loaders (GGUF, safetensors + config.json, tokenizer), the decoder-only
//! transformer architectures (llama, qwen2, qwen3) on the CPU reference backend, and the paged KV cache.

pub mod config;
pub mod error;
pub mod gguf;
pub mod gguf_source;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod kv_cache;
pub mod loader;
pub mod random;
pub mod source;
pub mod tokenizer;
pub mod transformer;

pub use config::{Arch, ModelConfig};
pub use error::ModelError;
pub use kv_cache::{PagedKvCache, SeqId};
pub use source::{SafetensorsSource, TensorSource, WeightDtype};
pub use transformer::{ForwardOutput, SeqInput, Transformer};
