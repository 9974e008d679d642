// Fused verification step, v1 (issue 6, the `latency_specialized` decode backend): the whole target
// forward of one decode/verify step -- every layer, the final norm and the LM head over the logits rows --
// in ONE persistent kernel launch. Compiled concatenated after decoder.cu (kernels/src/cuda/mod.rs), so
// it runs decoder.cu's own device functions for the norms, RoPE and attention (rms_norm_bf16_body,
// rope_rotate, attention_split_body / attention_gqa_body: the standard step's arithmetic) and the same
// tensor-core fragments as its skinny GEMM (mma_bf16_16816), but its own GEMM loop: weights stream
// through a ring of shared-memory slots filled by bulk copies (v0 loaded them into registers per tile as
// skinny_linear_tile does; measured on the H200 it was slower than the standard step, NOTES v0.6).
// Acceptance is NOT in this kernel: the step's logits land exactly where the standard step writes them
// (GpuTransformer's logits buffer, [n_logits, vocab] f32), and the existing argmax_rows / verify_drafts
// kernels run right after it on the same stream (in the same CUDA graph as the step when captured).
//
// Launch: block 256; grid = number of SMs (fused_forward, up to 255 registers per thread) or twice that
// (fused_forward_x2, at most 128 registers: two CTAs per SM), or fewer; all CTAs co-resident (launched
// cooperatively; the host checks occupancy first, model/src/gpu_fused.rs). Dynamic shared memory: the
// GEMM reduction (FUSED_RED_BYTES), then one region that holds the activations during a GEMM phase and
// the attention scratch during attention (attention_split's buffer, or attention_gqa's when the standard
// step may use whole-row attention; sized by the context limit), then the weight ring (ring_stages slots
// of fused_stage_bytes(chunk_k); see below).
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
// split-K and no atomics on data; a tile's K order (chunks, then sub-chunks per warp) and its 8-warp
// reduction order are fixed, and the attention slice count is a function of the row's key count only,
// its combine in slice order. So a row's logits do not depend on the grid size or on which CTA runs an
// item, nor on the other rows of the step except through the attention body, which follows the standard
// step's launch-size rule (whole-row for large launches); with split-key attention forced
// (StepAblation::attention = Split) the fused path is batch-invariant across shapes. Its GEMM sums in
// another order than the standard step's kernels, so the two backends agree to rounding, not bit for bit
// (v0, which ran skinny_linear_tile itself, was bit-identical; gpu_fused_check reports which).
//
// Grid barrier and weight ring: see fused_grid_barrier and the ring section below.
//
// Activations written inside this kernel are read with coherent loads (load_coherent_16): the
// non-coherent read-only path is invalid for data written during the kernel.

#define FUSED_THREADS 256

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
    unsigned long long* prof;  // FUSED_PROF_SLOTS counters per CTA, written when FUSED_PROFILE is set
    // v2 only, for kernels that hand a norm stage its rows from the residual's writers: a row's
    // bf16(norm weight * x) [FV2_MAX_ROWS, hidden] and its sums of squares per 16-column tile
    // [FV2_MAX_ROWS, hidden / 16]. Unused by this kernel (experiments/fused/candidates/xnorm.patch).
    unsigned short* xn16;
    float* ss_parts;
    int n_layers;
    int hidden;
    int n_heads;
    int n_kv_heads;
    int head_dim;
    int ffn;
    int vocab;
    int max_blocks;
    int block_size;
    int ring_stages;  // weight ring slots (2 .. FUSED_MAX_RING)
    int ring_offset;  // byte offset of the ring in dynamic shared memory (after the phase scratch)
    int xs_bytes;     // bytes of the activation / attention region (at FUSED_RED_BYTES)
    int chunk_k;      // weight columns per ring chunk (a multiple of 256)
    int max_rows;     // rows of the step buffers (attn_partials: 4 key slices per row and KV head); unused here
    float eps;
    float scale;
};
static_assert(sizeof(FusedParams) == 22 * 8 + 16 * 4, "FusedParams must match gpu_fused.rs PARAMS_WORDS");

// Launch flags. Timing only (gpu_fused.rs FusedMode): skip all work and prefetches, keep the barriers
// (their cost alone); skip attention (its cost by difference). FUSED_WHOLE_ROW_ATTENTION: phase D runs
// attention_gqa's body, one item per (row, KV head) over every key, instead of attention_split's; the
// host sets it from the launch shape with the standard step's rule (GpuTransformer::
// whole_row_attention_for), so both backends use the same attention arithmetic for a shape.
#define FUSED_SKIP_WORK 1
#define FUSED_SKIP_ATTENTION 2
#define FUSED_WHOLE_ROW_ATTENTION 4
// A chunk that spans whole rows (chunk_k >= K) is ONE bulk copy of the tile's 16 contiguous rows, landing
// unpadded (row stride 2 K: two-way bank conflicts on the fragment loads) instead of 16 row copies. The
// ring's rate improved with fewer, larger copies (NOTES v0.7; this one: 5% at 1 x 1). On by default
// (gpu_fused.rs FusedOptions::whole_tile_copies).
#define FUSED_WHOLE_TILE_COPIES 8
// Profiling (gpu_fused.rs FusedMode::Profile, a full step): thread 0 of each CTA sums clock64 cycles per
// category in shared memory and writes them to params->prof[CTA][slot] at the end. Slots: 0-9 work of
// phases A B C D E F G H Z1 Z2; 10-19 the grid-barrier wait after each; 20 waits for ring chunks; 21 GEMM
// tile epilogues (reduction and writes); 22 activation staging; 23 the whole kernel.
#define FUSED_PROFILE 16
// The ring filled with cp.async (LDGSTS, 16 bytes per thread per instruction, all 256 threads, one commit
// group per chunk, `cp.async.wait_group` before use) instead of the TMA engine: an A/B for the measured
// ~12 GB/s per SM of the bulk-copy ring (NOTES v0.7). Rows always land padded (fused_row_stride).
#define FUSED_LDGSTS 32
// v2's producer settings chosen per launch (gpu_fused.rs FusedOptions::copies_in_flight and friends), so
// that one process can compare them and a card can get its own: bits 8-11 the part copies in flight from
// HBM (0: FV2_MAX_INFLIGHT), bits 12-15 those of parts prefetched into L2 (0: FV2_L2_INFLIGHT), bits 16-19
// the paced L2 prefetch's interval in units of 500 cycles (0: FV2_L2_PACE_CYCLES), bits 20-23 its lead in
// chunks plus one (0: FV2_L2_LEAD; 1: no prefetch), bits 24-28 the most sequences and rows of a step it runs
// in (0: FV2_L2_MAX_SEQS and FV2_L2_MAX_ROWS; else that many of each, 1-16). Every setting was
// chosen on H100s; the H200 has ~1.4x the bandwidth at the same SM count, so it may want more bytes in
// flight per CTA (experiments/fused/candidates/README.md, `if2`).
#define FUSED_INFLIGHT_SHIFT 8
#define FUSED_L2_INFLIGHT_SHIFT 12
#define FUSED_L2_PACE_SHIFT 16
#define FUSED_L2_PACE_UNIT 500
#define FUSED_L2_LEAD_SHIFT 20
#define FUSED_L2_GATE_SHIFT 24
#define FUSED_PROF_SLOTS 32
__shared__ unsigned long long fused_prof[FUSED_PROF_SLOTS];
__shared__ int fused_prof_on;
// FUSED_PROFILING = 0 compiles the profile out: fused_clock() is 0 and fused_prof_add nothing. Compiled
// in, the profile costs the step 3-5% even with profiling off at run time: the A/B on the H200 ran 1 x 1
// at 1.287 ms without it against 1.351 with it (v2; NOTES v0.18). So 0 is the default, and the host
// compiles this program a second time with FUSED_PROFILING 1 for FusedMode::Profile only
// (kernels/src/cuda/mod.rs FUSED_PROFILING_SOURCE).
#ifndef FUSED_PROFILING
#define FUSED_PROFILING 0
#endif
__device__ __forceinline__ long long fused_clock() {
#if FUSED_PROFILING
    return clock64();
#else
    return 0;
#endif
}
__device__ __forceinline__ void fused_prof_add(int slot, long long t0) {
#if FUSED_PROFILING
    if (threadIdx.x == 0 && fused_prof_on) fused_prof[slot] += (unsigned long long)(clock64() - t0);
#endif
}
// The whole kernel's cycles into slot 23, then this CTA's slots out to prof[blockIdx.x] (profiled launches).
__device__ __forceinline__ void fused_prof_finish(unsigned long long* prof, long long t_kernel) {
    fused_prof_add(23, t_kernel);
    if (threadIdx.x == 0 && fused_prof_on && prof) {
        for (int i = 0; i < FUSED_PROF_SLOTS; ++i) prof[(size_t)blockIdx.x * FUSED_PROF_SLOTS + i] = fused_prof[i];
    }
}

// ---------------------------------------------------------------------------------------------------
// Weight ring (v1). Every CTA reads its weights as ONE sequence of chunks over the whole step: for each
// layer its tile range of QKV, O, gate/up and down, then its tile range of the LM head (phases numbered
// 4 l + {0, 1, 2, 3}, then 4 L). A chunk is 16 weight rows (one output tile) x up to chunk_k
// columns: 16 contiguous row segments, copied by the TMA engine (cp.async.bulk, sm_90) into one slot of a
// ring of `ring_stages` slots in shared memory, each slot with its own mbarrier (transaction count = the
// chunk's bytes). Warp 0 fills the ring at kernel start and refills a slot right after the CTA has
// consumed it, with the chunk `ring_stages` further down the sequence (lane i copies row i). So the copies run ahead of the
// computation by the whole ring, across phase boundaries and grid barriers: while a CTA normalises,
// rotates, attends or waits at a barrier, the next GEMM phase's first chunks are already landing (the
// weights never depend on the step's activations). Phases that read no weights consume nothing.
//
// Row segments land fused_row_stride bytes apart (2 chunk_k + 64): 16-byte fragment loads of two rows in one
// quarter-warp then hit disjoint banks.
#define FUSED_XS_PAD 64
// Row stride and slot size for chunks of `chunk_k` columns (a multiple of 256).
__device__ __forceinline__ int fused_row_stride(int chunk_k) { return chunk_k * 2 + 64; }
__device__ __forceinline__ int fused_stage_bytes(int chunk_k) { return 16 * fused_row_stride(chunk_k); }
#define FUSED_MAX_RING 16
// A CTA waiting longer than this many polls for a chunk traps (a transaction count that never completes).
#define FUSED_RING_SPIN_LIMIT (1u << 26)

// Architecture-specific part: mbarriers with transaction counts and bulk copies exist from sm_90. Below,
// the host never selects the fused backend (gpu_fused.rs: the kernel needs sm_90); these bodies trap.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
__device__ __forceinline__ unsigned int fused_smem_addr(const void* p) {
    return (unsigned int)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void fused_mbar_init(unsigned long long* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(fused_smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void fused_mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void fused_mbar_expect(unsigned long long* bar, unsigned int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(fused_smem_addr(bar)), "r"(bytes)
                 : "memory");
}
// An L2 policy that evicts the lines it tags first, and the bulk copy that tags its lines with it: the
// weight stream (2.5 GB a step, each byte read once) then no longer evicts what is read again, such as
// the KV cache, the norm weights, the activations and lines prefetched into L2 ahead of their copy.
// Every v2 stage got faster with it, the streaming ones most: -5 to -9% a step at every v2 shape on an
// H100 (session 27, NOTES v0.31; the 1 x 1 layer 68.4 -> 62.3 us, gate/up 26.4 -> 24.0 us).
__device__ __forceinline__ unsigned long long fused_l2_evict_first_policy() {
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}
__device__ __forceinline__ void fused_bulk_copy_hint(void* dst, const void* src, unsigned int bytes,
                                                     unsigned long long* bar, unsigned long long policy) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
            fused_smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(fused_smem_addr(bar)), "l"(policy)
        : "memory");
}
__device__ __forceinline__ void fused_mbar_wait(unsigned long long* bar, unsigned int parity) {
    const unsigned int a = fused_smem_addr(bar);
    unsigned int done = 0, spins = 0;
    while (true) {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(a), "r"(parity)
            : "memory");
        if (done) break;
        if (++spins == FUSED_RING_SPIN_LIMIT) __trap();
    }
}
// One try of a barrier's phase (no spin): true once the phase with this parity has completed.
__device__ __forceinline__ bool fused_mbar_test(unsigned long long* bar, unsigned int parity) {
    unsigned int done;
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(fused_smem_addr(bar)), "r"(parity)
        : "memory");
    return done != 0;
}
// A bulk prefetch of `bytes` (a multiple of 16, 16-byte aligned) into L2; nothing comes back to the SM.
__device__ __forceinline__ void fused_l2_prefetch(const void* src, unsigned int bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void fused_cp_async_16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(fused_smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void fused_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most `pending` of this thread's commit groups are in flight (an immediate in PTX).
__device__ __forceinline__ void fused_cp_async_wait(int pending) {
    switch (pending) {
        case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
        case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
        case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
        case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
        case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
        case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
        case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
        default: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
    }
}
#else
__device__ __forceinline__ void fused_cp_async_16(void*, const void*) { __trap(); }
__device__ __forceinline__ void fused_cp_async_commit() {}
__device__ __forceinline__ void fused_cp_async_wait(int) {}
__device__ __forceinline__ void fused_mbar_init(unsigned long long*) { __trap(); }
__device__ __forceinline__ void fused_mbar_init_fence() {}
__device__ __forceinline__ void fused_mbar_expect(unsigned long long*, unsigned int) { __trap(); }
__device__ __forceinline__ unsigned long long fused_l2_evict_first_policy() { return 0ull; }
__device__ __forceinline__ void fused_bulk_copy_hint(void*, const void*, unsigned int, unsigned long long*,
                                                     unsigned long long) {
    __trap();
}
__device__ __forceinline__ void fused_mbar_wait(unsigned long long*, unsigned int) { __trap(); }
__device__ __forceinline__ bool fused_mbar_test(unsigned long long*, unsigned int) {
    __trap();
    return true;
}
__device__ __forceinline__ void fused_l2_prefetch(const void*, unsigned int) { __trap(); }
#endif

// ---------------------------------------------------------------------------------------------------
// Grid barrier (see the top comment): one 64-bit arrival counter that only grows. A CTA's thread 0 adds 1
// with release semantics (its CTA's writes, ordered by the __syncthreads before, become visible first),
// computes the count at which this barrier is complete (the next multiple of the grid size) and polls
// with acquire loads until it is reached. No reset, no separate generation word: one atomic and the
// polls per CTA. The counter starts at 0 when the barrier words are allocated (each configuration of the
// kernel gets its own) and every launch adds a multiple of the grid size, so it stays aligned across
// launches and graph replays; 64 bits do not wrap. Watchdog: more than FUSED_BARRIER_SPIN_LIMIT polls
// traps, so a grid that is not co-resident fails the launch instead of hanging the process.
#define FUSED_BARRIER_SPIN_LIMIT (1u << 26)
__device__ __forceinline__ void fused_grid_barrier(unsigned int* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long* count = reinterpret_cast<unsigned long long*>(bar);
        unsigned long long old;
        asm volatile("atom.add.release.gpu.u64 %0, [%1], 1;" : "=l"(old) : "l"(count) : "memory");
        const unsigned long long g = gridDim.x;
        const unsigned long long target = (old / g + 1) * g;
        unsigned long long now;
        unsigned int spins = 0;
        while (true) {
            asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(now) : "l"(count) : "memory");
            if (now >= target) break;
            if (++spins > 64) __nanosleep(32);
            if (spins == FUSED_BARRIER_SPIN_LIMIT) __trap();
        }
    }
    __syncthreads();
}

// ---------------------------------------------------------------------------------------------------
// GEMM phases: out (+)= x * w^T over M (<= 128) activation rows. Output tiles of 16 weight rows are split
// into contiguous ranges, one per CTA (CTA c: tiles [c T / G, (c + 1) T / G)), so each CTA's weights of a
// phase are one contiguous byte range, streamed through the ring. Within a chunk each warp takes the
// 32-column sub-chunks w and w + 8; a thread holds 8 consecutive columns of two weight rows (g, g + 8)
// and of the activation rows nt * 8 + g, the k-permuted m16n8k16 fragments of skinny_linear_tile, and
// accumulates the tile over all of its chunks in registers; at the tile's end the 8 warps' partial sums
// are reduced in warp order through shared memory (deterministic; independent of the grid size).
struct FusedGemm {
    const unsigned short* w;
    const unsigned short* x;
    float* out;               // plain / accumulate
    unsigned short* act;      // SwiGLU output (paired gate/up), else null
    const float* bias_after;  // added to out after the tile (O projection bias), else null
    int N, K, M, accumulate;
};

