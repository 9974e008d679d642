// DSpark drafter kernels (issue 8). This file is compiled together with sampling.cu (appended to it, see
// kernels/src/cuda/mod.rs), so the Markov loop processes every slot's logits with sampling.cu's
// row_logits_to_probs (the CPU semantics of kernels/src/sampling.rs) and draws with its block_sample
// (the conventions of sampling::sample_from). Names defined here start with dsp_/DSP_/dspark_ so they
// cannot collide with sampling.cu's.
//
// The rest of the DSpark block pass (embedding, RMSNorm, q/k norms, RoPE with the K/V store, SwiGLU) uses
// decoder.cu's kernels unchanged, and its linear layers use cuda::Gemm.

#define DSP_ATTN_THREADS 256
#define DSP_MAX_GROUP 8

__device__ __forceinline__ float dsp_bf16_to_f32(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

// Round to nearest even, as half::bf16::from_f32 and decoder.cu's f32_to_bf16 (NaN kept quiet).
__device__ __forceinline__ unsigned short dsp_f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x40u);
    }
    unsigned int rounding = 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)((u + rounding) >> 16);
}

// ---------------------------------------------------------------------------------------------------
// Non-causal attention of the block rows. Each sequence owns a contiguous slot of the context K/V
// buffers: position j of sequence slot s is row s * max_ctx + j ([kv_dim] floats, k_norm and RoPE
// applied). The block's own keys/values are stored right after the context (rows ctx_len ..
// ctx_len + g, by rope_kv_append just before this launch; they are overwritten by the next context
// append, which is how the block's K/V are never cached). Every row of a block attends to all
// key_counts[row] = ctx_len + g keys: no causal mask, as DSpark's block pass requires. The causal
// kernels in decoder.cu are untouched.
//
// One CTA of 256 threads per (row, kv head) serves the G = n_heads / n_kv_heads query heads of that
// KV head, in three phases like decoder.cu's attention_gqa: thread j scores key j for all G heads; one
// warp per head takes the softmax; thread (c = t % head_dim, part = t / head_dim) sums p * v over every
// (256 / head_dim)-th key and the parts are added in shared memory in a fixed order. Scalar loads, so
// any head_dim up to 256 works (the DeepSpec fixture has head_dim 16).
// Dynamic shared memory: (G * head_dim + G * max_ctx + 256 * G + G) floats, fixed by max_ctx.
// Requires G <= 8 and 1 <= key_counts[row] <= max_ctx (checked on the host). Grid: (rows, n_kv_heads).
extern "C" __global__ void __launch_bounds__(DSP_ATTN_THREADS)
dspark_block_attention(const float* qkv, int row_stride, int n_heads, int n_kv_heads, int head_dim,
                       const int* key_counts, const int* seq_of_row, int max_ctx, const float* k_ctx,
                       const float* v_ctx, unsigned short* out, float scale) {
    extern __shared__ __align__(16) float dsp_smem[];
    const int G = n_heads / n_kv_heads;
    float* q_s = dsp_smem;                      // [G][head_dim], pre-scaled
    float* p_s = q_s + G * head_dim;            // [G][max_ctx] scores, then probabilities
    float* part_s = p_s + G * max_ctx;          // [256 / head_dim][G][head_dim]
    float* inv_s = part_s + DSP_ATTN_THREADS * G;  // [G]
    const int row = blockIdx.x, kvh = blockIdx.y, tid = threadIdx.x;
    const int kv_dim = n_kv_heads * head_dim;
    const float* q = qkv + (size_t)row * row_stride + (size_t)kvh * G * head_dim;
    for (int i = tid; i < G * head_dim; i += DSP_ATTN_THREADS) q_s[i] = q[i] * scale;
    __syncthreads();
    const int n_keys = key_counts[row];
    const size_t base = (size_t)seq_of_row[row] * max_ctx;
    for (int j = tid; j < n_keys; j += DSP_ATTN_THREADS) {
        const float* k = k_ctx + (base + j) * kv_dim + kvh * head_dim;
        float d[DSP_MAX_GROUP];
#pragma unroll
        for (int g = 0; g < DSP_MAX_GROUP; ++g) d[g] = 0.0f;
        for (int c = 0; c < head_dim; ++c) {
            float kk = k[c];
#pragma unroll
            for (int g = 0; g < DSP_MAX_GROUP; ++g)
                if (g < G) d[g] += q_s[g * head_dim + c] * kk;
        }
#pragma unroll
        for (int g = 0; g < DSP_MAX_GROUP; ++g)
            if (g < G) p_s[g * max_ctx + j] = d[g];
    }
    __syncthreads();
    const int warp = tid >> 5, lane = tid & 31;
    for (int g = warp; g < G; g += DSP_ATTN_THREADS / 32) {
        float* p = p_s + g * max_ctx;
        float m = SPL_F32_NEG_INF;
        for (int j = lane; j < n_keys; j += 32) m = fmaxf(m, p[j]);
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(SPL_FULL, m, o));
        float sum = 0.0f;
        for (int j = lane; j < n_keys; j += 32) {
            float e = expf(p[j] - m);
            p[j] = e;
            sum += e;
        }
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(SPL_FULL, sum, o);
        if (lane == 0) inv_s[g] = 1.0f / sum;
    }
    __syncthreads();
    const int parts = DSP_ATTN_THREADS / head_dim;
    const int c = tid % head_dim, part = tid / head_dim;
    if (part < parts) {
        float acc[DSP_MAX_GROUP];
#pragma unroll
        for (int g = 0; g < DSP_MAX_GROUP; ++g) acc[g] = 0.0f;
        const float* vbase = v_ctx + base * kv_dim + kvh * head_dim + c;
        for (int j = part; j < n_keys; j += parts) {
            float v = vbase[(size_t)j * kv_dim];
#pragma unroll
            for (int g = 0; g < DSP_MAX_GROUP; ++g)
                if (g < G) acc[g] += p_s[g * max_ctx + j] * v;
        }
#pragma unroll
        for (int g = 0; g < DSP_MAX_GROUP; ++g)
            if (g < G) part_s[(part * G + g) * head_dim + c] = acc[g];
    }
    __syncthreads();
    for (int i = tid; i < G * head_dim; i += DSP_ATTN_THREADS) {
        int g = i / head_dim, cc = i % head_dim;
        float s = 0.0f;
        for (int pp = 0; pp < parts; ++pp) s += part_s[(pp * G + g) * head_dim + cc];
        out[(size_t)row * n_heads * head_dim + (size_t)(kvh * G + g) * head_dim + cc] = dsp_f32_to_bf16(s * inv_s[g]);
    }
}

