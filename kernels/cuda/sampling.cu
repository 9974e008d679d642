// Sampling and verification kernels for the CUDA standard path (issue 5):
//   logits_to_probs   logits -> probabilities with exactly the CPU semantics of kernels/src/sampling.rs
//                     (temperature 0 = one-hot argmax, temperature, top-k then top-p, vocab limit), plus the
//                     1 / (f64 row sum) scale the verifier reads rows with;
//   row_inv_sums      that scale (and the verifier's row validation) for rows that came from elsewhere;
//   verify_drafts     one CTA per sequence runs the sequence's acceptance rule (greedy, standard, block,
//                     synthetic), a port of verifier/src/rules.rs, drawing uniforms from Philox4x32-10;
//                     row_argmax_chunks and block_residual_masses do its whole-row work beforehand
//                     across many CTAs;
//   philox4x32_10_blocks  the raw generator, so the host can check it against kernels/src/philox.rs.
// Nothing here synchronises with the host: errors become status codes in device buffers that the host
// reads with the step's one readback.
//
// Arithmetic follows the CPU reference operation by operation in f64 where the reference uses f64; the
// __d*_rn intrinsics keep NVRTC from contracting a multiply and an add into an FMA, which would round
// differently from the CPU. Every reduction runs in a fixed order (per-thread strided partial sums, then
// warp butterflies, then the warps in order), so a result never depends on scheduling.

#define SPL_MAX_WARPS 32
#define SPL_PROBS_THREADS 256
#define SPL_INT_MAX 0x7fffffff
#define SPL_FULL 0xffffffffu
// NVRTC has no math.h: infinities and NaN by their bit patterns.
#define SPL_F32_INF __int_as_float(0x7f800000)
#define SPL_F32_NEG_INF __int_as_float(0xff800000)
#define SPL_F32_NAN __int_as_float(0x7fc00000)
#define SPL_F64_NAN __longlong_as_double(0x7ff8000000000000ll)
#define SPL_F64_MAX 1.7976931348623157e308

typedef unsigned int u32;
typedef unsigned long long u64;

// Status codes (kept in sync with kernels/src/cuda/sampling.rs).
#define SPL_OK 0
// logits_to_probs
#define SPL_NON_FINITE_LOGIT 1
#define SPL_ALL_MASKED 2
#define SPL_BAD_BLOCK 3
// verify_drafts
#define SPL_BAD_DRAFT_COUNT 10
#define SPL_UNKNOWN_RULE 11
#define SPL_TOKEN_OUT_OF_VOCAB 12
#define SPL_INVALID_TARGET_ROW 13
#define SPL_INVALID_DRAFT_ROW 14
#define SPL_ZERO_DRAFT_PROB 15
#define SPL_TOO_FEW_RATES 16

// Rule ids (AcceptanceRule in the verifier crate).
#define SPL_RULE_GREEDY 0
#define SPL_RULE_STANDARD 1
#define SPL_RULE_BLOCK 2
#define SPL_RULE_SYNTHETIC 3

// ---------------------------------------------------------------------------------------------------
// Philox4x32-10 (Random123): the key is bumped before every round but the first.

__device__ __forceinline__ void philox4x32_10(u32 c[4], u32 k0, u32 k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        u32 lo0 = 0xD2511F53u * c[0];
        u32 hi0 = __umulhi(0xD2511F53u, c[0]);
        u32 lo1 = 0xCD9E8D57u * c[2];
        u32 hi1 = __umulhi(0xCD9E8D57u, c[2]);
        u32 n0 = hi1 ^ c[1] ^ k0;
        u32 n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0;
        c[1] = lo1;
        c[2] = n2;
        c[3] = lo0;
    }
}

// Draw `draw` of step `offset` for the stream keyed by `seed`: counter [offset_lo, offset_hi, draw, 0],
// 53 bits of the first two words -> [0, 1). Same as kernels/src/philox.rs `uniform`.
__device__ __forceinline__ double philox_uniform(u64 seed, u64 offset, u32 draw) {
    u32 c[4] = {(u32)offset, (u32)(offset >> 32), draw, 0u};
    philox4x32_10(c, (u32)seed, (u32)(seed >> 32));
    return ((double)(c[0] >> 5) * 67108864.0 + (double)(c[1] >> 6)) * (1.0 / 9007199254740992.0);
}

// counters: n x 4 words, keys: n x 2 words, out: n x 4 words. One thread per block of output.
extern "C" __global__ void philox4x32_10_blocks(const u32* counters, const u32* keys, u32* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u32 c[4] = {counters[4 * i], counters[4 * i + 1], counters[4 * i + 2], counters[4 * i + 3]};
    philox4x32_10(c, keys[2 * i], keys[2 * i + 1]);
    for (int j = 0; j < 4; ++j) out[4 * i + j] = c[j];
}

// ---------------------------------------------------------------------------------------------------
// Block-wide helpers. blockDim.x is a power of two between 32 and 1024. Every helper starts and ends with
// a barrier so callers can chain them on the same scratch.

struct Scratch {
    double d[SPL_MAX_WARPS];
    int i[SPL_MAX_WARPS];
    float f[SPL_MAX_WARPS];
    double bd, bd2;
    int bi, bi2;
    u32 bu;
};

// One CTA streams a 150k-entry row only as fast as its loads in flight allow (Little's law: one load
// per thread leaves an SM at a few GB/s). So every pass over a row goes through `strided`, which issues
// SPL_UNROLL independent loads per thread before using any of them; the uses still happen in index
// order per thread, so results are the same as the plain loop's.
#define SPL_UNROLL 8

// use(x, load(x)) for x = start, start + step, ... < end, in that order, UN loads at a time (kernels
// with few threads per SM ask for more).
template <class T, int UN = SPL_UNROLL, class L, class U>
__device__ __forceinline__ void strided(int start, int end, int step, const L& load, U&& use) {
    for (int base = start; base < end; base += UN * step) {
        T v[UN];
#pragma unroll
        for (int u = 0; u < UN; ++u) {
            int x = base + u * step;
            if (x < end) v[u] = load(x);
        }
#pragma unroll
        for (int u = 0; u < UN; ++u) {
            int x = base + u * step;
            if (x < end) use(x, v[u]);
        }
    }
}