// Tapped-layer copies of the residual stream (see fused_tile_out).
struct FusedTaps {
    float* buf;
    unsigned long long layers;  // slot s -> layer in bits 8 s .. 8 s + 7
    int count;                  // slots in use, <= 8
    int stride;                 // floats per slot
};

// The weight matrix (w, N rows, K columns) of sequence phase `phase`.
__device__ __forceinline__ void fused_phase_matrix(const FusedParams& p, int phase, const unsigned short** w, int* N,
                                                   int* K) {
    const int width = (p.n_heads + 2 * p.n_kv_heads) * p.head_dim;
    if (phase >= 4 * p.n_layers) {
        *w = p.lm_head;
        *N = p.vocab;
        *K = p.hidden;
        return;
    }
    const FusedLayer* L = p.layers + phase / 4;
    switch (phase % 4) {
        case 0: *w = L->wqkv; *N = width; *K = p.hidden; break;
        case 1: *w = L->wo; *N = p.hidden; *K = p.n_heads * p.head_dim; break;
        case 2: *w = L->w_gate_up; *N = 2 * p.ffn; *K = p.hidden; break;
        default: *w = L->w_down; *N = p.hidden; *K = p.ffn; break;
    }
}

// In 32-bit unsigned arithmetic: the 64-bit division is a subroutine call (CALL __cuda_sm20_div_s64 in the
// SASS, two per range, several ranges per layer, some after a counter wait). tiles * (blockIdx.x + 1) fits:
// a vocabulary of 152k rows is 9.5k tiles, times a grid of at most 264 CTAs is 2.5M < 2^32. The same
// quotients, so the same tile ranges. -1.2 to -3.9% at every v1 and v2 shape of <= 16 rows (session 31,
// H100).
__device__ __forceinline__ void fused_tile_range(int N, int* t0, int* t1) {
    const unsigned int tiles = (unsigned int)(N + 15) / 16u;
    *t0 = (int)(tiles * blockIdx.x / gridDim.x);
    *t1 = (int)(tiles * (blockIdx.x + 1u) / gridDim.x);
}

// Warp 0's position in the chunk sequence (what it copies next; the same in each of its lanes).
struct FusedProducer {
    int phase, phases;  // current phase; phases in the sequence (4 L, + 1 with logits rows)
    int tile, t1, kc, kchunks, N, K;
    const unsigned short* w;
    unsigned int issued;  // chunks copied so far (slot = issued % stages)
    bool whole_tiles;     // FUSED_WHOLE_TILE_COPIES
    bool ldgsts;          // FUSED_LDGSTS: every thread keeps the cursor and copies its share
};

// Bytes between consecutive weight rows of a chunk in its slot.
__device__ __forceinline__ int fused_chunk_row_stride(int K, int width, int chunk_k, bool whole_tiles) {
    return whole_tiles && width == K ? 2 * K : fused_row_stride(chunk_k);
}


// Moves to the first phase at or after `phase` where this CTA has tiles.
__device__ void fused_producer_seek(const FusedParams& p, FusedProducer& q, int phase) {
    for (q.phase = phase; q.phase < q.phases; ++q.phase) {
        fused_phase_matrix(p, q.phase, &q.w, &q.N, &q.K);
        fused_tile_range(q.N, &q.tile, &q.t1);
        q.kc = 0;
        q.kchunks = (q.K + p.chunk_k - 1) / p.chunk_k;
        if (q.tile < q.t1) return;
    }
}

// The cursor past the chunk just issued: next column chunk, next tile, or the next phase with tiles.
__device__ void fused_producer_advance(const FusedParams& p, FusedProducer& q) {
    ++q.issued;
    if (++q.kc == q.kchunks) {
        q.kc = 0;
        if (++q.tile == q.t1) fused_producer_seek(p, q, q.phase + 1);
    }
}

// Where the producer's next chunk goes and what it holds: slot, destination, first column, columns,
// first weight row, rows (the last tile of a matrix may have fewer than 16).
struct FusedChunk {
    int slot;
    unsigned char* dst;
    int k0, width, r0, rows;
};

__device__ __forceinline__ FusedChunk fused_next_chunk(const FusedParams& p, const FusedProducer& q,
                                                       unsigned char* ring, int stages) {
    FusedChunk c;
    c.slot = (int)(q.issued % (unsigned)stages);
    c.dst = ring + (size_t)c.slot * fused_stage_bytes(p.chunk_k);
    c.k0 = q.kc * p.chunk_k;
    c.width = min(p.chunk_k, q.K - c.k0);
    c.r0 = q.tile * 16;
    c.rows = min(16, q.N - c.r0);
    return c;
}

// Copies the next chunk of the sequence into its slot; nothing past the end. Called by all 32 lanes of
// warp 0, which keep identical cursors: lane 0 sets the slot's transaction count, lane i copies row i.
__device__ void fused_producer_issue(const FusedParams& p, FusedProducer& q, unsigned char* ring,
                                     unsigned long long* bars, int stages) {
    if (q.phase >= q.phases) return;
    const int lane = threadIdx.x & 31;
    const FusedChunk c = fused_next_chunk(p, q, ring, stages);
    const unsigned int bytes = (unsigned int)c.width * 2u;
    // No proxy fence before the copies: the consumers' reads of this slot are ordered before them by the
    // __syncthreads in fused_gemm_ring (the pattern of CUTLASS's TMA pipelines, which release a slot
    // through an mbarrier). A fence.proxy.async here made no measurable difference (NOTES v0.7).
    if (lane == 0) fused_mbar_expect(&bars[c.slot], bytes * (unsigned)c.rows);
    __syncwarp();
    // The weights evict first from L2, as in v2 (fv2_producer_issue_part).
    const unsigned long long policy = fused_l2_evict_first_policy();
    if (q.whole_tiles && c.width == q.K) {
        // The tile's rows are contiguous in memory: one copy (<= 16 x 2 chunk_k bytes, within the slot).
        if (lane == 0)
            fused_bulk_copy_hint(c.dst, q.w + (size_t)c.r0 * q.K, bytes * (unsigned)c.rows, &bars[c.slot], policy);
    } else if (lane < c.rows) {
        fused_bulk_copy_hint(c.dst + lane * fused_row_stride(p.chunk_k), q.w + (size_t)(c.r0 + lane) * q.K + c.k0,
                             bytes, &bars[c.slot], policy);
    }
    fused_producer_advance(p, q);
}

// FUSED_LDGSTS: the next chunk of the sequence into its slot by all threads (16 bytes each per
// instruction, padded rows), one commit group per call; past the end an empty group, so that "at most
// stages - 1 groups pending" always means "the chunk about to be consumed has landed".
__device__ void fused_producer_issue_ldgsts(const FusedParams& p, FusedProducer& q, unsigned char* ring,
                                            int stages) {
    if (q.phase < q.phases) {
        const FusedChunk ch = fused_next_chunk(p, q, ring, stages);
        const int per_row = ch.width / 8;  // 16-byte pieces
        const int rs = fused_row_stride(p.chunk_k);
        for (int i = threadIdx.x; i < ch.rows * per_row; i += blockDim.x) {
            const int r = i / per_row, c = i % per_row;
            fused_cp_async_16(ch.dst + r * rs + c * 16, q.w + (size_t)(ch.r0 + r) * q.K + ch.k0 + c * 8);
        }
        fused_producer_advance(p, q);
    }
    fused_cp_async_commit();
}

// The ring as the consumers see it: chunks consumed so far (uniform over the CTA).
struct FusedRing {
    unsigned char* slots;
    unsigned long long* bars;
    int stages;
    unsigned int consumed;
};

// The tile epilogue for activation rows [mbase, mbase + 8 NT) of the tile: the warp-order reduction and
// the write (SwiGLU, plain, accumulate, bias, tapped copies), skinny_linear_tile's arithmetic. The
// reduction goes through `red` (FUSED_RED_BYTES) in groups of 4 activation blocks (32 rows).
#define FUSED_RED_BYTES (8 * 32 * 16 * 4)
template <int NT>
__device__ __forceinline__ void fused_tile_out(const FusedGemm& g, float (&c)[NT][4], int mbase, int tile,
                                               float* red, const FusedTaps* taps, bool tapped, int layer) {
    float(*red3)[32][16] = reinterpret_cast<float(*)[32][16]>(red);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3;
#pragma unroll
    for (int grp = 0; grp < NT; grp += 4) {
        const int gn = NT - grp < 4 ? NT - grp : 4;  // blocks in this group
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (j >= gn) break;
            red3[warp][j * 8 + 2 * t][gq] = c[grp + j][0];
            red3[warp][j * 8 + 2 * t + 1][gq] = c[grp + j][1];
            red3[warp][j * 8 + 2 * t][gq + 8] = c[grp + j][2];
            red3[warp][j * 8 + 2 * t + 1][gq + 8] = c[grp + j][3];
        }
        __syncthreads();
        const int m0 = mbase + grp * 8;  // first activation row of the group
        const int M = g.M - m0;          // rows left from m0 (only 8 gn are in this group)
        if (g.act) {
            const int ffn = g.N / 2;
            for (int idx = threadIdx.x; idx < 8 * 8 * gn; idx += blockDim.x) {
                const int m = idx / 8, r = idx % 8;
                const int f = tile * 8 + r;
                if (m >= M || f >= ffn) continue;
                float gs = 0.0f, us = 0.0f;
#pragma unroll
                for (int ww = 0; ww < 8; ++ww) {
                    gs += red3[ww][m][r];
                    us += red3[ww][m][r + 8];
                }
                g.act[(size_t)(m0 + m) * ffn + f] = f32_to_bf16(gs / (1.0f + expf(-gs)) * us);
            }
        } else {
            for (int idx = threadIdx.x; idx < 16 * 8 * gn; idx += blockDim.x) {
                const int m = idx / 16, r = idx % 16;
                const int n = tile * 16 + r;
                if (m >= M || n >= g.N) continue;
                float sum = 0.0f;
#pragma unroll
                for (int ww = 0; ww < 8; ++ww) sum += red3[ww][m][r];
                float* dst = g.out + (size_t)(m0 + m) * g.N + n;
                float v = g.accumulate ? *dst + sum : sum;
                // The standard step adds the bias after the accumulate: (x + s) + b.
                if (g.bias_after) v += g.bias_after[n];
                *dst = v;
                if (tapped) {
                    for (int sl = 0; sl < taps->count; ++sl) {
                        if (((taps->layers >> (8 * sl)) & 0xffull) != (unsigned)layer) continue;
                        taps->buf[(size_t)sl * taps->stride + (size_t)(m0 + m) * g.N + n] = v;
                    }
                }
            }
        }
        __syncthreads();  // red is reused by the next group / pass / tile
    }
}

// One GEMM phase over the ring. NT = 8-row activation blocks per pass (M <= 8 NT, NT <= 8); more than 64
// rows take two passes over each chunk (rows 0..63, then 64..), accumulators for both kept in registers.
template <int NT, int PASSES>
__device__ __noinline__ void fused_gemm_ring(const FusedParams& p, FusedProducer& q, FusedRing& ring,
                                             const FusedGemm& g, float* red, unsigned char* xs_buf,
                                             const FusedTaps* taps, int layer) {
    bool tapped = false;
    if (taps) {
        for (int sl = 0; sl < taps->count; ++sl) tapped |= ((taps->layers >> (8 * sl)) & 0xffull) == (unsigned)layer;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3;
    // The ring addressed from the dynamic shared array, so the weight fragment loads are shared loads
    // (fv2_gemm says why).
    extern __shared__ __align__(128) unsigned char fused_dyn[];
    const unsigned char* slots = fused_dyn + (ring.slots - fused_dyn);
    int t0, t1;
    fused_tile_range(g.N, &t0, &t1);
    const int chunk_k = p.chunk_k;
    const int kchunks = (g.K + chunk_k - 1) / chunk_k;
    uint4 zero;
    zero.x = zero.y = zero.z = zero.w = 0u;
    // The activations, once per phase, into shared memory when they fit (rows FUSED_XS_PAD bytes apart
    // beyond K, for conflict-free fragment loads): every chunk of every tile then reads them on chip
    // instead of paying an L2 round trip per chunk. All loads of the copy are in flight together.
    const int xs_stride = g.K * 2 + FUSED_XS_PAD;
    const bool staged = t0 < t1 && g.M * xs_stride <= p.xs_bytes;
    const long long t_stage = fused_clock();
    if (staged) {
        const int per_row = g.K / 8;  // 16-byte pieces
        const int pieces = g.M * per_row;
        for (int base = threadIdx.x; base < pieces; base += 4 * FUSED_THREADS) {
            uint4 v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int i = base + u * FUSED_THREADS;
                if (i < pieces) v[u] = load_coherent_16(g.x + (size_t)(i / per_row) * g.K + (size_t)(i % per_row) * 8);
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int i = base + u * FUSED_THREADS;
                if (i < pieces) {
                    *reinterpret_cast<uint4*>(xs_buf + (size_t)(i / per_row) * xs_stride + (i % per_row) * 16) = v[u];
                }
            }
        }
        __syncthreads();
    }
    fused_prof_add(22, t_stage);
    for (int tile = t0; tile < t1; ++tile) {
        float c[PASSES][NT][4];
#pragma unroll
        for (int ps = 0; ps < PASSES; ++ps)
#pragma unroll
            for (int i = 0; i < NT; ++i) c[ps][i][0] = c[ps][i][1] = c[ps][i][2] = c[ps][i][3] = 0.0f;
        for (int kc = 0; kc < kchunks; ++kc) {
            const int slot = (int)(ring.consumed % (unsigned)ring.stages);
            const unsigned int parity = (ring.consumed / (unsigned)ring.stages) & 1u;
            const long long t_wait = fused_clock();
            if (q.ldgsts) {
                fused_cp_async_wait(ring.stages - 1);
                __syncthreads();  // every thread's pieces of the chunk have landed
            } else {
                fused_mbar_wait(&ring.bars[slot], parity);
            }
            fused_prof_add(20, t_wait);
            const unsigned char* st = slots + (size_t)slot * fused_stage_bytes(chunk_k);
            const int k0 = kc * chunk_k;
            const int width = min(chunk_k, g.K - k0);
            const int row_stride = fused_chunk_row_stride(g.K, width, chunk_k, q.whole_tiles && !q.ldgsts);
            // Warp w takes the 32-column sub-chunks w, w + 8, ...; HG of them at a time, their activation
            // loads issued together (one L2 round trip per group when the activations are not staged).
            constexpr int HG = NT >= 4 ? 1 : 4 / NT;
            for (int h0 = 0; 8 * h0 * 32 < width; h0 += HG) {
                uint4 a_lo[HG], a_hi[HG], b[HG][PASSES][NT];
#pragma unroll
                for (int j = 0; j < HG; ++j) {
                    const int sc = warp + 8 * (h0 + j);
                    const bool ok = sc * 32 < width;
                    const int kl = sc * 32 + t * 8;
                    a_lo[j] = ok ? *reinterpret_cast<const uint4*>(st + gq * row_stride + kl * 2) : zero;
                    a_hi[j] = ok ? *reinterpret_cast<const uint4*>(st + (gq + 8) * row_stride + kl * 2) : zero;
#pragma unroll
                    for (int ps = 0; ps < PASSES; ++ps) {
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt) {
                            const int m = ps * 64 + nt * 8 + gq;
                            if (!ok || m >= g.M) {
                                b[j][ps][nt] = zero;
                            } else if (staged) {
                                b[j][ps][nt] =
                                    *reinterpret_cast<const uint4*>(xs_buf + (size_t)m * xs_stride + (k0 + kl) * 2);
                            } else {
                                b[j][ps][nt] = load_coherent_16(g.x + (size_t)m * g.K + k0 + kl);
                            }
                        }
                    }
                }
#pragma unroll
                for (int j = 0; j < HG; ++j) {
#pragma unroll
                    for (int ps = 0; ps < PASSES; ++ps) {
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt) {
                            mma_bf16_16816(c[ps][nt], a_lo[j].x, a_hi[j].x, a_lo[j].y, a_hi[j].y, b[j][ps][nt].x,
                                           b[j][ps][nt].y);
                            mma_bf16_16816(c[ps][nt], a_lo[j].z, a_hi[j].z, a_lo[j].w, a_hi[j].w, b[j][ps][nt].z,
                                           b[j][ps][nt].w);
                        }
                    }
                }
            }
            __syncthreads();  // every warp is done with the slot
            if (q.ldgsts) {
                fused_producer_issue_ldgsts(p, q, ring.slots, ring.stages);
            } else if (threadIdx.x < 32) {
                fused_producer_issue(p, q, ring.slots, ring.bars, ring.stages);
            }
            ++ring.consumed;
        }
        const long long t_out = fused_clock();