// ---------------------------------------------------------------------------------------------------
// The block pass's q/k head norms, RoPE and K/V store in one launch (it was three: head_rms_norm on the q
// heads, on the k heads, then rope_kv_append; ~3 us each in the block pass's graph, per layer). Grid:
// (rows, n_heads + 2 * n_kv_heads), block: head_dim / 2 threads (head_dim even, <= 256). blockIdx.y <
// n_heads: RMSNorm the q head with q_norm, rotate it in place; next n_kv_heads: RMSNorm the k head with
// k_norm, rotate it and store it at context row slots[row]; last n_kv_heads: copy the v head there. Thread
// i holds dims i and i + head_dim / 2 (rotate-half pairs). The arithmetic is decoder.cu's head_rms_norm
// (weight * (x * 1 / sqrt(mean(x^2) + eps)), f32) and rope_rotate (angle in double), except that the sum of
// squares is reduced in another order (pairs per thread, then warps).
#define DSP_MAX_ROPE_WARPS 4
extern "C" __global__ void dspark_qk_norm_rope_append(float* qkv, int row_stride, int n_heads, int n_kv_heads,
                                                      int head_dim, const float* q_norm, const float* k_norm,
                                                      float eps, const int* positions, const double* inv_freq,
                                                      const int* slots, float* k_ctx, float* v_ctx) {
    __shared__ float warp_ss[DSP_MAX_ROPE_WARPS];
    const int half = head_dim / 2, i = threadIdx.x, y = blockIdx.y;
    const int kv_dim = n_kv_heads * head_dim;
    float* row = qkv + (size_t)blockIdx.x * row_stride;
    const size_t slot_base = (size_t)slots[blockIdx.x] * kv_dim;
    if (y >= n_heads + n_kv_heads) {
        if (i >= half) return;
        const int kvh = y - n_heads - n_kv_heads;
        const float* v = row + n_heads * head_dim + kv_dim + kvh * head_dim;
        float* dst = v_ctx + slot_base + kvh * head_dim;
        dst[i] = v[i];
        dst[i + half] = v[i + half];
        return;
    }
    const bool is_q = y < n_heads;
    float* h = row + y * head_dim;  // q heads, then k heads right after them
    float xa = 0.0f, xb = 0.0f;
    if (i < half) {
        xa = h[i];
        xb = h[i + half];
    }
    float ss = xa * xa + xb * xb;
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const int nw = (blockDim.x + 31) / 32;
    if ((i & 31) == 0) warp_ss[i >> 5] = ss;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < nw; ++w) total += warp_ss[w];
    if (i >= half) return;
    const float inv = 1.0f / sqrtf(total / (float)head_dim + eps);
    const float* w = is_q ? q_norm : k_norm;
    xa = w[i] * (xa * inv);
    xb = w[i + half] * (xb * inv);
    double s, c;
    sincos((double)positions[blockIdx.x] * inv_freq[i], &s, &c);
    const float ra = xa * (float)c - xb * (float)s;
    const float rb = xb * (float)c + xa * (float)s;
    if (is_q) {
        h[i] = ra;
        h[i + half] = rb;
    } else {
        float* dst = k_ctx + slot_base + (y - n_heads) * head_dim;
        dst[i] = ra;
        dst[i + half] = rb;
    }
}

