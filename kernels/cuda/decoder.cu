// Decoder-step kernels for the CUDA standard path (issue 5). Activations are f32, weights bf16 (stored as
// raw 16-bit patterns so that no CUDA header is needed under NVRTC), KV cache f32 in paged blocks.
// Every reduction runs in a fixed order inside one block per row, so a row's result does not depend on
// how many rows share the launch (the same batch-invariance rule as the CPU reference).

#define SPECULA_BLOCK 128
// NVRTC has no math.h: -infinity by its bit pattern.
#define SPECULA_NEG_INF __int_as_float(0xff800000)

// Programmatic dependent launch (sm_90+; kernels/src/cuda/launch.rs has the contract). A kernel launched
// with the PDL attribute may start while the previous kernel of the stream is still finishing: it must
// not read that kernel's outputs, or write anything, before SPECULA_PDL_WAIT(), and it lets the next
// kernel start with SPECULA_PDL_LAUNCH() after its own wait. Without the attribute both are no-ops.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define SPECULA_PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define SPECULA_PDL_LAUNCH() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define SPECULA_PDL_WAIT() do { } while (0)
#define SPECULA_PDL_LAUNCH() do { } while (0)
#endif

__device__ __forceinline__ float bf16_to_f32(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

// Round to nearest even, as the CPU path's half::bf16::from_f32 does (NaN kept quiet).
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x40u);
    }
    unsigned int rounding = 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)((u + rounding) >> 16);
}

// Sum over the block in a fixed tree order; every thread gets the result.
__device__ float block_sum(float v, float* scratch) {
    int t = threadIdx.x;
    scratch[t] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) scratch[t] += scratch[t + s];
        __syncthreads();
    }
    float r = scratch[0];
    __syncthreads();
    return r;
}

__device__ float block_max(float v, float* scratch) {
    int t = threadIdx.x;
    scratch[t] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) scratch[t] = fmaxf(scratch[t], scratch[t + s]);
        __syncthreads();
    }
    float r = scratch[0];
    __syncthreads();
    return r;
}

// out[row, :] = table[ids[row], :] widened to f32. Grid: rows.
extern "C" __global__ void embed_rows(const unsigned short* table, const unsigned int* ids, float* out, int dim) {
    SPECULA_PDL_WAIT();
    SPECULA_PDL_LAUNCH();
    const unsigned short* src = table + (size_t)ids[blockIdx.x] * dim;
    float* dst = out + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = bf16_to_f32(src[i]);
}

// RMSNorm of each row. Grid: rows, block: SPECULA_BLOCK threads.
extern "C" __global__ void rms_norm(const float* x, const float* weight, float* out, int dim, float eps) {
    __shared__ float scratch[SPECULA_BLOCK];
    const float* xr = x + (size_t)blockIdx.x * dim;
    float* orow = out + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    float total = block_sum(ss, scratch);
    float inv = 1.0f / sqrtf(total / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) orow[i] = weight[i] * (xr[i] * inv);
}

// Per-head RMSNorm in place on a strided slice of each row (Qwen3 q/k norms).
// Grid: (rows, heads), block: SPECULA_BLOCK.
extern "C" __global__ void head_rms_norm(float* x, int row_stride, int col_offset, const float* weight, int head_dim, float eps) {
    SPECULA_PDL_WAIT();
    SPECULA_PDL_LAUNCH();
    __shared__ float scratch[SPECULA_BLOCK];
    float* h = x + (size_t)blockIdx.x * row_stride + col_offset + blockIdx.y * head_dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) ss += h[i] * h[i];
    float inv = 1.0f / sqrtf(block_sum(ss, scratch) / (float)head_dim + eps);
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) h[i] = weight[i] * (h[i] * inv);
}

extern "C" __global__ void f32_to_bf16_rows(const float* x, unsigned short* y, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = f32_to_bf16(x[i]);
}

// x[row, :] += bias. Grid-stride over rows * dim.
extern "C" __global__ void add_bias_rows(float* x, const float* bias, int rows, int dim) {
    SPECULA_PDL_WAIT();
    SPECULA_PDL_LAUNCH();
    int n = rows * dim;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] += bias[i % dim];
}

extern "C" __global__ void add_in_place(float* a, const float* b, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) a[i] += b[i];
}

// Rotate-half RoPE on `n_heads` heads starting at `col_offset` of each row. Angles in double so long
// positions keep precision (as on the CPU). Grid: (rows, heads), block: head_dim / 2.
extern "C" __global__ void rope_neox(float* x, int row_stride, int col_offset, const int* positions,
                                     const double* inv_freq, int head_dim) {
    int half = head_dim / 2;
    int i = threadIdx.x;
    if (i >= half) return;
    float* h = x + (size_t)blockIdx.x * row_stride + col_offset + blockIdx.y * head_dim;
    double s, c;
    sincos((double)positions[blockIdx.x] * inv_freq[i], &s, &c);
    float xa = h[i], xb = h[i + half];
    h[i] = xa * (float)c - xb * (float)s;
    h[i + half] = xb * (float)c + xa * (float)s;
}

// Writes each row's k and v (columns k_offset.. and v_offset.. of the qkv rows) into cache slot
// slots[row] (physical block * block_size + offset, computed on the host from the block tables).
// Grid: rows, block: SPECULA_BLOCK.
extern "C" __global__ void kv_append(const float* qkv, int row_stride, int k_offset, int v_offset, int kv_dim,
                                     const int* slots, float* k_cache, float* v_cache) {
    const float* r = qkv + (size_t)blockIdx.x * row_stride;
    size_t base = (size_t)slots[blockIdx.x] * kv_dim;
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        k_cache[base + i] = r[k_offset + i];
        v_cache[base + i] = r[v_offset + i];
    }
}