#pragma unroll
        for (int ps = 0; ps < PASSES; ++ps) fused_tile_out<NT>(g, c[ps], ps * 64, tile, red, taps, tapped, layer);
        fused_prof_add(21, t_out);
    }
    if (staged) __syncthreads();  // xs_buf is the attention scratch of the next phase
}

__device__ __forceinline__ void fused_gemm_phase(const FusedParams& p, FusedProducer& q, FusedRing& ring,
                                                 const FusedGemm& g, float* red, unsigned char* xs_buf,
                                                 const FusedTaps* taps, int layer) {
    if (g.M <= 8) {
        fused_gemm_ring<1, 1>(p, q, ring, g, red, xs_buf, taps, layer);
    } else if (g.M <= 16) {
        fused_gemm_ring<2, 1>(p, q, ring, g, red, xs_buf, taps, layer);
    } else if (g.M <= 32) {
        fused_gemm_ring<4, 1>(p, q, ring, g, red, xs_buf, taps, layer);
    } else if (g.M <= 64) {
        fused_gemm_ring<8, 1>(p, q, ring, g, red, xs_buf, taps, layer);
    } else {
        fused_gemm_ring<8, 2>(p, q, ring, g, red, xs_buf, taps, layer);
    }
}

// Tapped layers (drafters that condition on target features, e.g. DSpark): after the down projection of
// layer l, the residual stream x is copied into every slot s whose layer (byte s of `layers`) is l, at
// buf + s * stride, [rows, hidden] -- what the standard step's device-to-device copy writes. Each down
// tile copies the elements it owns, right after writing them (fused_tile_out).

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
    extern __shared__ __align__(128) unsigned char fused_dyn[];
    __shared__ FusedParams P;
    __shared__ FusedLayer L;
    __shared__ __align__(8) unsigned long long ring_bars[FUSED_MAX_RING];
    if (threadIdx.x < sizeof(FusedParams) / 8) {
        ((unsigned long long*)&P)[threadIdx.x] = ((const unsigned long long*)params)[threadIdx.x];
    }
    if (threadIdx.x < FUSED_PROF_SLOTS) fused_prof[threadIdx.x] = 0;
    if (threadIdx.x == 0) fused_prof_on = (flags & FUSED_PROFILE) != 0;
    const long long t_kernel = fused_clock();
    __syncthreads();
    const FusedParams& p = P;
    const bool work = !(flags & FUSED_SKIP_WORK);
    // Dynamic shared memory: GEMM reduction | activations (GEMM phases) or attention scratch | weight ring.
    float* red = reinterpret_cast<float*>(fused_dyn);
    unsigned char* xs_buf = fused_dyn + FUSED_RED_BYTES;
    float* attn_smem = reinterpret_cast<float*>(xs_buf);
    const int h = p.hidden, qd = p.n_heads * p.head_dim;
    const int width = (p.n_heads + 2 * p.n_kv_heads) * p.head_dim;

    // The weight ring: thread 0 initialises the slots' barriers, warp 0 starts the first copies.
    FusedRing ring = {fused_dyn + p.ring_offset, ring_bars, p.ring_stages, 0u};
    FusedProducer q;
    q.phases = 4 * p.n_layers + (n_logits > 0 ? 1 : 0);
    q.issued = 0;
    q.whole_tiles = (flags & FUSED_WHOLE_TILE_COPIES) != 0;
    q.ldgsts = (flags & FUSED_LDGSTS) != 0;
    if (work && q.ldgsts) {
        fused_producer_seek(p, q, 0);
        for (int i = 0; i < ring.stages; ++i) fused_producer_issue_ldgsts(p, q, ring.slots, ring.stages);
    } else if (work && threadIdx.x < 32) {
        if (threadIdx.x == 0) {
            for (int i = 0; i < ring.stages; ++i) fused_mbar_init(&ring_bars[i]);
            fused_mbar_init_fence();
        }
        __syncwarp();
        fused_producer_seek(p, q, 0);
        for (int i = 0; i < ring.stages; ++i) fused_producer_issue(p, q, ring.slots, ring.bars, ring.stages);
    }
    __syncthreads();

    for (int l = 0; l < p.n_layers; ++l) {
        if (threadIdx.x < sizeof(FusedLayer) / 8) {
            ((unsigned long long*)&L)[threadIdx.x] = ((const unsigned long long*)(p.layers + l))[threadIdx.x];
        }
        __syncthreads();
        const FusedGemm qkv = {L.wqkv, p.act16, p.qkv, 0, 0, width, h, rows, 0};
        const FusedGemm o = {L.wo, p.act16, p.x, 0, L.bo, h, qd, rows, 1};
        const FusedGemm gate_up = {L.w_gate_up, p.act16, 0, p.ffn_act16, 0, 2 * p.ffn, h, rows, 0};
        const FusedGemm down = {L.w_down, p.ffn_act16, p.x, 0, 0, h, p.ffn, rows, 1};
        long long t = fused_clock();
        // Phase k's work, then the grid barrier after it, each timed when profiling.
#define FUSED_PHASE(k, work_stmt)           \
    t = fused_clock();                          \
    work_stmt;                              \
    fused_prof_add(k, t);                   \
    t = fused_clock();                          \
    fused_grid_barrier(p.barrier);          \
    fused_prof_add(10 + k, t);
        // A: attention RMSNorm (layer 0: from the embedding rows).
        FUSED_PHASE(0, if (work) fused_norm_phase(p.x, 0, rows, L.attn_norm, p.act16, h, p.eps,
                                                  l == 0 ? p.embed : 0, p.tokens))
        // B: QKV projection.
        FUSED_PHASE(1, if (work) fused_gemm_phase(p, q, ring, qkv, red, xs_buf, 0, -1))
        // C: bias, q/k norm, RoPE, KV append.
        FUSED_PHASE(2, if (work) fused_rope_phase(p, L, rows))
        // D: attention.
        FUSED_PHASE(3, if (work && !(flags & FUSED_SKIP_ATTENTION)) fused_attention_phase(
                           p, L, rows, attn_smem, (flags & FUSED_WHOLE_ROW_ATTENTION) != 0))
        // E: O projection + residual (+ o bias).
        FUSED_PHASE(4, if (work) fused_gemm_phase(p, q, ring, o, red, xs_buf, 0, -1))
        // F: FFN RMSNorm.
        FUSED_PHASE(5, if (work) fused_norm_phase(p.x, 0, rows, L.ffn_norm, p.act16, h, p.eps, 0, 0))
        // G: gate/up + SwiGLU.
        FUSED_PHASE(6, if (work) fused_gemm_phase(p, q, ring, gate_up, red, xs_buf, 0, -1))
        // H: down projection + residual (and the tapped-layer copies).
        FUSED_PHASE(7, if (work) fused_gemm_phase(p, q, ring, down, red, xs_buf, taps.count > 0 ? &taps : 0, l))
    }
    if (n_logits > 0) {
        long long t = fused_clock();
        // Z1: final norm of the logits rows; Z2: LM head.
        FUSED_PHASE(8, if (work) fused_norm_phase(p.x, p.logit_rows, n_logits, p.final_norm, p.act16, h, p.eps, 0, 0))
        const FusedGemm head = {p.lm_head, p.act16, p.logits, 0, 0, p.vocab, h, n_logits, 0};
        t = fused_clock();
        if (work) fused_gemm_phase(p, q, ring, head, red, xs_buf, 0, -1);
        fused_prof_add(9, t);
    }
#undef FUSED_PHASE
    fused_prof_finish(p.prof, t_kernel);
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

// ===================================================================================================
// v2 (FusedOptions::dataflow; `fused_forward_v2`): the same step without grid barriers, for steps of at
// most FV2_MAX_ROWS rows (the host launches v1 above for more, and wherever v2's shared-memory plan
// leaves fewer than two ring slots). Why (experiments/fused/README.md, "Plan for v2"): v1 spends most
// of a 1 x 1 step in per-phase fixed latency -- 129 grid barriers and their skew, norm and RoPE phases
// of a few microseconds on a handful of CTAs while 132 wait, attention on the critical path at ~15 us per
// layer -- while the weights stream at ~4 TB/s whenever a phase is long enough.
//
// Schedule. Five stages per layer, each a list of work items with a static owner CTA (a pure function
// of the launch shape, so graphs replay it):
//   Q  QKV tiles (contiguous tile range per CTA, as v1). The attention RMSNorm is computed by every CTA
//      that has QKV tiles, while staging its activations (layer 0: from the embedding rows); the output
//      is the raw qkv (no bias).
//   A  attention items (sequence, KV head, key split of <= FV2_ATT_KEYS keys): each adds the qkv bias,
//      applies the q/k head norms and RoPE to the rows it needs (q of its G heads, the new k and v of the
//      sequence), appends the new k/v of the positions in its own key range to the cache (one writer per
//      position), and runs an online softmax over its keys: the cached ones prefetched into shared
//      memory with cp.async BEFORE waiting for Q (they do not depend on this step). More than one split:
//      the last split to arrive (per (sequence, KV head) counter) combines the partials in split order.
//   O  O-projection tiles: x += attention output (+ o bias); at layer 0 x = embedding + ... (the same
//      sums as the standard step's embed, then accumulate).
//   G  gate/up tiles with the FFN RMSNorm computed while staging, SwiGLU in the epilogue.
//   D  down-projection tiles: x += (+ tapped-layer copies).
// then the LM head tiles (final RMSNorm of the logits rows computed while staging).
//
// Synchronisation: one monotonic 64-bit counter per (layer, stage). A CTA arrives on it once after its
// items of that stage (arrivals are release atomics after the consumer warps' barrier, fv2_sync); a CTA
// waits on the previous stage's counter only before its FIRST item of a stage (acquire polls by thread
// 0, then fv2_sync),
// and a CTA with no items in a stage arrives without waiting. Completion: counter == (epoch + 1) * grid,
// epoch = the launch's index, from a launch counter every CTA increments once at start (launches on a
// stream do not overlap, so the counters stay multiples of the grid between launches and graph replays
// need no reset). Since a CTA arrives on stage s only after finishing its items of every stage <= s, a
// full counter of stage s means every item of stages <= s is complete. That covers every hazard: each
// buffer's readers and next writers are at least one stage apart (qkv: Q writes, A reads, next Q writes
// after D; act16: A -> O; ffn_act16: G -> D; x: O and D write, G and the next Q read), and no CTA can
// start a stage's item before the previous stage is complete.
//
// Weights: the ring of v1, in 64 KB slots of one 16-row tile x up to FV2_CHUNK_K columns, each slot filled by
// FV2_PARTS copies of its rows (one bulk copy per part when K <= FV2_CHUNK_K, else one per row; 32 KB slots
// of half a tile's columns measured 6% slower at 1 x 1, NOTES v0.14). A CTA is 8 consumer warps (threads
// 0-255: every stage's work, synchronised by named barrier 1, fv2_sync) plus one producer warp (warp 8)
// that only walks this CTA's whole chunk sequence across stages and layers: it waits for a slot's release
// (the `empty` mbarrier, arrived by consumer thread 0 after the CTA is done with the slot) and for the
// copy FV2_MAX_INFLIGHT back to land, and issues the next part copy. So during a counter
// wait the next stage's weights keep landing, and issuing a copy (~1 us per 64 KB copy while the copy
// engine is busy, measured) never stalls the consumers (issued by consumer warp 0, it cost 18-24%).
//
// Activations produced inside the kernel are read with ld.global.cg (L2, never a stale L1 line).
// Determinism: every output element has one owner; the norms are computed identically by every CTA that
// stages them; the attention split count is a function of the sequence's key count; no float atomics.
// The arithmetic differs from the standard step's in summation order only (parity to rounding).
#define FV2_MAX_ROWS 16
#define FV2_CHUNK_K 2048
#define FV2_SLOT_BYTES (16 * FV2_CHUNK_K * 2)
#define FV2_MAX_SLOTS 8
#define FV2_ATT_KEYS 32
// Query vectors a warp takes at once in an attention item's keys and softmax (fv2_attention_item).
// 2, not 4: at 4 the loop's registers spill (session 26); at 2 with 2 accumulators a vector it spills
// 20/20 bytes and gains 1-6% at every v2 shape, most at k = 7 (session 27, NOTES v0.31).
#ifndef FV2_ATT_VB
#define FV2_ATT_VB 2
#endif
#define FV2_MAX_SPLITS 32
#define FV2_STAGES 5
#define FV2_CTR_WORDS 16  // u64 words between counters (each on its own 128-byte line)
#define FV2_XS_PAD 64
#define FV2_SPIN_LIMIT (1u << 26)
// Weight copies in flight. The producer fills each 64 KB slot with FV2_PARTS copies of FV2_PART_ROWS rows
// (32 KB each at K <= FV2_CHUNK_K), each on its own full barrier (bars[FV2_PARTS slot + part]; the consumers
// wait for all of a slot's), and issues part copy n only after copy n - FV2_MAX_INFLIGHT has landed; the
// ring still holds `stages` chunks ahead. Fewer bytes queued won at every step (H100, NOTES v0.26-v0.27):
// with every slot in flight, 132 CTAs queued ~25 MB against the ~3 MB the read bandwidth needs, and a
// CTA's gate/up time varied 2x from CTA to CTA and step to step; one 64 KB copy at a time was -5.0% at
// 1 x 1; one 32 KB copy at a time (~4 MB over the grid) -4.0% more, -0.8 to -3.1% at the other k = 0
// shapes. Keeping 64 KB in flight as two 32 KB copies, so the queue never empties, lost 1.2%: the queue's
// depth, not the gap between copies, stretches the dependent round trips (counters, staging, residuals).
#define FV2_PARTS 2
#define FV2_PART_ROWS (16 / FV2_PARTS)
// FV2_MAX_INFLIGHT, FV2_L2_INFLIGHT, FV2_L2_PACE_CYCLES, FV2_L2_LEAD and FV2_L2_MAX_SEQS / _ROWS are the
// defaults; a launch may set each (FUSED_INFLIGHT_SHIFT and beside it).
#define FV2_MAX_INFLIGHT 1
// Paced L2 prefetch while the ring is full. When the producer has waited FV2_L2_IDLE_CYCLES for a slot (the
// consumers are at a counter wait or in attention, and HBM idles: the timeline of NOTES v0.28 has ~13 us
// of attention per layer with the weight stream stopped), it prefetches into L2 the chunks it will copy
// next, from the one waiting for the slot on, up to FV2_L2_LEAD chunks, one part at a time and at most one
// part every FV2_L2_PACE_CYCLES (~1.5 us at 2 GHz: 32 KB per CTA at about its share of an H100's bandwidth,
// so the memory system's queue stays as shallow as the one-copy cap keeps it). Earlier L2 prefetches
// (v2y, l2g: NOTES v0.16, v0.17) were unpaced, ran during streaming too, and came with three 64 KB copies
// in flight per CTA. FV2_L2_LEAD 0 is the kernel without it.
#define FV2_L2_LEAD 2
#define FV2_L2_IDLE_CYCLES 2000
#define FV2_L2_PACE_CYCLES 3000
#define FV2_L2_MAX_SEQS 2
#define FV2_L2_MAX_ROWS 2
// Copies in flight for parts the producer prefetched into L2 (the one-copy cap is for parts that come from
// HBM). At one in flight a 32 KB copy takes about as long from L2 as from HBM at the SM's share of the read
// bandwidth (~1.4 us), so with the one-copy cap alone the paced prefetch bought only 1.4-2.2% at 1 x 1 and
// 2 x 1 (sessions 28-29). With up to 4 in flight for prefetched parts, and the prefetch gated to steps of
// <= 2 rows (`l2pace2i`, session 30, NOTES v0.34, H100, two same-call benches): -1.0/-1.2% at 1 x 1,
// -2.2/-2.3% at 2 x 1, +0.6/0.0% at 1 x 8, -0.2 to -0.8% at 2 x 8, 4 x 1 and 8 x 1. A lead of 4 chunks
// (`l2pace4i`) was the same within 0.4%.
#define FV2_L2_INFLIGHT 4

// The 8 consumer warps' barrier (named barrier 1): the producer warp (warp 8) never joins it.
__device__ __forceinline__ void fv2_sync() { asm volatile("bar.sync 1, %0;" ::"n"(FUSED_THREADS) : "memory"); }
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
__device__ __forceinline__ void fv2_mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(fused_smem_addr(bar)) : "memory");
}
#else
__device__ __forceinline__ void fv2_mbar_arrive(unsigned long long*) { __trap(); }
#endif
#define FV2_THREADS (FUSED_THREADS + 32)

__device__ __forceinline__ float4 fv2_ldcg4(const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }
__device__ __forceinline__ uint4 fv2_ldcg16(const unsigned short* p) {
    return __ldcg(reinterpret_cast<const uint4*>(p));
}

