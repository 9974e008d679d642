//! GGUF checkpoints as a `TensorSource`: llama.cpp tensor names mapped to HF names, the model config
//! read from `{arch}.*` metadata, quantised weights dequantised at load, and llama.cpp's Q/K row
//! permutation undone for `llama` checkpoints so one rotate-half RoPE serves every format.

use crate::config::{Arch, ModelConfig};
use crate::error::ModelError;
use crate::gguf::{GgmlType, GgufFile};
use crate::source::{TensorSource, TensorValues};
use half::bf16;

pub struct GgufSource {
    pub file: GgufFile,
    arch: Arch,
    num_heads: usize,
    num_kv_heads: usize,
}

/// HF tensor name -> llama.cpp tensor name.
fn gguf_name(hf: &str) -> Option<String> {
    match hf {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    let mapped = match tail {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "self_attn.o_proj.bias" => "attn_output.bias",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        _ => return None,
    };
    Some(format!("blk.{layer}.{mapped}"))
}

/// Inverse of llama.cpp's `permute(w, n_head)`: within each head, GGUF row `2i + j` holds HF row
/// `j * head_dim/2 + i` (interleaved rotary pairs back to rotate-half order).
fn unpermute_rows<T: Copy>(values: &[T], n_heads: usize, row_len: usize) -> Vec<T> {
    let rows = values.len() / row_len;
    let head_dim = rows / n_heads;
    let half = head_dim / 2;
    let mut out = Vec::with_capacity(values.len());
    for h in 0..n_heads {
        for j in 0..2 {
            for i in 0..half {
                let src = h * head_dim + 2 * i + j;
                out.extend_from_slice(&values[src * row_len..(src + 1) * row_len]);
            }
        }
    }
    out
}

impl GgufSource {
    pub fn new(file: GgufFile) -> Result<(GgufSource, ModelConfig), ModelError> {
        let config = config_from_gguf(&file)?;
        let source = GgufSource {
            file,
            arch: config.arch,
            num_heads: config.num_heads,
            num_kv_heads: config.num_kv_heads,
        };
        Ok((source, config))
    }
}

impl TensorSource for GgufSource {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let info = self.file.tensor_info(&gguf_name(name)?).ok()?;
        Some(
            info.shape_outermost_first()
                .into_iter()
                .map(|d| d as usize)
                .collect(),
        )
    }

    fn read(&self, name: &str, prefer_bf16: bool) -> Result<TensorValues, ModelError> {
        let gname = gguf_name(name).ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        let info = self.file.tensor_info(&gname)?;
        let row_len = info.dims.first().copied().unwrap_or(1) as usize;
        let mut values = self.file.dequantize_f32(&gname)?;
        if self.arch == Arch::Llama {
            let heads = if gname.ends_with("attn_q.weight") || gname.ends_with("attn_q.bias") {
                Some(self.num_heads)
            } else if gname.ends_with("attn_k.weight") || gname.ends_with("attn_k.bias") {
                Some(self.num_kv_heads)
            } else {
                None
            };
            if let Some(n) = heads {
                let row_len = if info.dims.len() == 1 { 1 } else { row_len };
                values = unpermute_rows(&values, n, row_len);
            }
        }
        let keep_bf16 = prefer_bf16 && !matches!(info.ggml_type, GgmlType::F32);
        Ok(if keep_bf16 {
            TensorValues::Bf16(values.iter().map(|&x| bf16::from_f32(x)).collect())
        } else {
            TensorValues::F32(values)
        })
    }

    fn describe(&self) -> String {
        self.file.path().display().to_string()
    }
}

/// Reads the architecture from `general.architecture` and `{arch}.*` keys, as llama.cpp writes them.
pub fn config_from_gguf(f: &GgufFile) -> Result<ModelConfig, ModelError> {
    let arch_name = f.get_str("general.architecture")?;
    let arch = Arch::parse(arch_name)?;
    let key = |k: &str| format!("{arch_name}.{k}");
    let usize_key = |k: &str| -> Result<usize, ModelError> { Ok(f.get_u64(&key(k))? as usize) };
    let opt_usize = |k: &str| {
        f.metadata
            .get(&key(k))
            .and_then(|v| v.as_u64())
            .map(|v| v as usize)
    };
    let hidden_size = usize_key("embedding_length")?;
    let num_heads = usize_key("attention.head_count")?;
    if num_heads == 0 {
        return Err(ModelError::Config(format!(
            "{}: attention.head_count is 0",
            f.path().display()
        )));
    }
    let embed = f.tensor_info("token_embd.weight")?;
    let vocab_size = embed.shape_outermost_first().first().copied().unwrap_or(0) as usize;
    let rope_freq_factors = if f.contains_tensor("rope_freqs.weight") {
        Some(f.dequantize_f32("rope_freqs.weight")?)
    } else {
        None
    };
    let id = |k: &str| f.metadata.get(k).and_then(|v| v.as_u64()).map(|v| v as u32);
    let config = ModelConfig {
        arch,
        vocab_size,
        hidden_size,
        intermediate_size: usize_key("feed_forward_length")?,
        num_layers: usize_key("block_count")?,
        num_heads,
        num_kv_heads: opt_usize("attention.head_count_kv").unwrap_or(num_heads),
        head_dim: opt_usize("attention.key_length").unwrap_or(hidden_size / num_heads),
        rms_norm_eps: f
            .metadata
            .get(&key("attention.layer_norm_rms_epsilon"))
            .and_then(|v| v.as_f64())
            .unwrap_or(1e-6) as f32,
        rope_theta: f
            .metadata
            .get(&key("rope.freq_base"))
            .and_then(|v| v.as_f64())
            .unwrap_or(10000.0),
        rope_scaling: None,
        rope_freq_factors,
        max_position_embeddings: opt_usize("context_length").unwrap_or(4096),
        tie_word_embeddings: !f.contains_tensor("output.weight"),
        qkv_bias: arch == Arch::Qwen2 || f.contains_tensor("blk.0.attn_q.bias"),
        o_bias: f.contains_tensor("blk.0.attn_output.bias"),
        qk_norm: arch == Arch::Qwen3,
        bos_token_id: id("tokenizer.ggml.bos_token_id"),
        eos_token_ids: id("tokenizer.ggml.eos_token_id").into_iter().collect(),
    };
    config.validate()?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp: w.reshape(n_head, 2, head_dim/2, cols).swapaxes(1, 2).reshape(rows, cols)
        let (n_heads, head_dim, cols) = (2, 8, 3);
        let rows = n_heads * head_dim;
        let hf: Vec<u32> = (0..(rows * cols) as u32).collect();
        let mut permuted = vec![0u32; hf.len()];
        for h in 0..n_heads {
            for i in 0..head_dim / 2 {
                for j in 0..2 {
                    let dst = h * head_dim + 2 * i + j;
                    let src = h * head_dim + j * head_dim / 2 + i;
                    permuted[dst * cols..(dst + 1) * cols]
                        .copy_from_slice(&hf[src * cols..(src + 1) * cols]);
                }
            }
        }
        assert_eq!(unpermute_rows(&permuted, n_heads, cols), hf);
    }
}
