// Fused verification step, v0 (issue 6, the `latency_specialized` decode backend): the whole target
// forward of one decode/verify step -- every layer, the final norm and the LM head over the logits rows --
// in ONE persistent kernel launch. Compiled concatenated after decoder.cu (kernels/src/cuda/mod.rs), so
// it runs decoder.cu's own device functions: rms_norm_bf16_body, rope_rotate, attention_split_body and
// skinny_linear_tile (the tensor-core GEMM tile), with the same arithmetic as the standard step.
// Acceptance is NOT in this kernel: the step's logits land exactly where the standard step writes them
// (GpuTransformer's logits buffer, [n_logits, vocab] f32), and the existing argmax_rows / verify_drafts
// kernels run right after it on the same stream (in the same CUDA graph as the step when captured).
//
// Launch: block 256; grid = number of SMs (fused_forward, up to 255 registers per thread) or twice that
// (fused_forward_x2, at most 128 registers: two CTAs per SM), or fewer; all CTAs co-resident (launched
// cooperatively; the host checks occupancy first, model/src/gpu_fused.rs). Dynamic shared memory: the
// largest of attention_split's buffer, attention_gqa's (when the standard step may use whole-row
// attention; sized by the context limit) and the GEMM tile's reduction scratch (8 * 64 * 16 floats).
//
// Phase plan. R = padded step rows (<= 128), L = logits rows. Each phase is a grid-strided loop over its
// work items (item i runs on CTA i % grid), and phases are separated by a grid barrier (below). Per layer:
//
//   phase | work items                     | reads                              | writes
//   ------+--------------------------------+------------------------------------+----------------------------
//   A     | R rows                         | x (layer 0: embedding rows), attn  | act16 [R, hidden] bf16
//         |                                | norm weight                        | (layer 0 also x = embed)
//   B     | ceil(width/16) x ceil(R/64)    | act16, wqkv                        | qkv [R, width] f32
//         | tiles                          |                                    |
//   C     | R x (heads + 2 kv heads),      | qkv (+ bias; q/k norm weights)     | qkv q heads (biased, normed,
//         | two per CTA (128 threads each) | positions, slots                   | rotated), k/v cache slots
//   D     | sum over rows of kv heads x    | qkv q heads, k/v cache (every key  | act16 [R, q_dim] bf16,
//         | key slices (attention_split),  | <= position of the row's sequence) | slice partials/counters
//         | or R x kv heads (attention_gqa)|                                    |
//   E     | ceil(hidden/16) x ceil(R/64)   | act16 (attention), wo, x, bo       | x += O proj (+ bo)
//   F     | R rows                         | x, ffn norm weight                 | act16 [R, hidden] bf16
//   G     | ceil(2 ffn/16) x ceil(R/64)    | act16, paired gate/up              | ffn_act16 [R, ffn] bf16
//   H     | ceil(hidden/16) x ceil(R/64)   | ffn_act16, w_down, x               | x += down proj (and the
//         |                                |                                    | tapped-layer copies of x)
//
// then Z1: final norm of the L logits rows (x[logit_rows[i]] -> act16 row i), and Z2: LM head tiles,
// ceil(vocab/16) x ceil(L/64), act16 -> logits [L, vocab] f32 (the standard step's logits buffer).
//
// Why each barrier (after the phase named) is needed:
//   A: B's every tile reads every row of act16 (K = hidden spans the whole row).
//   B: a head in C needs hd columns written by up to hd/16 different tiles (and q/k norm needs them all).
//   C: D reads the K/V of every earlier position of the row's sequence, including the rows of this step
//      appended in C by other CTAs (a verify block attends to its own earlier tokens), and q after RoPE.
//   D: E's K = q_dim spans all heads of a row (written by different items); the last-slice combine of
//      attention_split is inside D, so D's output is complete at the barrier.
//   E: F's norm reads the whole x row (written by hidden/16 different tiles).
//   F: G's every tile reads every act16 row.
//   G: H's K = ffn spans all gate/up tiles' outputs.
//   H: the next layer's A (or Z1) reads the whole x row; also orders H's reads of ffn_act16 before G of
//      the next layer rewrites it, and every read of act16/qkv before their next writers.
//   Z1: Z2's tiles read every logits row of act16.
// So 8 barriers per layer plus one: 129 for a 16-layer model. Write-after-read hazards are covered by the
// same barriers (every buffer's readers and next writers are at least one barrier apart).
//
// Determinism: every output element has exactly one owner (one tile, one row, one (row, head) item), no
// split-K and no atomics on data; the attention slice count is a function of the row's key count only and
// its combine runs in slice order. So a row's logits do not depend on the grid size or on which CTA runs
// an item. They depend on the other rows of the step only through the attention body, which follows the
// standard step's launch-size rule (whole-row for large launches); with split-key attention forced
// (StepAblation::attention = Split) the fused path is batch-invariant across shapes. The GEMM tile's K order
// and the 8-warp reduction order are those of the standard path's skinny kernel (per row independent of
// the row bucket) and the attention bodies are the standard kernels' own, so for R <= 64 with an untuned
// Gemm (skinny everywhere, no split-K; above 64 rows the standard step uses cuBLAS) the standard step
// should give bit-identical logits (gpu_fused_check reports it; not yet run on a GPU).
//
// Grid barrier: generation counting on two words of `barrier` in their own 128-byte lines ([0] arrival
// count, [32] generation). Each CTA: __syncthreads; thread 0 reads the generation, __threadfence (its
// CTA's writes before the arrival), atomicAdd on the count; the last to arrive resets the count to 0,
// fences, and bumps the generation; the others spin on a volatile read of the generation with
// __nanosleep backoff (and trap after FUSED_BARRIER_SPIN_LIMIT polls); then __threadfence (acquire) and
// __syncthreads. The count is back to 0 after every
// barrier, so it is 0 between launches and graph replays need no reset (the generation only has to
// change, wrap-around is fine); the host zeroes both words once at allocation.
//
// "HBM never idles", simplest form: right before a CTA waits at the barrier that ends a GEMM phase, it
// issues L2 prefetches of the weight rows of its first work items of the NEXT GEMM phase (QKV -> O ->
// gate/up -> down -> next layer's QKV / LM head; layer 0's QKV at kernel start), and inside a GEMM phase
// it prefetches the item `lead` items ahead of the one it computes. lead = prefetch_bytes / tile bytes
// (at least 1; 0 = off), so at most ~grid * prefetch_bytes of weights are in flight ahead of use: with
// the 128 KB default, ~17 MB of the H200's 50 MB L2. The non-GEMM phases between (RoPE, attention,
// norms) and barrier waits thereby overlap the next matrix's first bytes. On sm_90+ this is
// cp.async.bulk.prefetch.L2 (one instruction per weight row, nothing to wait for); elsewhere a no-op.
// The arch-specific instruction is isolated in fused_prefetch_l2 below.
//
// Activations written inside this kernel are read with coherent loads (skinny_linear_tile with
// X_READONLY = false): the non-coherent read-only path is invalid for data written during the kernel.

