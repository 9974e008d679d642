//! `out[t, r] = dot(w[r, :], x[t, :])`: the one GEMM/GEMV shape of a decoder forward.
//!
//! Batch invariance: every output element is one dot product accumulated in a fixed order (one
//! 8-lane accumulator over the columns in steps of 8, a fixed horizontal sum, then the scalar tail),
//! whatever micro-tile (rows x tokens) it was computed in and however rayon split the rows. So the
//! logits of a token are bit-identical whether it is processed alone or with seven others.

use crate::matrix::{Matrix, MatrixData};
use half::bf16;
use rayon::prelude::*;
use std::sync::OnceLock;

/// Which implementation of the dot-product micro-kernel to use. Both are batch-invariant; they
/// differ from each other in rounding (AVX2 fuses multiply and add).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuKernel {
    /// Plain Rust, 8 independent lanes, separate multiply and add; runs everywhere.
    Portable,
    /// x86-64 AVX2 + FMA.
    Avx2Fma,
}

impl CpuKernel {
    /// The fastest kernel this CPU supports, detected once per process so that every call in a
    /// process uses the same arithmetic.
    pub fn detect() -> CpuKernel {
        static DETECTED: OnceLock<CpuKernel> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            if std::env::var("SPECULA_CPU_KERNEL").as_deref() == Ok("portable") {
                return CpuKernel::Portable;
            }
            #[cfg(target_arch = "x86_64")]
            {
                if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                    return CpuKernel::Avx2Fma;
                }
            }
            CpuKernel::Portable
        })
    }
}

/// Rows handed to one rayon task. Large enough to amortise scheduling, small enough that the
/// vocabulary projection spreads over both cores evenly.
const ROWS_PER_TASK: usize = 32;

/// `out[t * w.rows + r] = sum_c w[r, c] * x[t * w.cols + c]` for `t < n_tokens`.
pub fn matmul(x: &[f32], n_tokens: usize, w: &Matrix, out: &mut [f32]) {
    matmul_with(CpuKernel::detect(), x, n_tokens, w, out)
}

pub fn matmul_with(kernel: CpuKernel, x: &[f32], n_tokens: usize, w: &Matrix, out: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    assert_eq!(
        x.len(),
        n_tokens * cols,
        "matmul: input is not [n_tokens, cols]"
    );
    assert_eq!(
        out.len(),
        n_tokens * rows,
        "matmul: output is not [n_tokens, rows]"
    );
    if n_tokens == 0 || rows == 0 {
        return;
    }
    let out_ptr = SharedOut(out.as_mut_ptr());
    let n_tasks = rows.div_ceil(ROWS_PER_TASK);
    (0..n_tasks).into_par_iter().for_each(|task| {
        let r0 = task * ROWS_PER_TASK;
        let r1 = (r0 + ROWS_PER_TASK).min(rows);
        let out_ptr = &out_ptr;
        let mut t0 = 0;
        while t0 < n_tokens {
            let nt = (n_tokens - t0).min(4);
            let mut r = r0;
            // Row-tile size by token-tile size keeps 8 accumulators live (enough FMA chains to
            // hide latency) without spilling registers. The tile shape never changes results.
            let rt = if nt <= 2 { 4 } else { 2 };
            while r < r1 {
                let nr = if r1 - r >= rt { rt } else { 1 };
                let mut tile = [[0f32; 4]; 4];
                tile_dot(kernel, w, r, nr, x, t0, nt, cols, &mut tile);
                for (i, row_vals) in tile.iter().enumerate().take(nr) {
                    for (j, &v) in row_vals.iter().enumerate().take(nt) {
                        // SAFETY: (t0 + j, r + i) is in bounds, and each row range belongs to
                        // exactly one task, so no two tasks write the same element.
                        unsafe { *out_ptr.0.add((t0 + j) * rows + r + i) = v };
                    }
                }
                r += nr;
            }
            t0 += nt;
        }
    });
}

struct SharedOut(*mut f32);
// SAFETY: tasks write disjoint elements (see matmul_with).
unsafe impl Sync for SharedOut {}

#[allow(clippy::too_many_arguments)]
fn tile_dot(
    kernel: CpuKernel,
    w: &Matrix,
    r: usize,
    nr: usize,
    x: &[f32],
    t0: usize,
    nt: usize,
    cols: usize,
    tile: &mut [[f32; 4]; 4],
) {
    let xs: [&[f32]; 4] = std::array::from_fn(|j| {
        if j < nt {
            &x[(t0 + j) * cols..(t0 + j + 1) * cols]
        } else {
            &[][..]
        }
    });
    match &w.data {
        MatrixData::F32(d) => {
            let ws: [&[f32]; 4] = std::array::from_fn(|i| {
                if i < nr {
                    &d[(r + i) * cols..(r + i + 1) * cols]
                } else {
                    &[][..]
                }
            });
            dispatch_tile(kernel, &ws, &xs, nr, nt, tile)
        }
        MatrixData::Bf16(d) => {
            let ws: [&[bf16]; 4] = std::array::from_fn(|i| {
                if i < nr {
                    &d[(r + i) * cols..(r + i + 1) * cols]
                } else {
                    &[][..]
                }
            });
            dispatch_tile(kernel, &ws, &xs, nr, nt, tile)
        }
    }
}

/// Element types a weight row can hold.
pub trait WeightElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    #[cfg(target_arch = "x86_64")]
    /// Loads 8 consecutive elements widened to f32.
    ///
    /// # Safety
    /// `p..p+8` must be readable and the CPU must support AVX2.
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl WeightElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
}

impl WeightElem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // bf16 is the top half of an f32: widen to u32 and shift left by 16.
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    }
}