__device__ __forceinline__ double warp_sum_d(double v) {
    // Butterfly: lanes add the same two values in either order, so every lane ends with the same bits.
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(SPL_FULL, v, o);
    return v;
}

__device__ __forceinline__ int warp_sum_i(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(SPL_FULL, v, o);
    return v;
}

__device__ __forceinline__ int warp_min_i(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(SPL_FULL, v, o));
    return v;
}

__device__ __forceinline__ int warp_max_i(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(SPL_FULL, v, o));
    return v;
}

__device__ double block_sum_d(double v, Scratch& sc) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) sc.d[warp] = v;
    __syncthreads();
    if (warp == 0) {
        double t = lane < nw ? sc.d[lane] : 0.0;
        t = warp_sum_d(t);
        if (lane == 0) sc.bd = t;
    }
    __syncthreads();
    double r = sc.bd;
    __syncthreads();
    return r;
}

__device__ int block_sum_i(int v, Scratch& sc) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum_i(v);
    __syncthreads();
    if (lane == 0) sc.i[warp] = v;
    __syncthreads();
    if (warp == 0) {
        int t = lane < nw ? sc.i[lane] : 0;
        t = warp_sum_i(t);
        if (lane == 0) sc.bi = t;
    }
    __syncthreads();
    int r = sc.bi;
    __syncthreads();
    return r;
}

__device__ int block_min_i(int v, Scratch& sc) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_min_i(v);
    __syncthreads();
    if (lane == 0) sc.i[warp] = v;
    __syncthreads();
    if (warp == 0) {
        int t = lane < nw ? sc.i[lane] : SPL_INT_MAX;
        t = warp_min_i(t);
        if (lane == 0) sc.bi = t;
    }
    __syncthreads();
    int r = sc.bi;
    __syncthreads();
    return r;
}

__device__ int block_max_i(int v, Scratch& sc) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max_i(v);
    __syncthreads();
    if (lane == 0) sc.i[warp] = v;
    __syncthreads();
    if (warp == 0) {
        int t = lane < nw ? sc.i[lane] : -1;
        t = warp_max_i(t);
        if (lane == 0) sc.bi = t;
    }
    __syncthreads();
    int r = sc.bi;
    __syncthreads();
    return r;
}

// Index of the largest value, the lowest index on ties (sampling::argmax and the verifier's argmax);
// SPL_INT_MAX when no value beats -inf (the caller maps that to 0, as the CPU loop does).
// Combines per-thread (best value, its lowest index) pairs.
__device__ int block_argmax_reduce(float bv, int bi, Scratch& sc, float* best_value) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(SPL_FULL, bv, o);
        int oi = __shfl_xor_sync(SPL_FULL, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) {
            bv = ov;
            bi = oi;
        }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) {
        sc.f[warp] = bv;
        sc.i[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        bv = lane < nw ? sc.f[lane] : SPL_F32_NEG_INF;
        bi = lane < nw ? sc.i[lane] : SPL_INT_MAX;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(SPL_FULL, bv, o);
            int oi = __shfl_xor_sync(SPL_FULL, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            sc.bi = bi;
            sc.f[0] = bv;
        }
    }
    __syncthreads();
    int r = sc.bi;
    if (best_value) *best_value = sc.f[0];
    __syncthreads();
    return r;
}

__device__ int block_argmax(const float* row, int n, Scratch& sc, float* best_value) {
    float bv = SPL_F32_NEG_INF;
    int bi = SPL_INT_MAX;
    strided<float>(threadIdx.x, n, blockDim.x, [&](int x) { return row[x]; }, [&](int x, float v) {
        if (v > bv) {
            bv = v;
            bi = x;
        }
    });
    return block_argmax_reduce(bv, bi, sc, best_value);
}

// Inclusive and exclusive prefix sums of one value per thread, in thread order. The exclusive value of
// thread t + 1 is bitwise the inclusive value of thread t (same operands, same operation), so a
// search over [excl, incl) intervals partitions [0, total). Returns the total.
__device__ double block_scan_d(double v, double* incl, double* excl, Scratch& sc) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    double x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        double y = __shfl_up_sync(SPL_FULL, x, o);
        if (lane >= o) x += y;
    }
    double e = __shfl_up_sync(SPL_FULL, x, 1);
    if (lane == 0) e = 0.0;
    __syncthreads();
    if (lane == 31) sc.d[warp] = x;
    __syncthreads();
    if (threadIdx.x == 0) {
        double run = 0.0;
        for (int j = 0; j < nw; ++j) {
            double t = sc.d[j];
            sc.d[j] = run;
            run += t;
        }
        sc.bd = run;
    }
    __syncthreads();
    double base = sc.d[warp];
    *incl = base + x;
    *excl = base + e;
    double total = sc.bd;
    __syncthreads();
    return total;
}

__device__ int block_scan_i(int v, int* incl, int* excl, Scratch& sc) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(SPL_FULL, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();
    if (lane == 31) sc.i[warp] = x;
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0;
        for (int j = 0; j < nw; ++j) {
            int t = sc.i[j];
            sc.i[j] = run;
            run += t;
        }
        sc.bi = run;
    }
    __syncthreads();
    int base = sc.i[warp];
    *incl = base + x;
    *excl = base + x - v;
    int total = sc.bi;
    __syncthreads();
    return total;
}

// ---------------------------------------------------------------------------------------------------
// Inverse-CDF sampling over weights w(0..n) in one CTA, with the conventions of sampling::sample_from and
// the verifier's sample_f64: target = u * total; the first index with positive weight whose cumulative
// weight exceeds target; rounding at the top end falls back to the last index with positive weight.
//
// The row is cut into blockDim.x contiguous segments (one per thread, summed cooperatively by a warp so
// loads stay coalesced); a block scan over segment sums finds the segment holding target, and one warp
// scans that segment. Cumulative sums are the CPU's up to association (~1e-16 relative), which can only
// move a draw whose uniform lies within that distance of a boundary. Returns -1 when the total weight is
// not positive (the caller decides the fallback, as the rules do).

struct RowWeight {
    const float* p;
    __device__ __forceinline__ double operator()(int x) const { return (double)p[x]; }
};

