//! Model runtime: configs, loaders (GGUF, safetensors + config.json, tokenizer), the decoder-only
//! transformer architectures (llama, qwen2, qwen3) on the CPU reference backend, and the paged KV cache.

pub mod error;
pub mod gguf;
pub mod tokenizer;

pub use error::ModelError;
