//! The decoder-only transformer (llama / qwen2 / qwen3) on the CPU reference kernels.
//!
//! One forward takes a batch of sequences, each with its own number of new tokens (prefill chunks,
//! single decode tokens, or k+1 verify tokens), and returns logits for the positions asked for plus,
//! on request, the outputs of chosen layers (DSpark/EAGLE drafters condition on them).

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::kv_cache::{PagedKvCache, SeqId};
use crate::source::{TensorSource, TensorValues, WeightDtype};
use half::bf16;
use specula_kernels::cpu::{self, RopeLayout};
use specula_kernels::{Matrix, MatrixData};

pub(crate) struct Layer {
    pub(crate) attn_norm: Vec<f32>,
    /// q, k and v projections stacked: one pass over the normalised input.
    pub(crate) wqkv: Matrix,
    pub(crate) bqkv: Option<Vec<f32>>,
    pub(crate) q_norm: Option<Vec<f32>>,
    pub(crate) k_norm: Option<Vec<f32>>,
    pub(crate) wo: Matrix,
    pub(crate) bo: Option<Vec<f32>>,
    pub(crate) ffn_norm: Vec<f32>,
    /// gate and up projections stacked: rows `[gate (ffn) | up (ffn)]`.
    pub(crate) w_gate_up: Matrix,
    pub(crate) w_down: Matrix,
}

pub struct Transformer {
    pub config: ModelConfig,
    pub(crate) embed: Matrix,
    pub(crate) layers: Vec<Layer>,
    pub(crate) final_norm: Vec<f32>,
    /// None when tied to the embeddings.
    pub(crate) lm_head: Option<Matrix>,
    pub(crate) inv_freq: Vec<f64>,
}

/// One sequence's part of a forward: its new tokens (appended at the end of its cache) and how many
/// of the last positions need logits (1 for prefill, k+1 for verification).
#[derive(Debug, Clone)]
pub struct SeqInput<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    pub num_logits: usize,
}

#[derive(Debug, Clone, Default)]
pub struct ForwardOutput {
    /// `[sum of num_logits, vocab]`, sequences in input order.
    pub logits: Vec<f32>,
    /// Row in `logits` where each sequence's rows start.
    pub logits_start: Vec<usize>,
    /// For each requested layer, `[total new tokens, hidden]`: that layer's output (the residual
    /// stream after the layer, i.e. HF `hidden_states[layer + 1]`).
    pub hidden: Vec<Vec<f32>>,
    pub vocab_size: usize,
}

impl ForwardOutput {
    /// Logits of row `j` of sequence `i`.
    pub fn row(&self, i: usize, j: usize) -> &[f32] {
        let r = self.logits_start[i] + j;
        &self.logits[r * self.vocab_size..(r + 1) * self.vocab_size]
    }
}

/// Fails with `MissingTensor` or `ShapeMismatch` unless `name` exists with shape `expected`.
pub fn shape_check(
    src: &dyn TensorSource,
    name: &str,
    expected: &[usize],
) -> Result<(), ModelError> {
    let found = src
        .shape(name)
        .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
    if found != expected {
        return Err(ModelError::ShapeMismatch {
            name: name.to_string(),
            expected: expected.to_vec(),
            found,
        });
    }
    Ok(())
}

/// A 1-D f32 tensor of length `len`, shape-checked.
pub fn load_vector(src: &dyn TensorSource, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    shape_check(src, name, &[len])?;
    Ok(src.read(name, false)?.into_f32())
}