// max(weight * P(x) - Q(x), 0) with P, Q read as entries times their 1 / (f64 row sum), as
// CheckedInput::residual computes it. q == nullptr is a one-hot draft on `token`.
struct ResidualWeight {
    const float* p;
    const float* q;
    double p_scale, q_scale, weight;
    int token;
    __device__ __forceinline__ double operator()(int x) const {
        double tp = __dmul_rn((double)p[x], p_scale);
        double dp = q ? __dmul_rn((double)q[x], q_scale) : (x == token ? 1.0 : 0.0);
        double r = __dsub_rn(__dmul_rn(weight, tp), dp);
        return r > 0.0 ? r : 0.0;
    }
};

template <class W>
__device__ void segment_sums(const W& w, int n, int seg_len, double* sum_out, int* last_out) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    double mine = 0.0;
    int mine_last = -1;
    // Four segments at a time, two tiles of each per step: eight independent loads per lane in flight
    // across segments, instead of one segment's loads and then its reduction before the next segment.
    // Each segment's per-lane sum still runs over its entries in index order.
    for (int j0 = 0; j0 < 32; j0 += 4) {
        double acc[4] = {0.0, 0.0, 0.0, 0.0};
        int last[4] = {-1, -1, -1, -1};
        for (int t = lane; t < seg_len; t += 64) {
            double v[8];
#pragma unroll
            for (int q = 0; q < 4; ++q)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    int off = t + 32 * h;
                    int x = (warp * 32 + j0 + q) * seg_len + off;
                    v[q * 2 + h] = (off < seg_len && x < n) ? w(x) : 0.0;
                }
#pragma unroll
            for (int q = 0; q < 4; ++q)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    double val = v[q * 2 + h];
                    acc[q] += val;
                    if (val > 0.0) last[q] = (warp * 32 + j0 + q) * seg_len + t + 32 * h;
                }
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            double a = warp_sum_d(acc[q]);
            int l = warp_max_i(last[q]);
            if (lane == j0 + q) {
                mine = a;
                mine_last = l;
            }
        }
    }
    *sum_out = mine;
    *last_out = mine_last;
}

template <class W>
__device__ int block_sample(const W& w, int n, double u, Scratch& sc, double* total_out) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int seg_len = (n + blockDim.x - 1) / blockDim.x;
    double s;
    int last;
    segment_sums(w, n, seg_len, &s, &last);
    double incl, excl;
    double total = block_scan_d(s, &incl, &excl, sc);
    if (total_out) *total_out = total;
    if (!(total > 0.0)) return -1;
    double target = u * total;
    int seg = block_min_i((s > 0.0 && target < incl) ? (int)threadIdx.x : SPL_INT_MAX, sc);
    int row_last = block_max_i(last, sc);
    if (seg == SPL_INT_MAX) return row_last;
    if ((int)threadIdx.x == seg) {
        sc.bd2 = excl;
        sc.bi2 = last;
    }
    __syncthreads();
    if (warp == 0) {
        double carry = sc.bd2;
        int result = -1;
        int lo = seg * seg_len, hi = min(lo + seg_len, n);
        for (int g = lo; g < hi && result < 0; g += 32 * SPL_UNROLL) {
            double vs[SPL_UNROLL];
#pragma unroll
            for (int u = 0; u < SPL_UNROLL; ++u) {
                int x = g + 32 * u + lane;
                vs[u] = x < hi ? w(x) : 0.0;
            }
#pragma unroll
            for (int u = 0; u < SPL_UNROLL; ++u) {
                double v = vs[u];
                double c = v;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    double y = __shfl_up_sync(SPL_FULL, c, o);
                    if (lane >= o) c += y;
                }
                unsigned hit = __ballot_sync(SPL_FULL, v > 0.0 && target < carry + c);
                if (hit && result < 0) result = g + 32 * u + __ffs(hit) - 1;
                carry = carry + __shfl_sync(SPL_FULL, c, 31);
            }
        }
        if (result < 0) result = sc.bi2;
        if (lane == 0) sc.bi = result;
    }
    __syncthreads();
    int r = sc.bi;
    __syncthreads();
    return r;
}

// sum of w(x) over [lo, hi), strided per thread then reduced in a fixed order.
template <class W>
__device__ double block_weight_sum(const W& w, int lo, int hi, Scratch& sc) {
    double acc = 0.0;
    strided<double, 16>(lo + threadIdx.x, hi, blockDim.x, w, [&](int, double v) { acc += v; });
    return block_sum_d(acc, sc);
}

// ---------------------------------------------------------------------------------------------------
// Row scales: 1 / (f64 sum of the row), the factor CheckedInput reads every row with, or NaN when the
// row would fail its validation (an entry not finite or negative, or a sum off 1 by more than 1e-3,
// verifier::NORMALISATION_TOLERANCE). Grid: rows; rows are contiguous with stride `n`.
#define SPL_NORMALISATION_TOLERANCE 1e-3

extern "C" __global__ void row_inv_sums(const float* rows, int n, double* inv_sums) {
    __shared__ Scratch sc;
    const float* r = rows + (size_t)blockIdx.x * n;
    double acc = 0.0;
    int bad = 0;
    strided<float, 32>(threadIdx.x, n, blockDim.x, [&](int x) { return r[x]; }, [&](int, float v) {
        // Not (finite and >= 0): NaN fails every comparison.
        if (!(v >= 0.0f && v < SPL_F32_INF)) bad = 1;
        acc += (double)v;
    });
    double sum = block_sum_d(acc, sc);
    bad = block_sum_i(bad, sc);
    if (threadIdx.x == 0) {
        double dev = sum - 1.0;
        if (dev < 0.0) dev = -dev;
        inv_sums[blockIdx.x] = (bad || !(dev <= SPL_NORMALISATION_TOLERANCE)) ? SPL_F64_NAN : 1.0 / sum;
    }
}

// ---------------------------------------------------------------------------------------------------
// logits_to_probs. One CTA of SPL_PROBS_THREADS threads per row.
//
// softmax(logits / T) in f64 per entry (stored as f32), then top-k, then top-p over what top-k kept, then
// renormalised; the kept set is the CPU's: entries ordered by f32 probability (descending), ties by
// index, the first top_k of them, then the shortest prefix whose cumulative f64 mass reaches
// top_p * (mass kept by top-k). Instead of sorting 150k entries, radix selection on the f32 bit patterns
// (monotone for non-negative floats) finds the boundary value, and the tie at the boundary is cut at
// the right index by a prefix count in index order. Top-p's cumulative mass is the CPU's up to
// summation order: the kept set can only differ when a cumulative sum lies within ~1e-15 relative of
// the threshold.