// ---------------------------------------------------------------------------------------------------
// The fused Markov loop: all slots of every sequence's block in one launch, one CTA of
// SPL_PROBS_THREADS threads per sequence (the slots depend on each other through the previous token,
// so a sequence's loop is sequential; sequences run side by side). For slot j of sequence b (row
// r = b * g + j of the block-pass outputs), with prev = the anchor for j = 0 and the token drafted at
// slot j - 1 after that — the CPU drafter's loop (drafters/src/dspark/mod.rs), step for step:
//   e = W1[row of prev]                 (zero when a pruned W1 has no row for prev)
//   confidence logit = w . [h_j; e] + b (when the checkpoint has a confidence head); with a threshold
//                      (>= 0) the loop stops before slot j when sigmoid(logit) < threshold
//   corrected_j = base_j + W2 e         (the full corrected logits, written out)
//   q_j = row_logits_to_probs(corrected_j restricted to the request's vocabulary) (written out)
//   token = argmax (temperature 0) or block_sample(q_j, uniforms[r])
// The uniforms come from the request's stream on the host, one per slot in slot order, exactly as the
// CPU drafter draws them, so both drafters pick the same tokens from the same distributions.
//
// Vocabulary restriction, as the CPU does it: without a pruned vocabulary (draft_to_target == null) the
// row is the first `limit` = min(vocab_limit, vocab) corrected logits. With one, draft id x is kept when
// draft_to_target[x] < limit (= the request's vocab_limit); the row is all vd draft ids with the others
// at -inf. That gives the CPU's distribution over its compacted list of kept ids exactly (masked entries
// get probability 0 and keep their index order, so argmax, top-k/top-p and inverse-CDF draws select the
// same kept ids), except when every kept logit is -inf: the CPU's argmax over the kept list is then its
// first entry, which the greedy path below reproduces. Tokens are written as target ids.
//
// Per-sequence inputs: seq_i [B, DSP_SEQ_INTS] = anchor, slots to draft, top_k, limit;
// seq_f [B, DSP_SEQ_FLOATS] = temperature, top_p, confidence threshold (< 0: none).
// Outputs per row r: corrected [r, vd], probs [r, vd] (only the first `n` entries of a row are written,
// n = vd with a pruned vocabulary, else limit), conf_out[r], tokens[r]; masked [r, vd] is scratch.
// status [B, DSP_STATUS_INTS] = code (SPL_OK or an SPL_/DSP_ code), detail, failing slot, slots drafted.
// Dynamic shared memory: rank floats.
#define DSP_SEQ_INTS 4
#define DSP_SEQ_FLOATS 3
#define DSP_STATUS_INTS 4
#define DSP_BAD_TOKEN 20
#define DSP_NOTHING_ALLOWED 21