#define FUSED_THREADS 256
#define FUSED_CHUNK_ROWS 64

// Device addresses of one layer's tensors (host: gpu_fused.rs `layer_words`, same order).
struct FusedLayer {
    const float* attn_norm;
    const unsigned short* wqkv;
    const float* bqkv;    // null unless qkv bias (qwen2, llama attention_bias)
    const float* q_norm;  // null unless q/k norm (qwen3)
    const float* k_norm;
    const unsigned short* wo;
    const float* bo;  // null unless o bias
    const float* ffn_norm;
    const unsigned short* w_gate_up;  // gate/up rows interleaved in groups of 8 (interleave_gate_up)
    const unsigned short* w_down;
    float* k_cache;
    float* v_cache;
};
static_assert(sizeof(FusedLayer) == 12 * 8, "FusedLayer must match gpu_fused.rs LAYER_WORDS");

// Everything the kernel reads besides the launch arguments (host: gpu_fused.rs `FusedParamsHost`, the
// same order: 19 pointers, then 10 ints and 2 floats, 4 bytes each).
struct FusedParams {
    const FusedLayer* layers;
    const unsigned short* embed;
    const float* final_norm;
    const unsigned short* lm_head;  // the embedding when tied
    const double* inv_freq;
    const int* tokens;
    const int* positions;
    const int* slots;
    const int* row_table;
    const int* logit_rows;
    const int* block_tables;
    float* x;
    unsigned short* act16;
    float* qkv;
    unsigned short* ffn_act16;
    float* logits;
    float* attn_partials;
    unsigned int* attn_counters;
    unsigned int* barrier;
    int n_layers;
    int hidden;
    int n_heads;
    int n_kv_heads;
    int head_dim;
    int ffn;
    int vocab;
    int max_blocks;
    int block_size;
    int prefetch_bytes;
    float eps;
    float scale;
};
static_assert(sizeof(FusedParams) == 19 * 8 + 12 * 4, "FusedParams must match gpu_fused.rs PARAMS_WORDS");