// The step's sequences: maximal runs of rows with the same block table and consecutive positions.
struct Fv2Seqs {
    int n;
    int first[FV2_MAX_ROWS], rows[FV2_MAX_ROWS], pos0[FV2_MAX_ROWS], splits[FV2_MAX_ROWS];
    int items;  // attention items: sum over sequences of n_kv_heads x ceil(splits / group)
    int group;  // consecutive key splits of one (sequence, KV head) per item (fv2_attention_group)
};

// Key splits of a sequence with `keys` keys: <= FV2_ATT_KEYS keys each while that takes at most
// FV2_MAX_SPLITS splits, more keys per split (several tiles) beyond.
__device__ __forceinline__ int fv2_splits(int keys) {
    return min(FV2_MAX_SPLITS, (keys + FV2_ATT_KEYS - 1) / FV2_ATT_KEYS);
}

// Splits per attention item. An item runs `group` consecutive splits of one (sequence, KV head) one after
// another, each with the same keys, the same order and its own partial as when it is an item alone, so
// the grouping changes no bits (the splits still depend on the key count only). What it saves is each
// item's fixed cost: the wait, the q/k/v head vectors, a barrier pair, the fence and the split counter's
// atomic. At 8 x 1 (256 positions) the step has 576 one-tile items on 132 CTAs, 4-5 per CTA in turn; in
// groups of 5 they are 128 items. The group minimises the splits the busiest CTA runs (group x rounds of
// items), then the rounds; one split per item where that is already one round (1 x 1, 1 x 8).
// Not inlined: inlined into the kernel its loop raised the kernel's spills from 12 to 40 bytes of stores
// and 88 of loads (ptxas), and the first build with it inlined ran 1 x 1 and 1 x 8 2-3% slower than
// without it (session 24, H100), though those shapes group nothing.
__device__ __noinline__ int fv2_attention_group(const Fv2Seqs& sq, int n_kv_heads, int grid, int* items_out) {
    int best_g = 1, best_cost = 0x7fffffff, best_rounds = 0x7fffffff, best_items = 0, max_splits = 1;
    for (int i = 0; i < sq.n; ++i) max_splits = max(max_splits, sq.splits[i]);
    for (int g = 1; g <= max_splits; ++g) {
        int items = 0;
        for (int i = 0; i < sq.n; ++i) items += n_kv_heads * ((sq.splits[i] + g - 1) / g);
        const int rounds = (items + grid - 1) / grid;
        const int cost = g * rounds;
        if (cost < best_cost || (cost == best_cost && rounds < best_rounds)) {
            best_g = g;
            best_cost = cost;
            best_rounds = rounds;
            best_items = items;
        }
    }
    *items_out = best_items;
    return best_g;
}

struct Fv2Ring {
    unsigned char* slots;
    unsigned long long* bars;
    unsigned long long* empty;  // consumers' releases (arrival count 1: thread 0 after the CTA's sync)
    int stages;
    // The consumers' cursor: the next chunk's slot and its full barrier's phase parity, advanced with a
    // wrap instead of a division by `stages` per chunk (Nsight Compute found the division, with the ring in
    // local memory, in ~3% of the stall samples: NOTES v0.16).
    int slot;
    unsigned int parity;
};

// The producer warp's cursor over this CTA's chunk sequence (phases 4 l + {QKV, O, gate/up, down}, then the head).
struct Fv2Producer {
    int phase, phases, tile, t1, kc, kchunks, N, K;
    const unsigned short* w;
    int slot;           // the next chunk's slot
    unsigned int laps;  // times the producer has gone round the ring (the slot's previous use was lap laps - 1)
};

__device__ void fv2_producer_seek(const FusedParams& p, Fv2Producer& q, int phase) {
    for (q.phase = phase; q.phase < q.phases; ++q.phase) {
        fused_phase_matrix(p, q.phase, &q.w, &q.N, &q.K);
        fused_tile_range(q.N, &q.tile, &q.t1);
        q.kc = 0;
        q.kchunks = (q.K + FV2_CHUNK_K - 1) / FV2_CHUNK_K;
        if (q.tile < q.t1) return;
    }
}

// Copies part `h` of the next chunk (rows FV2_PART_ROWS h .. of a tile's 16, fewer at the end of a matrix)
// into its slot, on the part's own full barrier; past the end, nothing. All 32 lanes of the producer warp
// call it with identical cursors: lane 0 sets the transaction count (0 bytes for a part past the matrix's
// last row: the barrier completes at once), then one copy (lane 0) or one row copy per lane.
// Part `h` of the cursor's chunk: its columns [k0, k0 + width) of the tile's rows r0 + h0 .. + hrows
// (hrows 0 past the matrix's last row), `bytes` per row. What fv2_producer_issue_part copies and
// fv2_prefetch_part prefetches.
struct Fv2Part {
    int k0, r0, h0, hrows;
    unsigned int bytes;
};
__device__ __forceinline__ Fv2Part fv2_part(const Fv2Producer& q, int h) {
    Fv2Part t;
    t.k0 = q.kc * FV2_CHUNK_K;
    const int width = min(FV2_CHUNK_K, q.K - t.k0);
    t.r0 = q.tile * 16;
    const int nrows = max(0, min(16, q.N - t.r0));
    t.h0 = FV2_PART_ROWS * h;
    t.hrows = max(0, min(FV2_PART_ROWS, nrows - t.h0));
    t.bytes = (unsigned int)width * 2u;
    return t;
}
__device__ void fv2_producer_issue_part(const Fv2Producer& q, Fv2Ring& ring, int h) {
    if (q.phase >= q.phases) return;
    const int lane = threadIdx.x & 31;
    const int slot = q.slot;
    unsigned char* dst = ring.slots + (size_t)slot * FV2_SLOT_BYTES;
    const Fv2Part t = fv2_part(q, h);
    const int k0 = t.k0, r0 = t.r0, h0 = t.h0, hrows = t.hrows;
    const unsigned int bytes = t.bytes;
    unsigned long long* bar = &ring.bars[FV2_PARTS * slot + h];
    if (lane == 0) fused_mbar_expect(bar, bytes * (unsigned)hrows);
    __syncwarp();
    const unsigned long long policy = fused_l2_evict_first_policy();
    if (q.K <= FV2_CHUNK_K) {
        if (lane == 0 && hrows > 0) {
            fused_bulk_copy_hint(dst + (size_t)h0 * bytes, q.w + (size_t)(r0 + h0) * q.K, bytes * (unsigned)hrows, bar,
                                 policy);
        }
    } else if (lane < hrows) {
        fused_bulk_copy_hint(dst + (h0 + lane) * (FV2_CHUNK_K * 2), q.w + (size_t)(r0 + h0 + lane) * q.K + k0, bytes,
                             bar, policy);
    }
}
// The L2 prefetch of part `h` of the cursor's chunk: the same rows and bytes fv2_producer_issue_part copies
// (one prefetch, or one per row when K > FV2_CHUNK_K). All 32 lanes call it with identical cursors.
__device__ void fv2_prefetch_part(const Fv2Producer& q, int h) {
    if (q.phase >= q.phases) return;
    const int lane = threadIdx.x & 31;
    const Fv2Part t = fv2_part(q, h);
    if (q.K <= FV2_CHUNK_K) {
        if (lane == 0 && t.hrows > 0) fused_l2_prefetch(q.w + (size_t)(t.r0 + t.h0) * q.K, t.bytes * (unsigned)t.hrows);
    } else if (lane < t.hrows) {
        fused_l2_prefetch(q.w + (size_t)(t.r0 + t.h0 + lane) * q.K + t.k0, t.bytes);
    }
}
// Moves the cursor to the next chunk (slot, column chunk, tile, then the next phase with tiles here).
__device__ void fv2_producer_advance(const FusedParams& p, Fv2Producer& q, Fv2Ring& ring) {
    if (++q.slot == ring.stages) {
        q.slot = 0;
        ++q.laps;
    }
    if (++q.kc == q.kchunks) {
        q.kc = 0;
        if (++q.tile == q.t1) fv2_producer_seek(p, q, q.phase + 1);
    }
}

// Stage counters. Arrive: every consumer thread's writes of the stage are ordered before thread 0's
// release add by the consumers' barrier (as by __syncthreads in v1's grid barrier; the producer warp
// writes no activations). Wait: thread 0 polls with acquire loads, then the consumers proceed together.
__device__ __forceinline__ void fv2_arrive(unsigned long long* ctr) {
    fv2_sync();
    if (threadIdx.x == 0) {
        unsigned long long old;
        asm volatile("atom.add.release.gpu.u64 %0, [%1], 1;" : "=l"(old) : "l"(ctr) : "memory");
    }
}
__device__ __forceinline__ void fv2_wait(const unsigned long long* ctr, unsigned long long target) {
    if (threadIdx.x == 0) {
        unsigned long long now;
        unsigned int spins = 0;
        while (true) {
            asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(now) : "l"(ctr) : "memory");
            if (now >= target) break;
            if (++spins > 32) __nanosleep(20);
            if (spins == FV2_SPIN_LIMIT) __trap();
        }
    }
    fv2_sync();
}

// Where a GEMM stage's activations come from and where its sums go.
#define FV2_SRC_BF16 0        // x16 [M, K] bf16, written earlier in this kernel
#define FV2_SRC_NORM 1        // RMSNorm(xf[src_rows ? src_rows[m] : m]) * norm_w, f32 rows
#define FV2_SRC_EMBED_NORM 2  // RMSNorm(embed[tokens[m]]) * norm_w (layer 0)
#define FV2_OUT_PLAIN 0       // out[m, n] = sum
#define FV2_OUT_ACC 1         // out[m, n] = (init_embed ? embed[tokens[m], n] : out[m, n]) + sum (+ bias[n])
#define FV2_OUT_SWIGLU 2      // act[m, f] = silu(gate) * up, gate/up rows paired in groups of 8
struct Fv2Gemm {
    int N, K, M;
    int src;
    const unsigned short* x16;
    const float* xf;
    const int* src_rows;
    const float* norm_w;
    const unsigned short* embed;
    const int* tokens;
    int out_mode;
    float* out;
    unsigned short* act;
    const float* bias;
    const unsigned short* init_embed;
};

// Bytes of the GEMM reduction scratch for NT 8-row activation blocks (host: gpu_fused.rs v2_plan).
__device__ __forceinline__ int fv2_red_bytes(int nt) { return nt * 8 * 8 * 16 * 4; }

