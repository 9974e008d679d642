//! The DSpark draft network on the CPU reference kernels: context projection, the non-causal block
//! pass, base logits, the Markov logit bias and the confidence head. Semantics follow DeepSpec's
//! reference (`deepspec/modeling/dspark/qwen3`), pinned by the parity test against
//! `shared/fixtures/dspark-deepspec`.

use super::config::DSparkConfig;
use crate::DraftError;
use specula_kernels::cpu::{self, KvSource, RopeLayout};
use specula_kernels::Matrix;
use specula_model::transformer;
use specula_model::{ModelError, SafetensorsSource, TensorSource, Transformer, WeightDtype};
use std::path::Path;

pub(super) struct DraftLayer {
    pub(super) input_norm: Vec<f32>,
    /// q, k and v stacked: the block rows need all three, context rows only k and v.
    pub(super) wqkv: Matrix,
    /// k and v stacked, for context rows.
    pub(super) wkv: Matrix,
    pub(super) q_norm: Vec<f32>,
    pub(super) k_norm: Vec<f32>,
    pub(super) wo: Matrix,
    pub(super) post_norm: Vec<f32>,
    pub(super) w_gate_up: Matrix,
    pub(super) w_down: Matrix,
}

/// A DSpark drafter's weights plus the target's embedding and LM head it shares.
pub struct DSparkModel {
    pub config: DSparkConfig,
    /// Width of the target's hidden state (one tapped layer's output).
    pub target_hidden: usize,
    pub(super) fc: Matrix,
    pub(super) hidden_norm: Vec<f32>,
    pub(super) layers: Vec<DraftLayer>,
    pub(super) norm: Vec<f32>,
    pub(super) embed: Matrix,
    pub(super) lm_head: Matrix,
    /// `[vocab, rank]`: the Markov embedding of the previous token.
    pub(super) markov_w1: Matrix,
    /// `[draft vocab, rank]`: projects it to a logit bias.
    pub(super) markov_w2: Matrix,
    /// `[hidden (+ rank)]` and bias; `None` without a confidence head.
    pub(super) confidence: Option<(Vec<f32>, f32)>,
    /// Pruned draft vocabulary: target id of each draft id (from `d2t`: `i + d2t[i]`); `None` when
    /// the draft vocabulary is the target's.
    pub(super) draft_to_target: Option<Vec<u32>>,
    /// Markov embedding row of each target id when `markov_w1` is indexed by draft ids (`None`: a
    /// target token outside the draft vocabulary, whose Markov embedding is zero).
    pub(super) markov_row_of_target: Option<Vec<Option<u32>>>,
    pub(super) inv_freq: Vec<f64>,
}

/// Per-sequence context keys/values of every draft layer: one row per committed target position.
#[derive(Debug, Clone, Default)]
pub struct ContextCache {
    /// Per layer, `[positions, kv_dim]` keys (k_norm and RoPE applied) and values.
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    len: usize,
}

impl ContextCache {
    /// Number of context positions (= target positions whose features were appended).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Keys/values of one layer: the context rows followed by the block's own rows.
struct ContextThenBlock<'a> {
    ctx_k: &'a [f32],
    ctx_v: &'a [f32],
    block_k: &'a [f32],
    block_v: &'a [f32],
    ctx_len: usize,
    kv_dim: usize,
}

impl KvSource for ContextThenBlock<'_> {
    fn key(&self, pos: usize) -> &[f32] {
        let d = self.kv_dim;
        if pos < self.ctx_len {
            &self.ctx_k[pos * d..(pos + 1) * d]
        } else {
            let p = pos - self.ctx_len;
            &self.block_k[p * d..(p + 1) * d]
        }
    }
    fn value(&self, pos: usize) -> &[f32] {
        let d = self.kv_dim;
        if pos < self.ctx_len {
            &self.ctx_v[pos * d..(pos + 1) * d]
        } else {
            let p = pos - self.ctx_len;
            &self.block_v[p * d..(p + 1) * d]
        }
    }
}