// Launch flags. Timing only (gpu_fused.rs FusedMode): skip all work and prefetches, keep the barriers
// (their cost alone); skip attention (its cost by difference). FUSED_WHOLE_ROW_ATTENTION: phase D runs
// attention_gqa's body, one item per (row, KV head) over every key, instead of attention_split's; the
// host sets it from the launch shape with the standard step's rule (GpuTransformer::
// whole_row_attention_for), so both backends use the same attention arithmetic for a shape.
#define FUSED_SKIP_WORK 1
#define FUSED_SKIP_ATTENTION 2
#define FUSED_WHOLE_ROW_ATTENTION 4

// ---------------------------------------------------------------------------------------------------
// Architecture-specific part: L2 prefetch of `bytes` bytes at `p` (16-byte aligned, multiple of 16).
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
__device__ __forceinline__ void fused_prefetch_l2(const void* p, unsigned int bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}
#else
__device__ __forceinline__ void fused_prefetch_l2(const void*, unsigned int) {}
#endif

// ---------------------------------------------------------------------------------------------------
// Grid barrier (see the top comment). `bar` points at the zero-initialised barrier words. Watchdog: a CTA
// that polls more than FUSED_BARRIER_SPIN_LIMIT times (each poll >= 128 ns of backoff plus an L2 round
// trip: seconds in all, where a whole step takes ~1 ms) traps, so a broken barrier or a grid that is not
// co-resident fails the launch with an error instead of hanging the process.
#define FUSED_BARRIER_SPIN_LIMIT (1u << 24)
__device__ __forceinline__ void fused_grid_barrier(unsigned int* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile unsigned int* gen_p = bar + 32;
        const unsigned int gen = *gen_p;
        __threadfence();
        const unsigned int arrived = atomicAdd(bar, 1u);
        if (arrived == gridDim.x - 1) {
            atomicExch(bar, 0u);
            __threadfence();
            atomicAdd(bar + 32, 1u);
        } else {
            unsigned int ns = 8, spins = 0;
            while (*gen_p == gen) {
                __nanosleep(ns);
                if (ns < 128) ns *= 2;
                if (++spins == FUSED_BARRIER_SPIN_LIMIT) __trap();
            }
        }
        __threadfence();
    }
    __syncthreads();
}

// ---------------------------------------------------------------------------------------------------
// GEMM phases: out (+)= x * w^T over M activation rows, one work item per (16-row weight tile, 64-row
// activation chunk), tile-major so the chunks of one tile run on neighbouring CTAs at the same time
// (the second read of the tile's weights then comes from L2).
struct FusedGemm {
    const unsigned short* w;
    const unsigned short* x;
    float* out;               // plain / accumulate
    unsigned short* act;      // SwiGLU output (paired gate/up), else null
    const float* bias_after;  // added to out after the tile (O projection bias), else null
    int N, K, M, accumulate;
};

__device__ __forceinline__ int fused_gemm_items(const FusedGemm& g) {
    return ((g.N + 15) / 16) * ((g.M + FUSED_CHUNK_ROWS - 1) / FUSED_CHUNK_ROWS);
}

// Items of the CTA's own queue prefetched ahead: prefetch_bytes / bytes of one tile's weights, at least 1.
__device__ __forceinline__ int fused_lead(const FusedGemm& g, int prefetch_bytes) {
    if (prefetch_bytes <= 0) return 0;
    int tile_bytes = 16 * g.K * 2;
    return max(1, prefetch_bytes / tile_bytes);
}

// One bulk prefetch per weight row of the item's tile, by threads 0..15.
__device__ __forceinline__ void fused_prefetch_item(const FusedGemm& g, int item) {
    int chunks = (g.M + FUSED_CHUNK_ROWS - 1) / FUSED_CHUNK_ROWS;
    int r = (item / chunks) * 16 + (int)threadIdx.x;
    if (threadIdx.x < 16 && r < g.N) fused_prefetch_l2(g.w + (size_t)r * g.K, (unsigned int)g.K * 2u);
}

