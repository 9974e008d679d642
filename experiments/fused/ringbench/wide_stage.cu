// wide_stage: can one CTA per SM run one GEMM stage of a 16-64-row step at the weight stream's rate, and
// which split of the work gets closest? (issue 6, written in session 35; item 4 of experiments/fused/README.md).
// A diagnostic, not part of the engine.
//
// Why: v2 takes steps of <= 16 rows. At 4 x 8 and 8 x 8 (32 and 64 rows) the engine runs v1 at 0.35x and
// 0.26x the standard step (H200, session 32). v2's GEMM stage gives each CTA whole 16-row weight tiles over
// the full K, splits K over its 8 warps and stages the activation rows in shared memory. At 64 rows that
// staging no longer fits beside the weight ring (64 rows x 2048 columns x 2 bytes = 256 KB), and a CTA that
// owns one tile of the down projection (K = 8192) must read all 64 x 8192 activations (1 MB) from L2 to use
// 256 KB of weights: 128 CTAs then read ~128 MB from L2 per stage against 33.6 MB from HBM. This program
// times the stage alone in other work splits, so the design of v2 beyond 16 rows can start from numbers:
// - each CTA takes a group of T consecutive 16-row tiles and 1/S of K (S > 1: a K split, whose S fp32
//   partial outputs a later stage would add in a fixed order);
// - K goes in chunks of KC columns: the producer warp bulk-copies the T tiles' KC-column slices into one
//   ring slot (the weights laid out tile by tile and chunk by chunk, so each slice is one contiguous copy,
//   tagged L2 evict-first as the fused step's), while the consumers stage the chunk's M x KC activations
//   from L2 by cp.async, double-buffered, once for all T tiles;
// - the 8 consumer warps split the T tiles (WT warps, T / WT tiles each), then the rows (WN, 8 rows each),
//   then K (WK), whichever the tile count leaves; each warp's fp32 accumulators stay in registers through
//   the whole K range. WT = T reads the staged activations once per warp (8 times a chunk at T = 8);
//   fewer warps across the tiles read each weight fragment more often and the activations less.
// Each launch runs LAYERS layers of the stage on fresh weights (so they come from HBM), with a grid
// barrier between layers as the next stage's dependency would impose; the producer runs ahead across it
// as the fused step's does. The table gives the median (and P90) microseconds per stage, the weight rate,
// its share of the plain read bandwidth measured in the same run, and the activation bytes read from L2.
// Every configuration's outputs (layer 0, all splits added) are checked against a plain GPU reference
// product; any mismatch fails the run.
//
// Build and run on the GPU machine:
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/wide_stage experiments/fused/ringbench/wide_stage.cu && /tmp/wide_stage
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ringbench.cuh"

#define CONSUMERS 256
#define THREADS (CONSUMERS + 32)
#define MAX_SLOTS 16
#define XS_PAD 64  // bytes after each staged activation row: row strides 64 bytes off a 128-byte multiple
#define LAYERS 16

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory"); }
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                               unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float bf16_to_f32(unsigned short v) { return __uint_as_float((unsigned)v << 16); }

struct StageArgs {
    // Weights of LAYERS layers, each [tiles][K / kc][16][kc] bf16 (tile t's chunk c is one contiguous
    // 16 x kc block: weight row n = 16 t + r, column k = kc c + j).
    const unsigned short* w;
    const unsigned short* x;  // [M][K] bf16, the same for every layer (so, after the first, from L2)
    float* out;               // [splits][M][N] fp32
    unsigned long long* ctr;  // grid barrier counter: only grows; `base` is its value at this launch
    unsigned long long base;
    int n, k, kc, splits, layers, slots;
};

// Weight element (n, k) in StageArgs::w's layout (layer 0).
__host__ __device__ inline size_t w_index(int n, int k, int K, int kc) {
    return (((size_t)(n / 16) * (K / kc) + k / kc) * 16 + n % 16) * kc + k % kc;
}