extern "C" __global__ void __launch_bounds__(SPL_PROBS_THREADS)
dspark_markov_loop(const float* base_logits, const float* hidden, int g, int vd, int vocab, int hidden_dim,
                   int rank, const unsigned short* w1, const int* w1_row_of_token, const unsigned short* w2,
                   const float* conf_w, int conf_width, float conf_b, const int* draft_to_target,
                   const int* seq_i, const float* seq_f, const double* uniforms, float* corrected,
                   float* masked, float* probs, float* conf_out, int* tokens, int* status) {
    __shared__ Scratch sc;
    __shared__ u32 hist[256];
    __shared__ double bins[16 * SPL_PROBS_THREADS + 256];
    __shared__ int row_status[2];
    __shared__ double row_inv_sum;
    extern __shared__ float dsp_e[];  // [rank]
    const int b = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    const int anchor = seq_i[b * DSP_SEQ_INTS + 0];
    const int n_slots = seq_i[b * DSP_SEQ_INTS + 1];
    const u32 top_k = (u32)seq_i[b * DSP_SEQ_INTS + 2];
    const int limit = seq_i[b * DSP_SEQ_INTS + 3];
    const float temperature = seq_f[b * DSP_SEQ_FLOATS + 0];
    const float top_p = seq_f[b * DSP_SEQ_FLOATS + 1];
    const float threshold = seq_f[b * DSP_SEQ_FLOATS + 2];
    const int n = draft_to_target ? vd : limit;
    // W2 rows are 16-byte aligned when rank % 8 == 0: then each thread reads its rows 8 entries per load.
    const bool vec_w2 = (rank & 7) == 0;

    int code = SPL_OK, detail = 0, fail_slot = 0, drafted = 0;
    int first_allowed = 0;
    if (draft_to_target) {
        int first = SPL_INT_MAX;
        for (int x = tid; x < vd; x += nt)
            if (draft_to_target[x] < limit) first = min(first, x);
        first_allowed = block_min_i(first, sc);
        if (first_allowed == SPL_INT_MAX) code = DSP_NOTHING_ALLOWED;
    }
    int prev = anchor;
    // Every branch below depends only on block-uniform values (prev, code, the block reductions), so
    // all threads take the same path through the barriers.
    for (int j = 0; j < n_slots && code == SPL_OK; ++j) {
        const size_t r = (size_t)b * g + j;
        if (prev < 0 || prev >= vocab) {
            code = DSP_BAD_TOKEN;
            detail = prev;
            fail_slot = j;
            break;
        }
        const int w1_row = w1_row_of_token ? w1_row_of_token[prev] : prev;
        for (int c = tid; c < rank; c += nt)
            dsp_e[c] = w1_row >= 0 ? dsp_bf16_to_f32(w1[(size_t)w1_row * rank + c]) : 0.0f;
        __syncthreads();
        if (conf_w) {
            const float* hrow = hidden + r * hidden_dim;
            float acc = 0.0f;
            for (int c = tid; c < hidden_dim; c += nt) acc += conf_w[c] * hrow[c];
            if (conf_width > hidden_dim)
                for (int c = tid; c < rank; c += nt) acc += conf_w[hidden_dim + c] * dsp_e[c];
            const float cl = (float)block_sum_d((double)acc, sc) + conf_b;
            if (tid == 0) conf_out[r] = cl;
            if (threshold >= 0.0f && 1.0f / (1.0f + expf(-cl)) < threshold) break;
        }
        const float* brow = base_logits + r * vd;
        float* crow = corrected + r * vd;
        float* mrow = masked + r * vd;
        for (int x = tid; x < vd; x += nt) {
            const unsigned short* w = w2 + (size_t)x * rank;
            float acc = 0.0f;
            if (vec_w2) {
                for (int c = 0; c < rank; c += 8) {
                    uint4 v = *(const uint4*)(w + c);
                    unsigned int words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        acc += dsp_bf16_to_f32((unsigned short)(words[q] & 0xffffu)) * dsp_e[c + 2 * q];
                        acc += dsp_bf16_to_f32((unsigned short)(words[q] >> 16)) * dsp_e[c + 2 * q + 1];
                    }
                }
            } else {
                for (int c = 0; c < rank; ++c) acc += dsp_bf16_to_f32(w[c]) * dsp_e[c];
            }
            const float v = brow[x] + acc;
            crow[x] = v;
            if (draft_to_target) mrow[x] = draft_to_target[x] < limit ? v : SPL_F32_NEG_INF;
        }
        __syncthreads();
        float* prow = probs + r * vd;
        const int best = row_logits_to_probs(draft_to_target ? mrow : crow, prow, n, n, temperature, top_k, top_p,
                                             &row_inv_sum, row_status, sc, hist, bins);
        __syncthreads();
        if (row_status[0] != SPL_OK || best < 0) {
            code = row_status[0] != SPL_OK ? row_status[0] : SPL_ALL_MASKED;
            detail = row_status[1];
            fail_slot = j;
            break;
        }
        int x;
        if (temperature == 0.0f) {
            x = best;
            if (draft_to_target && draft_to_target[x] >= limit) {
                // Every kept logit is -inf: the CPU's argmax over its kept list gives the first kept id.
                __syncthreads();
                for (int y = tid; y < n; y += nt) prow[y] = y == first_allowed ? 1.0f : 0.0f;
                x = first_allowed;
            }
        } else {
            x = block_sample(RowWeight{prow}, n, uniforms[r], sc, nullptr);
            if (x < 0) {
                code = SPL_ALL_MASKED;
                fail_slot = j;
                break;
            }
        }
        const int token = draft_to_target ? draft_to_target[x] : x;
        if (tid == 0) tokens[r] = token;
        prev = token;
        drafted = j + 1;
        // dsp_e, hist and bins are rewritten by the next slot.
        __syncthreads();
    }
    if (tid == 0) {
        int* st = status + (size_t)b * DSP_STATUS_INTS;
        st[0] = code;
        st[1] = detail;
        st[2] = fail_slot;
        st[3] = drafted;
    }
}

