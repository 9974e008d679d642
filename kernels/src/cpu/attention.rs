//! Causal attention of T new query tokens of one sequence over that sequence's cached keys/values
//! (the new tokens' own keys/values are already in the cache), with grouped-query heads.
//!
//! Batch invariance: each (query, head) is computed alone, over keys 0..=its position, in key
//! order, so a query's output does not depend on how many other queries share the call.

use super::dot;
use rayon::prelude::*;

/// Read access to one layer of one sequence's KV cache. Both return all KV heads of one position,
/// `[n_kv_heads * head_dim]`.
pub trait KvSource: Sync {
    fn key(&self, pos: usize) -> &[f32];
    fn value(&self, pos: usize) -> &[f32];
}

/// `q`: `[T, n_heads * head_dim]` for positions `start_pos..start_pos + T`; `out` has the same shape.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    kv: &dyn KvSource,
    start_pos: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    out: &mut [f32],
) {
    attend(
        q,
        kv,
        |t| start_pos + t + 1,
        n_heads,
        n_kv_heads,
        head_dim,
        scale,
        out,
    );
}

/// Every query attends to keys `0..n_keys`, with no causal mask: a parallel block drafter's
/// queries see the whole context and every position of their own block (DSpark, DFlash).
#[allow(clippy::too_many_arguments)]
pub fn attention_all_keys(
    q: &[f32],
    kv: &dyn KvSource,
    n_keys: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    out: &mut [f32],
) {
    attend(q, kv, |_| n_keys, n_heads, n_kv_heads, head_dim, scale, out);
}

/// Query row `t` attends to keys `0..visible(t)`.
#[allow(clippy::too_many_arguments)]
fn attend(
    q: &[f32],
    kv: &dyn KvSource,
    visible: impl Fn(usize) -> usize + Sync,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    out: &mut [f32],
) {
    assert_eq!(q.len(), out.len());
    assert_eq!(q.len() % (n_heads * head_dim), 0);
    assert_eq!(
        n_heads % n_kv_heads,
        0,
        "query heads must be a multiple of KV heads"
    );
    let group = n_heads / n_kv_heads;
    out.par_chunks_mut(head_dim)
        .enumerate()
        .for_each(|(idx, o)| {
            let (t, h) = (idx / n_heads, idx % n_heads);
            let kvh = h / group;
            let qh = &q[idx * head_dim..(idx + 1) * head_dim];
            let mut scores: Vec<f32> = (0..visible(t))
                .map(|j| dot(qh, &kv.key(j)[kvh * head_dim..(kvh + 1) * head_dim]) * scale)
                .collect();
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            o.iter_mut().for_each(|v| *v = 0.0);
            for (j, &p) in scores.iter().enumerate() {
                let v = &kv.value(j)[kvh * head_dim..(kvh + 1) * head_dim];
                for (oo, &vv) in o.iter_mut().zip(v) {
                    *oo += p * vv;
                }
            }
            let inv = 1.0 / sum;
            o.iter_mut().for_each(|v| *v *= inv);
        });
}