__device__ __forceinline__ bool kept_by(u32 bits, int x, u32 boundary, int cut) {
    return bits > boundary || (bits == boundary && x <= cut);
}

// The value of the K-th largest entry (K >= 1, K <= n) and how many entries are strictly larger.
// 8-bit digits, four passes; shared-memory integer histograms (integer adds are exact, so the result
// does not depend on the order of the atomics), one atomic per distinct bin per warp.
__device__ u32 select_kth_largest(const float* p, int n, u32 k, u32* hist, Scratch& sc, u32* above_out) {
    int lane = threadIdx.x & 31;
    u32 prefix = 0, mask = 0, above = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for (int g = 0; g < n; g += blockDim.x * SPL_UNROLL) {
            u32 bits[SPL_UNROLL];
#pragma unroll
            for (int u = 0; u < SPL_UNROLL; ++u) {
                int x = g + u * blockDim.x + threadIdx.x;
                bits[u] = x < n ? __float_as_uint(p[x]) : 0xffffffffu;
            }
#pragma unroll
            for (int u = 0; u < SPL_UNROLL; ++u) {
                // 0xffffffff is no probability's bit pattern (a NaN): the padding of the last tile.
                u32 bin = (bits[u] != 0xffffffffu && (bits[u] & mask) == prefix) ? (bits[u] >> shift) & 255u : 256u;
                u32 peers = __match_any_sync(SPL_FULL, bin);
                if (bin < 256 && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], (u32)__popc(peers));
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 cum = above;
            int d = 255;
            for (; d > 0; --d) {
                if (cum + hist[d] >= k) break;
                cum += hist[d];
            }
            sc.bi = d;
            sc.bu = cum;
        }
        __syncthreads();
        prefix |= (u32)sc.bi << shift;
        mask |= 255u << shift;
        above = sc.bu;
        __syncthreads();
    }
    *above_out = above;
    return prefix;
}

// The value v at which the descending cumulative mass of the kept-by-top-k entries reaches `target`:
// mass(> v) < target <= mass(>= v). 4-bit digits, eight passes; each thread sums its own entries into
// its own 16 bins (shared memory, [bin][thread]), and the bins are reduced in a fixed order, so the
// result is deterministic. `bins` holds 16 * SPL_PROBS_THREADS doubles plus 256 for the reduction.
__device__ u32 select_mass_boundary(const float* p, int n, u32 kb, int kcut, double target, double* bins,
                                    Scratch& sc, double* above_out) {
    const int nt = SPL_PROBS_THREADS;
    double* partial = bins + 16 * nt;
    u32 prefix = 0, mask = 0;
    double above = 0.0;
    for (int shift = 28; shift >= 0; shift -= 4) {
        for (int d = 0; d < 16; ++d) bins[d * nt + threadIdx.x] = 0.0;
        strided<float, 32>(threadIdx.x, n, nt, [&](int x) { return p[x]; }, [&](int x, float v) {
            u32 bits = __float_as_uint(v);
            if (kept_by(bits, x, kb, kcut) && (bits & mask) == prefix)
                bins[((bits >> shift) & 15u) * nt + threadIdx.x] += (double)v;
        });
        __syncthreads();
        {
            // 256 threads: bin t / 16, part t % 16 sums threads part*16 .. part*16+15 of that bin.
            int bin = threadIdx.x >> 4, part = threadIdx.x & 15;
            double s = 0.0;
            for (int j = 0; j < nt / 16; ++j) s += bins[bin * nt + part * (nt / 16) + j];
            partial[threadIdx.x] = s;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            double mass[16];
            for (int d = 0; d < 16; ++d) {
                double s = 0.0;
                for (int j = 0; j < 16; ++j) s += partial[d * 16 + j];
                mass[d] = s;
            }
            double cum = above;
            int pick = -1;
            for (int d = 15; d >= 0; --d) {
                if (cum + mass[d] >= target) {
                    pick = d;
                    break;
                }
                cum += mass[d];
            }
            if (pick < 0) {
                // Rounding left the whole kept mass a hair below target: keep everything down to
                // the lowest bin with mass (the CPU loop would run to the end of the kept set).
                cum = above;
                pick = 0;
                for (int d = 15; d >= 0; --d)
                    if (mass[d] > 0.0) pick = d;
                for (int d = 15; d > pick; --d) cum += mass[d];
            }
            sc.bi = pick;
            sc.bd = cum;
        }
        __syncthreads();
        prefix |= (u32)sc.bi << shift;
        mask |= 15u << shift;
        above = sc.bd;
        __syncthreads();
    }
    *above_out = above;
    return prefix;
}

// Entries with bits == value among those kept by (kb, kcut): their count.
__device__ int count_equal(const float* p, int n, u32 value, u32 kb, int kcut, Scratch& sc) {
    int c = 0;
    strided<float, 32>(threadIdx.x, n, blockDim.x, [&](int x) { return p[x]; }, [&](int x, float v) {
        u32 bits = __float_as_uint(v);
        if (bits == value && kept_by(bits, x, kb, kcut)) c++;
    });
    return block_sum_i(c, sc);
}