// Causal attention for every new row over its sequence's paged cache (keys 0..=position).
// q is read from the qkv rows at column 0; out is [rows, n_heads * head_dim].
// Grid: (rows, n_heads), block: SPECULA_BLOCK, dynamic shared memory: (max_context) floats for scores.
extern "C" __global__ void attention(const float* qkv, int row_stride, int n_heads, int n_kv_heads, int head_dim,
                                     const int* positions, const int* block_table_of_row, int max_blocks,
                                     const int* block_tables, int block_size, const float* k_cache,
                                     const float* v_cache, float* out, float scale) {
    extern __shared__ float scores[];
    __shared__ float scratch[SPECULA_BLOCK];
    int row = blockIdx.x, head = blockIdx.y;
    int kvh = head / (n_heads / n_kv_heads);
    int kv_dim = n_kv_heads * head_dim;
    const float* q = qkv + (size_t)row * row_stride + head * head_dim;
    const int* table = block_tables + (size_t)block_table_of_row[row] * max_blocks;
    int n_keys = positions[row] + 1;
    float local_max = SPECULA_NEG_INF;
    for (int j = threadIdx.x; j < n_keys; j += blockDim.x) {
        size_t slot = (size_t)table[j / block_size] * block_size + j % block_size;
        const float* k = k_cache + slot * kv_dim + kvh * head_dim;
        float d = 0.0f;
        for (int c = 0; c < head_dim; ++c) d += q[c] * k[c];
        d *= scale;
        scores[j] = d;
        local_max = fmaxf(local_max, d);
    }
    float m = block_max(local_max, scratch);
    float local_sum = 0.0f;
    for (int j = threadIdx.x; j < n_keys; j += blockDim.x) {
        float e = expf(scores[j] - m);
        scores[j] = e;
        local_sum += e;
    }
    float inv = 1.0f / block_sum(local_sum, scratch);
    float* o = out + (size_t)row * n_heads * head_dim + head * head_dim;
    for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < n_keys; ++j) {
            size_t slot = (size_t)table[j / block_size] * block_size + j % block_size;
            acc += scores[j] * v_cache[slot * kv_dim + kvh * head_dim + c];
        }
        o[c] = acc * inv;
    }
}

// out[row, i] = silu(gate) * up for rows laid out [gate (ffn) | up (ffn)].
extern "C" __global__ void swiglu(const float* gate_up, float* out, int rows, int ffn) {
    int n = rows * ffn;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        int r = i / ffn, c = i % ffn;
        float g = gate_up[(size_t)r * 2 * ffn + c];
        float u = gate_up[(size_t)r * 2 * ffn + ffn + c];
        out[i] = g / (1.0f + expf(-g)) * u;
    }
}

// Greedy token of each logits row (lowest index wins ties, as on the CPU). Grid: rows; block: a power
// of two up to 1024 (the step uses 1024: a 128k-entry row is then 125 loads per thread, unrolled so
// several are in flight, instead of a thousand-long chain).
extern "C" __global__ void argmax_rows(const float* logits, int vocab, unsigned int* out) {
    SPECULA_PDL_WAIT();
    SPECULA_PDL_LAUNCH();
    __shared__ float best_v[1024];
    __shared__ int best_i[1024];
    const float* r = logits + (size_t)blockIdx.x * vocab;
    float bv = SPECULA_NEG_INF;
    int bi = 0x7fffffff;
#pragma unroll 8
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = r[i];
        if (v > bv) { bv = v; bi = i; }
    }
    best_v[threadIdx.x] = bv;
    best_i[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float ov = best_v[threadIdx.x + s];
            int oi = best_i[threadIdx.x + s];
            if (ov > best_v[threadIdx.x] || (ov == best_v[threadIdx.x] && oi < best_i[threadIdx.x])) {
                best_v[threadIdx.x] = ov;
                best_i[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = (unsigned int)best_i[0];
}

// ---------------------------------------------------------------------------------------------------
// Batched decode/verify step (issue 5). Activations that feed a GEMM are written as bf16 directly by
// the kernel that produces them (no separate conversion pass); the residual stream stays f32.

// Seeded random weights (the `--random-weights` presets). Counter-based: element `i` of tensor `tag`
// is a pure function of (seed, tag, i), so the CPU (`specula_model::random`) and this kernel produce
// bit-identical values and the device can fill a multi-GB model in milliseconds.
__device__ __forceinline__ float random_unit(unsigned long long seed, unsigned long long tag, unsigned long long i) {
    unsigned long long z = seed ^ (tag * 0x9E3779B97F4A7C15ull);
    z += i * 0xD1B54A32D192ED03ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    // Top 24 bits -> [-1, 1) exactly (no rounding), as on the CPU.
    return __fsub_rn(__fmul_rn((float)(unsigned int)(z >> 40), 1.1920928955078125e-7f), 1.0f);
}

extern "C" __global__ void fill_random_bf16(unsigned short* out, unsigned long long n, unsigned long long seed,
                                            unsigned long long tag, float scale) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        out[i] = f32_to_bf16(__fmul_rn(random_unit(seed, tag, i), scale));
    }
}

extern "C" __global__ void fill_random_f32(float* out, unsigned long long n, unsigned long long seed,
                                           unsigned long long tag, float scale, float offset) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        out[i] = __fadd_rn(offset, __fmul_rn(random_unit(seed, tag, i), scale));
    }
}