// A norm stage's row sums of squares, in one order whatever the step's row count (batch invariance):
// thread tid sums its 8-column pieces tid, tid + FUSED_THREADS, ... of the row (each piece in column
// order, explicitly rounded so both paths below compile to the same operations), then lane 0's butterfly
// sum per warp, then the 8 warps in order.
__device__ __forceinline__ float fv2_piece_ss(const float (&x)[8]) {
    float s = __fmul_rn(x[0], x[0]);
#pragma unroll
    for (int j = 1; j < 8; ++j) s = __fmaf_rn(x[j], x[j], s);
    return s;
}
// Lane 0's warp sum of each row's partial into wsum[warp][m].
template <int R>
__device__ __forceinline__ void fv2_warp_ss(const float (&ss)[R], int M, float (*wsum)[FV2_MAX_ROWS]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int m = 0; m < R; ++m) {
        if (m < M) {
            float s = ss[m];
            for (int o = 16; o > 0; o >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
            if (lane == 0) wsum[warp][m] = s;
        }
    }
}
// Norm staging's batches: pieces in one pass (fv2_stage_norm_one_pass), rows per batch of fv2_row_rms,
// pieces per batch of fv2_stage_norm. Each batch's pieces sit in registers at once (8 floats a piece),
// inlined into fv2_gemm: with __noinline__ staging functions the calls' register saves cost 400-600
// bytes of spills per kernel, and with norm weights held per piece in fv2_stage_norm the kernel's
// spills reached the producer warp's loop (ptxas --resources, SASS). Batching the loads (`stg`, session
// 32, NOTES v0.36, H200, graph replay against the kernel before it, two calls): at 4 / 4 / 2, -5 % at
// 1 x 8, -8 % at 2 x 8 and 4 x 1, -3.5 % at 8 x 1, -1 % at 2 x 1, +0.3-0.6 % at 1 x 1. At 8 / 8 / 4 (one
// pass up to 8 rows) it gained more at 8 rows (-10 % at 1 x 8, -8.4 % at 8 x 1) but lost 3.6 % at 1 x 1:
// its spills (64/104 bytes in the kernel against 44/60) include loads in the producer warp's loop.
#ifndef FV2_ONE_PASS_PIECES
#define FV2_ONE_PASS_PIECES 4
#endif
#ifndef FV2_RMS_BATCH
#define FV2_RMS_BATCH 4
#endif
#ifndef FV2_STAGE_BATCH
#define FV2_STAGE_BATCH 2
#endif
// Loads the pieces u < P (source row cm[u], columns [cc[u], cc[u] + 8)) of a norm stage into x, every
// load issued before the first use. fv2_norm_src tested the source kind inside the per-piece loop, and
// the compiler made a branch of each piece holding its loads and then their use, so a thread's pieces
// went to L2 one after another: SASS of fv2_row_rms, 16 load-then-sum blocks in sequence; fv2_stage's
// four pieces likewise. At 8 rows the staging took 11.2 us against 1.7 at one row (session 31's
// timeline, 1 x 8). Here the kind is tested once and each load is predicated on its piece being live.
template <int P>
__device__ __forceinline__ void fv2_norm_load(const Fv2Gemm& g, const int (&cm)[P], const int (&cc)[P],
                                              const bool (&live)[P], float (&x)[P][8]) {
    const int K = g.K;
    if (g.src == FV2_SRC_EMBED_NORM) {
        int tok[P];
#pragma unroll
        for (int u = 0; u < P; ++u) tok[u] = live[u] ? g.tokens[cm[u]] : 0;
        uint4 e[P];
#pragma unroll
        for (int u = 0; u < P; ++u) {
            e[u] = make_uint4(0u, 0u, 0u, 0u);
            if (live[u]) e[u] = *reinterpret_cast<const uint4*>(g.embed + (size_t)tok[u] * K + cc[u]);
        }
#pragma unroll
        for (int u = 0; u < P; ++u) {
            const unsigned int w4[4] = {e[u].x, e[u].y, e[u].z, e[u].w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                x[u][2 * j] = bf16_to_f32((unsigned short)(w4[j] & 0xffffu));
                x[u][2 * j + 1] = bf16_to_f32((unsigned short)(w4[j] >> 16));
            }
        }
    } else {
        int r[P];
#pragma unroll
        for (int u = 0; u < P; ++u) r[u] = cm[u];
        if (g.src_rows) {
#pragma unroll
            for (int u = 0; u < P; ++u) r[u] = live[u] ? g.src_rows[cm[u]] : 0;
        }
        float4 a[P], b[P];
#pragma unroll
        for (int u = 0; u < P; ++u) {
            a[u] = b[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (live[u]) {
                a[u] = fv2_ldcg4(g.xf + (size_t)r[u] * K + cc[u]);
                b[u] = fv2_ldcg4(g.xf + (size_t)r[u] * K + cc[u] + 4);
            }
        }
#pragma unroll
        for (int u = 0; u < P; ++u) {
            x[u][0] = a[u].x; x[u][1] = a[u].y; x[u][2] = a[u].z; x[u][3] = a[u].w;
            x[u][4] = b[u].x; x[u][5] = b[u].y; x[u][6] = b[u].z; x[u][7] = b[u].w;
        }
    }
}
// rms_norm_bf16_body's expression for 8 columns, w * (x * inv), rounded to bf16 (fv2_norm_pack's).
__device__ __forceinline__ uint4 fv2_norm_pack_w(const float (&w)[8], const float (&x)[8], float inv) {
    unsigned int o[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const unsigned int lo = f32_to_bf16(w[2 * j] * (x[2 * j] * inv));
        const unsigned int hi = f32_to_bf16(w[2 * j + 1] * (x[2 * j + 1] * inv));
        o[j] = lo | (hi << 16);
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
}
__device__ __forceinline__ float fv2_inv_rms(const float (*wsum)[FV2_MAX_ROWS], int m, int K, float eps) {
    float total = 0.0f;
    for (int w = 0; w < 8; ++w) total = __fadd_rn(total, wsum[w][m]);
    return 1.0f / sqrtf(total / (float)K + eps);
}
// The warps' row sums of a norm staging (fv2_row_rms, the one pass, the groups), one array for all of them
// (each function's own array cost 512 bytes of the ring's shared memory apiece).
__shared__ float fv2_wsum[8][FV2_MAX_ROWS];

// inv_rms[m] for the M source rows of a norm stage that fv2_one_pass does not take (more pieces than
// FV2_ONE_PASS_PIECES, or more than two per row): the rows in groups of FV2_RMS_BATCH, each group's loads
// in flight together. Every row's partial adds its pieces in column order, as the one-pass staging does.
__device__ __forceinline__ void fv2_row_rms(const FusedParams& p, const Fv2Gemm& g, float* inv_rms) {
    float (*wsum)[FV2_MAX_ROWS] = fv2_wsum;
    const float eps = p.eps;
    const int tid = threadIdx.x;
    float ss[FV2_MAX_ROWS];
#pragma unroll
    for (int m = 0; m < FV2_MAX_ROWS; ++m) ss[m] = 0.0f;
    for (int c = tid * 8; c < g.K; c += 8 * FUSED_THREADS) {
#pragma unroll
        for (int m0 = 0; m0 < FV2_MAX_ROWS; m0 += FV2_RMS_BATCH) {
            if (m0 < g.M) {
                int cm[FV2_RMS_BATCH], cc[FV2_RMS_BATCH];
                bool live[FV2_RMS_BATCH];
#pragma unroll
                for (int u = 0; u < FV2_RMS_BATCH; ++u) {
                    cm[u] = m0 + u;
                    cc[u] = c;
                    live[u] = m0 + u < g.M;
                }
                float x[FV2_RMS_BATCH][8];
                fv2_norm_load<FV2_RMS_BATCH>(g, cm, cc, live, x);
#pragma unroll
                for (int u = 0; u < FV2_RMS_BATCH; ++u) {
                    if (live[u]) ss[m0 + u] = __fadd_rn(ss[m0 + u], fv2_piece_ss(x[u]));
                }
            }
        }
    }
    fv2_warp_ss(ss, g.M, wsum);
    fv2_sync();
    if (tid < g.M) inv_rms[tid] = fv2_inv_rms(wsum, tid, g.K, eps);
    fv2_sync();
}

// A norm stage staged whole in one pass when each thread has at most two pieces per row and at most
// FV2_ONE_PASS_PIECES pieces in all (at 4: up to 4 rows of hidden <= 2048, 2 rows of hidden <= 4096): the
// pieces are loaded once into registers, all in flight together, summed exactly as fv2_row_rms sums
// them, then normalised from the registers as fv2_stage does (same inv_rms, same expression). One L2
// round trip and one barrier fewer than fv2_row_rms + fv2_stage (4% of a 1 x 1 step, NOTES v0.15). The
// norm weights of the thread's columns are loaded with the pieces, so the pack after the barrier waits
// for no load. The caller syncs before the tiles read xs.
__device__ __forceinline__ int fv2_pieces_per_row(const Fv2Gemm& g) {
    return (g.K + 8 * FUSED_THREADS - 1) / (8 * FUSED_THREADS);
}
__device__ __forceinline__ bool fv2_one_pass(const Fv2Gemm& g) {
    const int per_row = fv2_pieces_per_row(g);
    return g.src != FV2_SRC_BF16 && g.K % 8 == 0 && per_row <= 2 && g.M * per_row <= FV2_ONE_PASS_PIECES;
}
// PT pieces per row per thread (1 or 2), so every index is compile-time: piece u is row u / PT's columns
// (tid + (u % PT) * FUSED_THREADS) * 8 + [0, 8).
template <int P, int PT>
__device__ __forceinline__ void fv2_norm_pieces(const Fv2Gemm& g, int m0, int (&cm)[P], int (&cc)[P], bool (&live)[P]) {
#pragma unroll
    for (int u = 0; u < P; ++u) {
        cm[u] = m0 + u / PT;
        cc[u] = (threadIdx.x + (u % PT) * FUSED_THREADS) * 8;
        live[u] = cm[u] < g.M && cc[u] < g.K;
    }
}
// The norm weights of a thread's PT columns of pieces (0 past K).
template <int PT>
__device__ __forceinline__ void fv2_norm_weights(const Fv2Gemm& g, float (&w)[PT][8]) {
#pragma unroll
    for (int j = 0; j < PT; ++j) {
        const int c = (threadIdx.x + j * FUSED_THREADS) * 8;
        const bool need = c < g.K;
#pragma unroll
        for (int e = 0; e < 8; ++e) w[j][e] = need ? __ldg(g.norm_w + c + e) : 0.0f;
    }
}
// The live pieces normalised with their rows' sums in wsum and the norm weights, stored as bf16 in xs.
template <int P, int PT>
__device__ __forceinline__ void fv2_norm_store(const Fv2Gemm& g, const int (&cm)[P], const int (&cc)[P],
                                               const bool (&live)[P], const float (&w)[PT][8], const float (&x)[P][8],
                                               const float (*wsum)[FV2_MAX_ROWS], float eps, unsigned char* xs,
                                               int xs_stride) {
#pragma unroll
    for (int u = 0; u < P; ++u) {
        if (!live[u]) continue;
        *reinterpret_cast<uint4*>(xs + (size_t)cm[u] * xs_stride + (size_t)cc[u] * 2) =
            fv2_norm_pack_w(w[u % PT], x[u], fv2_inv_rms(wsum, cm[u], g.K, eps));
    }
}
template <int PT>
__device__ __forceinline__ void fv2_stage_norm_one_pass(const FusedParams& p, const Fv2Gemm& g, unsigned char* xs,
                                                        int xs_stride) {
    constexpr int P = FV2_ONE_PASS_PIECES, R = P / PT;
    float (*wsum)[FV2_MAX_ROWS] = fv2_wsum;
    const float eps = p.eps;
    float x[P][8];
    int cm[P], cc[P];
    bool live[P];
    fv2_norm_pieces<P, PT>(g, 0, cm, cc, live);
    fv2_norm_load<P>(g, cm, cc, live, x);
    float w[PT][8];
    fv2_norm_weights<PT>(g, w);
    float ss[R];
#pragma unroll
    for (int m = 0; m < R; ++m) {
        ss[m] = 0.0f;
#pragma unroll
        for (int j = 0; j < PT; ++j) {
            if (live[m * PT + j]) ss[m] = __fadd_rn(ss[m], fv2_piece_ss(x[m * PT + j]));
        }
    }
    fv2_warp_ss(ss, g.M, wsum);
    fv2_sync();
    fv2_norm_store<P, PT>(g, cm, cc, live, w, x, wsum, eps, xs, xs_stride);
}

// The grouped staging (session 34's opg1): beyond one pass (more than FV2_ONE_PASS_PIECES pieces, at most
// two per row), the rows in groups of FV2_ONE_PASS_PIECES / (pieces per row): a group's pieces loaded
// together, warp-summed into its rows of wsum, one barrier, then normalised from the registers (the same
// sums and expressions as the one pass and as fv2_row_rms + fv2_stage_norm). The one pass above stays the
// path of <= 4 pieces (opg's single loop for every row count cost 0.6-0.7% at 1 x 1 on an H100, session 33).
__device__ __forceinline__ bool fv2_groups(const Fv2Gemm& g) {
    return g.src != FV2_SRC_BF16 && g.K % 8 == 0 && fv2_pieces_per_row(g) <= 2 && g.M <= FV2_MAX_ROWS;
}
template <int PT>
__device__ __forceinline__ void fv2_stage_norm_groups(const FusedParams& p, const Fv2Gemm& g, unsigned char* xs,
                                                        int xs_stride) {
    constexpr int P = FV2_ONE_PASS_PIECES, R = P / PT;
    float (*wsum)[FV2_MAX_ROWS] = fv2_wsum;
    const float eps = p.eps;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    float w[PT][8];
    fv2_norm_weights<PT>(g, w);
    // Each group writes its own rows of wsum, so no barrier is needed before the next group's writes.
    for (int m0 = 0; m0 < g.M; m0 += R) {
        float x[P][8];
        int cm[P], cc[P];
        bool live[P];
        fv2_norm_pieces<P, PT>(g, m0, cm, cc, live);
        fv2_norm_load<P>(g, cm, cc, live, x);
#pragma unroll
        for (int m = 0; m < R; ++m) {
            float ss = 0.0f;
#pragma unroll
            for (int j = 0; j < PT; ++j) {
                if (live[m * PT + j]) ss = __fadd_rn(ss, fv2_piece_ss(x[m * PT + j]));
            }
            // fv2_warp_ss's butterfly, into the group's row of wsum.
            if (m0 + m < g.M) {
                for (int o = 16; o > 0; o >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, o));
                if (lane == 0) wsum[warp][m0 + m] = ss;
            }
        }
        fv2_sync();
        fv2_norm_store<P, PT>(g, cm, cc, live, w, x, wsum, eps, xs, xs_stride);
    }
}

// Stages norm-source columns [k0, k0 + width) of the M rows as bf16 into xs (row stride xs_stride),
// FV2_STAGE_BATCH pieces at a time, each batch's loads in flight together.
__device__ __forceinline__ void fv2_stage_norm(const Fv2Gemm& g, const float* inv_rms, int k0, int width,
                                               unsigned char* xs, int xs_stride) {
    constexpr int P = FV2_STAGE_BATCH;
    const int per_row = width / 8;  // 8-column pieces
    const int pieces = g.M * per_row;
    for (int base = threadIdx.x; base < pieces; base += P * FUSED_THREADS) {
        int cm[P], cc[P];
        bool live[P];
#pragma unroll
        for (int u = 0; u < P; ++u) {
            const int i = base + u * FUSED_THREADS;
            live[u] = i < pieces;
            cm[u] = live[u] ? i / per_row : 0;
            cc[u] = live[u] ? k0 + (i % per_row) * 8 : 0;
        }
        float x[P][8];
        fv2_norm_load<P>(g, cm, cc, live, x);
#pragma unroll
        for (int u = 0; u < P; ++u) {
            if (!live[u]) continue;
            float w[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) w[e] = __ldg(g.norm_w + cc[u] + e);
            *reinterpret_cast<uint4*>(xs + (size_t)cm[u] * xs_stride + (size_t)(cc[u] - k0) * 2) =
                fv2_norm_pack_w(w, x[u], inv_rms[cm[u]]);
        }
    }
}

// Stages columns [k0, k0 + width) of the M rows of a bf16 source (FV2_SRC_BF16: x16, written earlier in
// this kernel) into xs, 4 pieces at a time (the path for K % 8 != 0, where fv2_stage_async cannot copy).
__device__ void fv2_stage_bf16(const Fv2Gemm& g, int k0, int width, unsigned char* xs, int xs_stride) {
    const int per_row = width / 8;
    const int pieces = g.M * per_row;
    for (int base = threadIdx.x; base < pieces; base += 4 * FUSED_THREADS) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = base + u * FUSED_THREADS;
            v[u] = make_uint4(0u, 0u, 0u, 0u);
            if (i < pieces) v[u] = fv2_ldcg16(g.x16 + (size_t)(i / per_row) * g.K + k0 + (i % per_row) * 8);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = base + u * FUSED_THREADS;
            if (i < pieces) *reinterpret_cast<uint4*>(xs + (size_t)(i / per_row) * xs_stride + (i % per_row) * 16) = v[u];
        }
    }
}

// Stages columns [k0, k0 + width) of the M rows of a bf16 source (FV2_SRC_BF16) into xs by cp.async (a
// plain copy: every piece in flight at once, no registers); commits one group, the caller waits.
__device__ void fv2_stage_async(const Fv2Gemm& g, int k0, int width, unsigned char* xs, int xs_stride) {
    const int per_row = width / 8;
    for (int i = threadIdx.x; i < g.M * per_row; i += FUSED_THREADS) {
        const int m = i / per_row, c = i % per_row;
        fused_cp_async_16(xs + (size_t)m * xs_stride + c * 16, g.x16 + (size_t)m * g.K + k0 + c * 8);
    }
    fused_cp_async_commit();
}

// The tile epilogue: 8-warp reduction in warp order through `red`, then the write. `base`: this thread's
// output element's value before the stage (FV2_OUT_ACC), loaded by fv2_gemm before the tile's MMAs.
// `red` alternates between two buffers from tile to tile, so no barrier ends the epilogue: a buffer is
// written again two tiles later, after the barrier that follows the next tile's MMAs.
template <int NT>
__device__ __forceinline__ void fv2_tile_out(const FusedParams& p, const Fv2Gemm& g, float (&c)[NT][4], int tile,
                                             float* red, const FusedTaps* taps, bool tapped, int layer, float base) {
    constexpr int MR = 8 * NT;  // activation rows per tile pass
    float(*r3)[MR][16] = reinterpret_cast<float(*)[MR][16]>(red);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        r3[warp][j * 8 + 2 * t][gq] = c[j][0];
        r3[warp][j * 8 + 2 * t + 1][gq] = c[j][1];
        r3[warp][j * 8 + 2 * t][gq + 8] = c[j][2];
        r3[warp][j * 8 + 2 * t + 1][gq + 8] = c[j][3];
    }
    fv2_sync();
    if (g.out_mode == FV2_OUT_SWIGLU) {
        const int ffn = g.N / 2;
        for (int idx = threadIdx.x; idx < MR * 8; idx += FUSED_THREADS) {
            const int m = idx / 8, r = idx % 8;
            const int f = tile * 8 + r;
            if (m >= g.M || f >= ffn) continue;
            float gs = 0.0f, us = 0.0f;
#pragma unroll
            for (int w = 0; w < 8; ++w) {
                gs += r3[w][m][r];
                us += r3[w][m][r + 8];
            }
            g.act[(size_t)m * ffn + f] = f32_to_bf16(gs / (1.0f + expf(-gs)) * us);
        }
    } else {
        for (int idx = threadIdx.x; idx < MR * 16; idx += FUSED_THREADS) {
            const int m = idx / 16, r = idx % 16;
            const int n = tile * 16 + r;
            if (m >= g.M || n >= g.N) continue;
            float sum = 0.0f;
#pragma unroll
            for (int w = 0; w < 8; ++w) sum += r3[w][m][r];
            float* dst = g.out + (size_t)m * g.N + n;
            float v = sum;
            if (g.out_mode == FV2_OUT_ACC) {
                v = base + sum;
                if (g.bias) v += g.bias[n];  // the standard step: (x + s) + b
                if (tapped) {
                    for (int sl = 0; sl < taps->count; ++sl) {
                        if (((taps->layers >> (8 * sl)) & 0xffull) != (unsigned)layer) continue;
                        taps->buf[(size_t)sl * taps->stride + (size_t)m * g.N + n] = v;
                    }
                }
            }
            *dst = v;
        }
    }
}