// One stage: M activation rows, T tiles per CTA group (1, 2, 4 or 8), WT warps across the tiles.
template <int M, int T, int WT>
__global__ void __launch_bounds__(THREADS, 1) stage_kernel(StageArgs a) {
    constexpr int TW = T / WT;                                   // tiles per warp
    constexpr int WN = (8 / WT) < (M / 8) ? (8 / WT) : (M / 8);  // warps across 8-row blocks
    constexpr int WK = 8 / (WT * WN);                            // then across K
    constexpr int NF = M / 8 / WN;                               // 8-row blocks per warp
    static_assert(TW * WT == T && WT * WN * WK == 8 && NF * WN * 8 == M, "warp split");
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ unsigned long long full[MAX_SLOTS], empty[MAX_SLOTS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, t = lane & 3;
    const int tiles = a.n / 16, groups_per_split = tiles / T, groups = groups_per_split * a.splits;
    const int ks = a.k / a.splits, nch = ks / a.kc;
    const unsigned slot_bytes = (unsigned)T * 16 * a.kc * 2;
    const int xs_stride = a.kc * 2 + XS_PAD;
    unsigned char* ring = smem;
    unsigned char* xs = smem + (size_t)a.slots * slot_bytes;  // two buffers of M rows
    init_ring(full, empty, a.slots);
    if (warp == 8) {
        // The producer: every chunk of every group of every layer, in the consumers' order, up to the ring
        // ahead (across the grid barriers too).
        if (lane == 0) {
            unsigned i = 0;
            for (int l = 0; l < a.layers; ++l) {
                const unsigned short* wl = a.w + (size_t)l * a.n * a.k;
                for (int g = blockIdx.x; g < groups; g += gridDim.x) {
                    const int s = g / groups_per_split, tile0 = (g % groups_per_split) * T;
                    for (int c = 0; c < nch; ++c, ++i) {
                        const int slot = i % a.slots;
                        if (i >= (unsigned)a.slots) mbar_wait(&empty[slot], (i / a.slots - 1) & 1u);
                        mbar_expect(&full[slot], slot_bytes);
                        const int kcol = s * ks + c * a.kc;
                        for (int tt = 0; tt < T; ++tt) {
                            bulk_copy_evict_first(ring + (size_t)slot * slot_bytes + (size_t)tt * 16 * a.kc * 2,
                                                  wl + w_index((tile0 + tt) * 16, kcol, a.k, a.kc), 16 * a.kc * 2,
                                                  &full[slot]);
                        }
                    }
                }
            }
        }
        return;
    }
    const int wt = warp % WT, wn = (warp / WT) % WN, wk = warp / (WT * WN);
    unsigned i = 0;
    // Stages chunk columns [k0, k0 + kc) of every activation row into buffer b.
    auto stage_x = [&](int b, int k0) {
        const int per_row = a.kc / 8;  // 16-byte pieces
        unsigned char* dst = xs + (size_t)b * M * xs_stride;
        for (int p = threadIdx.x; p < M * per_row; p += CONSUMERS) {
            const int m = p / per_row, j = p % per_row;
            cp_async16(dst + (size_t)m * xs_stride + j * 16, a.x + (size_t)m * a.k + k0 + j * 8);
        }
        cp_async_commit();
    };
    for (int l = 0; l < a.layers; ++l) {
        for (int g = blockIdx.x; g < groups; g += gridDim.x) {
            const int s = g / groups_per_split, tile0 = (g % groups_per_split) * T;
            float c[TW][NF][4];
#pragma unroll
            for (int u = 0; u < TW; ++u)
#pragma unroll
                for (int f = 0; f < NF; ++f) c[u][f][0] = c[u][f][1] = c[u][f][2] = c[u][f][3] = 0.0f;
            stage_x(0, s * ks);
            for (int ch = 0; ch < nch; ++ch, ++i) {
                cp_async_wait_all();
                consumers_sync();  // chunk ch's activations are in; every warp is done with chunk ch - 1
                if (ch + 1 < nch) stage_x((ch + 1) & 1, s * ks + (ch + 1) * a.kc);
                const int slot = i % a.slots;
                mbar_wait(&full[slot], (i / a.slots) & 1u);
                // This warp's tiles are wt, wt + WT, ... of the group.
                const unsigned char* wa = ring + (size_t)slot * slot_bytes + (size_t)wt * 16 * a.kc * 2;
                const size_t tile_step = (size_t)WT * 16 * a.kc * 2;
                const unsigned char* xb = xs + (size_t)(ch & 1) * M * xs_stride;
                // The fused step's fragment scheme (fv2_gemm): per 32 columns each lane loads 8 consecutive
                // columns of its A rows and its B row; the same k permutation on both sides, so the sum
                // over k is unchanged.
                for (int sc = wk; sc * 32 < a.kc; sc += WK) {
                    const int kl = sc * 32 + t * 8;
                    uint4 b[NF];
#pragma unroll
                    for (int f = 0; f < NF; ++f) {
                        const int m = (wn * NF + f) * 8 + gq;
                        b[f] = *reinterpret_cast<const uint4*>(xb + (size_t)m * xs_stride + kl * 2);
                    }
#pragma unroll
                    for (int u = 0; u < TW; ++u) {
                        const unsigned char* wu = wa + u * tile_step;
                        const uint4 a_lo = *reinterpret_cast<const uint4*>(wu + gq * a.kc * 2 + kl * 2);
                        const uint4 a_hi = *reinterpret_cast<const uint4*>(wu + (gq + 8) * a.kc * 2 + kl * 2);
#pragma unroll
                        for (int f = 0; f < NF; ++f) {
                            mma_bf16_16816(c[u][f], a_lo.x, a_hi.x, a_lo.y, a_hi.y, b[f].x, b[f].y);
                            mma_bf16_16816(c[u][f], a_lo.z, a_hi.z, a_lo.w, a_hi.w, b[f].z, b[f].w);
                        }
                    }
                }
                consumers_sync();  // every warp is done with the slot
                if (threadIdx.x == 0) mbar_arrive(&empty[slot]);
            }
            // The K-split warps' partials added in warp order through shared memory (the activation
            // buffers are free: the last chunk's barrier has passed), then written by the wk = 0 warps.
            if (WK > 1) {
                // WK > 1 only where the split leaves one tile and one 8-row block a warp (TW = NF = 1).
                static_assert(WK == 1 || (TW == 1 && NF == 1), "K-split warps hold one fragment");
                float* red = reinterpret_cast<float*>(xs);
#pragma unroll
                for (int e = 0; e < 4; ++e) red[(warp * 4 + e) * 32 + lane] = c[0][0][e];
                consumers_sync();
                if (wk == 0) {
                    for (int o = 1; o < WK; ++o) {
                        const int w2 = warp + o * WT * WN;
#pragma unroll
                        for (int e = 0; e < 4; ++e) c[0][0][e] += red[(w2 * 4 + e) * 32 + lane];
                    }
                }
                consumers_sync();
            }
            if (wk == 0) {
                float* o = a.out + (size_t)s * M * a.n;
#pragma unroll
                for (int u = 0; u < TW; ++u) {
                    const int n0 = (tile0 + wt + u * WT) * 16;
#pragma unroll
                    for (int f = 0; f < NF; ++f) {
                        const int m = (wn * NF + f) * 8 + 2 * t;
                        o[(size_t)m * a.n + n0 + gq] = c[u][f][0];
                        o[(size_t)(m + 1) * a.n + n0 + gq] = c[u][f][1];
                        o[(size_t)m * a.n + n0 + gq + 8] = c[u][f][2];
                        o[(size_t)(m + 1) * a.n + n0 + gq + 8] = c[u][f][3];
                    }
                }
            }
        }
        // The next layer's stage needs this one's outputs everywhere (grid barrier; the producer does not
        // join it and runs ahead).
        if (threadIdx.x == 0) grid_barrier(a.ctr, a.base + (unsigned long long)(l + 1) * gridDim.x);
        consumers_sync();
    }
}

// out[m][n] = sum over k of x[m][k] w(n, k), fp32, one thread per output.
__global__ void reference(const unsigned short* w, const unsigned short* x, float* out, int M, int N, int K, int kc) {
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= M * N) return;
    const int m = idx / N, n = idx % N;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) acc += bf16_to_f32(x[(size_t)m * K + k]) * bf16_to_f32(w[w_index(n, k, K, kc)]);
    out[idx] = acc;
}