// The index of the m-th (1-based, index order) entry with bits == value among those kept by (kb, kcut);
// SPL_INT_MAX if there are fewer than m. Segments per thread, counted by warps with ballots, a block
// scan over the counts, then one warp walks the segment that holds the m-th.
__device__ int locate_mth_equal(const float* p, int n, u32 value, u32 kb, int kcut, int m, Scratch& sc) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int seg_len = (n + blockDim.x - 1) / blockDim.x;
    int mine = 0;
    for (int j = 0; j < 32; ++j) {
        int lo = (warp * 32 + j) * seg_len, hi = min(lo + seg_len, n);
        int cnt = 0;
        strided<float>(lo + lane, hi, 32, [&](int x) { return p[x]; }, [&](int x, float v) {
            u32 bits = __float_as_uint(v);
            if (bits == value && kept_by(bits, x, kb, kcut)) cnt++;
        });
        cnt = warp_sum_i(cnt);
        if (lane == j) mine = cnt;
    }
    int incl, excl;
    block_scan_i(mine, &incl, &excl, sc);
    int seg = block_min_i((excl < m && m <= incl) ? (int)threadIdx.x : SPL_INT_MAX, sc);
    if (seg == SPL_INT_MAX) return SPL_INT_MAX;
    if ((int)threadIdx.x == seg) sc.bi2 = excl;
    __syncthreads();
    if (warp == 0) {
        int run = sc.bi2, result = SPL_INT_MAX;
        int lo = seg * seg_len, hi = min(lo + seg_len, n);
        for (int x0 = lo; x0 < hi; x0 += 32) {
            int x = x0 + lane;
            bool hit = false;
            if (x < hi) {
                u32 bits = __float_as_uint(p[x]);
                hit = bits == value && kept_by(bits, x, kb, kcut);
            }
            unsigned ballot = __ballot_sync(SPL_FULL, hit);
            int c = __popc(ballot);
            if (run + c >= m) {
                for (int r = m - run; r > 1; --r) ballot &= ballot - 1;
                result = x0 + __ffs(ballot) - 1;
                break;
            }
            run += c;
        }
        if (lane == 0) sc.bi = result;
    }
    __syncthreads();
    int r = sc.bi;
    __syncthreads();
    return r;
}

// logits, probs: rows x row_stride; entries [vocab, row_stride) are padding and get probability 0.
// Per row: temperature, top_k (0 disables), top_p (1 disables), validated on the host like
// SamplingParams::validate. Outputs: probs, inv_sums (1 / f64 sum of the written row, NaN on error),
// status: 2 ints per row, [code, detail] (SPL_NON_FINITE_LOGIT with the first bad index;
// SPL_ALL_MASKED; SPL_BAD_BLOCK when launched with the wrong block size). Rows with an error are NaN.
//
// The work of one row is the device function row_logits_to_probs, so that other kernels (the DSpark
// drafter's fused Markov loop, dspark.cu) process their rows with exactly these semantics. It writes
// *inv_sum and st[0..2] from thread 0 (callers synchronise before reading them) and returns the
// row's argmax (lowest index on ties, 0 when every logit is -inf) on success, -1 on error.
__device__ int row_logits_to_probs(const float* l, float* p, int row_stride, int vocab, float temperature,
                                   u32 top_k, float top_p, double* inv_sum, int* st, Scratch& sc, u32* hist,
                                   double* bins) {
    const int nt = blockDim.x;

    int error = SPL_OK, detail = 0;
    if (nt != SPL_PROBS_THREADS) {
        error = SPL_BAD_BLOCK;
        detail = nt;
    }
    int bad = SPL_INT_MAX;
    float max_value = SPL_F32_NEG_INF;
    int best = SPL_INT_MAX;
    if (error == SPL_OK) {
        // -inf is a legitimate mask; NaN and +inf are model failures (sampling::check_finite).
        // One pass finds the first bad index and the argmax (meaningful only without a bad value).
        float bv = SPL_F32_NEG_INF;
        int bi = SPL_INT_MAX;
        strided<float, 32>(threadIdx.x, vocab, nt, [&](int x) { return l[x]; }, [&](int x, float v) {
            if (v != v || v == SPL_F32_INF) bad = min(bad, x);
            if (v > bv) {
                bv = v;
                bi = x;
            }
        });
        bad = block_min_i(bad, sc);
        best = block_argmax_reduce(bv, bi, sc, &max_value);
        if (bad != SPL_INT_MAX) {
            error = SPL_NON_FINITE_LOGIT;
            detail = bad;
        }
    }
    if (error == SPL_OK && temperature == 0.0f) {
        // Greedy: one-hot at the argmax (index 0 when every logit is -inf, as the CPU loop gives).
        int at = best == SPL_INT_MAX ? 0 : best;
        for (int x = threadIdx.x; x < row_stride; x += nt) p[x] = x == at ? 1.0f : 0.0f;
        if (threadIdx.x == 0) {
            *inv_sum = 1.0;
            st[0] = SPL_OK;
            st[1] = 0;
        }
        return at;
    }
    if (error == SPL_OK && max_value == SPL_F32_NEG_INF) error = SPL_ALL_MASKED;
    if (error != SPL_OK) {
        for (int x = threadIdx.x; x < row_stride; x += nt) p[x] = SPL_F32_NAN;
        if (threadIdx.x == 0) {
            *inv_sum = SPL_F64_NAN;
            st[0] = error;
            st[1] = detail;
        }
        return -1;
    }

    // exp((l - max) / T) in f64, stored as f32; the unrestricted sum is over the f64 values.
    const double inv_t = 1.0 / (double)temperature;
    const double max_d = (double)max_value;
    double sum_e = 0.0;
    strided<float, 32>(threadIdx.x, row_stride, nt, [&](int x) { return x < vocab ? l[x] : 0.0f; }, [&](int x, float v) {
        if (x < vocab) {
            double e = exp(__dmul_rn(__dsub_rn((double)v, max_d), inv_t));
            p[x] = (float)e;
            sum_e += e;
        } else {
            p[x] = 0.0f;
        }
    });
    double sum = block_sum_d(sum_e, sc);  // its barriers also publish p to the whole block

    const bool by_k = top_k > 0 && top_k < (u32)vocab;
    const bool by_p = top_p < 1.0f;
    // Kept set: kept_by(bits, x, kb, kcut) && kept_by(bits, x, pb, pcut); (0, INT_MAX) keeps all.
    u32 kb = 0, pb = 0;
    int kcut = SPL_INT_MAX, pcut = SPL_INT_MAX;
    if (by_k) {
        u32 above;
        kb = select_kth_largest(p, vocab, top_k, hist, sc, &above);
        kcut = locate_mth_equal(p, vocab, kb, 0, SPL_INT_MAX, (int)(top_k - above), sc);
    }
    if (by_p) {
        double kept_mass = 0.0;
        strided<float, 32>(threadIdx.x, vocab, nt, [&](int x) { return p[x]; }, [&](int x, float v) {
            if (kept_by(__float_as_uint(v), x, kb, kcut)) kept_mass += (double)v;
        });
        kept_mass = block_sum_d(kept_mass, sc);
        const double target = __dmul_rn((double)top_p, kept_mass);
        double above;
        pb = select_mass_boundary(p, vocab, kb, kcut, target, bins, sc, &above);
        // Ties at the boundary join in index order until the cumulative mass reaches target (at least
        // one: the CPU keeps max(1, ..) entries).
        const int ties = count_equal(p, vocab, pb, kb, kcut, sc);
        const double v = (double)__uint_as_float(pb);
        double need = v > 0.0 ? ceil((target - above) / v) : (double)ties;
        int m = need < 1.0 ? 1 : (need > (double)ties ? ties : (int)need);
        if (m < 1) m = 1;
        pcut = locate_mth_equal(p, vocab, pb, kb, kcut, m, sc);
    }
    if (by_k || by_p) {
        // The restricted sum is over the kept f32 values, widened (as the CPU sums order[..keep]).
        double s = 0.0;
        strided<float, 32>(threadIdx.x, vocab, nt, [&](int x) { return p[x]; }, [&](int x, float v) {
            u32 bits = __float_as_uint(v);
            if (kept_by(bits, x, kb, kcut) && kept_by(bits, x, pb, pcut)) s += (double)v;
        });
        sum = block_sum_d(s, sc);
    }
    const double inv = 1.0 / sum;
    double written = 0.0;
    strided<float, 32>(threadIdx.x, vocab, nt, [&](int x) { return p[x]; }, [&](int x, float v) {
        u32 bits = __float_as_uint(v);
        float out = (kept_by(bits, x, kb, kcut) && kept_by(bits, x, pb, pcut)) ? (float)__dmul_rn((double)v, inv)
                                                                                 : 0.0f;
        p[x] = out;
        written += (double)out;
    });
    written = block_sum_d(written, sc);
    if (threadIdx.x == 0) {
        *inv_sum = 1.0 / written;
        st[0] = SPL_OK;
        st[1] = 0;
    }
    return best == SPL_INT_MAX ? 0 : best;
}