// One GEMM stage: this CTA's tile range of the stage's matrix, weights from the ring.
template <int NT>
__device__ __noinline__ void fv2_gemm(const FusedParams& p, Fv2Ring& ring, const Fv2Gemm& g_frame,
                                      unsigned char* scratch, int scratch_bytes, const FusedTaps* taps, int layer,
                                      int t0, int t1) {
    // The stage's descriptor copied into registers once: through the reference each use of a field was a
    // local-memory load (the caller's stack frame), ~270 LDL in this function's SASS, re-issued because
    // the compiler cannot prove the stores in between do not alias it. With 228 KB of the SM's 256 KB as
    // shared memory, the L1 that caches local memory is ~28 KB, less than the 256 consumer threads' frames,
    // so those loads may go to L2 and sit on the stage's dependent chain. With the one-pass staging's
    // partials in registers too: -10 to -11% at every v2 shape on an H100 (session 31, NOTES v0.35).
    const Fv2Gemm g = g_frame;
    __shared__ float inv_rms[FV2_MAX_ROWS];
    bool tapped = false;
    if (taps) {
        for (int sl = 0; sl < taps->count; ++sl) tapped |= ((taps->layers >> (8 * sl)) & 0xffull) == (unsigned)layer;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3;
    // The ring's slots addressed from the dynamic shared array itself: through the Fv2Ring pointer the
    // compiler cannot tell the address space and emits generic loads (LD.E) for the weight fragments,
    // whose results the MMAs then wait for on the long scoreboard (Nsight Compute, NOTES v0.16).
    extern __shared__ __align__(128) unsigned char fused_dyn[];
    const unsigned char* slots = fused_dyn + (ring.slots - fused_dyn);
    const int M = g.M;  // a register in the MMA loop (g lives in the caller's local memory)
    // The ring cursor in registers for the stage (ring, too, lives in the caller's local memory); written
    // back at the end.
    const int stages = ring.stages;
    int slot = ring.slot;
    unsigned int parity = ring.parity;
    float* red = reinterpret_cast<float*>(scratch);  // two buffers (fv2_tile_out)
    unsigned char* xs = scratch + 2 * fv2_red_bytes(NT);
    const int xs_cap = scratch_bytes - 2 * fv2_red_bytes(NT);
    const int kchunks = (g.K + FV2_CHUNK_K - 1) / FV2_CHUNK_K;
    // The whole K staged once when it fits (every stage at one row), else one chunk at a time.
    const bool whole = g.M * (g.K * 2 + FV2_XS_PAD) <= xs_cap;
    const int span = whole ? g.K : FV2_CHUNK_K;
    const int xs_stride = span * 2 + FV2_XS_PAD;
    const int w_stride = g.K <= FV2_CHUNK_K ? g.K * 2 : FV2_CHUNK_K * 2;  // bytes between weight rows in a slot
    long long ts = fused_clock();
    // A bf16 source staged per chunk gets two chunk buffers when they fit: chunk kc + 1's copies fly
    // during chunk kc's MMAs.
    const bool async_src = g.src == FV2_SRC_BF16 && g.K % 8 == 0;
    const bool two_bufs = !whole && async_src && 2 * g.M * xs_stride <= xs_cap;
    if (whole && fv2_one_pass(g)) {
        if (fv2_pieces_per_row(g) == 1) {
            fv2_stage_norm_one_pass<1>(p, g, xs, xs_stride);
        } else {
            fv2_stage_norm_one_pass<2>(p, g, xs, xs_stride);
        }
        fv2_sync();
    } else if (whole && fv2_groups(g)) {
        if (fv2_pieces_per_row(g) == 1) {
            fv2_stage_norm_groups<1>(p, g, xs, xs_stride);
        } else {
            fv2_stage_norm_groups<2>(p, g, xs, xs_stride);
        }
        fv2_sync();
    } else if (whole && async_src) {
        fv2_stage_async(g, 0, g.K, xs, xs_stride);
        fused_cp_async_wait(0);
        fv2_sync();
    } else {
        if (g.src != FV2_SRC_BF16) fv2_row_rms(p, g, inv_rms);
        if (whole) {
            if (g.src == FV2_SRC_BF16) {
                fv2_stage_bf16(g, 0, g.K, xs, xs_stride);
            } else {
                fv2_stage_norm(g, inv_rms, 0, g.K, xs, xs_stride);
            }
            fv2_sync();
        }
    }
    if (g.src != FV2_SRC_BF16) fused_prof_add(12, ts);  // the norm stages' share of slot 22
    fused_prof_add(22, ts);
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int tile = t0; tile < t1; ++tile) {
        float c[NT][4];
#pragma unroll
        for (int i = 0; i < NT; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.0f;
        // The residual element this thread's epilogue adds to (one per thread: 16 x 8 NT <= 256), loaded
        // now so its L2 round trip overlaps the MMAs. Nothing else writes it during the stage (one owner;
        // its previous writers are stages this one waited for).
        float base = 0.0f;
        if (g.out_mode == FV2_OUT_ACC && threadIdx.x < 8 * NT * 16) {
            const int m = threadIdx.x / 16, n = tile * 16 + threadIdx.x % 16;
            if (m < g.M && n < g.N) {
                base = g.init_embed ? bf16_to_f32(g.init_embed[(size_t)p.tokens[m] * g.N + n])
                                    : __ldcg(g.out + (size_t)m * g.N + n);
            }
        }
        for (int kc = 0; kc < kchunks; ++kc) {
            const int k0 = kc * FV2_CHUNK_K;
            const int width = min(FV2_CHUNK_K, g.K - k0);
            const unsigned char* xs_k = xs;
            if (two_bufs) {
                ts = fused_clock();
                if (kc == 0) fv2_stage_async(g, 0, width, xs, xs_stride);
                if (kc + 1 < kchunks) {
                    const int k1 = k0 + FV2_CHUNK_K;
                    fv2_stage_async(g, k1, min(FV2_CHUNK_K, g.K - k1), xs + (size_t)((kc + 1) & 1) * g.M * xs_stride,
                                    xs_stride);
                    fused_cp_async_wait(1);
                } else {
                    fused_cp_async_wait(0);
                }
                fv2_sync();
                fused_prof_add(22, ts);
                xs_k = xs + (size_t)(kc & 1) * g.M * xs_stride;
            } else if (!whole) {
                ts = fused_clock();
                if (g.src == FV2_SRC_BF16) {
                    fv2_stage_bf16(g, k0, width, xs, xs_stride);
                } else {
                    fv2_stage_norm(g, inv_rms, k0, width, xs, xs_stride);
                }
                fv2_sync();
                if (g.src != FV2_SRC_BF16) fused_prof_add(12, ts);
                fused_prof_add(22, ts);
            }
            const int xk0 = whole ? k0 : 0;
            const int s0 = slot;
            ts = fused_clock();
#pragma unroll
            for (int h = 0; h < FV2_PARTS; ++h) fused_mbar_wait(&ring.bars[FV2_PARTS * s0 + h], parity);
            fused_prof_add(20, ts);
            ts = fused_clock();
            const unsigned char* st0 = slots + (size_t)s0 * FV2_SLOT_BYTES;
            for (int sc = warp; sc * 32 < width; sc += 8) {
                const int kl = sc * 32 + t * 8;
                const uint4 a_lo = *reinterpret_cast<const uint4*>(st0 + gq * w_stride + kl * 2);
                const uint4 a_hi = *reinterpret_cast<const uint4*>(st0 + (gq + 8) * w_stride + kl * 2);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const int m = nt * 8 + gq;
                    const uint4 b =
                        m < M ? *reinterpret_cast<const uint4*>(xs_k + (size_t)m * xs_stride + (xk0 + kl) * 2) : zero;
                    mma_bf16_16816(c[nt], a_lo.x, a_hi.x, a_lo.y, a_hi.y, b.x, b.y);
                    mma_bf16_16816(c[nt], a_lo.z, a_hi.z, a_lo.w, a_hi.w, b.z, b.w);
                }
            }
            fv2_sync();  // every warp is done with the slot (and with xs when staged per chunk)
            fused_prof_add(0, ts);
            if (threadIdx.x == 0) fv2_mbar_arrive(&ring.empty[s0]);
            if (++slot == stages) {
                slot = 0;
                parity ^= 1u;
            }
        }
        ts = fused_clock();
        fv2_tile_out<NT>(p, g, c, tile, red + ((tile - t0) & 1) * (fv2_red_bytes(NT) / 4), taps, tapped, layer,
                         base);
        fused_prof_add(21, ts);
    }
    ring.slot = slot;
    ring.parity = parity;
}

// Attention scratch (floats, from the start of the scratch region) for a sequence of `rows` rows:
// K and V tiles [2][FV2_ATT_KEYS][hd + 4] | q [rows G][hd] | acc [rows G][hd] | m, l [rows G] (padded to
// 4 floats: G may be odd) | new k, v [2][rows][hd] | cache slots [FV2_ATT_KEYS] (ints). Host: gpu_fused.rs v2_plan.
__device__ __forceinline__ int fv2_kv_stride(int hd) { return hd + 4; }

// The item's tile of keys [kt, kt + nk) into kv_s: cached keys (position < pos0) by cp.async from the
// cache (slots through the block table), this step's keys from nk_s / nv_s. Commits one group.
__device__ void fv2_load_keys(const FusedParams& p, const FusedLayer& L, int table_row, int pos0, int kt, int nk,
                              int kvh, float* kv_s, const float* nkv_s, int rows, int* slot_s) {
    const int hd = p.head_dim, ks = fv2_kv_stride(hd), kv_dim = p.n_kv_heads * hd;
    const int* table = p.block_tables + (size_t)table_row * p.max_blocks;
    if (threadIdx.x < nk) {
        const int kp = kt + threadIdx.x;
        slot_s[threadIdx.x] = kp < pos0 ? table[kp / p.block_size] * p.block_size + kp % p.block_size : -1;
    }
    fv2_sync();
    const int per_key = hd / 4;  // 16-byte pieces per key vector
    for (int i = threadIdx.x; i < 2 * nk * per_key; i += FUSED_THREADS) {
        const int which = i / (nk * per_key), rem = i % (nk * per_key);
        const int j = rem / per_key, c = (rem % per_key) * 4;
        float* dst = kv_s + ((size_t)which * FV2_ATT_KEYS + j) * ks + c;
        const int slot = slot_s[j];
        if (slot >= 0) {
            const float* src = (which ? L.v_cache : L.k_cache) + (size_t)slot * kv_dim + kvh * hd + c;
            fused_cp_async_16(dst, src);
        } else {
            const int r = kt + j - pos0;  // this step's key: row r of the sequence
            *reinterpret_cast<float4*>(dst) = *reinterpret_cast<const float4*>(nkv_s + ((size_t)which * rows + r) * hd + c);
        }
    }
    fused_cp_async_commit();
}

// One lane's share of a head vector (hd / 32 elements: lane + 32 i) after bias, head norm and RoPE.
// `y` = head index in the qkv row (q heads, k heads, v heads); RoPE for q and k heads, the norm for q/k
// heads when the model has it. hd % 64 == 0: the RoPE pairs (d, d + hd/2) sit in one lane; hd == 32: in
// lanes d and d + 16, exchanged by a shuffle (the host builds v2 for hd in {32, 64, 128, 192, 256}).
// PER > 0: PER = hd / 32 known at compile time, so the loops unroll and v stays in registers. With a
// run-time count (PER 0, `per_rt`) v and RoPE's v[i + half] are indexed at run time and live in local
// memory, whose L1 (~28 KB beside the kernel's 228 KB of shared memory) the consumer threads' frames
// overflow: each head vector's loads, norm and rotation then wait on local-memory round trips (at 1 x 8, six
// vectors a warp, the head vectors took 6.8 us that way and 4.4 us in registers: session 31's timeline,
// H100). The same operations in the same order either way, so the same bits.
template <int PER>
__device__ __forceinline__ void fv2_head(const FusedParams& p, const FusedLayer& L, int row, int y, int pos,
                                         float* v, int per_rt) {
    const int per = PER > 0 ? PER : per_rt;
    const int hd = per * 32, lane = threadIdx.x & 31;
    const int width = (p.n_heads + 2 * p.n_kv_heads) * hd;
    const float* src = p.qkv + (size_t)row * width + (size_t)y * hd;
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < per; ++i) {
        float x = __ldcg(src + lane + 32 * i);
        if (L.bqkv) x += L.bqkv[y * hd + lane + 32 * i];
        v[i] = x;
        ss += x * x;
    }
    if (y >= p.n_heads + p.n_kv_heads) return;  // v head: bias only
    if (L.q_norm) {
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float inv = 1.0f / sqrtf(ss / (float)hd + p.eps);
        const float* w = y < p.n_heads ? L.q_norm : L.k_norm;
#pragma unroll
        for (int i = 0; i < per; ++i) v[i] = w[lane + 32 * i] * (v[i] * inv);
    }
    if (per == 1) {
        const float other = __shfl_xor_sync(0xffffffffu, v[0], 16);
        float ra, rb;
        if (lane < 16) {
            rope_rotate(&v[0], &other, pos, p.inv_freq[lane], &ra, &rb);
            v[0] = ra;
        } else {
            rope_rotate(&other, &v[0], pos, p.inv_freq[lane - 16], &ra, &rb);
            v[0] = rb;
        }
        return;
    }
    const int half = per / 2;
#pragma unroll
    for (int i = 0; i < half; ++i) {
        float ra, rb;
        rope_rotate(&v[i], &v[i + half], pos, p.inv_freq[lane + 32 * i], &ra, &rb);
        v[i] = ra;
        v[i + half] = rb;
    }
}

// rope_rotate (decoder.cu) in two halves, the angle's sincos once per row for all of the row's q heads and
// its k head: the same double sincos and casts, and the same float expressions, so the same bits.
__device__ __forceinline__ void fv2_rope_angle(int position, double inv_freq, float* fc, float* fs) {
    double s, c;
    sincos((double)position * inv_freq, &s, &c);
    *fc = (float)c;
    *fs = (float)s;
}
__device__ __forceinline__ void fv2_rope_apply(float xa, float xb, float c, float s, float* ra, float* rb) {
    *ra = xa * c - xb * s;
    *rb = xb * c + xa * s;
}

// fv2_stage_heads for a sequence of >= 8 rows at head_dim 64: warp w takes whole rows (w, w + 8, ...), each
// row's G q heads, k head and v head. The row's RoPE angles are computed once, not per
// vector (each a double sincos: at 1 x 8 a warp ran six vectors one after another, 4.4 us on an H100,
// session 31's timeline). Its vectors' loads are issued FV2_HEAD_BATCH at a time. Each vector's arithmetic
// is fv2_head's, in its order.
#ifndef FV2_HEAD_BATCH
#define FV2_HEAD_BATCH 3
#endif
__device__ __forceinline__ void fv2_stage_heads_rows(const FusedParams& p, const FusedLayer& L, int r0, int rows,
                                                     int G, int kvh, int pos0, int kb_item, int ke_item,
                                                     float* q_s, float* nkv_s, int warp, int lane) {
    constexpr int PER = 2, HALF = PER / 2, NB = FV2_HEAD_BATCH;  // a lane's 2 values, one in each half
    const int hd = PER * 32, kv_dim = p.n_kv_heads * hd;
    const int width = (p.n_heads + 2 * p.n_kv_heads) * hd;
    const int nvec = G + 2;  // the row's q heads, then its k head, then its v head
    for (int r = warp; r < rows; r += 8) {
        const int row = r0 + r;
        const int pos = p.positions[row];
        float fc[HALF], fs[HALF];
#pragma unroll
        for (int i = 0; i < HALF; ++i) {
            fv2_rope_angle(pos, p.inv_freq[lane + 32 * i], &fc[i], &fs[i]);
        }
        const float* src_row = p.qkv + (size_t)row * width;
        for (int j0 = 0; j0 < nvec; j0 += NB) {
            float v[NB][PER];
            int yb[NB];
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                const int j = j0 + b;
                yb[b] = j < G ? kvh * G + j : (j == G ? p.n_heads + kvh : p.n_heads + p.n_kv_heads + kvh);
                if (j < nvec) {
#pragma unroll
                    for (int i = 0; i < PER; ++i) v[b][i] = __ldcg(src_row + (size_t)yb[b] * hd + lane + 32 * i);
                }
            }
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                const int j = j0 + b, y = yb[b];
                if (j >= nvec) continue;
                // fv2_head's bias, sum of squares, head norm and rotation.
                float ss = 0.0f;
#pragma unroll
                for (int i = 0; i < PER; ++i) {
                    float x = v[b][i];
                    if (L.bqkv) x += L.bqkv[y * hd + lane + 32 * i];
                    v[b][i] = x;
                    ss += x * x;
                }
                if (j <= G) {  // q and k heads: norm, RoPE
                    if (L.q_norm) {
                        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
                        const float inv = 1.0f / sqrtf(ss / (float)hd + p.eps);
                        const float* w = y < p.n_heads ? L.q_norm : L.k_norm;
#pragma unroll
                        for (int i = 0; i < PER; ++i) v[b][i] = w[lane + 32 * i] * (v[b][i] * inv);
                    }
#pragma unroll
                    for (int i = 0; i < HALF; ++i) {
                        float ra, rb;
                        fv2_rope_apply(v[b][i], v[b][i + HALF], fc[i], fs[i], &ra, &rb);
                        v[b][i] = ra;
                        v[b][i + HALF] = rb;
                    }
                }
                if (j < G) {
#pragma unroll
                    for (int i = 0; i < PER; ++i) q_s[(r * G + j) * hd + lane + 32 * i] = v[b][i] * p.scale;
                } else {
                    const int which = j == G ? 0 : 1;
#pragma unroll
                    for (int i = 0; i < PER; ++i) nkv_s[(which * rows + r) * hd + lane + 32 * i] = v[b][i];
                    const int kp = pos0 + r;
                    if (kp >= kb_item && kp < ke_item) {
                        float* dst = (which ? L.v_cache : L.k_cache) + (size_t)p.slots[row] * kv_dim + kvh * hd;
#pragma unroll
                        for (int i = 0; i < PER; ++i) dst[lane + 32 * i] = v[b][i];
                    }
                }
            }
        }
    }
}