/// The block pass's outputs for one sequence.
#[derive(Debug, Clone)]
pub struct BlockOutput {
    /// `[block_size, hidden]` after the final norm.
    pub hidden: Vec<f32>,
    /// `[block_size, draft vocab]` from the LM head, before the Markov bias.
    pub base_logits: Vec<f32>,
}

fn shape_check(src: &dyn TensorSource, name: &str, expected: &[usize]) -> Result<(), DraftError> {
    Ok(transformer::shape_check(src, name, expected)?)
}

fn vector(src: &dyn TensorSource, name: &str, len: usize) -> Result<Vec<f32>, DraftError> {
    Ok(transformer::load_vector(src, name, len)?)
}

/// Keeps the file's dtype (bf16 stays bf16, f32 stays exact).
fn matrix(
    src: &dyn TensorSource,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<Matrix, DraftError> {
    Ok(transformer::load_matrix(
        src,
        name,
        rows,
        cols,
        WeightDtype::Auto,
    )?)
}

/// Stacks matrices with the same column count (all f32 or all bf16 after conversion).
fn stack(parts: &[Matrix]) -> Matrix {
    let refs: Vec<&Matrix> = parts.iter().collect();
    Matrix::vstack(&refs).unwrap_or_else(|| {
        // Mixed dtypes: fall back to f32 for the stacked copy.
        let cols = parts[0].cols;
        let mut data = Vec::new();
        let mut row = vec![0f32; cols];
        for m in parts {
            for r in 0..m.rows {
                m.row_to_f32(r, &mut row);
                data.extend_from_slice(&row);
            }
        }
        Matrix::from_f32(data.len() / cols, cols, data)
    })
}

/// Reads `d2t` (draft id i -> target id i + d2t[i]) when the checkpoint prunes the draft vocabulary,
/// checking every mapped id is inside the target vocabulary and distinct.
fn read_draft_vocabulary(
    src: &dyn TensorSource,
    c: &DSparkConfig,
) -> Result<Option<Vec<u32>>, DraftError> {
    let Some(shape) = src.shape("d2t") else {
        if c.draft_vocab_size.is_some_and(|v| v != c.vocab_size) {
            return Err(DraftError::Config(format!(
                "draft_vocab_size {} differs from vocab_size {} but the checkpoint has no d2t map",
                c.draft_vocab(),
                c.vocab_size
            )));
        }
        return Ok(None);
    };
    if shape.len() != 1 || shape[0] == 0 {
        return Err(DraftError::Config(format!(
            "d2t has shape {shape:?}; expected [draft vocab]"
        )));
    }
    if c.draft_vocab_size.is_some_and(|v| v != shape[0]) {
        return Err(DraftError::Config(format!(
            "draft_vocab_size {} but d2t has {} entries",
            c.draft_vocab(),
            shape[0]
        )));
    }
    let offsets = src.read_integers("d2t")?;
    let mut seen = vec![false; c.vocab_size];
    let mut map = Vec::with_capacity(offsets.len());
    for (i, &o) in offsets.iter().enumerate() {
        let t = i as i64 + o;
        if t < 0 || t as usize >= c.vocab_size || seen[t as usize] {
            return Err(DraftError::Config(format!(
                "d2t maps draft id {i} to target id {t}: outside the vocabulary of {} or repeated",
                c.vocab_size
            )));
        }
        seen[t as usize] = true;
        map.push(t as u32);
    }
    Ok(Some(map))
}

impl DSparkModel {
    /// Loads `dir/config.json` + `dir/model.safetensors`. Embedding and LM head come from the
    /// checkpoint when it has them (`embed_tokens.weight`, `lm_head.weight`), else from `target`.
    pub fn load(dir: &Path, target: &Transformer) -> Result<DSparkModel, DraftError> {
        let config = DSparkConfig::from_file(&dir.join("config.json"))?;
        let weights = dir.join("model.safetensors");
        let src = SafetensorsSource::open(std::slice::from_ref(&weights))?;
        Self::from_source(config, &src, target)
    }

    pub fn from_source(
        config: DSparkConfig,
        src: &dyn TensorSource,
        target: &Transformer,
    ) -> Result<DSparkModel, DraftError> {
        let c = &config;
        let tc = &target.config;
        if c.vocab_size != tc.vocab_size {
            return Err(DraftError::VocabularyMismatch(format!(
                "the DSpark drafter has vocab_size {}, the target {}",
                c.vocab_size, tc.vocab_size
            )));
        }
        if let Some(&l) = c.target_layer_ids.iter().find(|&&l| l >= tc.num_layers) {
            return Err(DraftError::Config(format!(
                "target_layer_ids names layer {l} but the target has {} layers",
                tc.num_layers
            )));
        }
        let (h, qd, kvd, f, r) = (
            c.hidden_size,
            c.q_dim(),
            c.kv_dim(),
            c.intermediate_size,
            c.markov_rank,
        );
        let hd = c.head_dim();
        let th = tc.hidden_size;
        let m = c.target_layer_ids.len();
        let fc = matrix(src, "fc.weight", h, m * th)?;
        let hidden_norm = vector(src, "hidden_norm.weight", h)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let p = format!("layers.{l}");
            let wq = matrix(src, &format!("{p}.self_attn.q_proj.weight"), qd, h)?;
            let wk = matrix(src, &format!("{p}.self_attn.k_proj.weight"), kvd, h)?;
            let wv = matrix(src, &format!("{p}.self_attn.v_proj.weight"), kvd, h)?;
            let gate = matrix(src, &format!("{p}.mlp.gate_proj.weight"), f, h)?;
            let up = matrix(src, &format!("{p}.mlp.up_proj.weight"), f, h)?;
            layers.push(DraftLayer {
                input_norm: vector(src, &format!("{p}.input_layernorm.weight"), h)?,
                wkv: stack(&[wk.clone(), wv.clone()]),
                wqkv: stack(&[wq, wk, wv]),
                q_norm: vector(src, &format!("{p}.self_attn.q_norm.weight"), hd)?,
                k_norm: vector(src, &format!("{p}.self_attn.k_norm.weight"), hd)?,
                wo: matrix(src, &format!("{p}.self_attn.o_proj.weight"), h, qd)?,
                post_norm: vector(src, &format!("{p}.post_attention_layernorm.weight"), h)?,
                w_gate_up: stack(&[gate, up]),
                w_down: matrix(src, &format!("{p}.mlp.down_proj.weight"), h, f)?,
            });
        }
        let norm = vector(src, "norm.weight", h)?;
        let draft_to_target = read_draft_vocabulary(src, c)?;
        let draft_vocab = draft_to_target.as_ref().map_or(c.vocab_size, |m| m.len());
        let (embed, lm_head) = {
            let own = |name: &str| -> Result<Option<Matrix>, DraftError> {
                if src.shape(name).is_some() {
                    Ok(Some(matrix(src, name, c.vocab_size, h)?))
                } else {
                    Ok(None)
                }
            };
            let embed = own("embed_tokens.weight")?;
            let lm_head = if src.shape("lm_head.weight").is_some() {
                Some(matrix(src, "lm_head.weight", draft_vocab, h)?)
            } else {
                None
            };
            if (embed.is_none() || lm_head.is_none()) && th != h {
                return Err(DraftError::Config(format!(
                    "the DSpark drafter (hidden {h}) shares the target's embedding or LM head, \
                     but the target's hidden size is {th}"
                )));
            }
            let lm_head = match (lm_head, &draft_to_target) {
                (Some(m), _) => m,
                (None, None) => target.lm_head().clone(),
                // A shared LM head restricted to the draft vocabulary: the target's rows of the
                // kept ids.
                (None, Some(map)) => {
                    let full = target.lm_head();
                    let mut data = vec![0f32; map.len() * h];
                    for (i, &t) in map.iter().enumerate() {
                        full.row_to_f32(t as usize, &mut data[i * h..(i + 1) * h]);
                    }
                    Matrix::from_f32(map.len(), h, data)
                }
            };
            (embed.unwrap_or_else(|| target.embedding().clone()), lm_head)
        };
        // W1 is indexed by target ids, or by draft ids in some pruned checkpoints.
        let w1_rows = src
            .shape("markov_head.markov_w1.weight")
            .and_then(|s| s.first().copied())
            .unwrap_or(c.vocab_size);
        let markov_row_of_target = match &draft_to_target {
            Some(map) if w1_rows == map.len() && map.len() != c.vocab_size => {
                let mut rows = vec![None; c.vocab_size];
                for (i, &t) in map.iter().enumerate() {
                    rows[t as usize] = Some(i as u32);
                }
                Some(rows)
            }
            _ => None,
        };
        let w1_expected = if markov_row_of_target.is_some() {
            draft_vocab
        } else {
            c.vocab_size
        };
        let markov_w1 = matrix(src, "markov_head.markov_w1.weight", w1_expected, r)?;
        let markov_w2 = matrix(src, "markov_head.markov_w2.weight", draft_vocab, r)?;
        let confidence = if c.enable_confidence_head {
            let width = if c.confidence_head_with_markov {
                h + r
            } else {
                h
            };
            shape_check(src, "confidence_head.proj.weight", &[1, width])?;
            let w = src.read("confidence_head.proj.weight", false)?.into_f32();
            let b = vector(src, "confidence_head.proj.bias", 1)?[0];
            Some((w, b))
        } else {
            None
        };
        let inv_freq = config.rope_inv_freq();
        Ok(DSparkModel {
            target_hidden: th,
            fc,
            hidden_norm,
            layers,
            norm,
            embed,
            lm_head,
            markov_w1,
            markov_w2,
            confidence,
            draft_to_target,
            markov_row_of_target,
            inv_freq,
            config,
        })
    }

    pub fn new_context(&self) -> ContextCache {
        ContextCache {
            keys: vec![Vec::new(); self.layers.len()],
            values: vec![Vec::new(); self.layers.len()],
            len: 0,
        }
    }

    /// Width of one context-feature row: the tapped target layers' outputs concatenated.
    pub fn feature_width(&self) -> usize {
        self.config.target_layer_ids.len() * self.target_hidden
    }

    /// Projects `features` (`[n, feature_width]`, positions `ctx.len()..ctx.len() + n`) through
    /// `fc` and `hidden_norm`, then every layer's k/v projections (k_norm, RoPE at their own
    /// positions), and appends them to the context cache. Context rows skip the layers' input
    /// norm, as in the reference.
    pub fn append_context(
        &self,
        ctx: &mut ContextCache,
        features: &[f32],
    ) -> Result<(), DraftError> {
        let w = self.feature_width();
        if !features.len().is_multiple_of(w) {
            return Err(DraftError::Config(format!(
                "context features of length {} are not rows of {w}",
                features.len()
            )));
        }
        let n = features.len() / w;
        if n == 0 {
            return Ok(());
        }
        let c = &self.config;
        let (h, kvd, hd) = (c.hidden_size, c.kv_dim(), c.head_dim());
        let mut projected = vec![0f32; n * h];
        cpu::matmul(features, n, &self.fc, &mut projected);
        let mut normed = vec![0f32; n * h];
        cpu::rms_norm(&projected, &self.hidden_norm, c.rms_norm_eps, &mut normed);
        let positions: Vec<usize> = (ctx.len..ctx.len + n).collect();
        let mut kv = vec![0f32; n * 2 * kvd];
        for (l, layer) in self.layers.iter().enumerate() {
            cpu::matmul(&normed, n, &layer.wkv, &mut kv);
            let mut k = Vec::with_capacity(n * kvd);
            let mut v = Vec::with_capacity(n * kvd);
            for row in kv.chunks(2 * kvd) {
                k.extend_from_slice(&row[..kvd]);
                v.extend_from_slice(&row[kvd..]);
            }
            cpu::rms_norm_in_place(&mut k, &layer.k_norm, c.rms_norm_eps);
            cpu::apply_rope(
                &mut k,
                &positions,
                c.num_key_value_heads,
                hd,
                &self.inv_freq,
                RopeLayout::Neox,
            );
            ctx.keys[l].extend_from_slice(&k);
            ctx.values[l].extend_from_slice(&v);
        }
        ctx.len += n;
        Ok(())
    }

    /// One non-causal pass over the blocks `[anchor, mask x (block_size - 1)]` of several sequences,
    /// each at positions `ctx.len()..ctx.len() + block_size`. Linear layers run over all blocks'
    /// rows at once (the CPU matmul is batch-invariant); attention is per sequence.
    pub fn block_forward(
        &self,
        blocks: &[(&ContextCache, u32)],
    ) -> Result<Vec<BlockOutput>, DraftError> {
        let c = &self.config;
        let g = c.block_size;
        let (h, qd, kvd, hd, f) = (
            c.hidden_size,
            c.q_dim(),
            c.kv_dim(),
            c.head_dim(),
            c.intermediate_size,
        );
        let b = blocks.len();
        let n = b * g;
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut x = vec![0f32; n * h];
        let mut positions = Vec::with_capacity(n);
        for (i, &(ctx, anchor)) in blocks.iter().enumerate() {
            if anchor as usize >= c.vocab_size {
                return Err(ModelError::TokenOutOfRange {
                    id: anchor,
                    vocab_size: c.vocab_size,
                }
                .into());
            }
            for j in 0..g {
                let t = if j == 0 { anchor } else { c.mask_token_id };
                let row = i * g + j;
                self.embed
                    .row_to_f32(t as usize, &mut x[row * h..(row + 1) * h]);
                positions.push(ctx.len + j);
            }
        }
        let mut normed = vec![0f32; n * h];
        let width = qd + 2 * kvd;
        let mut qkv = vec![0f32; n * width];
        let mut q = vec![0f32; n * qd];
        let mut k = vec![0f32; n * kvd];
        let mut v = vec![0f32; n * kvd];
        let mut attn = vec![0f32; n * qd];
        let mut proj = vec![0f32; n * h];
        let mut gate_up = vec![0f32; n * 2 * f];
        let mut act = vec![0f32; n * f];
        let scale = 1.0 / (hd as f32).sqrt();
        for (l, layer) in self.layers.iter().enumerate() {
            cpu::rms_norm(&x, &layer.input_norm, c.rms_norm_eps, &mut normed);
            cpu::matmul(&normed, n, &layer.wqkv, &mut qkv);
            for t in 0..n {
                let r = &qkv[t * width..(t + 1) * width];
                q[t * qd..(t + 1) * qd].copy_from_slice(&r[..qd]);
                k[t * kvd..(t + 1) * kvd].copy_from_slice(&r[qd..qd + kvd]);
                v[t * kvd..(t + 1) * kvd].copy_from_slice(&r[qd + kvd..]);
            }
            cpu::rms_norm_in_place(&mut q, &layer.q_norm, c.rms_norm_eps);
            cpu::rms_norm_in_place(&mut k, &layer.k_norm, c.rms_norm_eps);
            let heads = c.num_attention_heads;
            cpu::apply_rope(
                &mut q,
                &positions,
                heads,
                hd,
                &self.inv_freq,
                RopeLayout::Neox,
            );
            let kv_heads = c.num_key_value_heads;
            cpu::apply_rope(
                &mut k,
                &positions,
                kv_heads,
                hd,
                &self.inv_freq,
                RopeLayout::Neox,
            );
            for (i, &(ctx, _)) in blocks.iter().enumerate() {
                let rows = i * g..(i + 1) * g;
                let kv = ContextThenBlock {
                    ctx_k: &ctx.keys[l],
                    ctx_v: &ctx.values[l],
                    block_k: &k[rows.start * kvd..rows.end * kvd],
                    block_v: &v[rows.start * kvd..rows.end * kvd],
                    ctx_len: ctx.len,
                    kv_dim: kvd,
                };
                cpu::attention_all_keys(
                    &q[rows.start * qd..rows.end * qd],
                    &kv,
                    ctx.len + g,
                    heads,
                    kv_heads,
                    hd,
                    scale,
                    &mut attn[rows.start * qd..rows.end * qd],
                );
            }
            cpu::matmul(&attn, n, &layer.wo, &mut proj);
            cpu::add_in_place(&mut x, &proj);
            cpu::rms_norm(&x, &layer.post_norm, c.rms_norm_eps, &mut normed);
            cpu::matmul(&normed, n, &layer.w_gate_up, &mut gate_up);
            cpu::swiglu_rows(&gate_up, f, &mut act);
            cpu::matmul(&act, n, &layer.w_down, &mut proj);
            cpu::add_in_place(&mut x, &proj);
        }
        cpu::rms_norm(&x, &self.norm, c.rms_norm_eps, &mut normed);
        let vocab = self.lm_head.rows;
        let mut logits = vec![0f32; n * vocab];
        cpu::matmul(&normed, n, &self.lm_head, &mut logits);
        Ok((0..b)
            .map(|i| BlockOutput {
                hidden: normed[i * g * h..(i + 1) * g * h].to_vec(),
                base_logits: logits[i * g * vocab..(i + 1) * g * vocab].to_vec(),
            })
            .collect())
    }

    /// The Markov embedding `W1[prev]` (`[rank]`) of a target token (zero for a token outside a
    /// pruned draft vocabulary when W1 is indexed by draft ids).
    pub fn markov_embedding(&self, prev: u32) -> Vec<f32> {
        let mut e = vec![0f32; self.config.markov_rank];
        let row = match &self.markov_row_of_target {
            None => Some(prev),
            Some(rows) => rows.get(prev as usize).copied().flatten(),
        };
        if let Some(row) = row {
            self.markov_w1.row_to_f32(row as usize, &mut e);
        }
        e
    }

    /// Target id of each draft id for a pruned draft vocabulary; `None` when drafts are target ids.
    pub fn draft_to_target(&self) -> Option<&[u32]> {
        self.draft_to_target.as_deref()
    }

    /// Size of the draft vocabulary (rows of base logits).
    pub fn draft_vocab(&self) -> usize {
        self.lm_head.rows
    }

    /// Adds the Markov bias `W2 W1[prev]` to one slot's base logits (`[draft vocab]`).
    pub fn add_markov_bias(&self, prev_embedding: &[f32], logits: &mut [f32]) {
        let mut bias = vec![0f32; self.markov_w2.rows];
        cpu::matmul(prev_embedding, 1, &self.markov_w2, &mut bias);
        cpu::add_in_place(logits, &bias);
    }

    /// The confidence head's pre-sigmoid logit for a slot, `None` without a confidence head.
    pub fn confidence_logit(&self, hidden: &[f32], prev_embedding: &[f32]) -> Option<f32> {
        let (w, b) = self.confidence.as_ref()?;
        let h = hidden.len();
        let mut s = cpu::dot(&w[..h], hidden);
        if w.len() > h {
            s += cpu::dot(&w[h..], prev_embedding);
        }
        Some(s + b)
    }
}