// RMSNorm of row src_rows[blockIdx.x] (or blockIdx.x when src_rows is null) written as bf16: the input
// of the next GEMM. Grid: output rows, block: 256 threads (any multiple of 32 up to 1024 works).
// Latency, not bandwidth, is its cost (a row is a few KB): every thread loads its float4s of the row and
// of the weight at once into registers (the weight before the PDL wait), sums squares in a fixed order
// (own elements, then a warp butterfly, then the warps' sums in order), and writes from the registers,
// so the row is read once in one round of loads. Rows longer than 32 float4s per thread, or not a
// multiple of 4, take a plain strided loop.
// The body is a device function over output row `row` so the persistent fused kernel (fused_step.cu)
// runs the same arithmetic; PDL = false there (no programmatic launch inside one kernel). A caller that
// runs it for several rows in a loop must __syncthreads() between rows (warp_sums is reused).
#define SPECULA_NORM_VEC 8
template <bool PDL>
__device__ __forceinline__ void rms_norm_bf16_body(const float* x, const int* src_rows, int row, const float* weight,
                                                   unsigned short* out, int dim, float eps) {
    __shared__ float warp_sums[32];
    const int tid = threadIdx.x, nt = blockDim.x;
    const int d4 = dim / 4;
    const bool vec = (dim % 4 == 0) && d4 <= SPECULA_NORM_VEC * nt;
    float4 wv[SPECULA_NORM_VEC], xv[SPECULA_NORM_VEC];
    if (vec) {
#pragma unroll
        for (int u = 0; u < SPECULA_NORM_VEC; ++u) {
            int i = tid + u * nt;
            if (i < d4) wv[u] = ((const float4*)weight)[i];
        }
    }
    if (PDL) {
        SPECULA_PDL_WAIT();
        SPECULA_PDL_LAUNCH();
    }
    int src = src_rows ? src_rows[row] : row;
    const float* xr = x + (size_t)src * dim;
    unsigned short* orow = out + (size_t)row * dim;
    float ss = 0.0f;
    if (vec) {
#pragma unroll
        for (int u = 0; u < SPECULA_NORM_VEC; ++u) {
            int i = tid + u * nt;
            if (i < d4) {
                xv[u] = ((const float4*)xr)[i];
                ss += xv[u].x * xv[u].x + xv[u].y * xv[u].y + xv[u].z * xv[u].z + xv[u].w * xv[u].w;
            }
        }
    } else {
        for (int i = tid; i < dim; i += nt) ss += xr[i] * xr[i];
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((tid & 31) == 0) warp_sums[tid >> 5] = ss;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < nt / 32; ++w) total += warp_sums[w];
    float inv = 1.0f / sqrtf(total / (float)dim + eps);
    if (vec) {
#pragma unroll
        for (int u = 0; u < SPECULA_NORM_VEC; ++u) {
            int i = tid + u * nt;
            if (i < d4) {
                ushort4 o;
                o.x = f32_to_bf16(wv[u].x * (xv[u].x * inv));
                o.y = f32_to_bf16(wv[u].y * (xv[u].y * inv));
                o.z = f32_to_bf16(wv[u].z * (xv[u].z * inv));
                o.w = f32_to_bf16(wv[u].w * (xv[u].w * inv));
                ((ushort4*)orow)[i] = o;
            }
        }
    } else {
        for (int i = tid; i < dim; i += nt) orow[i] = f32_to_bf16(weight[i] * (xr[i] * inv));
    }
}

extern "C" __global__ void rms_norm_bf16(const float* x, const int* src_rows, const float* weight,
                                         unsigned short* out, int dim, float eps) {
    rms_norm_bf16_body<true>(x, src_rows, blockIdx.x, weight, out, dim, eps);
}

// Rotate-half RoPE of one (x[i], x[i + half]) pair at `position` (angle in double, as on the CPU). Shared
// by rope_kv_append and the fused kernel (fused_step.cu) so both round identically.
__device__ __forceinline__ void rope_rotate(const float* a, const float* b, int position, double inv_freq, float* ra,
                                            float* rb) {
    double s, c;
    sincos((double)position * inv_freq, &s, &c);
    float xa = *a, xb = *b;
    *ra = xa * (float)c - xb * (float)s;
    *rb = xb * (float)c + xa * (float)s;
}

// RoPE on q and k and the KV-cache append in one launch. Grid: (rows, n_heads + 2 * n_kv_heads),
// block: head_dim / 2. blockIdx.y < n_heads: rotate a q head in place; next n_kv_heads: rotate a k head
// and store it at cache slot slots[row]; last n_kv_heads: copy a v head to the cache.
extern "C" __global__ void rope_kv_append(float* qkv, int row_stride, int n_heads, int n_kv_heads, int head_dim,
                                          const int* positions, const double* inv_freq, const int* slots,
                                          float* k_cache, float* v_cache) {
    SPECULA_PDL_WAIT();
    SPECULA_PDL_LAUNCH();
    int half = head_dim / 2;
    int i = threadIdx.x;
    if (i >= half) return;
    int y = blockIdx.y;
    int kv_dim = n_kv_heads * head_dim;
    float* row = qkv + (size_t)blockIdx.x * row_stride;
    size_t slot_base = (size_t)slots[blockIdx.x] * kv_dim;
    if (y >= n_heads + n_kv_heads) {
        int kvh = y - n_heads - n_kv_heads;
        const float* v = row + n_heads * head_dim + kv_dim + kvh * head_dim;
        float* dst = v_cache + slot_base + kvh * head_dim;
        dst[i] = v[i];
        dst[i + half] = v[i + half];
        return;
    }
    float* h = row + y * head_dim;  // q heads, then k heads right after them
    float ra, rb;
    rope_rotate(h + i, h + i + half, positions[blockIdx.x], inv_freq[i], &ra, &rb);
    if (y < n_heads) {
        h[i] = ra;
        h[i + half] = rb;
    } else {
        float* dst = k_cache + slot_base + (y - n_heads) * head_dim;
        dst[i] = ra;
        dst[i + half] = rb;
    }
}