// The attention item's head vectors: q of the G heads of every row (pre-scaled) into q_s, the new k and v of
// the sequence into nkv_s and, for the positions of the item's key range, the KV cache. One warp per vector.
// PER > 0: head_dim = 32 PER, v in registers; PER 0: any head_dim (fv2_head).
template <int PER>
__device__ __forceinline__ void fv2_stage_heads(const FusedParams& p, const FusedLayer& L, int r0, int rows, int G,
                                                int kvh, int hd, int per, int pos0, int kb_item, int ke_item,
                                                float* q_s, float* nkv_s, int warp, int lane) {
    // head_dim 64 only: instantiated for head_dim 32 and 128 too, the rows path raised the kernel's spills
    // from 44/60 to 64/104 bytes (ptxas --resources), which cost elsewhere (stg8, NOTES v0.36).
    if (PER == 2 && rows >= 8) {
        fv2_stage_heads_rows(p, L, r0, rows, G, kvh, pos0, kb_item, ke_item, q_s, nkv_s, warp, lane);
        return;
    }
    constexpr int VN = PER > 0 ? PER : 8;
    const int QV = rows * G, kv_dim = p.n_kv_heads * hd;
    float v[VN];
    for (int vec = warp; vec < QV + 2 * rows; vec += 8) {
        int row, y, out_q = -1;
        if (vec < QV) {
            row = r0 + vec / G;
            y = kvh * G + vec % G;
            out_q = vec;
        } else {
            const int r = (vec - QV) % rows;
            row = r0 + r;
            y = p.n_heads + (vec - QV < rows ? 0 : p.n_kv_heads) + kvh;
        }
        fv2_head<PER>(p, L, row, y, p.positions[row], v, per);
        const int n = PER > 0 ? PER : per;
        if (out_q >= 0) {
#pragma unroll
            for (int i = 0; i < VN; ++i) {
                if (i < n) q_s[out_q * hd + lane + 32 * i] = v[i] * p.scale;
            }
        } else {
            const int which = vec - QV < rows ? 0 : 1, r = (vec - QV) % rows;
#pragma unroll
            for (int i = 0; i < VN; ++i) {
                if (i < n) nkv_s[(which * rows + r) * hd + lane + 32 * i] = v[i];
            }
            // Append to the cache the positions of this item's key range (one writer per position).
            const int kp = pos0 + r;
            if (kp >= kb_item && kp < ke_item) {
                float* dst = (which ? L.v_cache : L.k_cache) + (size_t)p.slots[row] * kv_dim + kvh * hd;
#pragma unroll
                for (int i = 0; i < VN; ++i) {
                    if (i < n) dst[lane + 32 * i] = v[i];
                }
            }
        }
    }
}

// Warp per query vector, lane per key: scores, online softmax, then lane per output dimension. A
// warp takes FV2_ATT_VB of its vectors (qv, qv + 8, ...) at once: each key row and each value is
// read from shared memory once for all of them, and their chains of dependent loads, shuffles and
// FMAs interleave (at 1 x 8 a warp has 4 vectors, whose keys and softmax took 16 us per item one
// after another: NOTES v0.16). Each vector's arithmetic is the expression, and the order, of the
// one-vector loop, whatever VB is.
// VB is FV2_ATT_VB when a warp has several vectors (QV > 8: several rows per sequence), else 1: with one
// vector per warp the other VB - 1 would be dead work (attn_vb was 2.5-3.5% slower at 4 x 1 and 8 x 1,
// NOTES v0.17).
template <int VB, int PER>
__device__ __forceinline__ void fv2_att_keys_tile(const float* q_s, const float* kv_s, float* acc_s, float* m_s,
                                                  float* l_s, int QV, int G, int hd, int ks, int per, int nk,
                                                  int kt, int pos0, int warp, int lane) {
    const float* vs = kv_s + (size_t)FV2_ATT_KEYS * ks;
    const float* kr = kv_s + (size_t)lane * ks;
    for (int qv0 = warp; qv0 < QV; qv0 += 8 * VB) {
        bool live[VB], valid[VB], skip[VB];
        float d[VB], sc[VB], mt[VB], m_old[VB], m_new[VB];
        float e[VB], sum[VB], f[VB];
        const float* qr[VB];
#pragma unroll
        for (int u = 0; u < VB; ++u) {
            const int qv = qv0 + 8 * u;
            live[u] = qv < QV;  // uniform over the warp
            valid[u] = live[u] && lane < nk && kt + lane <= pos0 + qv / G;
            qr[u] = q_s + (size_t)(live[u] ? qv : qv0) * hd;  // a dead vector reads a live one's row
            d[u] = 0.0f;
        }
        // Lanes past the tile's keys read stale rows of kv_s (inside the buffer); their scores are
        // discarded below, as in the one-vector loop, which did not compute them.
        for (int c = 0; c < hd; c += 4) {
            const float4 b = *reinterpret_cast<const float4*>(kr + c);
#pragma unroll
            for (int u = 0; u < VB; ++u) {
                const float4 a = *reinterpret_cast<const float4*>(qr[u] + c);
                d[u] += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
            }
        }
#pragma unroll
        for (int u = 0; u < VB; ++u) {
            sc[u] = valid[u] ? d[u] : SPECULA_NEG_INF;
            mt[u] = sc[u];
        }
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
            for (int u = 0; u < VB; ++u) mt[u] = fmaxf(mt[u], __shfl_xor_sync(0xffffffffu, mt[u], o));
        }
#pragma unroll
        for (int u = 0; u < VB; ++u) {
            const int qv = live[u] ? qv0 + 8 * u : qv0;
            m_old[u] = m_s[qv];
            m_new[u] = fmaxf(m_old[u], mt[u]);
            // No key of this tile is visible to the row (uniform), or no such vector: no update.
            skip[u] = !live[u] || m_new[u] == SPECULA_NEG_INF;
            e[u] = !skip[u] && valid[u] ? expf(sc[u] - m_new[u]) : 0.0f;
            sum[u] = e[u];
        }
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
            for (int u = 0; u < VB; ++u) sum[u] += __shfl_xor_sync(0xffffffffu, sum[u], o);
        }
        float a[VB][PER];
#pragma unroll
        for (int u = 0; u < VB; ++u) {
            f[u] = skip[u] || m_old[u] == SPECULA_NEG_INF ? 0.0f : expf(m_old[u] - m_new[u]);
            const int qv = live[u] ? qv0 + 8 * u : qv0;
#pragma unroll
            for (int i = 0; i < PER; ++i) {  // per <= PER; unrolled, so a stays in registers
                if (i < per) a[u][i] = acc_s[qv * hd + lane + 32 * i] * f[u];
            }
        }
        for (int j = 0; j < nk; ++j) {
            float pj[VB];
#pragma unroll
            for (int u = 0; u < VB; ++u) pj[u] = __shfl_sync(0xffffffffu, e[u], j);
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                if (i >= per) break;
                const float vji = vs[(size_t)j * ks + lane + 32 * i];
#pragma unroll
                for (int u = 0; u < VB; ++u) a[u][i] += pj[u] * vji;
            }
        }
#pragma unroll
        for (int u = 0; u < VB; ++u) {
            if (skip[u]) continue;
            const int qv = qv0 + 8 * u;
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                if (i < per) acc_s[qv * hd + lane + 32 * i] = a[u][i];
            }
        }
        __syncwarp();
        if (lane == 0) {
#pragma unroll
            for (int u = 0; u < VB; ++u) {
                if (skip[u]) continue;
                const int qv = qv0 + 8 * u;
                m_s[qv] = m_new[u];
                l_s[qv] = l_s[qv] * f[u] + sum[u];
            }
        }
    }
}

// One attention item: sequence `s`, KV head `kvh`, key split `split`. Returns after the item's output
// (one split) or partial (+ the combine when it is the last split to arrive) is written.
__device__ __noinline__ void fv2_attention_item(const FusedParams& p, const FusedLayer& L, const Fv2Seqs& sq,
                                                int s, int kvh, int split, int nsplit, float* smem, bool prefetched,
                                                const unsigned long long* q_ctr, unsigned long long target,
                                                bool* waited) {
    __shared__ int last_s;
    const int hd = p.head_dim, ks = fv2_kv_stride(hd), G = p.n_heads / p.n_kv_heads, per = hd / 32;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int rows = sq.rows[s], r0 = sq.first[s], pos0 = sq.pos0[s];
    const int keys = pos0 + rows, splits = sq.splits[s];
    const int per_split = (keys + splits - 1) / splits;
    // This item's key range: splits split .. split + nsplit - 1.
    const int kb_item = split * per_split, ke_item = min(keys, (split + nsplit) * per_split);
    const int QV = rows * G;
    const int table_row = p.row_table[r0];
    float* kv_s = smem;
    float* q_s = kv_s + 2 * FV2_ATT_KEYS * ks;
    float* acc_s = q_s + QV * hd;
    float* m_s = acc_s + QV * hd;
    float* l_s = m_s + QV;
    float* nkv_s = m_s + ((2 * QV + 3) & ~3);  // 16-byte aligned (float4 loads) for odd QV
    int* slot_s = reinterpret_cast<int*>(nkv_s + 2 * rows * hd);
    // The first tile's cached keys before the wait (they do not depend on this step).
    const int first_nk = min(FV2_ATT_KEYS, min(keys, kb_item + per_split) - kb_item);
    const bool first_cached_only = kb_item + first_nk <= pos0;
    if (!prefetched && first_cached_only) {
        fv2_load_keys(p, L, table_row, pos0, kb_item, first_nk, kvh, kv_s, nkv_s, rows, slot_s);
    }
    if (!*waited) {
        const long long tw = fused_clock();
        fv2_wait(q_ctr, target);
        fused_prof_add(13, tw);
        *waited = true;
    }
    long long ta = fused_clock();
    // q of the G heads of every row (pre-scaled), the new k and v of the sequence: one warp per vector,
    // with v in registers at head_dim 32, 64 and 128 (fv2_stage_heads).
    switch (per) {
        case 1: fv2_stage_heads<1>(p, L, r0, rows, G, kvh, hd, per, pos0, kb_item, ke_item, q_s, nkv_s, warp, lane); break;
        case 2: fv2_stage_heads<2>(p, L, r0, rows, G, kvh, hd, per, pos0, kb_item, ke_item, q_s, nkv_s, warp, lane); break;
        case 4: fv2_stage_heads<4>(p, L, r0, rows, G, kvh, hd, per, pos0, kb_item, ke_item, q_s, nkv_s, warp, lane); break;
        default: fv2_stage_heads<0>(p, L, r0, rows, G, kvh, hd, per, pos0, kb_item, ke_item, q_s, nkv_s, warp, lane); break;
    }
    const int pstride = hd + 2;  // a partial: hd outputs, m, l
    for (int sp = split; sp < split + nsplit; ++sp) {
        const int kb = sp * per_split, ke = min(keys, kb + per_split);
        if (sp > split) fv2_sync();  // the previous split's partials are written (they read acc_s, m_s, l_s)
        for (int i = tid; i < QV; i += FUSED_THREADS) {
            m_s[i] = SPECULA_NEG_INF;
            l_s[i] = 0.0f;
        }
        for (int i = tid; i < QV * hd; i += FUSED_THREADS) acc_s[i] = 0.0f;
        fv2_sync();
        fused_prof_add(2, ta);
        ta = fused_clock();
        for (int kt = kb; kt < ke; kt += FV2_ATT_KEYS) {
            const int nk = min(FV2_ATT_KEYS, ke - kt);
            if (!(sp == split && kt == kb && first_cached_only)) fv2_load_keys(p, L, table_row, pos0, kt, nk, kvh, kv_s, nkv_s, rows, slot_s);
            fused_cp_async_wait(0);
            fv2_sync();
            // Warp per query vector, lane per key (fv2_att_keys_tile).
            // Several vectors at once only at head_dim <= 64 (per <= 2), with 2 accumulators a vector: at
            // 8 per vector (any head_dim) the attention item's registers cost the kernel 100/232 bytes
            // of spills against 8/8, and 2-2.5% at one row per sequence (session 26, NOTES v0.30).
            if (QV > 8 && per <= 2) {
                fv2_att_keys_tile<FV2_ATT_VB, 2>(q_s, kv_s, acc_s, m_s, l_s, QV, G, hd, ks, per, nk, kt, pos0, warp, lane);
            } else {
                fv2_att_keys_tile<1, 8>(q_s, kv_s, acc_s, m_s, l_s, QV, G, hd, ks, per, nk, kt, pos0, warp, lane);
            }
            fv2_sync();  // kv_s is reloaded by the next tile; acc/m/l complete
        }
        fused_prof_add(5, ta);
        ta = fused_clock();
        // Output: one split writes act16 directly; several write partials [row][head][split][hd + 2] and the
        // last to arrive combines them in split order.
        if (splits == 1) {
            for (int i = tid; i < QV * hd; i += FUSED_THREADS) {
                const int qv = i / hd, d = i % hd;
                const int row = r0 + qv / G, head = kvh * G + qv % G;
                p.act16[(size_t)row * p.n_heads * hd + (size_t)head * hd + d] = f32_to_bf16(acc_s[i] / l_s[qv]);
            }
            return;
        }
        for (int i = tid; i < QV * pstride; i += FUSED_THREADS) {
            const int qv = i / pstride, d = i % pstride;
            const int row = r0 + qv / G, head = kvh * G + qv % G;
            float* dst = p.attn_partials + (((size_t)row * p.n_heads + head) * FV2_MAX_SPLITS + sp) * pstride;
            dst[d] = d < hd ? acc_s[qv * hd + d] : (d == hd ? m_s[qv] : l_s[qv]);
        }
    }
    __threadfence();
    fv2_sync();
    if (tid == 0) {
        const unsigned int done = atomicAdd(p.attn_counters + (size_t)s * p.n_kv_heads + kvh, (unsigned int)nsplit);
        last_s = done + (unsigned int)nsplit == (unsigned int)splits;
    }
    fv2_sync();
    fused_prof_add(8, ta);
    if (!last_s) return;
    ta = fused_clock();
    __threadfence();
    if (QV * hd <= FUSED_THREADS) {  // one output per thread: its own loads are two rounds already
        const int i = tid;
        if (i < QV * hd) {
            const int qv = i / hd, d = i % hd;
            const int row = r0 + qv / G, head = kvh * G + qv % G;
            const float* all = p.attn_partials + ((size_t)row * p.n_heads + head) * FV2_MAX_SPLITS * pstride;
            float m = SPECULA_NEG_INF;
            for (int sp = 0; sp < splits; ++sp) m = fmaxf(m, __ldcg(all + sp * pstride + hd));
            float l = 0.0f, o = 0.0f;
            for (int sp = 0; sp < splits; ++sp) {
                const float ms = __ldcg(all + sp * pstride + hd);
                const float w = ms == SPECULA_NEG_INF ? 0.0f : expf(ms - m);
                l += __ldcg(all + sp * pstride + hd + 1) * w;
                o += __ldcg(all + sp * pstride + d) * w;
            }
            p.act16[(size_t)row * p.n_heads * hd + (size_t)head * hd + d] = f32_to_bf16(o / l);
        }
        fused_prof_add(10, ta);
        if (tid == 0) p.attn_counters[(size_t)s * p.n_kv_heads + kvh] = 0u;
        return;
    }
    // The combine, in rounds of loads that do not wait for each other: every (query vector, split)'s m
    // and l; then per query vector the max, the weights and the denominator (in split order); then the
    // outputs, four per thread with all their splits' loads in flight (the same sums, in split order).
    // w_s reuses acc_s and the raw l's q_s (QV x splits <= QV x hd: FV2_MAX_SPLITS <= 32 <= hd).
    const size_t head_stride = (size_t)FV2_MAX_SPLITS * pstride;
    float* w_s = acc_s;
    float* lraw_s = q_s;
    for (int i = tid; i < QV * splits; i += FUSED_THREADS) {
        const int qv = i / splits, sp = i % splits;
        const float* part = p.attn_partials + ((size_t)(r0 + qv / G) * p.n_heads + kvh * G + qv % G) * head_stride +
                            (size_t)sp * pstride;
        w_s[i] = __ldcg(part + hd);
        lraw_s[i] = __ldcg(part + hd + 1);
    }
    fv2_sync();
    for (int qv = tid; qv < QV; qv += FUSED_THREADS) {
        float m = SPECULA_NEG_INF;
        for (int sp = 0; sp < splits; ++sp) m = fmaxf(m, w_s[qv * splits + sp]);
        float l = 0.0f;
        for (int sp = 0; sp < splits; ++sp) {
            const float ms = w_s[qv * splits + sp];
            const float w = ms == SPECULA_NEG_INF ? 0.0f : expf(ms - m);
            l += lraw_s[qv * splits + sp] * w;
            w_s[qv * splits + sp] = w;
        }
        l_s[qv] = l;
    }
    fv2_sync();
    for (int i0 = tid; i0 < QV * hd; i0 += 4 * FUSED_THREADS) {
        const float* src[4];
        int qv[4];
        float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = min(i0 + u * FUSED_THREADS, QV * hd - 1);  // past the end: a harmless duplicate
            qv[u] = i / hd;
            src[u] = p.attn_partials +
                     ((size_t)(r0 + qv[u] / G) * p.n_heads + kvh * G + qv[u] % G) * head_stride + i % hd;
        }
#pragma unroll 4
        for (int sp = 0; sp < splits; ++sp) {
            float x[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) x[u] = __ldcg(src[u] + (size_t)sp * pstride);
#pragma unroll
            for (int u = 0; u < 4; ++u) o[u] += x[u] * w_s[qv[u] * splits + sp];
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = i0 + u * FUSED_THREADS;
            if (i >= QV * hd) continue;
            const int row = r0 + qv[u] / G, head = kvh * G + qv[u] % G;
            p.act16[(size_t)row * p.n_heads * hd + (size_t)head * hd + i % hd] = f32_to_bf16(o[u] / l_s[qv[u]]);
        }
    }
    fused_prof_add(10, ta);
    if (tid == 0) p.attn_counters[(size_t)s * p.n_kv_heads + kvh] = 0u;
}