// ---------------------------------------------------------------------------------------------------
// The same Markov loop spread over a cluster of DSP_CLUSTER CTAs per sequence (sm_90 and later), for
// rows without top-k / top-p (the host picks dspark_markov_loop above for those). Why: with one CTA per
// sequence a slot is bound by one SM streaming the 1 MB of W2 (vd x rank bf16) and by its block-wide
// passes over the whole row (the embedded drafter on the H200, 7 greedy slots: 321 us on one CTA, 46 us
// on this kernel; NOTES v0.5e). Here CTA c
// of a sequence's cluster owns draft ids [c * S, (c + 1) * S), S = ceil(vd / DSP_CLUSTER), keeps its
// slice of W2 in shared memory for the whole loop (staged once per launch, rows padded by DSP_W2_PAD
// entries so one thread per row reads 16 bytes without bank conflicts), and computes the corrected
// logits, the argmax, the softmax and the draw over its own ids. The CTAs agree on the rest through
// distributed shared memory: each publishes its partial results (max, argmax, first non-finite index,
// then the f64 sums) in its own `DspShare`, a cluster barrier makes them visible, and every CTA combines
// the DSP_CLUSTER records in cluster order, so all of them hold bitwise the same global values and take
// the same branches. Barriers per slot: one at temperature 0, four when sampling (max, sum, normalised
// sum, the drawn token).
//
// Semantics are dspark_markov_loop's without top-k / top-p (row_logits_to_probs's f64 exp and sums,
// block_sample's inverse-CDF draw over the normalised f32 row, lowest index on argmax ties, the first
// non-finite index, the same status codes); the sums are taken in another order (per CTA, then across
// the cluster), so q may differ from the single-CTA kernel's in the last bits, and a sampled draw only
// when the uniform falls within that difference of a CDF boundary.
//
// The records are double-buffered by slot parity: slot j + 2 rewrites a record only after every CTA has
// passed slot j + 1's first barrier, which it reaches only after reading slot j's records. The token of
// a sampled slot is written by the CTA that owns it into every CTA's record (remote stores) before the
// fourth barrier. A last barrier keeps every CTA's shared memory alive until no other CTA can read it.
//
// Dynamic shared memory (bytes, host: DSparkKernels::cluster_smem_bytes): the W2 slice
// S * (rank + DSP_W2_PAD) * 2 when w2_in_smem (requires rank % 8 == 0), then e [rank rounded up to 4],
// then the slice's logits and probabilities, S floats each. Grid: batch * DSP_CLUSTER CTAs.
#define DSP_CLUSTER 8
#define DSP_W2_PAD 8

struct DspShare {
    float max_value;
    int best;
    int bad;
    int last;
    double sum;
    double written;
    int token;
};

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define DSP_CLUSTER_DIMS __cluster_dims__(DSP_CLUSTER, 1, 1)
__device__ __forceinline__ u32 dsp_cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// Release/acquire: shared-memory writes before the barrier are visible to every CTA of the cluster after it.
__device__ __forceinline__ void dsp_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The address of `p` (a shared variable of this CTA) in CTA `rank`'s shared memory.
__device__ __forceinline__ u32 dsp_remote(const void* p, u32 rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"((u32)__cvta_generic_to_shared(p)), "r"(rank));
    return r;
}
__device__ __forceinline__ float dsp_ld_f32(u32 a) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(a) : "memory");
    return v;
}
__device__ __forceinline__ int dsp_ld_s32(u32 a) {
    int v;
    asm volatile("ld.shared::cluster.s32 %0, [%1];" : "=r"(v) : "r"(a) : "memory");
    return v;
}
__device__ __forceinline__ double dsp_ld_f64(u32 a) {
    double v;
    asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(a) : "memory");
    return v;
}
__device__ __forceinline__ void dsp_st_s32(u32 a, int v) {
    asm volatile("st.shared::cluster.s32 [%0], %1;" ::"r"(a), "r"(v) : "memory");
}
#else
#define DSP_CLUSTER_DIMS
#endif

