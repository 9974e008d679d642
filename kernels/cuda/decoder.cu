// Decoder-step kernels for the CUDA standard path (issue 5). Activations are f32, weights bf16 (stored as
// raw 16-bit patterns so that no CUDA header is needed under NVRTC), KV cache f32 in paged blocks.
// Every reduction runs in a fixed order inside one block per row, so a row's result does not depend on
// how many rows share the launch (the same batch-invariance rule as the CPU reference).

#define SPECULA_BLOCK 128
// NVRTC has no math.h: -infinity by its bit pattern.
#define SPECULA_NEG_INF __int_as_float(0xff800000)

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

// Greedy token of each logits row (lowest index wins ties, as on the CPU). Grid: rows.
extern "C" __global__ void argmax_rows(const float* logits, int vocab, unsigned int* out) {
    __shared__ float best_v[SPECULA_BLOCK];
    __shared__ int best_i[SPECULA_BLOCK];
    const float* r = logits + (size_t)blockIdx.x * vocab;
    float bv = SPECULA_NEG_INF;
    int bi = 0x7fffffff;
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