extern "C" __global__ void __launch_bounds__(SPL_PROBS_THREADS)
    logits_to_probs(const float* logits, int row_stride, int vocab, const float* temperatures,
                    const u32* top_ks, const float* top_ps, float* probs, double* inv_sums, int* status) {
    __shared__ Scratch sc;
    __shared__ u32 hist[256];
    __shared__ double bins[16 * SPL_PROBS_THREADS + 256];
    const int row = blockIdx.x;
    row_logits_to_probs(logits + (size_t)row * row_stride, probs + (size_t)row * row_stride, row_stride, vocab,
                        temperatures[row], top_ks[row], top_ps[row], inv_sums + row, status + 2 * row, sc, hist,
                        bins);
}

// ---------------------------------------------------------------------------------------------------
// Verification. Inputs, with B sequences, K = k_max and V = vocab:
//   target_probs [B, K+1, V], target_inv_sums [B, K+1]   P_1..P_{k+1} of the sequence and their scales
//   draft_probs [B, K, V], draft_inv_sums [B, K]          Q_1..Q_k (read only if has_draft_probs; else one-hot)
//   draft_tokens [B, K], num_drafts [B] (k <= K), rules [B], rates [B, K] (synthetic conditional rates;
//   NaN marks a slot the configuration does not cover), seeds [B], offsets [B] (Philox step counter:
//   read, then advanced by one, so consecutive steps of a request never reuse uniforms).
//
// The work that needs whole rows but not the step's random decisions runs first, spread over many CTAs
// (one CTA per sequence could only stream rows at one SM's bandwidth):
//   row_argmax_chunks       argmax of every chunk of every target row (greedy sequences);
//   block_residual_masses   the block rule's Z_i for i < k, as partial sums per chunk.
// verify_drafts then runs each sequence's rule in one CTA, combining the chunk results in chunk order
// (so the answers are the same whatever the launch shape), and makes the one pass it cannot avoid: the
// inverse-CDF draw of the emitted target token.

// Chunks of this many entries per pre-pass CTA (16 chunks for a 128k vocabulary).
#define SPL_CHUNK 8192

// Grid: B * (K+1) * chunks. arg_val/arg_idx [B * (K+1), chunks]: the largest value of the chunk and its
// lowest index (SPL_INT_MAX when nothing beats -inf).
extern "C" __global__ void row_argmax_chunks(const float* target_probs, int vocab, int chunks, float* arg_val,
                                             int* arg_idx) {
    __shared__ Scratch sc;
    const int c = blockIdx.x % chunks, row = blockIdx.x / chunks;
    const float* r = target_probs + (size_t)row * vocab;
    const int lo = c * SPL_CHUNK, hi = min(lo + SPL_CHUNK, vocab);
    float bv = SPL_F32_NEG_INF;
    int bi = SPL_INT_MAX;
    strided<float, 32>(lo + threadIdx.x, hi, blockDim.x, [&](int x) { return r[x]; }, [&](int x, float v) {
        if (v > bv) {
            bv = v;
            bi = x;
        }
    });
    float best;
    int at = block_argmax_reduce(bv, bi, sc, &best);
    if (threadIdx.x == 0) {
        arg_val[(size_t)row * chunks + c] = best;
        arg_idx[(size_t)row * chunks + c] = at;
    }
}

// A step's per-slot scalars, loaded once into shared memory by one parallel read (a chain of dependent
// global loads per slot would cost a memory latency each): draft tokens, row scales, P_i(x_i), Q_i(x_i),
// synthetic rates. Every kernel that needs p_i computes it from these with the same operations, so the
// values agree bitwise between kernels.
#define SPL_MAX_K 64

struct StepScalars {
    u32 x[SPL_MAX_K];
    double p_scale[SPL_MAX_K + 1];
    double q_scale[SPL_MAX_K];
    double p_at[SPL_MAX_K];  // P_{s+1}(x_s) as stored (0 when x_s is outside the vocabulary)
    double q_at[SPL_MAX_K];  // Q_{s+1}(x_s) as stored (one-hot: unused)
    double rate[SPL_MAX_K];
};