// The (sequence, KV head, first split, split count) of attention item `item` (items are enumerated
// sequence by sequence, then KV head, then group of sq.group consecutive splits).
__device__ __forceinline__ void fv2_attention_coords(const FusedParams& p, const Fv2Seqs& sq, int item, int* s, int* kvh,
                                                     int* split, int* nsplit) {
    int acc = 0;
    const int g = sq.group;
    for (int i = 0; i < sq.n; ++i) {
        const int groups = (sq.splits[i] + g - 1) / g;
        const int cnt = p.n_kv_heads * groups;
        if (item < acc + cnt) {
            *s = i;
            *kvh = (item - acc) / groups;
            *split = (item - acc) % groups * g;
            *nsplit = min(g, sq.splits[i] - *split);
            return;
        }
        acc += cnt;
    }
    *s = 0;
    *kvh = 0;
    *split = 0;
    *nsplit = 0;
}

template <int NT>
__device__ __forceinline__ void fv2_forward_body(const FusedParams* __restrict__ params, int rows, int n_logits,
                                                 int flags, const FusedTaps& taps, int layout) {
    extern __shared__ __align__(128) unsigned char fused_dyn[];
    __shared__ FusedParams P;
    __shared__ FusedLayer L;
    __shared__ Fv2Seqs sq;
    __shared__ __align__(8) unsigned long long ring_bars[FV2_PARTS * FV2_MAX_SLOTS];
    __shared__ __align__(8) unsigned long long ring_empty[FV2_MAX_SLOTS];
    __shared__ unsigned long long epoch_s;
    if (threadIdx.x < sizeof(FusedParams) / 8) {
        ((unsigned long long*)&P)[threadIdx.x] = ((const unsigned long long*)params)[threadIdx.x];
    }
    if (threadIdx.x < FUSED_PROF_SLOTS) fused_prof[threadIdx.x] = 0;
    if (threadIdx.x == 0) fused_prof_on = (flags & FUSED_PROFILE) != 0;
    const long long t_kernel = fused_clock();
    __syncthreads();  // all FV2_THREADS
    const FusedParams& p = P;
    unsigned long long* ctr = reinterpret_cast<unsigned long long*>(p.barrier);
    const bool work = !(flags & FUSED_SKIP_WORK);
    if (threadIdx.x == 0) {
        unsigned long long old;
        asm volatile("atom.add.relaxed.gpu.u64 %0, [%1], 1;" : "=l"(old) : "l"(ctr) : "memory");
        epoch_s = old / gridDim.x;
        // The step's sequences (rows <= FV2_MAX_ROWS).
        sq.n = 0;
        sq.items = 0;
        for (int r = 0; r < rows; ++r) {
            const bool cont = r > 0 && p.row_table[r] == p.row_table[r - 1] && p.positions[r] == p.positions[r - 1] + 1;
            if (cont) {
                ++sq.rows[sq.n - 1];
            } else {
                sq.first[sq.n] = r;
                sq.rows[sq.n] = 1;
                sq.pos0[sq.n] = p.positions[r];
                ++sq.n;
            }
        }
        for (int i = 0; i < sq.n; ++i) {
            sq.splits[i] = fv2_splits(sq.pos0[i] + sq.rows[i]);
        }
        sq.group = fv2_attention_group(sq, p.n_kv_heads, (int)gridDim.x, &sq.items);
    }
    const int ring_offset = layout & 0xffffff, stages = layout >> 24;
    Fv2Ring ring = {fused_dyn + ring_offset, ring_bars, ring_empty, stages, 0, 0u};
    Fv2Producer q;
    q.phases = 4 * p.n_layers + (n_logits > 0 ? 1 : 0);
    q.slot = 0;
    q.laps = 0;
    if (threadIdx.x == 0) {
        for (int i = 0; i < stages; ++i) {
            for (int h = 0; h < FV2_PARTS; ++h) fused_mbar_init(&ring_bars[FV2_PARTS * i + h]);
            fused_mbar_init(&ring_empty[i]);
        }
        fused_mbar_init_fence();
    }
    __syncthreads();  // all FV2_THREADS
    if (threadIdx.x >= FUSED_THREADS) {
        // The producer warp: walks the whole chunk sequence, refilling a slot once the consumers have
        // released its previous chunk, then leaves (the consumers synchronise among themselves only).
        if (work) {
            fv2_producer_seek(p, q, 0);
            // At most FV2_MAX_INFLIGHT part copies in flight: before issuing copy n, wait until copy
            // n - FV2_MAX_INFLIGHT has landed. Part copies are waited for in issue order: copy i is part i % FV2_PARTS of slot
            // (i / FV2_PARTS) % stages, its barrier's phase parity (i / FV2_PARTS / stages) & 1. Its barrier
            // is not re-armed before copy i + FV2_PARTS stages, and the cap keeps the copy waited for
            // within that distance of the one issued.
            // The launch's flags may set both caps (FUSED_INFLIGHT_SHIFT); FV2_PARTS x stages bounds them.
            const int cap_set = (flags >> FUSED_INFLIGHT_SHIFT) & 15;
            const int cap_l2_set = (flags >> FUSED_L2_INFLIGHT_SHIFT) & 15;
            const unsigned int cap = (unsigned)min(cap_set ? cap_set : FV2_MAX_INFLIGHT, FV2_PARTS * stages);
            int w_slot = 0, w_h = 0;
            unsigned int w_parity = 0u, issued = 0u, landed = 0u;
            const unsigned int cap_l2 = (unsigned)min(cap_l2_set ? cap_l2_set : FV2_L2_INFLIGHT, FV2_PARTS * stages);
#if FV2_L2_LEAD > 0
            // The prefetch cursor: pf_lead whole chunks prefetched from the ring's next chunk on, then part
            // pf_h of pf's chunk. Every decision is lane 0's, broadcast, so the lanes' cursors stay equal.
            Fv2Producer pf = q;
            int pf_lead = 0, pf_h = 0;
            long long pf_last = 0;
            const int pace_set = (flags >> FUSED_L2_PACE_SHIFT) & 15;
            const long long pace = pace_set ? (long long)pace_set * FUSED_L2_PACE_UNIT : FV2_L2_PACE_CYCLES;
            // Only in steps of <= FV2_L2_MAX_SEQS sequences and <= FV2_L2_MAX_ROWS rows: on an H100 (session
            // 25, NOTES v0.29) the prefetch won 1.2-2.5% at 1 x 1, 2 x 1 and 1 x 8 and lost 3-5% at 4 x 1 and
            // 2 x 8; on the evict-first kernel it lost 0.9-1.6% at 1 x 8 (sessions 28-29), hence <= 2 rows.
            // The launch's flags may set the lead and both limits (FUSED_L2_LEAD_SHIFT, FUSED_L2_GATE_SHIFT).
            const int lead_set = (flags >> FUSED_L2_LEAD_SHIFT) & 15;
            const int gate_set = (flags >> FUSED_L2_GATE_SHIFT) & 31;
            const int max_seqs = gate_set ? gate_set : FV2_L2_MAX_SEQS;
            const int max_rows = gate_set ? gate_set : FV2_L2_MAX_ROWS;
            const int pf_lead_max = sq.n <= max_seqs && rows <= max_rows ? (lead_set ? lead_set - 1 : FV2_L2_LEAD) : 0;
#endif
            while (q.phase < q.phases) {
#if FV2_L2_LEAD > 0
                if (q.laps > 0) {
                    unsigned long long* empty = &ring_empty[q.slot];
                    const unsigned int ep = (q.laps - 1u) & 1u;
                    const long long w0 = clock64();
                    unsigned int spins = 0;
                    while (!__shfl_sync(0xffffffffu, (int)fused_mbar_test(empty, ep), 0)) {
                        const long long now = clock64();
                        const bool go = pf_lead < pf_lead_max && pf.phase < pf.phases && now - w0 >= FV2_L2_IDLE_CYCLES &&
                                        now - pf_last >= pace;
                        if (__shfl_sync(0xffffffffu, (int)go, 0)) {
                            fv2_prefetch_part(pf, pf_h);
                            pf_last = __shfl_sync(0xffffffffu, now, 0);
                            if (++pf_h == FV2_PARTS) {
                                pf_h = 0;
                                ++pf_lead;
                                fv2_producer_advance(p, pf, ring);
                            }
                        }
                        if (++spins == FUSED_RING_SPIN_LIMIT) __trap();
                    }
                }
#else
                if (q.laps > 0) fused_mbar_wait(&ring_empty[q.slot], (q.laps - 1u) & 1u);
#endif
                for (int h = 0; h < FV2_PARTS; ++h) {
                    // Part h of this chunk was prefetched: the chunk is pf's first whole one (pf_lead > 0),
                    // or pf is this chunk and got past part h. Then up to cap_l2 copies may fly; each part
                    // still waits, in issue order, for the copies beyond its own cap to land.
#if FV2_L2_LEAD > 0
                    const bool in_l2 = pf_lead > 0 || h < pf_h;
#else
                    const bool in_l2 = false;
#endif
                    const unsigned int c = in_l2 ? cap_l2 : cap;
                    while (issued - landed >= c) {
                        fused_mbar_wait(&ring_bars[FV2_PARTS * w_slot + w_h], w_parity);
                        ++landed;
                        if (++w_h == FV2_PARTS) {
                            w_h = 0;
                            if (++w_slot == stages) {
                                w_slot = 0;
                                w_parity ^= 1u;
                            }
                        }
                    }
                    fv2_producer_issue_part(q, ring, h);
                    ++issued;
                }
                fv2_producer_advance(p, q, ring);
#if FV2_L2_LEAD > 0
                // The chunk just copied was pf's first whole one, or pf's own (then pf restarts at the next).
                if (pf_lead > 0) {
                    --pf_lead;
                } else {
                    pf = q;
                    pf_h = 0;
                }
#endif
            }
        }
        return;
    }
    const unsigned long long target = (epoch_s + 1) * gridDim.x;
    unsigned char* scratch = fused_dyn;
    float* att = reinterpret_cast<float*>(fused_dyn);
    const int h = p.hidden, qd = p.n_heads * p.head_dim;
    const int width = (p.n_heads + 2 * p.n_kv_heads) * p.head_dim;
    const FusedTaps* tp = taps.count > 0 ? &taps : 0;
    // Counter of stage st of layer l.
#define FV2_CTR(l, st) (ctr + (size_t)(1 + (l) * FV2_STAGES + (st)) * FV2_CTR_WORDS)
    long long t;
    for (int l = 0; l < p.n_layers; ++l) {
        if (threadIdx.x < sizeof(FusedLayer) / 8) {
            ((unsigned long long*)&L)[threadIdx.x] = ((const unsigned long long*)(p.layers + l))[threadIdx.x];
        }
        fv2_sync();
        int t0, t1;
        // Q: QKV tiles, attention norm while staging.
        fused_tile_range(width, &t0, &t1);
        if (t0 < t1) {
            t = fused_clock();
            if (l > 0) fv2_wait(FV2_CTR(l - 1, 4), target);
            fused_prof_add(11, t);
            t = fused_clock();
            if (work) {
                const Fv2Gemm g = {width, h, rows, l == 0 ? FV2_SRC_EMBED_NORM : FV2_SRC_NORM, 0, p.x, 0,
                                   L.attn_norm, p.embed, p.tokens, FV2_OUT_PLAIN, p.qkv, 0, 0, 0};
                fv2_gemm<NT>(p, ring, g, scratch, ring_offset, 0, -1, t0, t1);
            }
            fused_prof_add(1, t);
        }
        fv2_arrive(FV2_CTR(l, 0));
        // A: attention items, grid-strided from the last CTA down.
        {
            bool waited = false;
            const int first = (int)gridDim.x - 1 - (int)blockIdx.x;
            t = fused_clock();
            for (int item = first; item < sq.items; item += gridDim.x) {
                int s, kvh, split, nsplit;
                fv2_attention_coords(p, sq, item, &s, &kvh, &split, &nsplit);
                if (work && !(flags & FUSED_SKIP_ATTENTION)) {
                    fv2_attention_item(p, L, sq, s, kvh, split, nsplit, att, false, FV2_CTR(l, 0), target, &waited);
                } else if (!waited) {
                    fv2_wait(FV2_CTR(l, 0), target);
                    waited = true;
                }
                fv2_sync();  // the scratch is reused by the next item
            }
            fused_prof_add(3, t);
        }
        fv2_arrive(FV2_CTR(l, 1));
        // O: O-projection tiles, x += (layer 0: x = embedding + ...).
        fused_tile_range(h, &t0, &t1);
        if (t0 < t1) {
            t = fused_clock();
            fv2_wait(FV2_CTR(l, 1), target);
            fused_prof_add(14, t);
            t = fused_clock();
            if (work) {
                const Fv2Gemm g = {h, qd, rows, FV2_SRC_BF16, p.act16, 0, 0, 0, 0, 0, FV2_OUT_ACC, p.x, 0, L.bo,
                                   l == 0 ? p.embed : 0};
                fv2_gemm<NT>(p, ring, g, scratch, ring_offset, 0, -1, t0, t1);
            }
            fused_prof_add(4, t);
        }
        fv2_arrive(FV2_CTR(l, 2));
        // G: gate/up tiles, FFN norm while staging, SwiGLU.
        fused_tile_range(2 * p.ffn, &t0, &t1);
        if (t0 < t1) {
            t = fused_clock();
            fv2_wait(FV2_CTR(l, 2), target);
            fused_prof_add(16, t);
            t = fused_clock();
            if (work) {
                const Fv2Gemm g = {2 * p.ffn, h, rows, FV2_SRC_NORM, 0, p.x, 0, L.ffn_norm, 0, 0, FV2_OUT_SWIGLU, 0,
                                   p.ffn_act16, 0, 0};
                fv2_gemm<NT>(p, ring, g, scratch, ring_offset, 0, -1, t0, t1);
            }
            fused_prof_add(6, t);
        }
        fv2_arrive(FV2_CTR(l, 3));
        // D: down tiles, x += (+ tapped-layer copies).
        fused_tile_range(h, &t0, &t1);
        if (t0 < t1) {
            t = fused_clock();
            fv2_wait(FV2_CTR(l, 3), target);
            fused_prof_add(17, t);
            t = fused_clock();
            if (work) {
                const Fv2Gemm g = {h, p.ffn, rows, FV2_SRC_BF16, p.ffn_act16, 0, 0, 0, 0, 0, FV2_OUT_ACC, p.x, 0, 0, 0};
                fv2_gemm<NT>(p, ring, g, scratch, ring_offset, tp, l, t0, t1);
            }
            fused_prof_add(7, t);
        }
        fv2_arrive(FV2_CTR(l, 4));
    }
    if (n_logits > 0) {
        int t0, t1;
        fused_tile_range(p.vocab, &t0, &t1);
        if (t0 < t1) {
            t = fused_clock();
            fv2_wait(FV2_CTR(p.n_layers - 1, 4), target);
            fused_prof_add(19, t);
            t = fused_clock();
            if (work) {
                const Fv2Gemm g = {p.vocab, h, n_logits, FV2_SRC_NORM, 0, p.x, p.logit_rows, p.final_norm, 0, 0,
                                   FV2_OUT_PLAIN, p.logits, 0, 0, 0};
                fv2_gemm<NT>(p, ring, g, scratch, ring_offset, 0, -1, t0, t1);
            }
            fused_prof_add(9, t);
        }
    }
#undef FV2_CTR
    fused_prof_finish(p.prof, t_kernel);
}

// v2 entry points: rows <= 8 (one 8-row activation block) and rows <= 16 (two). Arguments as
// fused_forward's, plus `layout`: the ring's byte offset in dynamic shared memory (bits 0-23; the
// scratch before it holds the GEMM reduction and staged activations, or the attention buffers) and the
// ring's slot count (bits 24-31), from the host's plan for this row count (gpu_fused.rs v2_plan).
extern "C" __global__ void __launch_bounds__(FV2_THREADS, 1)
fused_forward_v2_m8(const FusedParams* __restrict__ params, int rows, int n_logits, int flags, float* tap_buf,
                    unsigned long long tap_layers, int tap_count, int tap_stride, int layout) {
    const FusedTaps taps = {tap_buf, tap_layers, tap_count, tap_stride};
    fv2_forward_body<1>(params, rows, n_logits, flags, taps, layout);
}
extern "C" __global__ void __launch_bounds__(FV2_THREADS, 1)
fused_forward_v2_m16(const FusedParams* __restrict__ params, int rows, int n_logits, int flags, float* tap_buf,
                     unsigned long long tap_layers, int tap_count, int tap_stride, int layout) {
    const FusedTaps taps = {tap_buf, tap_layers, tap_count, tap_stride};
    fv2_forward_body<2>(params, rows, n_logits, flags, taps, layout);
}