// Deterministic bf16 values in [-1, 1) from the element index.
__global__ void fill(unsigned short* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        const float v = (float)(h & 0xffff) / 32768.0f - 1.0f;
        p[i] = (unsigned short)(__float_as_uint(v) >> 16);
    }
}

struct Config {
    const char* stage;
    int n, k, m, t, splits, kc;
    int wt;  // warps across the tiles (0: min(T, 8), one tile a warp)
};

typedef void (*Kernel)(StageArgs);
static Kernel kernel_for(int m, int t, int wt) {
    static const struct {
        int m, t, wt;
        Kernel k;
    } table[] = {
        {16, 1, 1, stage_kernel<16, 1, 1>}, {16, 2, 2, stage_kernel<16, 2, 2>}, {16, 4, 4, stage_kernel<16, 4, 4>},
        {16, 8, 8, stage_kernel<16, 8, 8>}, {32, 1, 1, stage_kernel<32, 1, 1>}, {32, 2, 2, stage_kernel<32, 2, 2>},
        {32, 4, 4, stage_kernel<32, 4, 4>}, {32, 8, 8, stage_kernel<32, 8, 8>}, {64, 1, 1, stage_kernel<64, 1, 1>},
        {64, 2, 2, stage_kernel<64, 2, 2>}, {64, 4, 4, stage_kernel<64, 4, 4>}, {64, 8, 8, stage_kernel<64, 8, 8>},
        // Fewer warps across the tiles at 64 rows: each activation fragment read by 4 or 2 warps a chunk
        // instead of 8, each weight fragment by 2 or 4.
        {64, 8, 4, stage_kernel<64, 8, 4>}, {64, 8, 2, stage_kernel<64, 8, 2>}, {64, 4, 2, stage_kernel<64, 4, 2>},
    };
    for (const auto& e : table)
        if (e.m == m && e.t == t && e.wt == wt) return e.k;
    return nullptr;
}