// The rows of sequence b and its scalars.
struct SeqView {
    const float* P;
    const float* Q;  // nullptr: one-hot drafter
    size_t V;
    const StepScalars* s;
    // P_{s+1}(x_s) and Q_{s+1}(x_s) as CheckedInput::target_prob / draft_prob read them.
    __device__ __forceinline__ double target_prob_at(int slot) const {
        return __dmul_rn(s->p_at[slot], s->p_scale[slot]);
    }
    __device__ __forceinline__ double draft_prob_at(int slot) const {
        return Q ? __dmul_rn(s->q_at[slot], s->q_scale[slot]) : 1.0;
    }
    __device__ __forceinline__ double ratio(int slot) const { return target_prob_at(slot) / draft_prob_at(slot); }
    // The block rule's p_i = min(1, p_{i-1} P_i(x_i) / Q_i(x_i)), p_0 = 1.
    __device__ __forceinline__ double block_weight(int i) const {
        double w = 1.0;
        for (int slot = 0; slot < i; ++slot) {
            double next = w * ratio(slot);
            w = next < 1.0 ? next : 1.0;
        }
        return w;
    }
    // max(weight * P_{row+1} - Q_{row+1}, 0), as CheckedInput::residual.
    __device__ __forceinline__ ResidualWeight residual(int row, double weight) const {
        ResidualWeight w = {P + (size_t)row * V, Q ? Q + (size_t)row * V : nullptr, s->p_scale[row],
                            Q ? s->q_scale[row] : 1.0, weight, (int)s->x[row]};
        return w;
    }
};

// Loads sequence b's scalars for all k_max slots (every slot exists in the buffers whatever k is).
__device__ SeqView load_seq(int b, const float* target_probs, const double* target_inv_sums,
                            const float* draft_probs, const double* draft_inv_sums, int has_draft_probs,
                            const u32* draft_tokens, const double* rates, int k_max, int vocab,
                            StepScalars* sm) {
    SeqView v;
    v.V = (size_t)vocab;
    v.P = target_probs + (size_t)b * (k_max + 1) * v.V;
    v.Q = has_draft_probs ? draft_probs + (size_t)b * k_max * v.V : nullptr;
    v.s = sm;
    const u32* xs = draft_tokens + (size_t)b * k_max;
    for (int t = threadIdx.x; t <= k_max; t += blockDim.x) {
        sm->p_scale[t] = target_inv_sums[(size_t)b * (k_max + 1) + t];
        if (t < k_max) {
            u32 x = xs[t];
            bool in = x < (u32)vocab;
            sm->x[t] = x;
            sm->p_at[t] = in ? (double)v.P[t * v.V + x] : 0.0;
            sm->q_scale[t] = v.Q ? draft_inv_sums[(size_t)b * k_max + t] : 1.0;
            sm->q_at[t] = (v.Q && in) ? (double)v.Q[t * v.V + x] : 0.0;
            sm->rate[t] = rates ? rates[(size_t)b * k_max + t] : 0.0;
        }
    }
    __syncthreads();
    return v;
}

// Grid: (B * chunks, max(K-1, 1)). z_partial [B, max(K-1, 1), chunks]: for block-rule sequence b and
// i = blockIdx.y + 1 < k, sum over chunk c of max(p_i P_{i+1}(x) - Q_{i+1}(x), 0); 0 elsewhere. A sequence
// whose input is invalid gets zeros (verify_drafts reports it without reading them).
extern "C" __global__ void block_residual_masses(const float* target_probs, const double* target_inv_sums,
                                                 const float* draft_probs, const double* draft_inv_sums,
                                                 int has_draft_probs, const u32* draft_tokens,
                                                 const int* num_drafts, const int* rules, int k_max, int vocab,
                                                 int chunks, double* z_partial) {
    __shared__ Scratch sc;
    __shared__ StepScalars sm;
    const int b = blockIdx.x / chunks, c = blockIdx.x % chunks, i = blockIdx.y + 1;
    double* out = z_partial + ((size_t)b * gridDim.y + blockIdx.y) * chunks + c;
    const int k = num_drafts[b];
    if (!(rules[b] == SPL_RULE_BLOCK && k >= 0 && k <= k_max && i < k)) {
        if (threadIdx.x == 0) *out = 0.0;
        return;
    }
    const SeqView v = load_seq(b, target_probs, target_inv_sums, draft_probs, draft_inv_sums, has_draft_probs,
                               draft_tokens, nullptr, k_max, vocab, &sm);
    bool valid = true;
    for (int s = 0; s <= i; ++s)
        if (sm.x[s] >= (u32)vocab) valid = false;
    if (!valid) {
        if (threadIdx.x == 0) *out = 0.0;
        return;
    }
    const int lo = c * SPL_CHUNK, hi = min(lo + SPL_CHUNK, vocab);
    // Row i holds P_{i+1} and Q_{i+1}.
    double z = block_weight_sum(v.residual(i, v.block_weight(i)), lo, hi, sc);
    if (threadIdx.x == 0) *out = z;
}

__device__ __forceinline__ bool valid_scale(double s) { return s > 0.0 && s <= SPL_F64_MAX; }