fn dispatch_tile<W: WeightElem>(
    kernel: CpuKernel,
    ws: &[&[W]; 4],
    xs: &[&[f32]; 4],
    nr: usize,
    nt: usize,
    tile: &mut [[f32; 4]; 4],
) {
    macro_rules! go {
        ($($r:literal, $n:literal);*) => {
            match (nr, nt) {
                $(($r, $n) => run_tile::<W, $r, $n>(kernel, ws, xs, tile),)*
                _ => unreachable!("tile shape {nr}x{nt}"),
            }
        };
    }
    go!(4,1; 4,2; 2,3; 2,4; 1,1; 1,2; 1,3; 1,4)
}

#[inline(always)]
fn run_tile<W: WeightElem, const R: usize, const N: usize>(
    kernel: CpuKernel,
    ws: &[&[W]; 4],
    xs: &[&[f32]; 4],
    tile: &mut [[f32; 4]; 4],
) {
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Avx2Fma is only selected (by detect) or requested on CPUs with AVX2 and FMA;
        // tests request it only after checking.
        CpuKernel::Avx2Fma => unsafe { tile_avx2::<W, R, N>(ws, xs, tile) },
        _ => tile_portable::<W, R, N>(ws, xs, tile),
    }
}

fn tile_portable<W: WeightElem, const R: usize, const N: usize>(
    ws: &[&[W]; 4],
    xs: &[&[f32]; 4],
    tile: &mut [[f32; 4]; 4],
) {
    let cols = xs[0].len();
    let main = cols / 8 * 8;
    let mut acc = [[[0f32; 8]; N]; R];
    let mut c = 0;
    while c < main {
        for r in 0..R {
            let wr = &ws[r][c..c + 8];
            for n in 0..N {
                let xn = &xs[n][c..c + 8];
                for l in 0..8 {
                    acc[r][n][l] += wr[l].to_f32() * xn[l];
                }
            }
        }
        c += 8;
    }
    for r in 0..R {
        for n in 0..N {
            let a = &acc[r][n];
            let mut s = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
            for cc in main..cols {
                s += ws[r][cc].to_f32() * xs[n][cc];
            }
            tile[r][n] = s;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<W: WeightElem, const R: usize, const N: usize>(
    ws: &[&[W]; 4],
    xs: &[&[f32]; 4],
    tile: &mut [[f32; 4]; 4],
) {
    use std::arch::x86_64::*;
    let cols = xs[0].len();
    let main = cols / 8 * 8;
    let mut acc = [[_mm256_setzero_ps(); N]; R];
    let wp: [*const W; R] = std::array::from_fn(|r| ws[r].as_ptr());
    let xp: [*const f32; N] = std::array::from_fn(|n| xs[n].as_ptr());
    let mut c = 0;
    while c < main {
        let wv: [__m256; R] = std::array::from_fn(|r| W::load8(wp[r].add(c)));
        for n in 0..N {
            let xv = _mm256_loadu_ps(xp[n].add(c));
            for r in 0..R {
                acc[r][n] = _mm256_fmadd_ps(wv[r], xv, acc[r][n]);
            }
        }
        c += 8;
    }
    for r in 0..R {
        for n in 0..N {
            let v = acc[r][n];
            let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
            let mut s = _mm_cvtss_f32(s1);
            for cc in main..cols {
                s += ws[r][cc].to_f32() * xs[n][cc];
            }
            tile[r][n] = s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn kernels() -> Vec<CpuKernel> {
        let mut k = vec![CpuKernel::Portable];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            k.push(CpuKernel::Avx2Fma);
        }
        k
    }

    fn random(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    #[test]
    fn matches_f64_reference_for_f32_and_bf16() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for &(rows, cols, n) in &[(1, 1, 1), (7, 13, 3), (65, 64, 5), (33, 200, 9)] {
            let x = random(&mut rng, n * cols);
            let wf = random(&mut rng, rows * cols);
            for w in [
                Matrix::from_f32(rows, cols, wf.clone()),
                Matrix::from_f32_as_bf16(rows, cols, &wf),
            ] {
                for k in kernels() {
                    let mut out = vec![0f32; n * rows];
                    matmul_with(k, &x, n, &w, &mut out);
                    let mut row = vec![0f32; cols];
                    for r in 0..rows {
                        w.row_to_f32(r, &mut row);
                        for t in 0..n {
                            let exact: f64 = (0..cols)
                                .map(|c| row[c] as f64 * x[t * cols + c] as f64)
                                .sum();
                            let got = out[t * rows + r] as f64;
                            assert!(
                                (got - exact).abs() <= 1e-5 * (cols as f64),
                                "{k:?} {rows}x{cols}x{n}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_token_is_bit_identical_alone_and_in_a_batch() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let (rows, cols) = (45, 203);
        let wf = random(&mut rng, rows * cols);
        for w in [
            Matrix::from_f32(rows, cols, wf.clone()),
            Matrix::from_f32_as_bf16(rows, cols, &wf),
        ] {
            for k in kernels() {
                for n in 1..=11 {
                    let x = random(&mut rng, n * cols);
                    let mut batch = vec![0f32; n * rows];
                    matmul_with(k, &x, n, &w, &mut batch);
                    for t in 0..n {
                        let mut single = vec![0f32; rows];
                        matmul_with(k, &x[t * cols..(t + 1) * cols], 1, &w, &mut single);
                        let b = &batch[t * rows..(t + 1) * rows];
                        assert!(
                            single
                                .iter()
                                .zip(b)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{k:?} token {t} of {n} differs from the single-token result"
                        );
                    }
                }
            }
        }
    }
}