extern "C" __global__ void DSP_CLUSTER_DIMS __launch_bounds__(SPL_PROBS_THREADS)
dspark_markov_cluster(const float* base_logits, const float* hidden, int g, int vd, int vocab, int hidden_dim,
                      int rank, const unsigned short* w1, const int* w1_row_of_token, const unsigned short* w2,
                      const float* conf_w, int conf_width, float conf_b, const int* draft_to_target,
                      const int* seq_i, const float* seq_f, const double* uniforms, float* corrected,
                      float* probs, float* conf_out, int* tokens, int* status, int w2_in_smem) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
    __shared__ Scratch sc;
    __shared__ DspShare share[2];
    extern __shared__ __align__(16) unsigned char dsp_dyn[];
    const int b = blockIdx.x / DSP_CLUSTER, tid = threadIdx.x, nt = blockDim.x;
    const u32 crank = dsp_cluster_rank();
    const int S = (vd + DSP_CLUSTER - 1) / DSP_CLUSTER;
    const int lo = (int)crank * S, hi = min(lo + S, vd);
    const int wstride = rank + DSP_W2_PAD;
    unsigned short* w2s = (unsigned short*)dsp_dyn;
    const size_t w2_bytes = w2_in_smem ? (((size_t)S * wstride * 2 + 15) & ~(size_t)15) : 0;
    float* e_s = (float*)(dsp_dyn + w2_bytes);
    float* lg = e_s + ((rank + 3) & ~3);  // this CTA's row values (restricted logits), [S]
    float* ps = lg + S;                    // this CTA's probabilities, [S]

    const int anchor = seq_i[b * DSP_SEQ_INTS + 0];
    const int n_slots = seq_i[b * DSP_SEQ_INTS + 1];
    const int limit = seq_i[b * DSP_SEQ_INTS + 3];
    const float temperature = seq_f[b * DSP_SEQ_FLOATS + 0];
    const float threshold = seq_f[b * DSP_SEQ_FLOATS + 2];
    const int n = draft_to_target ? vd : limit;
    const int nhi = max(lo, min(hi, n));  // this CTA's ids inside the probability row: [lo, nhi)

    int code = SPL_OK, detail = 0, fail_slot = 0, drafted = 0;
    if (nt != SPL_PROBS_THREADS) {
        code = SPL_BAD_BLOCK;
        detail = nt;
    }
    if (w2_in_smem && code == SPL_OK) {
        // 16-byte pieces, 8 loads in flight per thread before any store.
        const int pieces = rank / 8, total = (hi > lo ? hi - lo : 0) * pieces;
        strided<uint4>(tid, total, nt,
                       [&](int i) { return *(const uint4*)(w2 + (size_t)(lo + i / pieces) * rank + (i % pieces) * 8); },
                       [&](int i, uint4 v) { *(uint4*)(w2s + (size_t)(i / pieces) * wstride + (i % pieces) * 8) = v; });
    }
    int first_allowed = 0;
    if (draft_to_target && code == SPL_OK) {
        int first = SPL_INT_MAX;
        for (int x = tid; x < vd; x += nt)
            if (draft_to_target[x] < limit) first = min(first, x);
        first_allowed = block_min_i(first, sc);  // its barriers also publish the W2 slice
        if (first_allowed == SPL_INT_MAX) code = DSP_NOTHING_ALLOWED;
    }
    __syncthreads();
    int prev = anchor;
    // Every branch below depends only on cluster-uniform values (prev, code, the combined records, the
    // confidence logit that every CTA computes the same way from the same inputs).
    for (int j = 0; j < n_slots && code == SPL_OK; ++j) {
        const int par = j & 1;
        const size_t r = (size_t)b * g + j;
        if (prev < 0 || prev >= vocab) {
            code = DSP_BAD_TOKEN;
            detail = prev;
            fail_slot = j;
            break;
        }
        // e and the confidence logit as in dspark_markov_loop, written out again on purpose: moved into
        // shared device functions (session 9), NVRTC allocated both kernels' registers differently (this
        // one went from 128 registers and no spills to 80 with spills), so the measured code stays inline.
        const int w1_row = w1_row_of_token ? w1_row_of_token[prev] : prev;
        for (int c = tid; c < rank; c += nt)
            e_s[c] = w1_row >= 0 ? dsp_bf16_to_f32(w1[(size_t)w1_row * rank + c]) : 0.0f;
        __syncthreads();
        if (conf_w) {
            const float* hrow = hidden + r * hidden_dim;
            float acc = 0.0f;
            for (int c = tid; c < hidden_dim; c += nt) acc += conf_w[c] * hrow[c];
            if (conf_width > hidden_dim)
                for (int c = tid; c < rank; c += nt) acc += conf_w[hidden_dim + c] * e_s[c];
            const float cl = (float)block_sum_d((double)acc, sc) + conf_b;
            if (tid == 0 && crank == 0) conf_out[r] = cl;
            if (threshold >= 0.0f && 1.0f / (1.0f + expf(-cl)) < threshold) break;
        }
        // Corrected logits of this CTA's ids, the first non-finite index and the argmax of its row part.
        const float* brow = base_logits + r * vd;
        float* crow = corrected + r * vd;
        float* prow = probs + r * vd;
        float bv = SPL_F32_NEG_INF;
        int bi = SPL_INT_MAX, bad = SPL_INT_MAX;
        for (int x = lo + tid; x < hi; x += nt) {
            float acc = 0.0f;
            if (w2_in_smem) {
                const unsigned short* w = w2s + (size_t)(x - lo) * wstride;
                for (int c = 0; c < rank; c += 8) {
                    const uint4 v = *(const uint4*)(w + c);
                    const unsigned int words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        acc += dsp_bf16_to_f32((unsigned short)(words[q] & 0xffffu)) * e_s[c + 2 * q];
                        acc += dsp_bf16_to_f32((unsigned short)(words[q] >> 16)) * e_s[c + 2 * q + 1];
                    }
                }
            } else {
                const unsigned short* w = w2 + (size_t)x * rank;
                for (int c = 0; c < rank; ++c) acc += dsp_bf16_to_f32(w[c]) * e_s[c];
            }
            const float v = brow[x] + acc;
            crow[x] = v;
            const float rv = draft_to_target ? (draft_to_target[x] < limit ? v : SPL_F32_NEG_INF) : v;
            lg[x - lo] = rv;
            if (x < n) {
                if (rv != rv || rv == SPL_F32_INF) bad = min(bad, x);
                if (rv > bv) {
                    bv = rv;
                    bi = x;
                }
            }
        }
        bad = block_min_i(bad, sc);
        float part_max;
        const int part_best = block_argmax_reduce(bv, bi, sc, &part_max);
        if (tid == 0) {
            share[par].max_value = part_max;
            share[par].best = part_best;
            share[par].bad = bad;
        }
        dsp_cluster_sync();
        // Combined in cluster order: CTAs own ascending id ranges, so a strict > keeps the lowest index.
        float max_value = SPL_F32_NEG_INF;
        int best = SPL_INT_MAX, first_bad = SPL_INT_MAX;
        for (u32 c = 0; c < DSP_CLUSTER; ++c) {
            const float m = dsp_ld_f32(dsp_remote(&share[par].max_value, c));
            const int bb = dsp_ld_s32(dsp_remote(&share[par].best, c));
            first_bad = min(first_bad, dsp_ld_s32(dsp_remote(&share[par].bad, c)));
            if (m > max_value) {
                max_value = m;
                best = bb;
            }
        }
        int err = SPL_OK;
        if (first_bad != SPL_INT_MAX) {
            err = SPL_NON_FINITE_LOGIT;
            detail = first_bad;
        } else if (temperature != 0.0f && max_value == SPL_F32_NEG_INF) {
            err = SPL_ALL_MASKED;
            detail = 0;
        }
        if (err != SPL_OK) {
            for (int x = lo + tid; x < nhi; x += nt) prow[x] = SPL_F32_NAN;
            code = err;
            fail_slot = j;
            break;
        }
        int x;
        if (temperature == 0.0f) {
            // One-hot at the argmax (index 0 when every logit is -inf); with a pruned vocabulary whose
            // kept logits are all -inf, at the first kept id (the CPU's argmax over its kept list).
            x = best == SPL_INT_MAX ? 0 : best;
            if (draft_to_target && draft_to_target[x] >= limit) x = first_allowed;
            for (int y = lo + tid; y < nhi; y += nt) prow[y] = y == x ? 1.0f : 0.0f;
        } else {
            // exp((l - max) / T) in f64, stored as f32; the sum is over the f64 values.
            const double inv_t = 1.0 / (double)temperature;
            const double max_d = (double)max_value;
            double sum_e = 0.0;
            for (int y = lo + tid; y < nhi; y += nt) {
                const double e = exp(__dmul_rn(__dsub_rn((double)lg[y - lo], max_d), inv_t));
                ps[y - lo] = (float)e;
                sum_e += e;
            }
            sum_e = block_sum_d(sum_e, sc);
            if (tid == 0) share[par].sum = sum_e;
            dsp_cluster_sync();
            double sum = 0.0;
            for (u32 c = 0; c < DSP_CLUSTER; ++c) sum += dsp_ld_f64(dsp_remote(&share[par].sum, c));
            const double inv = 1.0 / sum;
            double written = 0.0;
            int last = -1;
            for (int y = lo + tid; y < nhi; y += nt) {
                const float out = (float)__dmul_rn((double)ps[y - lo], inv);
                ps[y - lo] = out;
                prow[y] = out;
                written += (double)out;
                if (out > 0.0f) last = y;
            }
            written = block_sum_d(written, sc);  // its barriers also publish ps
            last = block_max_i(last, sc);
            if (tid == 0) {
                share[par].written = written;
                share[par].last = last;
            }
            dsp_cluster_sync();
            // block_sample's inverse CDF: target = u * total; the first id with p > 0 whose cumulative
            // mass passes target, the last id with p > 0 when rounding leaves target above every sum.
            double w_c[DSP_CLUSTER];
            double total = 0.0;
            int row_last = -1;
            for (u32 c = 0; c < DSP_CLUSTER; ++c) {
                w_c[c] = dsp_ld_f64(dsp_remote(&share[par].written, c));
                row_last = max(row_last, dsp_ld_s32(dsp_remote(&share[par].last, c)));
                total += w_c[c];
            }
            if (!(total > 0.0)) {
                code = SPL_ALL_MASKED;
                detail = 0;
                fail_slot = j;
                break;
            }
            const double target = uniforms[r] * total;
            int owner = -1;
            double carry = 0.0, run = 0.0;
            for (int c = 0; c < DSP_CLUSTER; ++c) {
                const double incl = run + w_c[c];
                if (owner < 0 && w_c[c] > 0.0 && target < incl) {
                    owner = c;
                    carry = run;
                }
                run = incl;
            }
            if (owner < 0) {
                x = row_last;
            } else {
                if ((int)crank == owner) {
                    // Contiguous segments per thread, scanned in thread order (block_sample's layout).
                    const int cnt = nhi - lo, seg_len = (cnt + nt - 1) / nt;
                    const int s0 = min(tid * seg_len, cnt), s1 = min(s0 + seg_len, cnt);
                    double s = 0.0;
                    for (int i = s0; i < s1; ++i) s += (double)ps[i];
                    double incl, excl;
                    block_scan_d(s, &incl, &excl, sc);
                    const int seg = block_min_i((s > 0.0 && target < carry + incl) ? tid : SPL_INT_MAX, sc);
                    if (seg == SPL_INT_MAX && tid == 0) {
                        for (u32 c = 0; c < DSP_CLUSTER; ++c)
                            dsp_st_s32(dsp_remote(&share[par].token, c), last);
                    }
                    if (tid == seg) {
                        double cum = carry + excl;
                        int found = -1, last_nz = -1;
                        for (int i = s0; i < s1 && found < 0; ++i) {
                            const float p = ps[i];
                            if (p > 0.0f) {
                                cum += (double)p;
                                last_nz = i;
                                if (target < cum) found = i;
                            }
                        }
                        const int id = lo + (found >= 0 ? found : last_nz);
                        for (u32 c = 0; c < DSP_CLUSTER; ++c)
                            dsp_st_s32(dsp_remote(&share[par].token, c), id);
                    }
                }
                dsp_cluster_sync();
                x = share[par].token;
            }
        }
        const int token = draft_to_target ? draft_to_target[x] : x;
        if (tid == 0 && crank == 0) tokens[r] = token;
        prev = token;
        drafted = j + 1;
        // e_s, lg, ps and Scratch are rewritten by the next slot.
        __syncthreads();
    }
    dsp_cluster_sync();
    if (tid == 0 && crank == 0) {
        int* st = status + (size_t)b * DSP_STATUS_INTS;
        st[0] = code;
        st[1] = detail;
        st[2] = fail_slot;
        st[3] = drafted;
    }
#else
    __trap();  // the host selects this kernel only on sm_90 and later (DSparkKernels::new)
#endif
}