// One CTA per sequence, any power-of-two block size 32..1024. Output out [B, K+4]: status, detail,
// num_accepted, emitted tokens (num_accepted + 1 of them). Needs row_argmax_chunks' results when a
// sequence is greedy and block_residual_masses' when one uses the block rule (same chunks).
//
// Uniform consumption per step matches AcceptanceRule::verify: greedy none; standard and synthetic one
// per examined slot plus one for the target token; block exactly k plus one. So the CPU verifier fed
// PhiloxStream(seed, offset) makes the same decisions.
extern "C" __global__ void __launch_bounds__(1024)
    verify_drafts(const float* target_probs, const double* target_inv_sums, const float* draft_probs,
                  const double* draft_inv_sums, int has_draft_probs, const u32* draft_tokens, const int* num_drafts,
                  const int* rules, const double* rates, const u64* seeds, u64* offsets, int k_max, int vocab,
                  int chunks, const float* arg_val, const int* arg_idx, const double* z_partial, int* out) {
    __shared__ Scratch sc;
    __shared__ StepScalars sm;
    const int b = blockIdx.x;
    const int k = num_drafts[b];
    const int rule = rules[b];
    const u64 seed = seeds[b], offset = offsets[b];
    int* o = out + (size_t)b * (k_max + 4);
    const SeqView v = load_seq(b, target_probs, target_inv_sums, draft_probs, draft_inv_sums, has_draft_probs,
                               draft_tokens, rates, k_max, vocab, &sm);
    const size_t V = v.V;
    const float* P = v.P;
    const bool one_hot = v.Q == nullptr;

    // Validation, in CheckedInput::new's order; every thread computes the same answer.
    int error = SPL_OK, detail = 0;
    if (k < 0 || k > k_max) {
        error = SPL_BAD_DRAFT_COUNT;
        detail = k;
    } else if (rule < SPL_RULE_GREEDY || rule > SPL_RULE_SYNTHETIC) {
        error = SPL_UNKNOWN_RULE;
        detail = rule;
    }
    for (int s = 0; error == SPL_OK && s < k; ++s)
        if (sm.x[s] >= (u32)vocab) {
            error = SPL_TOKEN_OUT_OF_VOCAB;
            detail = s;
        }
    for (int r = 0; error == SPL_OK && r <= k; ++r)
        if (!valid_scale(sm.p_scale[r])) {
            error = SPL_INVALID_TARGET_ROW;
            detail = r;
        }
    for (int r = 0; error == SPL_OK && !one_hot && r < k; ++r)
        if (!valid_scale(sm.q_scale[r])) {
            error = SPL_INVALID_DRAFT_ROW;
            detail = r;
        }
    for (int s = 0; error == SPL_OK && !one_hot && s < k; ++s)
        if (sm.q_at[s] == 0.0) {
            error = SPL_ZERO_DRAFT_PROB;
            detail = s;
        }
    for (int s = 0; error == SPL_OK && rule == SPL_RULE_SYNTHETIC && s < k; ++s)
        if (!(sm.rate[s] >= 0.0 && sm.rate[s] <= 1.0)) {
            error = SPL_TOO_FEW_RATES;
            detail = s;
        }
    if (error != SPL_OK) {
        if (threadIdx.x == 0) {
            o[0] = error;
            o[1] = detail;
            o[2] = 0;
        }
        return;
    }

    u32 draw = 0;
    int accepted = 0;
    int token = 0;
    if (rule == SPL_RULE_GREEDY) {
        // Accept while x_i == argmax P_i; emit the argmax at the first mismatch, or of P_{k+1}. The row's
        // argmax is the first chunk's best among the largest chunk values (chunks in index order).
        accepted = k;
        for (int s = 0; s <= k; ++s) {
            const size_t base = ((size_t)b * (k_max + 1) + s) * chunks;
            float bv = SPL_F32_NEG_INF;
            int best = SPL_INT_MAX;
            for (int c = 0; c < chunks; ++c)
                if (arg_val[base + c] > bv) {
                    bv = arg_val[base + c];
                    best = arg_idx[base + c];
                }
            if (best == SPL_INT_MAX) best = 0;
            if (s == k || (u32)best != sm.x[s]) {
                accepted = s;
                token = best;
                break;
            }
        }
    } else if (rule == SPL_RULE_STANDARD || rule == SPL_RULE_SYNTHETIC) {
        // Standard: accept x_i with min(1, P_i(x_i) / Q_i(x_i)); at the first rejection draw from
        // norm(max(P_i - Q_i, 0)) (P_i itself if that is empty). Synthetic: accept with the configured
        // conditional rate; at the first rejection draw from P_i. Both: bonus from P_{k+1}.
        accepted = k;
        for (int s = 0; s < k; ++s) {
            double prob;
            if (rule == SPL_RULE_STANDARD) {
                double ratio = v.ratio(s);
                prob = ratio < 1.0 ? ratio : 1.0;
            } else {
                prob = sm.rate[s];
            }
            double u = philox_uniform(seed, offset, draw++);
            if (!(u < prob)) {
                accepted = s;
                break;
            }
        }
        double u = philox_uniform(seed, offset, draw++);
        token = -1;
        if (accepted < k && rule == SPL_RULE_STANDARD) token = block_sample(v.residual(accepted, 1.0), vocab, u, sc, nullptr);
        if (token < 0) {
            RowWeight w = {P + (size_t)accepted * V};
            token = block_sample(w, vocab, u, sc, nullptr);
        }
    } else {
        // Block verification (Sun et al. 2024, Algorithm 2) as verifier/src/rules.rs writes it:
        // p_0 = 1, p_i = min(1, p_{i-1} P_i(x_i) / Q_i(x_i)); h_i = Z_i / (Z_i + 1 - p_i) with
        // Z_i = sum_x max(p_i P_{i+1}(x) - Q_{i+1}(x), 0) for i < k (0 when that is 0/0), h_k = p_k;
        // u_1..u_k are all drawn (draws 0..k-1); tau = the largest i with u_i < h_i, found from i = k
        // down; the emitted token uses draw k.
        const int ny = k_max > 1 ? k_max - 1 : 1;
        int tau = 0;
        double p_tau = 1.0;
        for (int i = k; i >= 1; --i) {
            double p_i = v.block_weight(i);
            double h;
            if (i == k) {
                h = p_i;
            } else {
                const double* zp = z_partial + ((size_t)b * ny + (i - 1)) * chunks;
                double z = 0.0;
                for (int c = 0; c < chunks; ++c) z += zp[c];
                double denominator = z + (1.0 - p_i);
                h = denominator > 0.0 ? z / denominator : 0.0;
            }
            if (philox_uniform(seed, offset, (u32)(i - 1)) < h) {
                tau = i;
                p_tau = p_i;
                break;
            }
        }
        draw = (u32)k;
        double u = philox_uniform(seed, offset, draw++);
        token = -1;
        if (tau < k) token = block_sample(v.residual(tau, p_tau), vocab, u, sc, nullptr);
        if (token < 0) {
            RowWeight w = {P + (size_t)tau * V};
            token = block_sample(w, vocab, u, sc, nullptr);
        }
        accepted = tau;
    }
    if (threadIdx.x == 0) {
        o[0] = SPL_OK;
        o[1] = 0;
        o[2] = accepted;
        for (int s = 0; s < accepted; ++s) o[3 + s] = (int)sm.x[s];
        o[3 + accepted] = token;
        offsets[b] = offset + 1;
    }
}