// The first `lead` items of this CTA's queue in phase g (issued before a barrier wait).
__device__ __forceinline__ void fused_prefetch_phase(const FusedGemm& g, int prefetch_bytes) {
    int lead = fused_lead(g, prefetch_bytes), items = fused_gemm_items(g);
    for (int k = 0; k < lead; ++k) {
        int item = blockIdx.x + k * gridDim.x;
        if (item >= items) break;
        fused_prefetch_item(g, item);
    }
}

// One tile with the skinny kernel's row bucket for `mc` rows (the same template the standard step's
// skinny_linear_m* launch uses for that many rows).
template <bool SWIGLU>
__device__ __forceinline__ void fused_tile(int mc, const unsigned short* w, const unsigned short* x, float* out,
                                           unsigned short* act, int N, int K, int accumulate, int tile, float* red) {
    if (mc <= 8) {
        skinny_linear_tile<1, 4, SWIGLU, false, false>(w, x, out, N, K, mc, accumulate, 1, act, tile, 0, red);
    } else if (mc <= 16) {
        skinny_linear_tile<2, 4, SWIGLU, false, false>(w, x, out, N, K, mc, accumulate, 1, act, tile, 0, red);
    } else if (mc <= 32) {
        skinny_linear_tile<4, 2, SWIGLU, false, false>(w, x, out, N, K, mc, accumulate, 1, act, tile, 0, red);
    } else {
        skinny_linear_tile<8, 2, SWIGLU, false, false>(w, x, out, N, K, mc, accumulate, 1, act, tile, 0, red);
    }
}

// Tapped layers (drafters that condition on target features, e.g. DSpark): after the down projection of
// layer l, the residual stream x is copied into every slot s whose layer (byte s of `layers`) is l, at
// buf + s * stride, [rows, hidden] -- what the standard step's device-to-device copy writes. Each down
// tile copies the elements it owns, right after writing them.
struct FusedTaps {
    float* buf;
    unsigned long long layers;  // slot s -> layer in bits 8 s .. 8 s + 7
    int count;                  // slots in use, <= 8
    int stride;                 // floats per slot
};

__device__ __noinline__ void fused_gemm_phase(const FusedGemm& g, int prefetch_bytes, float* red,
                                              const FusedTaps* taps, int layer) {
    bool tapped = false;
    if (taps) {
        for (int s = 0; s < taps->count; ++s) tapped |= ((taps->layers >> (8 * s)) & 0xffull) == (unsigned)layer;
    }
    const int chunks = (g.M + FUSED_CHUNK_ROWS - 1) / FUSED_CHUNK_ROWS;
    const int items = fused_gemm_items(g);
    const int lead = fused_lead(g, prefetch_bytes);
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        if (lead > 0) {
            int ahead = item + lead * gridDim.x;
            if (ahead < items) fused_prefetch_item(g, ahead);
        }
        const int tile = item / chunks, chunk = item % chunks;
        const int m0 = chunk * FUSED_CHUNK_ROWS;
        const int mc = min(FUSED_CHUNK_ROWS, g.M - m0);
        const unsigned short* x = g.x + (size_t)m0 * g.K;
        if (g.act) {
            fused_tile<true>(mc, g.w, x, 0, g.act + (size_t)m0 * (g.N / 2), g.N, g.K, 0, tile, red);
        } else {
            float* out = g.out + (size_t)m0 * g.N;
            fused_tile<false>(mc, g.w, x, out, 0, g.N, g.K, g.accumulate, tile, red);
            if (g.bias_after) {
                // The standard step adds the bias after the accumulate: (x + s) + b, element by element.
                __syncthreads();
                for (int idx = threadIdx.x; idx < 16 * mc; idx += blockDim.x) {
                    int m = idx / 16, n = tile * 16 + idx % 16;
                    if (n < g.N) out[(size_t)m * g.N + n] += g.bias_after[n];
                }
            }
            if (tapped) {
                __syncthreads();
                for (int s = 0; s < taps->count; ++s) {
                    if (((taps->layers >> (8 * s)) & 0xffull) != (unsigned)layer) continue;
                    float* dst = taps->buf + (size_t)s * taps->stride + (size_t)m0 * g.N;
                    for (int idx = threadIdx.x; idx < 16 * mc; idx += blockDim.x) {
                        int m = idx / 16, n = tile * 16 + idx % 16;
                        if (n < g.N) dst[(size_t)m * g.N + n] = out[(size_t)m * g.N + n];
                    }
                }
            }
        }
        __syncthreads();  // the reduction scratch is reused by the next item
    }
}

