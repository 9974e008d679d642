//! `out[t, r] = dot(w[r, :], x[t, :])`: the one GEMM/GEMV shape of a decoder forward.
//!
//! Batch invariance: every output element is one dot product accumulated in a fixed order that
//! depends only on the kernel and the number of columns, whatever micro-tile (rows x tokens) it was
//! computed in and however rayon split the rows. So the logits of a token are bit-identical whether
//! it is processed alone or with seven others. The order per kernel:
//!
//! - `Portable`, `Avx2Fma`: one 8-lane accumulator over the columns in steps of 8 (lane `l` sums
//!   columns `l, l + 8, ...` in increasing order), a fixed horizontal sum, then the scalar tail
//!   (`cols % 8` columns) added one by one in increasing order.
//! - `Avx512`: one 16-lane accumulator over the columns in steps of 16 (lane `l` sums columns
//!   `l, l + 16, ...` in increasing order, each with one fused multiply-add); the last
//!   `cols % 16` columns go through the same accumulator as one more step whose missing lanes are
//!   zero (masked loads, so lane `l` of that step adds `+0` when column `main + l` does not exist);
//!   then the fixed horizontal sum `((lanes 0..8 + lanes 8..16) -> 8, halves -> 4, halves -> 2,
//!   lane 0 + lane 1)`. No scalar tail. Weights are widened to f32 exactly (bf16 is the top half of
//!   an f32); activations stay f32.
//!
//! Different kernels round differently (FMA vs separate multiply/add, 8 vs 16 lanes), which is why
//! `CpuKernel::detect` picks one per process.

use crate::matrix::{Matrix, MatrixData};
use half::bf16;
use rayon::prelude::*;
use std::sync::OnceLock;

/// Which implementation of the dot-product micro-kernel to use. All are batch-invariant; they
/// differ from each other in rounding (see the module docs for each one's order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuKernel {
    /// Plain Rust, 8 independent lanes, separate multiply and add; runs everywhere.
    Portable,
    /// x86-64 AVX2 + FMA.
    Avx2Fma,
    /// x86-64 AVX-512F + AVX-512BW: 16-lane f32 FMA accumulators, f32 activations.
    Avx512,
}

