//! CPU reference kernels. Every reduction runs in a fixed order that depends only on the row being
//! reduced, never on how many rows share the call (see the crate docs on batch invariance).

pub mod attention;
pub mod matmul;

pub use attention::{attention, attention_all_keys, KvSource};
pub use matmul::{matmul, matmul_with, CpuKernel};

use rayon::prelude::*;

/// Dot product with 8 independent lanes and a fixed final sum (vectorises without reassociation).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let main = a.len() / 8 * 8;
    let mut acc = [0f32; 8];
    for (ca, cb) in a[..main].chunks_exact(8).zip(b[..main].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += ca[l] * cb[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for i in main..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// RMSNorm of each `dim`-wide row of `x` into `out`: `x / sqrt(mean(x^2) + eps) * weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    assert_eq!(x.len(), out.len());
    assert_eq!(x.len() % dim, 0);
    let norm_row = |(xr, or): (&[f32], &mut [f32])| {
        let mean_sq = dot(xr, xr) / dim as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for ((o, &xv), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = w * (xv * inv);
        }
    };
    // Per-head q/k norms are many tiny rows: not worth rayon's overhead.
    if x.len() >= 1 << 14 {
        x.par_chunks(dim)
            .zip(out.par_chunks_mut(dim))
            .for_each(norm_row);
    } else {
        x.chunks(dim).zip(out.chunks_mut(dim)).for_each(norm_row);
    }
}

/// In-place RMSNorm (used for the per-head q/k norms of Qwen3).
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let copy = x.to_vec();
    rms_norm(&copy, weight, eps, x);
}

/// How rotary dimensions are paired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// HF "rotate half": dimension i pairs with i + head_dim/2 (Llama/Qwen in HF layout, GGUF qwen2).
    Neox,
    /// Adjacent pairs (2i, 2i+1): the original Llama layout, which llama.cpp's permuted Q/K expect.
    Interleaved,
}

/// Rotates every head of every row of `x` (`[n_rows, n_heads * head_dim]`); row `t` is at
/// `positions[t]`. `inv_freq` has `head_dim / 2` entries. Angles are computed in f64 so that long
/// positions lose no precision.
pub fn apply_rope(
    x: &mut [f32],
    positions: &[usize],
    n_heads: usize,
    head_dim: usize,
    inv_freq: &[f64],
    layout: RopeLayout,
) {
    let half = head_dim / 2;
    assert_eq!(inv_freq.len(), half);
    assert_eq!(x.len(), positions.len() * n_heads * head_dim);
    let mut cos = vec![0f32; half];
    let mut sin = vec![0f32; half];
    for (row, &pos) in x.chunks_mut(n_heads * head_dim).zip(positions) {
        for i in 0..half {
            let angle = pos as f64 * inv_freq[i];
            cos[i] = angle.cos() as f32;
            sin[i] = angle.sin() as f32;
        }
        for head in row.chunks_mut(head_dim) {
            for i in 0..half {
                let (a, b) = match layout {
                    RopeLayout::Neox => (i, i + half),
                    RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                };
                let (xa, xb) = (head[a], head[b]);
                head[a] = xa * cos[i] - xb * sin[i];
                head[b] = xb * cos[i] + xa * sin[i];
            }
        }
    }
}

/// SwiGLU: `out[i] = silu(gate[i]) * up[i]` for rows laid out `[gate (ffn) | up (ffn)]`.
pub fn swiglu_rows(gate_up: &[f32], ffn: usize, out: &mut [f32]) {
    assert_eq!(gate_up.len(), 2 * out.len());
    for (gu, o) in gate_up.chunks(2 * ffn).zip(out.chunks_mut(ffn)) {
        let (g, u) = gu.split_at(ffn);
        for i in 0..ffn {
            let x = g[i];
            o[i] = x / (1.0 + (-x).exp()) * u[i];
        }
    }
}

/// Softmax in place with max subtraction; a row of all -inf gives all zeros rather than NaN.
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        x.iter_mut().for_each(|v| *v = 0.0);
        return;
    }
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// `a[i] += b[i]`.
pub fn add_in_place(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaved_rope_equals_neox_on_permuted_dims() {
        // llama.cpp permutes Q/K rows so that interleaved RoPE on the permuted vector equals the
        // permuted result of rotate-half RoPE: both layouts must agree under that permutation.
        let head_dim = 8;
        let half = head_dim / 2;
        let inv: Vec<f64> = (0..half)
            .map(|i| 1.0 / 10000f64.powf(2.0 * i as f64 / head_dim as f64))
            .collect();
        let x: Vec<f32> = (0..head_dim).map(|i| (i as f32 * 0.37).sin()).collect();
        let perm = |v: &[f32]| -> Vec<f32> {
            (0..head_dim)
                .map(|j| v[if j % 2 == 0 { j / 2 } else { half + j / 2 }])
                .collect()
        };
        let mut neox = x.clone();
        apply_rope(&mut neox, &[17], 1, head_dim, &inv, RopeLayout::Neox);
        let mut inter = perm(&x);
        apply_rope(
            &mut inter,
            &[17],
            1,
            head_dim,
            &inv,
            RopeLayout::Interleaved,
        );
        for (a, b) in perm(&neox).iter().zip(&inter) {
            assert!((a - b).abs() < 1e-6);
        }
        // Position 0 is the identity.
        let mut p0 = x.clone();
        apply_rope(&mut p0, &[0], 1, head_dim, &inv, RopeLayout::Neox);
        assert_eq!(p0, x);
    }

    #[test]
    fn softmax_handles_extremes() {
        let mut v = vec![1000.0, 1000.0, f32::NEG_INFINITY];
        softmax_in_place(&mut v);
        assert_eq!(v, vec![0.5, 0.5, 0.0]);
        let mut all_masked = vec![f32::NEG_INFINITY; 3];
        softmax_in_place(&mut all_masked);
        assert_eq!(all_masked, vec![0.0; 3]);
    }

    #[test]
    fn rms_norm_matches_definition() {
        let x = [3.0f32, 4.0, 0.0, 0.0];
        let w = [1.0f32, 2.0, 1.0, 1.0];
        let mut out = [0f32; 4];
        rms_norm(&x, &w, 0.0, &mut out);
        let rms = (25.0f32 / 4.0).sqrt();
        assert!((out[0] - 3.0 / rms).abs() < 1e-6 && (out[1] - 8.0 / rms).abs() < 1e-6);
    }
}