// ---------------------------------------------------------------------------------------------------
// RMSNorm rows -> bf16 (rms_norm_bf16's body). With `embed`, row r of x is first set to the embedding of
// tokens[r] (layer 0; embed_rows' arithmetic), by the same CTA that then normalises it.
__device__ __noinline__ void fused_norm_phase(float* x, const int* src_rows, int nrows, const float* weight,
                                              unsigned short* out, int dim, float eps, const unsigned short* embed,
                                              const int* tokens) {
    for (int r = blockIdx.x; r < nrows; r += gridDim.x) {
        if (embed) {
            const unsigned short* src = embed + (size_t)tokens[r] * dim;
            float* dst = x + (size_t)r * dim;
            for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = bf16_to_f32(src[i]);
            __syncthreads();
        }
        rms_norm_bf16_body<false>(x, src_rows, r, weight, out, dim, eps);
        __syncthreads();  // warp_sums is reused by the next row
    }
}

// ---------------------------------------------------------------------------------------------------
// Phase C: per (row, head) of the qkv rows: + bias (qkv bias), per-head RMSNorm (q/k norm), RoPE (q and k
// heads), q written back to qkv, k and v stored at the row's cache slot. Each half of the CTA (128
// threads) takes one item, so the head norm's sum runs over 128 threads in the same tree order as the
// standard step's head_rms_norm (block of 128) and the whole sequence of operations matches
// add_bias_rows -> head_rms_norm -> rope_kv_append element by element. Both halves execute the same
// barriers whether or not they hold an item.
__device__ __noinline__ void fused_rope_phase(const FusedParams& p, const FusedLayer& L, int rows) {
    __shared__ float hs[2][256];
    __shared__ float ssum[2][128];
    const int half = threadIdx.x >> 7, ht = threadIdx.x & 127;
    const int hd = p.head_dim, hh = hd / 2;
    const int per_row = p.n_heads + 2 * p.n_kv_heads;
    const int width = per_row * hd;
    const int kv_dim = p.n_kv_heads * hd;
    const int items = rows * per_row;
    const bool qk_norm = L.q_norm != 0;
    for (int base = 2 * blockIdx.x; base < items; base += 2 * gridDim.x) {
        const int it = base + half;
        const bool active = it < items;
        const int row = active ? it / per_row : 0, y = active ? it % per_row : 0;
        float* h = p.qkv + (size_t)row * width + (size_t)y * hd;  // q heads, then k heads, then v heads
        float ss = 0.0f;
        if (active) {
            for (int i = ht; i < hd; i += 128) {
                float v = h[i];
                if (L.bqkv) v += L.bqkv[y * hd + i];
                hs[half][i] = v;
                ss += v * v;
            }
        }
        if (qk_norm) {  // uniform over the CTA
            ssum[half][ht] = ss;
            __syncthreads();
            for (int s = 64; s > 0; s >>= 1) {
                if (ht < s) ssum[half][ht] += ssum[half][ht + s];
                __syncthreads();
            }
            const float inv = 1.0f / sqrtf(ssum[half][0] / (float)hd + p.eps);
            if (active && y < p.n_heads + p.n_kv_heads) {
                const float* w = y < p.n_heads ? L.q_norm : L.k_norm;
                for (int i = ht; i < hd; i += 128) hs[half][i] = w[i] * (hs[half][i] * inv);
            }
        }
        __syncthreads();
        if (active) {
            const size_t slot_base = (size_t)p.slots[row] * kv_dim;
            if (y >= p.n_heads + p.n_kv_heads) {
                float* dst = L.v_cache + slot_base + (size_t)(y - p.n_heads - p.n_kv_heads) * hd;
                for (int i = ht; i < hd; i += 128) dst[i] = hs[half][i];
            } else {
                const int pos = p.positions[row];
                for (int i = ht; i < hh; i += 128) {
                    float ra, rb;
                    rope_rotate(&hs[half][i], &hs[half][i + hh], pos, p.inv_freq[i], &ra, &rb);
                    if (y < p.n_heads) {
                        h[i] = ra;
                        h[i + hh] = rb;
                    } else {
                        float* dst = L.k_cache + slot_base + (size_t)(y - p.n_heads) * hd;
                        dst[i] = ra;
                        dst[i + hh] = rb;
                    }
                }
            }
        }
        __syncthreads();  // hs / ssum are reused by the next pair of items
    }
}