// Causal GQA attention over the paged cache for decode/verify rows: one block of 256 threads per
// (row, kv head) serves the whole group of G = n_heads / n_kv_heads query heads, so each key and value
// is read once for all G heads, and the work is spread over the keys (a first version, one warp per
// query head walking the keys serially, was a chain of dependent loads: ~80 us per layer at 200 keys).
// Phase 1: thread j scores key j (all G heads) and keeps its cache slot; phase 2: one warp per head
// takes the softmax; phase 3: thread (quad = t % (head_dim / 4), lane = t / (head_dim / 4)) sums p * v
// over every (1024 / head_dim)-th key for dims 4 quad .. 4 quad + 3 with 16-byte loads, and the lanes'
// partial sums are added in shared memory in a fixed order. (Phase 3 was one float per thread over
// every 4th key: ~90 dependent rounds of loads at 370 keys, the step's cost growing ~1 us per key.)
// Dynamic shared memory: (G * head_dim + G * max_keys + max_keys + 1024 * G + 8) floats, sized at
// launch from the model's max_keys, so the launch does not depend on the current context length.
// Requires G <= 8, head_dim a multiple of 32 and at most 256. Grid: (rows, n_kv_heads), block 256.
// The body is a device function of the (row, KV head) work item and the dynamic shared memory, so the
// persistent fused kernel (fused_step.cu) runs the same arithmetic with PDL = false; a caller that runs
// several items in a loop must __syncthreads() between them (the shared buffers are reused).
#define SPECULA_ATTN_THREADS 256
template <bool PDL>
__device__ __forceinline__ void attention_gqa_body(const float* qkv, int row_stride, int n_heads, int n_kv_heads,
                                                   int head_dim, const int* positions, const int* block_table_of_row,
                                                   int max_blocks, const int* block_tables, int block_size,
                                                   const float* k_cache, const float* v_cache, unsigned short* out,
                                                   float scale, int max_keys, int row, int kvh, float* smem) {
    if (PDL) {
        SPECULA_PDL_WAIT();
        SPECULA_PDL_LAUNCH();
    }
    const int G = n_heads / n_kv_heads;
    float* q_s = smem;                       // [G][head_dim], pre-scaled
    float* p_s = q_s + G * head_dim;         // [G][max_keys] scores, then probabilities
    int* slot_s = (int*)(p_s + G * max_keys);  // [max_keys]
    float* part_s = (float*)(slot_s + max_keys);  // [1024 / head_dim][G][head_dim]
    float* inv_s = part_s + 1024 * G;  // [G]
    const int tid = threadIdx.x;
    const int kv_dim = n_kv_heads * head_dim;
    const float* q = qkv + (size_t)row * row_stride + (size_t)kvh * G * head_dim;
    for (int i = tid; i < G * head_dim; i += SPECULA_ATTN_THREADS) q_s[i] = q[i] * scale;
    __syncthreads();
    const int* table = block_tables + (size_t)block_table_of_row[row] * max_blocks;
    const int n_keys = positions[row] + 1;
    const int d4 = head_dim / 4;
    for (int j = tid; j < n_keys; j += SPECULA_ATTN_THREADS) {
        int slot = table[j / block_size] * block_size + j % block_size;
        slot_s[j] = slot;
        const float4* k4 = (const float4*)(k_cache + (size_t)slot * kv_dim + kvh * head_dim);
        float d[8];
#pragma unroll
        for (int g = 0; g < 8; ++g) d[g] = 0.0f;
#pragma unroll 8
        for (int c = 0; c < d4; ++c) {
            float4 kk = k4[c];
#pragma unroll
            for (int g = 0; g < 8; ++g) {
                if (g < G) {
                    float4 qq = ((const float4*)(q_s + g * head_dim))[c];
                    d[g] += qq.x * kk.x + qq.y * kk.y + qq.z * kk.z + qq.w * kk.w;
                }
            }
        }
#pragma unroll
        for (int g = 0; g < 8; ++g)
            if (g < G) p_s[g * max_keys + j] = d[g];
    }
    __syncthreads();
    const int warp = tid >> 5, lane = tid & 31;
    for (int g = warp; g < G; g += SPECULA_ATTN_THREADS / 32) {
        float* p = p_s + g * max_keys;
        float m = SPECULA_NEG_INF;
        for (int j = lane; j < n_keys; j += 32) m = fmaxf(m, p[j]);
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float sum = 0.0f;
        for (int j = lane; j < n_keys; j += 32) {
            float e = expf(p[j] - m);
            p[j] = e;
            sum += e;
        }
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (lane == 0) inv_s[g] = 1.0f / sum;
    }
    __syncthreads();
    const int lanes = SPECULA_ATTN_THREADS / d4;  // keys summed in parallel
    const int quad = tid % d4, lane_k = tid / d4;
    float4 acc[8];
#pragma unroll
    for (int g = 0; g < 8; ++g) acc[g] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float* vbase = v_cache + kvh * head_dim + 4 * quad;
#pragma unroll 4
    for (int j = lane_k; j < n_keys; j += lanes) {
        float4 v = *(const float4*)(vbase + (size_t)slot_s[j] * kv_dim);
#pragma unroll
        for (int g = 0; g < 8; ++g) {
            if (g < G) {
                float p = p_s[g * max_keys + j];
                acc[g].x += p * v.x;
                acc[g].y += p * v.y;
                acc[g].z += p * v.z;
                acc[g].w += p * v.w;
            }
        }
    }
#pragma unroll
    for (int g = 0; g < 8; ++g)
        if (g < G) *(float4*)(part_s + (lane_k * G + g) * head_dim + 4 * quad) = acc[g];
    __syncthreads();
    for (int i = tid; i < G * head_dim; i += SPECULA_ATTN_THREADS) {
        int g = i / head_dim, cc = i % head_dim;
        float s = 0.0f;
        for (int pp = 0; pp < lanes; ++pp) s += part_s[(pp * G + g) * head_dim + cc];
        out[(size_t)row * n_heads * head_dim + (size_t)(kvh * G + g) * head_dim + cc] = f32_to_bf16(s * inv_s[g]);
    }
}

extern "C" __global__ void __launch_bounds__(SPECULA_ATTN_THREADS)
attention_gqa(const float* qkv, int row_stride, int n_heads, int n_kv_heads, int head_dim,
              const int* positions, const int* block_table_of_row, int max_blocks, const int* block_tables,
              int block_size, const float* k_cache, const float* v_cache, unsigned short* out, float scale,
              int max_keys) {
    extern __shared__ __align__(16) float smem[];
    attention_gqa_body<true>(qkv, row_stride, n_heads, n_kv_heads, head_dim, positions, block_table_of_row,
                             max_blocks, block_tables, block_size, k_cache, v_cache, out, scale, max_keys,
                             blockIdx.x, blockIdx.y, smem);
}

// out[row, i] = silu(gate) * up as bf16 (the down projection's input).
extern "C" __global__ void swiglu_bf16(const float* gate_up, unsigned short* out, int rows, int ffn) {
    SPECULA_PDL_WAIT();
    SPECULA_PDL_LAUNCH();
    int n = rows * ffn;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        int r = i / ffn, c = i % ffn;
        float g = gate_up[(size_t)r * 2 * ffn + c];
        float u = gate_up[(size_t)r * 2 * ffn + ffn + c];
        out[i] = f32_to_bf16(g / (1.0f + expf(-g)) * u);
    }
}