int main() {
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount;
    const size_t max_w = (size_t)16384 * 2048 * LAYERS;  // the largest stage's LAYERS layers, elements
    unsigned short *w, *x;
    float *out, *ref;
    unsigned long long* ctr;
    unsigned* sink;
    CHECK(cudaMalloc(&w, max_w * 2));
    CHECK(cudaMalloc(&x, (size_t)64 * 8192 * 2));
    CHECK(cudaMalloc(&out, (size_t)8 * 64 * 16384 * 4));
    CHECK(cudaMalloc(&ref, (size_t)64 * 16384 * 4));
    CHECK(cudaMalloc(&ctr, 8));
    CHECK(cudaMalloc(&sink, 4));
    CHECK(cudaMemset(ctr, 0, 8));
    fill<<<sms * 8, 256>>>(w, max_w, 0x9e3779b9u);
    fill<<<sms * 8, 256>>>(x, (size_t)64 * 8192, 0x85ebca6bu);
    CHECK(cudaGetLastError());
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    // The floor: the plain read rate over the weight buffer, median of 5 (after one warm-up).
    const double read_tbs = (double)max_w * 2 / (median_read_ms(w, max_w * 2, sms, sink) * 1e-3) / 1e12;
    printf("GPU %s, %d SMs, %zu KB opt-in shared memory per block; plain read bandwidth %.3f TB/s (%.0f MB read, median of 5)\n",
           prop.name, sms, prop.sharedMemPerBlockOptin / 1024, read_tbs, max_w * 2 / 1e6);
    printf("one CTA per SM (8 consumer warps + 1 producer warp); %d layers of the stage per launch on fresh weights, a grid barrier between layers; 10 timed launches after 2\n\n",
           LAYERS);
    // llama3.2-1b's stages: QKV 3072 x 2048, O 2048 x 2048, gate/up (paired) 16384 x 2048, down 2048 x 8192.
    std::vector<Config> configs;
    for (int m : {16, 32, 64}) {
        configs.push_back({"gate/up", 16384, 2048, m, 8, 1, 256});
        configs.push_back({"gate/up", 16384, 2048, m, 8, 1, 128});
        if (m == 64) {
            configs.push_back({"gate/up", 16384, 2048, m, 8, 1, 128, 4});
            configs.push_back({"gate/up", 16384, 2048, m, 8, 1, 128, 2});
        }
        configs.push_back({"down", 2048, 8192, m, 1, 1, 512});
        configs.push_back({"down", 2048, 8192, m, 2, 2, 256});
        configs.push_back({"down", 2048, 8192, m, 4, 4, 256});
        if (m == 64) configs.push_back({"down", 2048, 8192, m, 4, 4, 256, 2});
        configs.push_back({"down", 2048, 8192, m, 8, 8, 256});
        configs.push_back({"qkv", 3072, 2048, m, 1, 1, 512});
        configs.push_back({"qkv", 3072, 2048, m, 2, 1, 256});
        configs.push_back({"o", 2048, 2048, m, 1, 1, 512});
        configs.push_back({"o", 2048, 2048, m, 2, 2, 256});
        if (m == 16) {
            // Closest to v2 as it runs at 16 rows (one tile over the whole K per CTA, 32 KB copies).
            configs.push_back({"down", 2048, 8192, m, 1, 1, 1024});
            configs.push_back({"o", 2048, 2048, m, 1, 1, 1024});
        }
    }
    unsigned long long base = 0;
    int failures = 0;
    printf("| stage | rows | tiles/CTA | warps across tiles | K split | chunk cols | groups | ring slots x KB | us median | P90 | weight TB/s | %% of read bw | floor us | activation MB from L2 | check |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|\n");
    for (const Config& c : configs) {
        const int tiles = c.n / 16, groups = tiles / c.t * c.splits;
        const size_t slot_bytes = (size_t)c.t * 16 * c.kc * 2;
        const size_t xs_bytes = 2 * (size_t)c.m * (c.kc * 2 + XS_PAD);
        const size_t budget = prop.sharedMemPerBlockOptin - 2 * MAX_SLOTS * 8 - 1024;
        const int slots = xs_bytes >= budget ? 0 : (int)std::min<size_t>(MAX_SLOTS, (budget - xs_bytes) / slot_bytes);
        const size_t smem = slots * slot_bytes + xs_bytes;
        const int wt = c.wt ? c.wt : std::min(c.t, 8);
        Kernel kern = kernel_for(c.m, c.t, wt);
        if (slots < 2 || !kern || tiles % c.t || (c.k / c.splits) % c.kc || c.kc % 32) {
            printf("| %s | %d | %d | %d | %d | %d | %d | - | not runnable (%d slots) |\n", c.stage, c.m, c.t, wt, c.splits,
                   c.kc, groups, slots);
            continue;
        }
        CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        StageArgs a{w, x, out, ctr, 0, c.n, c.k, c.kc, c.splits, LAYERS, slots};
        std::vector<float> us;
        for (int r = 0; r < 12; ++r) {
            a.base = base;
            CHECK(cudaEventRecord(e0));
            kern<<<sms, THREADS, smem>>>(a);
            CHECK(cudaEventRecord(e1));
            CHECK(cudaEventSynchronize(e1));
            CHECK(cudaGetLastError());
            base += (unsigned long long)LAYERS * sms;
            float ms;
            CHECK(cudaEventElapsedTime(&ms, e0, e1));
            if (r >= 2) us.push_back(ms * 1e3f / LAYERS);
        }
        std::sort(us.begin(), us.end());
        const double med = us[us.size() / 2], p90 = us[std::min(us.size() - 1, us.size() * 9 / 10)];
        const double wbytes = (double)c.n * c.k * 2;
        // The check: layer 0 alone, the splits added, against the reference product.
        a.layers = 1;
        a.base = base;
        CHECK(cudaMemset(out, 0, (size_t)c.splits * c.m * c.n * 4));
        kern<<<sms, THREADS, smem>>>(a);
        base += sms;
        reference<<<(c.m * c.n + 255) / 256, 256>>>(w, x, ref, c.m, c.n, c.k, c.kc);
        CHECK(cudaDeviceSynchronize());
        std::vector<float> o((size_t)c.splits * c.m * c.n), rf((size_t)c.m * c.n);
        CHECK(cudaMemcpy(o.data(), out, o.size() * 4, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(rf.data(), ref, rf.size() * 4, cudaMemcpyDeviceToHost));
        double worst = 0, scale = 0;
        for (size_t j = 0; j < rf.size(); ++j) {
            double sum = 0;
            for (int s = 0; s < c.splits; ++s) sum += o[(size_t)s * rf.size() + j];
            worst = std::max(worst, std::fabs(sum - rf[j]));
            scale = std::max(scale, (double)std::fabs(rf[j]));
        }
        // fp32 sums of K products of values in [-1, 1) in two orders differ by rounding, far below 1e-4 of
        // the largest output; a wrong fragment or index mapping is off by the outputs' own size.
        const bool ok = worst <= 1e-4 * std::max(scale, 1.0);
        failures += !ok;
        printf("| %s | %d | %d | %d | %d | %d | %d | %d x %zu | %.2f | %.2f | %.2f | %.0f%% | %.2f | %.1f | %s (%.1e of %.1f) |\n",
               c.stage, c.m, c.t, wt, c.splits, c.kc, groups, slots, slot_bytes / 1024, med, p90, wbytes / (med * 1e-6) / 1e12,
               100.0 * wbytes / (med * 1e-6) / 1e12 / read_tbs, wbytes / (read_tbs * 1e12) * 1e6,
               (double)groups * c.m * (c.k / c.splits) * 2 / 1e6, ok ? "ok" : "MISMATCH", worst, scale);
    }
    printf("\n%d configuration(s) mismatched the reference\n", failures);
    return failures ? 1 : 0;
}