/// A `[rows, cols]` weight matrix, shape-checked; `WeightDtype::Auto` keeps the file's dtype.
pub fn load_matrix(
    src: &dyn TensorSource,
    name: &str,
    rows: usize,
    cols: usize,
    dtype: WeightDtype,
) -> Result<Matrix, ModelError> {
    shape_check(src, name, &[rows, cols])?;
    let values = src.read(name, dtype != WeightDtype::F32)?;
    let data = match (dtype, values) {
        (WeightDtype::F32, v) => MatrixData::F32(v.into_f32()),
        (WeightDtype::Auto, TensorValues::F32(v)) => MatrixData::F32(v),
        (_, TensorValues::Bf16(v)) => MatrixData::Bf16(v),
        (WeightDtype::Bf16, TensorValues::F32(v)) => {
            MatrixData::Bf16(v.iter().map(|&x| bf16::from_f32(x)).collect())
        }
    };
    Ok(Matrix::new(rows, cols, data))
}

impl Transformer {
    /// Builds the model from HF-named tensors, checking every shape against the config.
    pub fn load(
        config: ModelConfig,
        src: &dyn TensorSource,
        dtype: WeightDtype,
    ) -> Result<Transformer, ModelError> {
        config.validate()?;
        let c = &config;
        let (h, q, kv, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let embed = load_matrix(src, "model.embed_tokens.weight", c.vocab_size, h, dtype)?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            let wq = load_matrix(src, &p("self_attn.q_proj.weight"), q, h, dtype)?;
            let wk = load_matrix(src, &p("self_attn.k_proj.weight"), kv, h, dtype)?;
            let wv = load_matrix(src, &p("self_attn.v_proj.weight"), kv, h, dtype)?;
            let bqkv = if c.qkv_bias {
                let mut b = load_vector(src, &p("self_attn.q_proj.bias"), q)?;
                b.extend(load_vector(src, &p("self_attn.k_proj.bias"), kv)?);
                b.extend(load_vector(src, &p("self_attn.v_proj.bias"), kv)?);
                Some(b)
            } else {
                None
            };
            let (q_norm, k_norm) = if c.qk_norm {
                (
                    Some(load_vector(src, &p("self_attn.q_norm.weight"), c.head_dim)?),
                    Some(load_vector(src, &p("self_attn.k_norm.weight"), c.head_dim)?),
                )
            } else {
                (None, None)
            };
            let gate = load_matrix(src, &p("mlp.gate_proj.weight"), f, h, dtype)?;
            let up = load_matrix(src, &p("mlp.up_proj.weight"), f, h, dtype)?;
            layers.push(Layer {
                attn_norm: load_vector(src, &p("input_layernorm.weight"), h)?,
                wqkv: Matrix::vstack(&[&wq, &wk, &wv]).expect("same dtype and width"),
                bqkv,
                q_norm,
                k_norm,
                wo: load_matrix(src, &p("self_attn.o_proj.weight"), h, q, dtype)?,
                bo: if c.o_bias {
                    Some(load_vector(src, &p("self_attn.o_proj.bias"), h)?)
                } else {
                    None
                },
                ffn_norm: load_vector(src, &p("post_attention_layernorm.weight"), h)?,
                w_gate_up: Matrix::vstack(&[&gate, &up]).expect("same dtype and width"),
                w_down: load_matrix(src, &p("mlp.down_proj.weight"), h, f, dtype)?,
            });
        }
        let final_norm = load_vector(src, "model.norm.weight", h)?;
        // Some tied checkpoints still ship lm_head.weight; an untied one must.
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(load_matrix(src, "lm_head.weight", c.vocab_size, h, dtype)?)
        };
        let inv_freq = c.rope_inv_freq();
        Ok(Transformer {
            config,
            embed,
            layers,
            final_norm,
            lm_head,
            inv_freq,
        })
    }

    /// The token embedding matrix `[vocab, hidden]` (drafters that share the target's embedding
    /// read it, e.g. DSpark).
    pub fn embedding(&self) -> &Matrix {
        &self.embed
    }

    /// The LM head `[vocab, hidden]` (the embedding when tied).
    pub fn lm_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// A KV cache sized for this model holding up to `max_positions` positions over all sequences.
    pub fn new_cache(&self, max_positions: usize) -> PagedKvCache {
        PagedKvCache::new(
            self.config.num_layers,
            self.config.kv_dim(),
            PagedKvCache::DEFAULT_BLOCK_SIZE,
            max_positions,
        )
    }

    /// Bytes of weights (what one decode step must stream from memory).
    pub fn weight_bytes(&self) -> usize {
        let mut n = self.embed.size_bytes() + self.lm_head.as_ref().map_or(0, Matrix::size_bytes);
        for l in &self.layers {
            n += l.wqkv.size_bytes()
                + l.wo.size_bytes()
                + l.w_gate_up.size_bytes()
                + l.w_down.size_bytes();
        }
        n
    }

    pub fn weight_dtype_name(&self) -> &'static str {
        self.embed.dtype_name()
    }

    /// Runs the new tokens of every input through the model, appending their keys/values to the
    /// cache. `hidden_layers` lists layers whose outputs to return. On error the cache is left as it
    /// was (lengths are only grown after validation).
    pub fn forward(
        &self,
        cache: &mut PagedKvCache,
        inputs: &[SeqInput<'_>],
        hidden_layers: &[usize],
    ) -> Result<ForwardOutput, ModelError> {
        let c = &self.config;
        let (h, qd, kvd, hd) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.head_dim);
        // Validate everything before touching the cache.
        let mut starts = Vec::with_capacity(inputs.len());
        for inp in inputs {
            if inp.tokens.is_empty() {
                return Err(ModelError::InvalidRequest(
                    "a sequence in the batch has no new tokens".into(),
                ));
            }
            if inp.num_logits > inp.tokens.len() {
                return Err(ModelError::InvalidRequest(format!(
                    "asked for {} logits rows from {} new tokens",
                    inp.num_logits,
                    inp.tokens.len()
                )));
            }
            if let Some(&id) = inp.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(ModelError::TokenOutOfRange {
                    id,
                    vocab_size: c.vocab_size,
                });
            }
            let start = cache.len(inp.seq)?;
            let needed = start + inp.tokens.len();
            if needed > c.max_position_embeddings {
                return Err(ModelError::ContextOverflow {
                    needed,
                    limit: c.max_position_embeddings,
                });
            }
            starts.push(start);
        }
        for &l in hidden_layers {
            if l >= c.num_layers {
                return Err(ModelError::InvalidRequest(format!(
                    "hidden layer {l} requested of {}",
                    c.num_layers
                )));
            }
        }
        for (i, inp) in inputs.iter().enumerate() {
            if let Err(e) = cache.grow(inp.seq, starts[i] + inp.tokens.len()) {
                for (j, prev) in inputs[..i].iter().enumerate() {
                    cache.truncate(prev.seq, starts[j])?;
                }
                return Err(e.into());
            }
        }

        let n: usize = inputs.iter().map(|i| i.tokens.len()).sum();
        let mut positions = Vec::with_capacity(n);
        let mut x = vec![0f32; n * h];
        let mut row = 0;
        for (inp, &start) in inputs.iter().zip(&starts) {
            for (j, &t) in inp.tokens.iter().enumerate() {
                self.embed
                    .row_to_f32(t as usize, &mut x[row * h..(row + 1) * h]);
                positions.push(start + j);
                row += 1;
            }
        }

        let mut hidden = vec![Vec::new(); hidden_layers.len()];
        let mut normed = vec![0f32; n * h];
        let mut qkv = vec![0f32; n * (qd + 2 * kvd)];
        let mut q = vec![0f32; n * qd];
        let mut k = vec![0f32; n * kvd];
        let mut v = vec![0f32; n * kvd];
        let mut attn = vec![0f32; n * qd];
        let mut proj = vec![0f32; n * h];
        let f = c.intermediate_size;
        let mut gate_up = vec![0f32; n * 2 * f];
        let mut act = vec![0f32; n * f];
        let scale = 1.0 / (hd as f32).sqrt();

        for (li, layer) in self.layers.iter().enumerate() {
            cpu::rms_norm(&x, &layer.attn_norm, c.rms_norm_eps, &mut normed);
            cpu::matmul(&normed, n, &layer.wqkv, &mut qkv);
            let width = qd + 2 * kvd;
            for t in 0..n {
                let r = &mut qkv[t * width..(t + 1) * width];
                if let Some(b) = &layer.bqkv {
                    cpu::add_in_place(r, b);
                }
                q[t * qd..(t + 1) * qd].copy_from_slice(&r[..qd]);
                k[t * kvd..(t + 1) * kvd].copy_from_slice(&r[qd..qd + kvd]);
                v[t * kvd..(t + 1) * kvd].copy_from_slice(&r[qd + kvd..]);
            }
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                cpu::rms_norm_in_place(&mut q, qn, c.rms_norm_eps);
                cpu::rms_norm_in_place(&mut k, kn, c.rms_norm_eps);
            }
            cpu::apply_rope(
                &mut q,
                &positions,
                c.num_heads,
                hd,
                &self.inv_freq,
                RopeLayout::Neox,
            );
            cpu::apply_rope(
                &mut k,
                &positions,
                c.num_kv_heads,
                hd,
                &self.inv_freq,
                RopeLayout::Neox,
            );
            let mut t0 = 0;
            for (inp, &start) in inputs.iter().zip(&starts) {
                let nt = inp.tokens.len();
                for j in 0..nt {
                    let t = t0 + j;
                    cache.write(
                        li,
                        inp.seq,
                        start + j,
                        &k[t * kvd..(t + 1) * kvd],
                        &v[t * kvd..(t + 1) * kvd],
                    )?;
                }
                let view = cache.view(li, inp.seq)?;
                cpu::attention(
                    &q[t0 * qd..(t0 + nt) * qd],
                    &view,
                    start,
                    c.num_heads,
                    c.num_kv_heads,
                    hd,
                    scale,
                    &mut attn[t0 * qd..(t0 + nt) * qd],
                );
                t0 += nt;
            }
            cpu::matmul(&attn, n, &layer.wo, &mut proj);
            if let Some(b) = &layer.bo {
                proj.chunks_mut(h).for_each(|r| cpu::add_in_place(r, b));
            }
            cpu::add_in_place(&mut x, &proj);

            cpu::rms_norm(&x, &layer.ffn_norm, c.rms_norm_eps, &mut normed);
            cpu::matmul(&normed, n, &layer.w_gate_up, &mut gate_up);
            cpu::swiglu_rows(&gate_up, f, &mut act);
            cpu::matmul(&act, n, &layer.w_down, &mut proj);
            cpu::add_in_place(&mut x, &proj);

            for (slot, &want) in hidden_layers.iter().enumerate() {
                if want == li {
                    hidden[slot] = x.clone();
                }
            }
        }

        // Final norm and LM head only for the rows whose logits were asked for.
        let mut picked = Vec::new();
        let mut logits_start = Vec::with_capacity(inputs.len());
        let mut t0 = 0;
        for inp in inputs {
            logits_start.push(picked.len() / h);
            let nt = inp.tokens.len();
            picked.extend_from_slice(&x[(t0 + nt - inp.num_logits) * h..(t0 + nt) * h]);
            t0 += nt;
        }
        let rows = picked.len() / h;
        let mut normed_rows = vec![0f32; picked.len()];
        cpu::rms_norm(&picked, &self.final_norm, c.rms_norm_eps, &mut normed_rows);
        let mut logits = vec![0f32; rows * c.vocab_size];
        cpu::matmul(
            &normed_rows,
            rows,
            self.lm_head.as_ref().unwrap_or(&self.embed),
            &mut logits,
        );
        Ok(ForwardOutput {
            logits,
            logits_start,
            hidden,
            vocab_size: c.vocab_size,
        })
    }
}