// Skinny linear layer on the tensor cores for decode/verify shapes (M <= 64 activation rows):
// out[m, n] (+)= sum_k w[n, k] * x[m, k], w bf16 [N, K] row-major, x bf16 [M, K], out f32 [M, N].
// The weight rows take the MMA's 16-row side and the activation rows its 8-column side ("swap AB"),
// so every weight element is read from memory once for all M rows. A block of 8 warps owns 16 output
// features; warp w takes the 32-wide K chunks w, w+8, ... (the block reads 512 contiguous bytes of a
// row per step). Inside a chunk, thread (g = lane/4, t = lane%4) loads 16 bytes at k = 32c + 8t of
// weight rows g and g+8 and of activation rows g (+8, +16, ...): since a dot product may permute k
// freely as long as both operands use the same permutation, these vector loads feed the m16n8k16
// fragments directly (first MMA: elements 0-3, second: 4-7). Partial sums of the 8 warps are added in
// shared memory in a fixed order. With `splits` > 1 (grid.y), block y takes the y-th slice of the K
// chunks and adds its sums into `out` with atomicAdd (out must hold zeros or the residual): more blocks
// in flight for the narrow matrices (N = hidden size) whose 16-row blocks alone cannot fill the GPU;
// the order of those additions varies from run to run (~1e-7 relative). Requires K % 32 == 0.
// Grid: (ceil(N / 16), splits), block 256.
__device__ __forceinline__ uint4 load_stream_16(const unsigned short* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// Activations: small and re-read by every block, so through the read-only cache (kept in L1).
__device__ __forceinline__ uint4 load_cached_16(const unsigned short* p) {
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// Activations written earlier in the same kernel (the persistent fused kernel, fused_step.cu): the
// non-coherent path above is only valid for data that is read-only for the whole kernel, so these go
// through the ordinary coherent load (L1-cached; the fused kernel's grid barrier orders them).
__device__ __forceinline__ uint4 load_coherent_16(const unsigned short* p) {
    uint4 r;
    asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ void mma_bf16_16816(float* c, unsigned int a0, unsigned int a1, unsigned int a2,
                                               unsigned int a3, unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One output tile of the skinny GEMM: weight rows 16 tile .. 16 tile + 15, K slice `split` of `splits`.
// `red` is the block's reduction scratch, 8 * (8 NT) * 16 floats in shared memory. The kernels below
// pass (blockIdx.x, blockIdx.y) and a static buffer (skinny_linear); the persistent fused kernel
// (fused_step.cu) passes its own work item and dynamic shared memory, with PDL = false and
// X_READONLY = false (its activations are written earlier in the same kernel, so they must not go
// through the non-coherent load). A caller that runs several tiles in a loop must __syncthreads()
// between them (red is reused).
template <int NT, int U, bool SWIGLU, bool PDL, bool X_READONLY>
__device__ __forceinline__ void skinny_linear_tile(const unsigned short* w, const unsigned short* x, float* out, int N,
                                                   int K, int M, int accumulate, int splits, unsigned short* act,
                                                   int tile, int split, float* red) {
    float(*red3)[8 * NT][16] = reinterpret_cast<float(*)[8 * NT][16]>(red);
#define SKINNY_RED(ww, m, r) red3[ww][m][r]
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int g = lane >> 2, t = lane & 3;
    int n0 = tile * 16;
    int ra = n0 + g, rb = n0 + g + 8;
    float c[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.0f;
    uint4 zero;
    zero.x = zero.y = zero.z = zero.w = 0u;
    int total_chunks = K / 32;
    int first = (int)(((long long)total_chunks * split) / splits);
    int nchunks = (int)(((long long)total_chunks * (split + 1)) / splits);
    // Weight fragments are loaded one iteration ahead (double-buffered in registers), and the first
    // iteration's before SPECULA_PDL_WAIT(): weights are never written during a step, so under PDL
    // they stream in while the previous kernel (the norm or attention producing x) is finishing.
    uint4 a_lo[U], a_hi[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        int ch = first + warp + 8 * u;
        bool ok = ch < nchunks;
        size_t koff = (size_t)ch * 32 + t * 8;
        a_lo[u] = (ok && ra < N) ? load_stream_16(w + (size_t)ra * K + koff) : zero;
        a_hi[u] = (ok && rb < N) ? load_stream_16(w + (size_t)rb * K + koff) : zero;
    }
    if (PDL) {
        SPECULA_PDL_WAIT();
        SPECULA_PDL_LAUNCH();
    }
    for (int base = first + warp; base < nchunks; base += 8 * U) {
        uint4 b[U][NT], na_lo[U], na_hi[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int ch = base + 8 * u;
            bool ok = ch < nchunks;
            size_t koff = (size_t)ch * 32 + t * 8;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                int m = nt * 8 + g;
                if (X_READONLY) {
                    b[u][nt] = (ok && m < M) ? load_cached_16(x + (size_t)m * K + koff) : zero;
                } else {
                    b[u][nt] = (ok && m < M) ? load_coherent_16(x + (size_t)m * K + koff) : zero;
                }
            }
            int nch = ch + 8 * U;
            bool nok = nch < nchunks;
            size_t nkoff = (size_t)nch * 32 + t * 8;
            na_lo[u] = (nok && ra < N) ? load_stream_16(w + (size_t)ra * K + nkoff) : zero;
            na_hi[u] = (nok && rb < N) ? load_stream_16(w + (size_t)rb * K + nkoff) : zero;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                mma_bf16_16816(c[nt], a_lo[u].x, a_hi[u].x, a_lo[u].y, a_hi[u].y, b[u][nt].x, b[u][nt].y);
                mma_bf16_16816(c[nt], a_lo[u].z, a_hi[u].z, a_lo[u].w, a_hi[u].w, b[u][nt].z, b[u][nt].w);
            }
            a_lo[u] = na_lo[u];
            a_hi[u] = na_hi[u];
        }
    }
    // Accumulator layout of m16n8: c0, c1 -> (row g, cols 2t, 2t+1); c2, c3 -> (row g+8, same cols).
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        SKINNY_RED(warp, nt * 8 + 2 * t, g) = c[nt][0];
        SKINNY_RED(warp, nt * 8 + 2 * t + 1, g) = c[nt][1];
        SKINNY_RED(warp, nt * 8 + 2 * t, g + 8) = c[nt][2];
        SKINNY_RED(warp, nt * 8 + 2 * t + 1, g + 8) = c[nt][3];
    }
    __syncthreads();
    if (SWIGLU) {
        // Paired gate/up rows (see skinny_linear_swiglu_m*): rows r and r + 8 of this tile are the gate
        // and up projections of feature 8 * tile + r; write silu(gate) * up as bf16, exactly as
        // swiglu_bf16 computes it from the same sums.
        int ffn = N / 2;
        for (int idx = threadIdx.x; idx < 8 * 8 * NT; idx += blockDim.x) {
            int m = idx / 8, r = idx % 8;
            int f = tile * 8 + r;
            if (m >= M || f >= ffn) continue;
            float gs = 0.0f, us = 0.0f;
#pragma unroll
            for (int ww = 0; ww < 8; ++ww) {
                gs += SKINNY_RED(ww, m, r);
                us += SKINNY_RED(ww, m, r + 8);
            }
            act[(size_t)m * ffn + f] = f32_to_bf16(gs / (1.0f + expf(-gs)) * us);
        }
        return;
    }
    for (int idx = threadIdx.x; idx < 16 * 8 * NT; idx += blockDim.x) {
        int m = idx / 16, r = idx % 16;
        int n = n0 + r;
        if (m >= M || n >= N) continue;
        float s = 0.0f;
#pragma unroll
        for (int ww = 0; ww < 8; ++ww) s += SKINNY_RED(ww, m, r);
        float* dst = out + (size_t)m * N + n;
        if (splits > 1) {
            atomicAdd(dst, s);
        } else {
            *dst = accumulate ? *dst + s : s;
        }
    }
#undef SKINNY_RED
}

// The standalone kernels' tile: blockIdx.x is the tile, blockIdx.y the K split.
template <int NT, int U, bool SWIGLU>
__device__ __forceinline__ void skinny_linear(const unsigned short* w, const unsigned short* x, float* out, int N,
                                              int K, int M, int accumulate, int splits, unsigned short* act) {
    __shared__ float red[8][8 * NT][16];
    skinny_linear_tile<NT, U, SWIGLU, true, true>(w, x, out, N, K, M, accumulate, splits, act, blockIdx.x,
                                                  blockIdx.y, &red[0][0][0]);
}

extern "C" __global__ void __launch_bounds__(256) skinny_linear_m8(const unsigned short* w, const unsigned short* x,
                                                                   float* out, int N, int K, int M, int acc,
                                                                   int splits) {
    skinny_linear<1, 4, false>(w, x, out, N, K, M, acc, splits, 0);
}
extern "C" __global__ void __launch_bounds__(256) skinny_linear_m16(const unsigned short* w, const unsigned short* x,
                                                                    float* out, int N, int K, int M, int acc,
                                                                   int splits) {
    skinny_linear<2, 4, false>(w, x, out, N, K, M, acc, splits, 0);
}
extern "C" __global__ void __launch_bounds__(256) skinny_linear_m32(const unsigned short* w, const unsigned short* x,
                                                                    float* out, int N, int K, int M, int acc,
                                                                   int splits) {
    skinny_linear<4, 2, false>(w, x, out, N, K, M, acc, splits, 0);
}
extern "C" __global__ void __launch_bounds__(256) skinny_linear_m64(const unsigned short* w, const unsigned short* x,
                                                                    float* out, int N, int K, int M, int acc,
                                                                   int splits) {
    skinny_linear<8, 2, false>(w, x, out, N, K, M, acc, splits, 0);
}

// Gate/up projection with SwiGLU in the epilogue: w holds the gate and up rows interleaved in groups of 8
// (rows 16 b .. 16 b + 7 = gate features 8 b .., rows 16 b + 8 .. = the same up features; see
// interleave_gate_up), N = 2 * ffn with ffn % 8 == 0, no K split. Writes act[m, f] = silu(gate) * up as
// bf16 (the down projection's input): no f32 gate/up round trip and no separate swiglu launch.
extern "C" __global__ void __launch_bounds__(256) skinny_linear_swiglu_m8(const unsigned short* w, const unsigned short* x,
                                                                          unsigned short* act, int N, int K, int M) {
    skinny_linear<1, 4, true>(w, x, 0, N, K, M, 0, 1, act);
}
extern "C" __global__ void __launch_bounds__(256) skinny_linear_swiglu_m16(const unsigned short* w, const unsigned short* x,
                                                                           unsigned short* act, int N, int K, int M) {
    skinny_linear<2, 4, true>(w, x, 0, N, K, M, 0, 1, act);
}
extern "C" __global__ void __launch_bounds__(256) skinny_linear_swiglu_m32(const unsigned short* w, const unsigned short* x,
                                                                           unsigned short* act, int N, int K, int M) {
    skinny_linear<4, 2, true>(w, x, 0, N, K, M, 0, 1, act);
}
extern "C" __global__ void __launch_bounds__(256) skinny_linear_swiglu_m64(const unsigned short* w, const unsigned short* x,
                                                                           unsigned short* act, int N, int K, int M) {
    skinny_linear<8, 2, true>(w, x, 0, N, K, M, 0, 1, act);
}

// dst = the stacked [gate; up] matrix (2 * ffn rows of `cols`) with rows interleaved in groups of 8 for
// the paired kernels: dst row 16 b + i = gate row 8 b + i, dst row 16 b + 8 + i = up row 8 b + i.
// One-time at load. Grid: 2 * ffn rows, block 256.
extern "C" __global__ void interleave_gate_up(const unsigned short* src, unsigned short* dst, int ffn, int cols) {
    int r = blockIdx.x, b = r / 16, i = r % 16;
    int s = i < 8 ? 8 * b + i : ffn + 8 * b + (i - 8);
    const unsigned short* from = src + (size_t)s * cols;
    unsigned short* to = dst + (size_t)r * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) to[c] = from[c];
}

// SwiGLU over interleaved gate/up rows (the cuBLAS path of a paired gate/up matrix): out[row, f] =
// silu(gate) * up as bf16 with gate at column 16 (f / 8) + f % 8 and up 8 columns later.
extern "C" __global__ void swiglu_bf16_paired(const float* gate_up, unsigned short* out, int rows, int ffn) {
    SPECULA_PDL_WAIT();
    SPECULA_PDL_LAUNCH();
    int n = rows * ffn;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        int r = i / ffn, f = i % ffn;
        size_t col = (size_t)16 * (f / 8) + f % 8;
        float g = gate_up[(size_t)r * 2 * ffn + col];
        float u = gate_up[(size_t)r * 2 * ffn + col + 8];
        out[i] = f32_to_bf16(g / (1.0f + expf(-g)) * u);
    }
}

