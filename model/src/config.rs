//! Architecture configuration, read from an HF `config.json` or from GGUF metadata.

use crate::error::ModelError;
use serde_json::Value;

/// The decoder-only families the runtime implements. They differ only in small switches
/// (`qkv_bias`, `qk_norm`), so one forward serves all three.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
}

impl Arch {
    pub fn parse(name: &str) -> Result<Arch, ModelError> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            other => Err(ModelError::Config(format!(
                "unsupported architecture {other:?} (supported: llama, qwen2, qwen3)"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }
}

/// Llama 3.x RoPE frequency scaling (`rope_type: "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Per-frequency divisors stored by llama.cpp for Llama 3 (`rope_freqs.weight`), used instead of
    /// `rope_scaling` when a GGUF carries them.
    pub rope_freq_factors: Option<Vec<f32>>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Biases on the q/k/v projections (Qwen2 always; Llama with `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama with `attention_bias`).
    pub o_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

fn get_usize(v: &Value, key: &str) -> Result<Option<usize>, ModelError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
            ModelError::Config(format!(
                "config.json: {key} must be a non-negative integer, got {x}"
            ))
        }),
    }
}

fn req_usize(v: &Value, key: &str) -> Result<usize, ModelError> {
    get_usize(v, key)?
        .ok_or_else(|| ModelError::Config(format!("config.json: missing required field {key}")))
}

fn get_f64(v: &Value, key: &str) -> Result<Option<f64>, ModelError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x.as_f64().map(Some).ok_or_else(|| {
            ModelError::Config(format!("config.json: {key} must be a number, got {x}"))
        }),
    }
}

fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect(),
        _ => Vec::new(),
    }
}

impl ModelConfig {
    /// Parses an HF `config.json` (transformers 4 `rope_theta`/`rope_scaling` or transformers 5
    /// `rope_parameters`).
    pub fn from_hf_json(text: &str) -> Result<ModelConfig, ModelError> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| ModelError::Config(format!("config.json is not valid JSON: {e}")))?;
        let model_type = v
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| ModelError::Config("config.json: missing model_type".into()))?;
        let arch = Arch::parse(model_type)?;
        let hidden_size = req_usize(&v, "hidden_size")?;
        let num_heads = req_usize(&v, "num_attention_heads")?;
        if num_heads == 0 {
            return Err(ModelError::Config(
                "config.json: num_attention_heads is 0".into(),
            ));
        }
        let num_kv_heads = get_usize(&v, "num_key_value_heads")?.unwrap_or(num_heads);
        let head_dim = get_usize(&v, "head_dim")?.unwrap_or(hidden_size / num_heads);
        let rope = v
            .get("rope_parameters")
            .or_else(|| v.get("rope_scaling"))
            .filter(|r| !r.is_null());
        let rope_theta = match rope
            .and_then(|r| r.get("rope_theta"))
            .and_then(Value::as_f64)
        {
            Some(t) => t,
            None => get_f64(&v, "rope_theta")?.unwrap_or(10000.0),
        };
        let rope_type = rope
            .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
            .and_then(Value::as_str);
        let rope_scaling = match rope_type {
            None | Some("default") => None,
            Some("llama3") => {
                let r = rope.expect("rope_type came from it");
                let f = |k: &str| {
                    r.get(k).and_then(Value::as_f64).ok_or_else(|| {
                        ModelError::Config(format!("config.json: llama3 rope scaling lacks {k}"))
                    })
                };
                Some(Llama3RopeScaling {
                    factor: f("factor")?,
                    low_freq_factor: f("low_freq_factor")?,
                    high_freq_factor: f("high_freq_factor")?,
                    original_max_position_embeddings: f("original_max_position_embeddings")?,
                })
            }
            Some(other) => {
                return Err(ModelError::Config(format!(
                    "config.json: unsupported rope_type {other:?} (supported: default, llama3)"
                )))
            }
        };
        let attention_bias = v
            .get("attention_bias")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let config = ModelConfig {
            arch,
            vocab_size: req_usize(&v, "vocab_size")?,
            hidden_size,
            intermediate_size: req_usize(&v, "intermediate_size")?,
            num_layers: req_usize(&v, "num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: get_f64(&v, "rms_norm_eps")?.unwrap_or(1e-6) as f32,
            rope_theta,
            rope_scaling,
            rope_freq_factors: None,
            max_position_embeddings: get_usize(&v, "max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            qkv_bias: match arch {
                Arch::Qwen2 => true,
                Arch::Llama | Arch::Qwen3 => attention_bias,
            },
            o_bias: match arch {
                Arch::Qwen2 => false,
                Arch::Llama | Arch::Qwen3 => attention_bias,
            },
            qk_norm: arch == Arch::Qwen3,
            bos_token_id: token_ids(v.get("bos_token_id")).first().copied(),
            eos_token_ids: token_ids(v.get("eos_token_id")),
        };
        config.validate()?;
        Ok(config)
    }

    /// Internal consistency; shapes of tensors are checked against these numbers at load.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Config(m));
        for (name, val) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_layers", self.num_layers),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if val == 0 {
                return bad(format!("{name} must be positive"));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim ({}) must be even for RoPE",
                self.head_dim
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad(format!(
                "rope_theta must be positive, got {}",
                self.rope_theta
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return bad(format!(
                "rms_norm_eps must be >= 0, got {}",
                self.rms_norm_eps
            ));
        }
        // Guard against absurd configs that would allocate terabytes before any tensor is read.
        if self.hidden_size > 1 << 16 || self.num_layers > 1024 || self.vocab_size > 1 << 24 {
            return bad("config dimensions are implausibly large".into());
        }
        if let Some(f) = &self.rope_freq_factors {
            if f.len() != self.head_dim / 2 {
                return bad(format!(
                    "rope_freqs has {} entries, expected head_dim/2 = {}",
                    f.len(),
                    self.head_dim / 2
                ));
            }
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// RoPE inverse frequencies (f64), with Llama 3 scaling or llama.cpp frequency factors applied.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim as f64;
        let mut inv: Vec<f64> = (0..self.head_dim / 2)
            .map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / d))
            .collect();
        if let Some(factors) = &self.rope_freq_factors {
            for (f, &k) in inv.iter_mut().zip(factors) {
                *f /= k as f64;
            }
        } else if let Some(s) = &self.rope_scaling {
            let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
            let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
            for f in inv.iter_mut() {
                let wavelen = 2.0 * std::f64::consts::PI / *f;
                if wavelen > low_wavelen {
                    *f /= s.factor;
                } else if wavelen >= high_wavelen {
                    let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    *f = (1.0 - smooth) * *f / s.factor + smooth * *f;
                }
            }
        }
        inv
    }

    /// Parameter count (embeddings counted once when tied).
    pub fn num_parameters(&self) -> usize {
        let h = self.hidden_size;
        let attn = h * (self.q_dim() + 2 * self.kv_dim()) + self.q_dim() * h;
        let mlp = 3 * h * self.intermediate_size;
        let per_layer = attn + mlp + 2 * h;
        let embed = self.vocab_size * h;
        embed * if self.tie_word_embeddings { 1 } else { 2 } + self.num_layers * per_layer + h
    }
}