impl CpuKernel {
    /// The fastest kernel this CPU supports, detected once per process so that every call in a
    /// process uses the same arithmetic. `SPECULA_CPU_KERNEL=portable|avx2|avx512` forces one;
    /// a forced kernel the CPU lacks falls back to the detected one with a message on stderr.
    pub fn detect() -> CpuKernel {
        static DETECTED: OnceLock<CpuKernel> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            let best = CpuKernel::available().last().copied().unwrap_or(CpuKernel::Portable);
            match std::env::var("SPECULA_CPU_KERNEL") {
                Ok(v) if !v.is_empty() => match CpuKernel::from_name(&v) {
                    Some(k) if k.is_available() => k,
                    Some(k) => {
                        eprintln!(
                            "SPECULA_CPU_KERNEL={v}: this CPU lacks {}; using {}",
                            k.name(),
                            best.name()
                        );
                        best
                    }
                    None => {
                        eprintln!(
                            "SPECULA_CPU_KERNEL={v}: unknown kernel (portable, avx2, avx512); using {}",
                            best.name()
                        );
                        best
                    }
                },
                _ => best,
            }
        })
    }

    /// Short name, as `SPECULA_CPU_KERNEL` spells it and result files record it.
    pub fn name(self) -> &'static str {
        match self {
            CpuKernel::Portable => "portable",
            CpuKernel::Avx2Fma => "avx2",
            CpuKernel::Avx512 => "avx512",
        }
    }

    /// The kernel called `name` (see [`CpuKernel::name`]).
    pub fn from_name(name: &str) -> Option<CpuKernel> {
        match name.trim().to_ascii_lowercase().as_str() {
            "portable" => Some(CpuKernel::Portable),
            "avx2" | "avx2fma" => Some(CpuKernel::Avx2Fma),
            "avx512" => Some(CpuKernel::Avx512),
            _ => None,
        }
    }

    /// Whether this CPU can run the kernel.
    pub fn is_available(self) -> bool {
        match self {
            CpuKernel::Portable => true,
            #[cfg(target_arch = "x86_64")]
            CpuKernel::Avx2Fma => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            CpuKernel::Avx512 => {
                is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every kernel this CPU can run, slowest first.
    pub fn available() -> Vec<CpuKernel> {
        [CpuKernel::Portable, CpuKernel::Avx2Fma, CpuKernel::Avx512]
            .into_iter()
            .filter(|k| k.is_available())
            .collect()
    }
}

/// Rows handed to one rayon task. Large enough to amortise scheduling, small enough that the
/// vocabulary projection spreads over both cores evenly.
const ROWS_PER_TASK: usize = 32;

/// Largest micro-tile side (rows or tokens) of the Portable and AVX2 kernels.
const MAX_TILE: usize = 4;

/// Micro-tile shape `(rows, tokens)` of the Portable and AVX2 kernels for `remaining` tokens
/// left in this task. Row-tile size by token-tile size keeps 8 accumulators live (enough FMA
/// chains to hide latency) without spilling the 16 ymm registers. The shape never changes
/// results, only speed.
fn tile_shape(remaining: usize) -> (usize, usize) {
    let nt = remaining.min(MAX_TILE);
    (if nt <= 2 { 4 } else { 2 }, nt)
}

/// AVX-512: tokens sharing each weight load (one token group at a time).
const AVX512_MAX_TOKENS: usize = 8;
/// AVX-512: rows per micro-tile, by tokens in the group (index 0 unused). 32 zmm registers hold
/// rows x tokens accumulators, one register per weight row and one for the activations.
const AVX512_ROWS: [usize; AVX512_MAX_TOKENS + 1] = [0, 8, 4, 4, 4, 3, 3, 3, 3];
/// AVX-512: columns per cache block (a multiple of 16, so only the last block has a tail). The
/// activations of one token group over one block (8 x 512 x 4 B = 16 KiB) stay in L1 while every
/// row of the task passes over them; the accumulators wait in memory between blocks, so the
/// order of every dot product is that of one pass over all columns.
const AVX512_BLOCK_COLS: usize = 512;

/// `out[t * w.rows + r] = sum_c w[r, c] * x[t * w.cols + c]` for `t < n_tokens`.
pub fn matmul(x: &[f32], n_tokens: usize, w: &Matrix, out: &mut [f32]) {
    matmul_with(CpuKernel::detect(), x, n_tokens, w, out)
}

/// [`matmul`] with a chosen kernel.
///
/// # Panics
/// If `kernel` is not available on this CPU (see [`CpuKernel::is_available`]), or the shapes do
/// not match.
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
    // The SIMD kernels are unsafe on CPUs without their features; refuse instead.
    assert!(
        kernel == CpuKernel::Portable || kernel.is_available(),
        "matmul: kernel {} is not available on this CPU",
        kernel.name()
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
        #[cfg(target_arch = "x86_64")]
        if kernel == CpuKernel::Avx512 {
            // SAFETY: checked above that the CPU has AVX-512F and AVX-512BW; the task writes only
            // its own rows.
            match &w.data {
                MatrixData::F32(d) => unsafe {
                    task_avx512(d, rows, cols, r0, r1, x, n_tokens, out_ptr)
                },
                MatrixData::Bf16(d) => unsafe {
                    task_avx512(d, rows, cols, r0, r1, x, n_tokens, out_ptr)
                },
            }
            return;
        }
        let mut t0 = 0;
        while t0 < n_tokens {
            let (rt, nt) = tile_shape(n_tokens - t0);
            let mut r = r0;
            while r < r1 {
                let nr = if r1 - r >= rt { rt } else { 1 };
                let mut tile = [[0f32; MAX_TILE]; MAX_TILE];
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

type Tile = [[f32; MAX_TILE]; MAX_TILE];

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
    tile: &mut Tile,
) {
    let xs: [&[f32]; MAX_TILE] = std::array::from_fn(|j| {
        if j < nt {
            &x[(t0 + j) * cols..(t0 + j + 1) * cols]
        } else {
            &[][..]
        }
    });
    match &w.data {
        MatrixData::F32(d) => {
            let ws: [&[f32]; MAX_TILE] = std::array::from_fn(|i| {
                if i < nr {
                    &d[(r + i) * cols..(r + i + 1) * cols]
                } else {
                    &[][..]
                }
            });
            dispatch_tile(kernel, &ws, &xs, nr, nt, tile)
        }
        MatrixData::Bf16(d) => {
            let ws: [&[bf16]; MAX_TILE] = std::array::from_fn(|i| {
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
    #[cfg(target_arch = "x86_64")]
    /// Loads 16 consecutive elements widened to f32.
    ///
    /// # Safety
    /// `p..p+16` must be readable and the CPU must support AVX-512F and AVX-512BW.
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
    #[cfg(target_arch = "x86_64")]
    /// Loads the elements `p + l` whose bit `l` is set in `mask`, widened to f32; the other lanes
    /// are zero and their addresses are not read.
    ///
    /// # Safety
    /// The selected elements must be readable and the CPU must support AVX-512F and AVX-512BW.
    unsafe fn load16_masked(p: *const Self, mask: u16) -> std::arch::x86_64::__m512;
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
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16_masked(p: *const f32, mask: u16) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_maskz_loadu_ps(mask, p)
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
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const bf16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let h = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16_masked(p: *const bf16, mask: u16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // A 32-element masked load (AVX-512BW) with only the low 16 bits set: the masked-out
        // elements are neither read nor faulted on.
        let h = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16(mask as u32, p as *const i16));
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
    }
}

fn dispatch_tile<W: WeightElem>(
    kernel: CpuKernel,
    ws: &[&[W]; MAX_TILE],
    xs: &[&[f32]; MAX_TILE],
    nr: usize,
    nt: usize,
    tile: &mut Tile,
) {
    macro_rules! go {
        ($f:ident; $($r:literal, $n:literal);*) => {
            match (nr, nt) {
                $(($r, $n) => $f::<W, $r, $n>(ws, xs, tile),)*
                _ => unreachable!("{kernel:?} tile shape {nr}x{nt}"),
            }
        };
    }
    match kernel {
        #[cfg(target_arch = "x86_64")]
        CpuKernel::Avx2Fma => {
            // SAFETY: matmul_with refuses Avx2Fma unless the CPU has AVX2 and FMA.
            unsafe fn f<W: WeightElem, const R: usize, const N: usize>(
                ws: &[&[W]; MAX_TILE],
                xs: &[&[f32]; MAX_TILE],
                tile: &mut Tile,
            ) {
                unsafe { tile_avx2::<W, R, N>(ws, xs, tile) }
            }
            unsafe { go!(f; 4,1; 4,2; 2,3; 2,4; 1,1; 1,2; 1,3; 1,4) }
        }
        _ => go!(tile_portable; 4,1; 4,2; 2,3; 2,4; 1,1; 1,2; 1,3; 1,4),
    }
}

fn tile_portable<W: WeightElem, const R: usize, const N: usize>(
    ws: &[&[W]; MAX_TILE],
    xs: &[&[f32]; MAX_TILE],
    tile: &mut Tile,
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
    ws: &[&[W]; MAX_TILE],
    xs: &[&[f32]; MAX_TILE],
    tile: &mut Tile,
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
            let mut s = hsum256(acc[r][n]);
            for cc in main..cols {
                s += ws[r][cc].to_f32() * xs[n][cc];
            }
            tile[r][n] = s;
        }
    }
}

/// `((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))`, in that order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn hsum256(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    _mm_cvtss_f32(s1)
}

/// One rayon task of the AVX-512 kernel: rows `r0..r1` for every token. Token groups of up to
/// `AVX512_MAX_TOKENS`; within a group, column blocks in increasing order; within a block, every
/// row tile of the task. Each output element's accumulator sees its columns in increasing order
/// in steps of 16 whatever the group, tile or block, so the result is that of the module docs.
///
/// # Safety
/// The CPU must support AVX-512F and AVX-512BW; `w` is `rows x cols`, `x` is `n_tokens x cols`,
/// and no other task writes rows `r0..r1` of `out`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn task_avx512<W: WeightElem>(
    w: &[W],
    rows: usize,
    cols: usize,
    r0: usize,
    r1: usize,
    x: &[f32],
    n_tokens: usize,
    out: &SharedOut,
) {
    use std::arch::x86_64::*;
    debug_assert!(w.len() == rows * cols && x.len() == n_tokens * cols && r1 <= rows);
    let mut acc = [[_mm512_setzero_ps(); AVX512_MAX_TOKENS]; ROWS_PER_TASK];
    let mut t0 = 0;
    while t0 < n_tokens {
        let nt = (n_tokens - t0).min(AVX512_MAX_TOKENS);
        let rt = AVX512_ROWS[nt];
        // One token's activations fit L1 whole; blocks only help when several tokens share them.
        let block = if nt == 1 { cols } else { AVX512_BLOCK_COLS };
        for a in acc.iter_mut() {
            *a = [_mm512_setzero_ps(); AVX512_MAX_TOKENS];
        }
        let xp = x.as_ptr().add(t0 * cols);
        let mut c0 = 0;
        while c0 < cols {
            let c1 = (c0 + block).min(cols);
            let mut r = r0;
            while r < r1 {
                let nr = if r1 - r >= rt { rt } else { 1 };
                let wp = w.as_ptr().add(r * cols);
                let a = &mut acc[r - r0..];
                macro_rules! go {
                    ($($r:literal, $n:literal);*) => {
                        match (nr, nt) {
                            $(($r, $n) => block_avx512::<W, $r, $n>(wp, xp, cols, c0, c1, a),)*
                            _ => unreachable!("AVX-512 tile shape {nr}x{nt}"),
                        }
                    };
                }
                go!(8,1; 4,2; 4,3; 4,4; 3,5; 3,6; 3,7; 3,8;
                    1,1; 1,2; 1,3; 1,4; 1,5; 1,6; 1,7; 1,8);
                r += nr;
            }
            c0 = c1;
        }
        for (i, row_acc) in acc.iter().enumerate().take(r1 - r0) {
            for (j, &v) in row_acc.iter().enumerate().take(nt) {
                // Lanes 0..8 + lanes 8..16, then the same fixed 8-lane sum as AVX2.
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
                let s = hsum256(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
                // SAFETY: in bounds; rows r0..r1 belong to this task only.
                *out.0.add((t0 + j) * rows + r0 + i) = s;
            }
        }
        t0 += nt;
    }
}

/// Accumulates columns `c0..c1` of `R` weight rows (from `wp`, stride `cols`) against `N` tokens
/// (from `xp`, stride `cols`) into `acc[r][n]`. `c0` is a multiple of 16; a tail shorter than 16
/// (only ever at `c1 == cols`) is one more step with the missing lanes zero (0 * 0 + a == a).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
#[inline]
unsafe fn block_avx512<W: WeightElem, const R: usize, const N: usize>(
    wp: *const W,
    xp: *const f32,
    cols: usize,
    c0: usize,
    c1: usize,
    acc: &mut [[std::arch::x86_64::__m512; AVX512_MAX_TOKENS]],
) {
    use std::arch::x86_64::*;
    let mut a: [[__m512; N]; R] = std::array::from_fn(|r| std::array::from_fn(|n| acc[r][n]));
    let wr: [*const W; R] = std::array::from_fn(|r| wp.add(r * cols));
    let xr: [*const f32; N] = std::array::from_fn(|n| xp.add(n * cols));
    let main = c0 + (c1 - c0) / 16 * 16;
    let mut c = c0;
    while c < main {
        let wv: [__m512; R] = std::array::from_fn(|r| W::load16(wr[r].add(c)));
        for n in 0..N {
            let xv = _mm512_loadu_ps(xr[n].add(c));
            for r in 0..R {
                a[r][n] = _mm512_fmadd_ps(wv[r], xv, a[r][n]);
            }
        }
        c += 16;
    }
    if main < c1 {
        let mask = ((1u32 << (c1 - main)) - 1) as u16;
        let wv: [__m512; R] = std::array::from_fn(|r| W::load16_masked(wr[r].add(main), mask));
        for n in 0..N {
            let xv = _mm512_maskz_loadu_ps(mask, xr[n].add(main));
            for r in 0..R {
                a[r][n] = _mm512_fmadd_ps(wv[r], xv, a[r][n]);
            }
        }
    }
    for r in 0..R {
        for n in 0..N {
            acc[r][n] = a[r][n];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn kernels() -> Vec<CpuKernel> {
        CpuKernel::available()
    }

    fn random(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    #[test]
    fn names_round_trip() {
        for k in [CpuKernel::Portable, CpuKernel::Avx2Fma, CpuKernel::Avx512] {
            assert_eq!(CpuKernel::from_name(k.name()), Some(k));
        }
        assert_eq!(CpuKernel::from_name("sse"), None);
        assert!(CpuKernel::Portable.is_available());
        assert!(CpuKernel::detect().is_available());
    }

    #[test]
    fn matches_f64_reference_for_f32_and_bf16() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for &(rows, cols, n) in &[
            (1, 1, 1),
            (7, 13, 3),
            (65, 64, 5),
            (33, 200, 9),
            (19, 15, 8),
            (40, 17, 13),
            (37, 255, 24),
            (70, 1536, 2),
        ] {
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
        // Odd columns (not a multiple of 8 or 16, shorter than one step, exact multiples) and
        // rows that are not a multiple of any tile or of the rows per rayon task.
        for &(rows, cols) in &[(45, 203), (70, 15), (37, 16), (9, 33), (67, 96)] {
            let wf = random(&mut rng, rows * cols);
            for w in [
                Matrix::from_f32(rows, cols, wf.clone()),
                Matrix::from_f32_as_bf16(rows, cols, &wf),
            ] {
                for k in kernels() {
                    let ns: Vec<usize> = if (rows, cols) == (45, 203) {
                        (1..=40).collect()
                    } else {
                        vec![1, 2, 3, 5, 8, 9, 17, 24, 40]
                    };
                    for n in ns {
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
                                "{k:?} {rows}x{cols}: token {t} of {n} differs from the single-token result"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The documented order, written out in scalar code: the AVX-512 kernel must equal it bit for
    /// bit (FMA lanes over steps of 16, masked tail as one more step, fixed 16 -> 1 tree).
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn avx512_follows_the_documented_order() {
        if !CpuKernel::Avx512.is_available() {
            return;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for &(rows, cols, n) in &[(5, 203, 3), (9, 16, 9), (3, 7, 1), (11, 1536, 8)] {
            let x = random(&mut rng, n * cols);
            let wf = random(&mut rng, rows * cols);
            let w = Matrix::from_f32_as_bf16(rows, cols, &wf);
            let mut out = vec![0f32; n * rows];
            matmul_with(CpuKernel::Avx512, &x, n, &w, &mut out);
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                w.row_to_f32(r, &mut row);
                for t in 0..n {
                    let mut lanes = [0f32; 16];
                    for (c, &wc) in row.iter().enumerate() {
                        lanes[c % 16] = wc.mul_add(x[t * cols + c], lanes[c % 16]);
                    }
                    let a: [f32; 8] = std::array::from_fn(|l| lanes[l] + lanes[l + 8]);
                    let s = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
                    assert_eq!(
                        out[t * rows + r].to_bits(),
                        s.to_bits(),
                        "{rows}x{cols}x{n}"
                    );
                }
            }
        }
    }
}
