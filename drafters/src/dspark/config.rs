//! The DSpark drafter's `config.json` in the DeepSpec layout (`Qwen3DSparkModel` and friends).

use crate::DraftError;
use serde::Deserialize;
use std::path::Path;

/// Which Markov logit bias the checkpoint carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MarkovHeadType {
    /// `logits_j = U_j + W2 W1[prev_j]`.
    Vanilla,
    /// `W1[prev]` scaled by a learned gate; not supported yet (refused at load, never guessed).
    Gated,
}

#[derive(Debug, Clone, Deserialize)]
struct RopeParameters {
    rope_theta: Option<f64>,
    rope_type: Option<String>,
}

/// The fields of a DeepSpec DSpark config that inference needs. Unknown keys are ignored (HF
/// configs carry many).
#[derive(Debug, Clone, Deserialize)]
pub struct DSparkConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    #[serde(default)]
    head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(default)]
    rope_parameters: Option<RopeParameters>,
    /// Draft length of one block (gamma): the block is `[anchor, mask x (block_size - 1)]` and every
    /// slot proposes one token.
    pub block_size: usize,
    pub mask_token_id: u32,
    /// Target layers whose outputs (HF `hidden_states[l + 1]`) are concatenated into the context
    /// features, in this order.
    pub target_layer_ids: Vec<usize>,
    pub markov_rank: usize,
    #[serde(default = "default_markov_type")]
    pub markov_head_type: MarkovHeadType,
    #[serde(default)]
    pub enable_confidence_head: bool,
    /// The confidence head reads `[h_j; W1[prev_j]]` (true) or `h_j` alone (false).
    #[serde(default)]
    pub confidence_head_with_markov: bool,
    /// Size of a pruned draft vocabulary (`d2t`/`t2d` maps present); `None` = the target's.
    #[serde(default)]
    pub draft_vocab_size: Option<usize>,
}

fn default_eps() -> f32 {
    1e-6
}

fn default_markov_type() -> MarkovHeadType {
    MarkovHeadType::Vanilla
}

impl DSparkConfig {
    pub fn from_json(text: &str) -> Result<DSparkConfig, DraftError> {
        let c: DSparkConfig = serde_json::from_str(text)
            .map_err(|e| DraftError::Config(format!("DSpark config.json: {e}")))?;
        c.validate()?;
        Ok(c)
    }

    pub fn from_file(path: &Path) -> Result<DSparkConfig, DraftError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| DraftError::Config(format!("reading {}: {e}", path.display())))?;
        Self::from_json(&text).map_err(|e| match e {
            DraftError::Config(m) => DraftError::Config(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim()
    }

    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim()
    }

    pub fn rope_theta(&self) -> f64 {
        self.rope_parameters
            .as_ref()
            .and_then(|r| r.rope_theta)
            .or(self.rope_theta)
            .unwrap_or(10000.0)
    }

    pub fn draft_vocab(&self) -> usize {
        self.draft_vocab_size.unwrap_or(self.vocab_size)
    }

    /// RoPE inverse frequencies (default RoPE, f64 like the target's).
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim() as f64;
        (0..self.head_dim() / 2)
            .map(|i| 1.0 / self.rope_theta().powf(2.0 * i as f64 / d))
            .collect()
    }

    fn validate(&self) -> Result<(), DraftError> {
        let bad = |m: String| Err(DraftError::Config(m));
        if self.vocab_size == 0 || self.hidden_size == 0 || self.num_hidden_layers == 0 {
            return bad("vocab_size, hidden_size and num_hidden_layers must be positive".into());
        }
        if self.num_attention_heads == 0
            || self.num_key_value_heads == 0
            || !self
                .num_attention_heads
                .is_multiple_of(self.num_key_value_heads)
        {
            return bad(format!(
                "num_attention_heads {} must be a positive multiple of num_key_value_heads {}",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        let hd = self.head_dim();
        if hd == 0 || !hd.is_multiple_of(2) {
            return bad(format!("head_dim must be positive and even, got {hd}"));
        }
        if !(1..=16).contains(&self.block_size) {
            return bad(format!(
                "block_size must be in 1..=16, got {}",
                self.block_size
            ));
        }
        if self.mask_token_id as usize >= self.vocab_size {
            return bad(format!(
                "mask_token_id {} is outside the vocabulary of {}",
                self.mask_token_id, self.vocab_size
            ));
        }
        if self.target_layer_ids.is_empty() {
            return bad("target_layer_ids is empty: DSpark conditions on target layers".into());
        }
        if self.markov_rank == 0 {
            return bad("markov_rank must be positive".into());
        }
        if self.markov_head_type == MarkovHeadType::Gated {
            return bad("the gated Markov head is not supported yet (vanilla only)".into());
        }
        if let Some(p) = &self.rope_parameters {
            if let Some(t) = p.rope_type.as_deref() {
                if t != "default" {
                    return bad(format!(
                        "unsupported rope_type {t:?} for DSpark (default only)"
                    ));
                }
            }
        }
        if !(self.rope_theta() > 0.0 && self.rope_theta().is_finite()) {
            return bad(format!(
                "rope_theta must be positive, got {}",
                self.rope_theta()
            ));
        }
        if self.draft_vocab() == 0 || self.draft_vocab() > self.vocab_size {
            return bad(format!(
                "draft_vocab_size {} must be in 1..={}",
                self.draft_vocab(),
                self.vocab_size
            ));
        }
        Ok(())
    }
}