// ---------------------------------------------------------------------------------------------------
// Phase D: attention_split's body over the (row, KV head, key slice) items that exist: a row has
// attn_num_splits(its key count) slices, so the items are enumerated row by row from the positions
// (no empty items, unlike the standalone launch's fixed grid). With `whole_row`, attention_gqa's body
// over (row, KV head) items instead (dynamic shared memory sized for max_blocks * block_size keys).
__device__ __noinline__ void fused_attention_phase(const FusedParams& p, const FusedLayer& L, int rows, float* smem,
                                                   bool whole_row) {
    const int nkv = p.n_kv_heads;
    if (whole_row) {
        const int width = (p.n_heads + 2 * nkv) * p.head_dim;
        for (int item = blockIdx.x; item < rows * nkv; item += gridDim.x) {
            attention_gqa_body<false>(p.qkv, width, p.n_heads, nkv, p.head_dim, p.positions, p.row_table,
                                      p.max_blocks, p.block_tables, p.block_size, L.k_cache, L.v_cache, p.act16,
                                      p.scale, p.max_blocks * p.block_size, item / nkv, item % nkv, smem);
            __syncthreads();  // shared buffers are reused by the next item
        }
        return;
    }
    int total = 0;
    for (int r = 0; r < rows; ++r) total += nkv * attn_num_splits(p.positions[r] + 1);
    const int width = (p.n_heads + 2 * nkv) * p.head_dim;
    for (int item = blockIdx.x; item < total; item += gridDim.x) {
        int acc = 0, row = 0, kvh = 0, split = 0;
        for (int r = 0; r < rows; ++r) {
            int ns = attn_num_splits(p.positions[r] + 1);
            int cnt = nkv * ns;
            if (item < acc + cnt) {
                row = r;
                kvh = (item - acc) / ns;
                split = (item - acc) % ns;
                break;
            }
            acc += cnt;
        }
        attention_split_body<false>(p.qkv, width, p.n_heads, nkv, p.head_dim, p.positions, p.row_table, p.max_blocks,
                                    p.block_tables, p.block_size, L.k_cache, L.v_cache, p.act16, p.scale,
                                    p.attn_partials, p.attn_counters, row, kvh, split, smem);
        __syncthreads();  // shared buffers are reused by the next item
    }
}