// ---------------------------------------------------------------------------------------------------
// Split-key causal GQA attention (flash-decoding) for decode/verify/prefill rows over the paged cache.
// attention_gqa above runs one block per (row, KV head) over every key: at ~260 keys that block is a
// chain of dependent load rounds (~21 us per layer on the H200, a quarter of the llama3.2-1b step).
// Here block (row, KV head, split) takes one slice of the row's keys; the number of slices depends only
// on the row's own key count (S = min(ATTN_MAX_SPLITS, ceil(keys / ATTN_SPLIT_KEYS)), slices of
// ceil(keys / S)), never on what else is in the launch. The host runs this kernel only for launches
// whose whole-row blocks would leave most SMs idle (gpu.rs `whole_row_attention_for`); larger launches
// already fill the GPU with attention_gqa blocks, where splitting only adds blocks and a combine pass.
// Blocks past S exit at once (the grid is fixed for CUDA graphs). Inside a block keys go in tiles of 256:
// thread j scores key j for the G query heads of the KV head; one warp per head keeps a running max and
// sum (online softmax); p * v is summed by (key lane, 4-dim quad) threads with 16-byte loads. Each slice
// writes its unnormalised output, max and sum to `partials`; the last slice to finish (a counter per
// (row, KV head), reset by that block so graph replays start from zero) combines the slices in slice
// order and writes bf16. One slice writes its output directly.
// Dynamic shared memory: (G * head_dim + G * 256 + 256 + 1024 * G + 24) floats. Requires G <= 8 and
// head_dim a multiple of 32, at most 256. Grid: (rows, n_kv_heads, ATTN_MAX_SPLITS), block 256.
#define ATTN_TILE 256
#define ATTN_SPLIT_KEYS 128
#define ATTN_MAX_SPLITS 4
// A row's key slices: a function of its own key count only (fused_step.cu enumerates work items with it).
__device__ __forceinline__ int attn_num_splits(int n_keys) {
    return min(ATTN_MAX_SPLITS, (n_keys + ATTN_SPLIT_KEYS - 1) / ATTN_SPLIT_KEYS);
}
// The body is a device function of the (row, KV head, slice) work item and the dynamic shared memory,
// so the persistent fused kernel (fused_step.cu) runs the same arithmetic with PDL = false. Every
// return is uniform over the block; a caller that runs several items in a loop must __syncthreads()
// between them (the shared buffers are reused).
template <bool PDL>
__device__ __forceinline__ void attention_split_body(const float* qkv, int row_stride, int n_heads, int n_kv_heads,
                                                     int head_dim, const int* positions, const int* block_table_of_row,
                                                     int max_blocks, const int* block_tables, int block_size,
                                                     const float* k_cache, const float* v_cache, unsigned short* out,
                                                     float scale, float* partials, unsigned int* counters, int row,
                                                     int kvh, int split, float* smem) {
    if (PDL) {
        SPECULA_PDL_WAIT();
        SPECULA_PDL_LAUNCH();
    }
    __shared__ int last_s;
    const int G = n_heads / n_kv_heads;
    const int tid = threadIdx.x;
    const int n_keys = positions[row] + 1;
    const int n_splits = attn_num_splits(n_keys);
    if (split >= n_splits) return;  // uniform over the block, before any barrier
    const int per = (n_keys + n_splits - 1) / n_splits;
    const int k_begin = split * per, k_end = min(n_keys, k_begin + per);
    float* q_s = smem;                             // [G][head_dim], pre-scaled
    float* p_s = q_s + G * head_dim;               // [G][ATTN_TILE]
    int* slot_s = (int*)(p_s + G * ATTN_TILE);     // [ATTN_TILE]
    float* part_s = (float*)(slot_s + ATTN_TILE);  // [1024 / head_dim][G][head_dim]
    float* m_s = part_s + 1024 * G;                // [8] running max per head
    float* l_s = m_s + 8;                          // [8] running sum per head
    float* f_s = l_s + 8;                          // [8] this tile's rescale of the old sums
    const int kv_dim = n_kv_heads * head_dim;
    const float* q = qkv + (size_t)row * row_stride + (size_t)kvh * G * head_dim;
    for (int i = tid; i < G * head_dim; i += SPECULA_ATTN_THREADS) q_s[i] = q[i] * scale;
    if (tid < 8) {
        m_s[tid] = SPECULA_NEG_INF;
        l_s[tid] = 0.0f;
    }
    __syncthreads();
    const int* table = block_tables + (size_t)block_table_of_row[row] * max_blocks;
    const int d4 = head_dim / 4;
    const int lanes = SPECULA_ATTN_THREADS / d4;
    const int quad = tid % d4, lane_k = tid / d4;
    const int warp = tid >> 5, lane = tid & 31;
    float4 acc[8];
#pragma unroll
    for (int g = 0; g < 8; ++g) acc[g] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int t0 = k_begin; t0 < k_end; t0 += ATTN_TILE) {
        const int nt = min(ATTN_TILE, k_end - t0);
        if (tid < nt) {
            int key = t0 + tid;
            int slot = table[key / block_size] * block_size + key % block_size;
            slot_s[tid] = slot;
            const float4* k4 = (const float4*)(k_cache + (size_t)slot * kv_dim + kvh * head_dim);
            float d[8];
#pragma unroll
            for (int g = 0; g < 8; ++g) d[g] = 0.0f;
#pragma unroll 16
            for (int c = 0; c < d4; ++c) {
                float4 kk = k4[c];
#pragma unroll
                for (int g = 0; g < 8; ++g) {
                    if (g < G) {
                        float4 qq = ((const float4*)(q_s + g * head_dim))[c];
                        d[g] += qq.x * kk.x + qq.y * kk.y + qq.z * kk.z + qq.w * kk.w;
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < 8; ++g)
                if (g < G) p_s[g * ATTN_TILE + tid] = d[g];
        }
        __syncthreads();
        for (int g = warp; g < G; g += SPECULA_ATTN_THREADS / 32) {
            float* p = p_s + g * ATTN_TILE;
            float mt = SPECULA_NEG_INF;
            for (int j = lane; j < nt; j += 32) mt = fmaxf(mt, p[j]);
            for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
            float m_old = m_s[g];
            float m_new = fmaxf(m_old, mt);
            float sum = 0.0f;
            for (int j = lane; j < nt; j += 32) {
                float e = expf(p[j] - m_new);
                p[j] = e;
                sum += e;
            }
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            __syncwarp();
            if (lane == 0) {
                float f = m_old == SPECULA_NEG_INF ? 0.0f : expf(m_old - m_new);
                f_s[g] = f;
                l_s[g] = l_s[g] * f + sum;
                m_s[g] = m_new;
            }
        }
        __syncthreads();
        const float* vbase = v_cache + kvh * head_dim + 4 * quad;
#pragma unroll
        for (int g = 0; g < 8; ++g) {
            if (g < G) {
                float f = f_s[g];
                acc[g].x *= f;
                acc[g].y *= f;
                acc[g].z *= f;
                acc[g].w *= f;
            }
        }
#pragma unroll 4
        for (int j = lane_k; j < nt; j += lanes) {
            float4 v = *(const float4*)(vbase + (size_t)slot_s[j] * kv_dim);
#pragma unroll
            for (int g = 0; g < 8; ++g) {
                if (g < G) {
                    float p = p_s[g * ATTN_TILE + j];
                    acc[g].x += p * v.x;
                    acc[g].y += p * v.y;
                    acc[g].z += p * v.z;
                    acc[g].w += p * v.w;
                }
            }
        }
        __syncthreads();  // p_s and slot_s are rewritten by the next tile
    }
#pragma unroll
    for (int g = 0; g < 8; ++g)
        if (g < G) *(float4*)(part_s + (lane_k * G + g) * head_dim + 4 * quad) = acc[g];
    __syncthreads();
    const size_t out_base = (size_t)row * n_heads * head_dim + (size_t)kvh * G * head_dim;
    if (n_splits == 1) {
        for (int i = tid; i < G * head_dim; i += SPECULA_ATTN_THREADS) {
            int g = i / head_dim, cc = i % head_dim;
            float s = 0.0f;
            for (int pp = 0; pp < lanes; ++pp) s += part_s[(pp * G + g) * head_dim + cc];
            out[out_base + i] = f32_to_bf16(s / l_s[g]);
        }
        return;
    }
    // This slice's unnormalised output [G][head_dim], then max [G] and sum [G].
    const int stride = G * (head_dim + 2);
    const size_t rk = (size_t)row * n_kv_heads + kvh;
    float* mine = partials + (rk * ATTN_MAX_SPLITS + split) * stride;
    for (int i = tid; i < G * head_dim; i += SPECULA_ATTN_THREADS) {
        int g = i / head_dim, cc = i % head_dim;
        float s = 0.0f;
        for (int pp = 0; pp < lanes; ++pp) s += part_s[(pp * G + g) * head_dim + cc];
        mine[i] = s;
    }
    if (tid < G) {
        mine[G * head_dim + tid] = m_s[tid];
        mine[G * head_dim + G + tid] = l_s[tid];
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        unsigned int done = atomicAdd(counters + rk, 1u);
        last_s = done == (unsigned int)(n_splits - 1);
    }
    __syncthreads();
    if (!last_s) return;
    __threadfence();
    const float* all = partials + rk * ATTN_MAX_SPLITS * stride;
    for (int i = tid; i < G * head_dim; i += SPECULA_ATTN_THREADS) {
        int g = i / head_dim;
        float m = SPECULA_NEG_INF;
        for (int sp = 0; sp < n_splits; ++sp) m = fmaxf(m, __ldcg(all + sp * stride + G * head_dim + g));
        float l = 0.0f, o = 0.0f;
        for (int sp = 0; sp < n_splits; ++sp) {
            float w = expf(__ldcg(all + sp * stride + G * head_dim + g) - m);
            l += __ldcg(all + sp * stride + G * head_dim + G + g) * w;
            o += __ldcg(all + sp * stride + i) * w;
        }
        out[out_base + i] = f32_to_bf16(o / l);
    }
    if (tid == 0) counters[rk] = 0u;
}

extern "C" __global__ void __launch_bounds__(SPECULA_ATTN_THREADS)
attention_split(const float* qkv, int row_stride, int n_heads, int n_kv_heads, int head_dim,
                const int* positions, const int* block_table_of_row, int max_blocks, const int* block_tables,
                int block_size, const float* k_cache, const float* v_cache, unsigned short* out, float scale,
                float* partials, unsigned int* counters) {
    extern __shared__ __align__(16) float smem[];
    attention_split_body<true>(qkv, row_stride, n_heads, n_kv_heads, head_dim, positions, block_table_of_row,
                               max_blocks, block_tables, block_size, k_cache, v_cache, out, scale, partials,
                               counters, blockIdx.x, blockIdx.y, blockIdx.z, smem);
}