// ---------------------------------------------------------------------------------------------------
// The kernel body; the entry points below differ only in their register budget (CTAs per SM).
__device__ __forceinline__ void fused_forward_body(const FusedParams* __restrict__ params, int rows, int n_logits,
                                                   int flags, const FusedTaps& taps) {
    extern __shared__ __align__(16) float fused_smem[];
    __shared__ FusedParams P;
    __shared__ FusedLayer L;
    if (threadIdx.x < sizeof(FusedParams) / 8) {
        ((unsigned long long*)&P)[threadIdx.x] = ((const unsigned long long*)params)[threadIdx.x];
    }
    __syncthreads();
    const FusedParams& p = P;
    const bool work = !(flags & FUSED_SKIP_WORK);
    const int pf = work ? p.prefetch_bytes : 0;
    const int h = p.hidden, qd = p.n_heads * p.head_dim;
    const int width = (p.n_heads + 2 * p.n_kv_heads) * p.head_dim;

    for (int l = 0; l < p.n_layers; ++l) {
        if (threadIdx.x < sizeof(FusedLayer) / 8) {
            ((unsigned long long*)&L)[threadIdx.x] = ((const unsigned long long*)(p.layers + l))[threadIdx.x];
        }
        __syncthreads();
        const FusedGemm qkv = {L.wqkv, p.act16, p.qkv, 0, 0, width, h, rows, 0};
        const FusedGemm o = {L.wo, p.act16, p.x, 0, L.bo, h, qd, rows, 1};
        const FusedGemm gate_up = {L.w_gate_up, p.act16, 0, p.ffn_act16, 0, 2 * p.ffn, h, rows, 0};
        const FusedGemm down = {L.w_down, p.ffn_act16, p.x, 0, 0, h, p.ffn, rows, 1};
        if (l == 0) fused_prefetch_phase(qkv, pf);
        // A: attention RMSNorm (layer 0: from the embedding rows).
        if (work) {
            fused_norm_phase(p.x, 0, rows, L.attn_norm, p.act16, h, p.eps, l == 0 ? p.embed : 0, p.tokens);
        }
        fused_grid_barrier(p.barrier);
        // B: QKV projection.
        if (work) fused_gemm_phase(qkv, pf, fused_smem, 0, -1);
        fused_prefetch_phase(o, pf);
        fused_grid_barrier(p.barrier);
        // C: bias, q/k norm, RoPE, KV append.
        if (work) fused_rope_phase(p, L, rows);
        fused_grid_barrier(p.barrier);
        // D: attention.
        if (work && !(flags & FUSED_SKIP_ATTENTION)) {
            fused_attention_phase(p, L, rows, fused_smem, (flags & FUSED_WHOLE_ROW_ATTENTION) != 0);
        }
        fused_grid_barrier(p.barrier);
        // E: O projection + residual (+ o bias).
        if (work) fused_gemm_phase(o, pf, fused_smem, 0, -1);
        fused_prefetch_phase(gate_up, pf);
        fused_grid_barrier(p.barrier);
        // F: FFN RMSNorm.
        if (work) fused_norm_phase(p.x, 0, rows, L.ffn_norm, p.act16, h, p.eps, 0, 0);
        fused_grid_barrier(p.barrier);
        // G: gate/up + SwiGLU.
        if (work) fused_gemm_phase(gate_up, pf, fused_smem, 0, -1);
        fused_prefetch_phase(down, pf);
        fused_grid_barrier(p.barrier);
        // H: down projection + residual.
        if (work) fused_gemm_phase(down, pf, fused_smem, taps.count > 0 ? &taps : 0, l);
        if (l + 1 < p.n_layers) {
            const FusedLayer* next = p.layers + l + 1;
            const FusedGemm next_qkv = {next->wqkv, p.act16, p.qkv, 0, 0, width, h, rows, 0};
            fused_prefetch_phase(next_qkv, pf);
        } else if (n_logits > 0) {
            const FusedGemm head = {p.lm_head, p.act16, p.logits, 0, 0, p.vocab, h, n_logits, 0};
            fused_prefetch_phase(head, pf);
        }
        fused_grid_barrier(p.barrier);
    }
    if (n_logits <= 0) return;
    // Z1: final norm of the logits rows; Z2: LM head.
    if (work) fused_norm_phase(p.x, p.logit_rows, n_logits, p.final_norm, p.act16, h, p.eps, 0, 0);
    fused_grid_barrier(p.barrier);
    const FusedGemm head = {p.lm_head, p.act16, p.logits, 0, 0, p.vocab, h, n_logits, 0};
    if (work) fused_gemm_phase(head, pf, fused_smem, 0, -1);
}

// One CTA per SM: up to 255 registers per thread.
// Arguments: the parameter block, the step's rows and logits rows, FUSED_* flags, and the tapped layers
// (tap_buf: [slot][max_rows][hidden] f32, tap_layers: slot -> layer bytes, tap_count <= 8, tap_stride:
// floats per slot; tap_count 0 and tap_buf null without taps).
extern "C" __global__ void __launch_bounds__(FUSED_THREADS, 1)
fused_forward(const FusedParams* __restrict__ params, int rows, int n_logits, int flags, float* tap_buf,
              unsigned long long tap_layers, int tap_count, int tap_stride) {
    const FusedTaps taps = {tap_buf, tap_layers, tap_count, tap_stride};
    fused_forward_body(params, rows, n_logits, flags, taps);
}

// Two CTAs per SM (16 warps to hide the latency-bound phases: norms, RoPE, attention), at most 128
// registers per thread. Which is faster is for the device to say (gpu_fused_check --bench).
extern "C" __global__ void __launch_bounds__(FUSED_THREADS, 2)
fused_forward_x2(const FusedParams* __restrict__ params, int rows, int n_logits, int flags, float* tap_buf,
                 unsigned long long tap_layers, int tap_count, int tap_stride) {
    const FusedTaps taps = {tap_buf, tap_layers, tap_count, tap_stride};
    fused_forward_body(params, rows, n_logits, flags, taps);
}
