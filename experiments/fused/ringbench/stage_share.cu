// stage_share: what one activation staging costs when every CTA copies the same rows from L2 at the same
// moment, under the weight stream, and whether a different order or sharing the copy within a thread-block
// cluster makes it cheaper (issue 6, session 36). A diagnostic, not part of the engine.
//
// Why: in session 34's profiled v2 step (H100) the activation stagings were 9% of the step at 1 x 1 and 19%
// at 1 x 8. The O stage's cp.async copy of 8 rows (32 KB a CTA) took ~2.7 us, ~1.6 TB/s over the grid, far
// below what L2 serves. Every CTA copies the same rows in the same order, so at any moment 132 SMs ask for
// the same few lines. Three readings predict different fixes:
//   - the lines' slices serialise the 132 requests while the other slices idle: a rotated order (each CTA
//     starting at its own line, candidate `rot`) is as fast as L2's bandwidth allows;
//   - every copy pays L2's latency under the weight stream whatever its order: rotating changes nothing, and
//     only fewer round trips help;
//   - the bytes through L2 are the limit: a cluster of C CTAs that copies the rows once and multicasts them
//     to all C (cp.async.bulk ... .multicast::cluster) takes ~1/C of the time.
//
// One CTA per SM (or per cluster slot): 8 consumer warps and a producer warp. The producer streams the CTA's
// own fresh weight region through bulk copies, one 32 KB copy in flight, L2 evict-first (the fused step's),
// or nothing. The consumers run REPS rounds: a grid barrier (so every CTA starts the round together, as after
// a stage counter), then thread 0 times one staging of M rows of K = 2048 bf16 (4 KB a row) into shared
// memory until it has landed and the CTA (or cluster) is past a barrier:
//   order   cp.async of 16-byte pieces by the 256 consumer threads, every CTA in the same order (shipped);
//   rotated the same, each CTA starting at its own 128-byte line (candidate `rot`);
//   bulk    one bulk copy per row by thread 0, completing on an mbarrier;
//   mcast2  clusters of 2: each CTA bulk-copies every other row, multicast to both CTAs;
//   mcast4  clusters of 4, every fourth row each.
// Per mode, rows and stream it prints the median over rounds of the mean and the slowest CTA's staging
// time, and the grid's staging rate (M x 4 KB x CTAs / the slowest CTA's time).
//
// Build and run on the GPU machine (run_fused_h200.sh's `share` part):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/stage_share \
//     experiments/fused/ringbench/stage_share.cu && /tmp/stage_share
// (sm_90a: ptxas advises the multicast copy there rather than on sm_90.)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ringbench.cuh"

#define CONSUMERS 256
#define THREADS (CONSUMERS + 32)
#define K_COLS 2048
#define ROW_BYTES (K_COLS * 2)
#define MAX_ROWS 16
#define REPS 64

enum { ORDER = 0, ROTATED = 1, BULK = 2, MCAST = 3 };

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory"); }
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned cluster_size() {
    unsigned n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return n;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// One bulk copy of `bytes` into the same shared-memory offset of every CTA in `mask`, each completing on its
// own mbarrier at `bar`'s offset.
__device__ __forceinline__ void bulk_copy_multicast(void* dst, const void* src, unsigned bytes, unsigned long long* bar,
                                                    unsigned short mask) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], "
        "%4;" ::"r"(smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar)), "h"(mask)
        : "memory");
}

struct Args {
    const unsigned char* w;  // per CTA a fresh weight region of region_bytes
    size_t region_bytes;
    const unsigned char* rows;  // MAX_ROWS x ROW_BYTES, written once (L2-resident)
    int m, mode, stream;
    unsigned long long* ctr;  // grid barrier (only grows; base at this launch)
    unsigned long long base;
    unsigned long long* out;  // per CTA: REPS staging cycles, then the SM clock's cycles and ns over them
};

__device__ void consume(const Args& a, unsigned char* xs, unsigned long long* xbar);

__global__ void __launch_bounds__(THREADS, 1) share_kernel(Args a) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* xs = smem;                                // MAX_ROWS x ROW_BYTES
    unsigned char* ring = smem + MAX_ROWS * ROW_BYTES;       // 2 x 32 KB
    __shared__ unsigned long long full[2], xbar;
    __shared__ volatile int stop;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        mbar_init(&full[0], 1);
        mbar_init(&full[1], 1);
        mbar_init(&xbar, 1);
        stop = 0;
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    // Every CTA of a cluster has its barrier initialised before any multicast reaches it.
    if (a.mode == MCAST) cluster_sync();
    if (warp == CONSUMERS / 32) {
        // Until the consumers are done; no copy is in flight when the CTA leaves.
        if (lane == 0 && a.stream) {
            stream_region(a.w + (size_t)blockIdx.x * a.region_bytes, a.region_bytes, 32u << 10, ring, full,
                          [&] { return stop != 0; });
        }
        __syncwarp();
    } else {
        consume(a, xs, &xbar);
        if (threadIdx.x == 0) stop = 1;
    }
    // No CTA of a cluster leaves while a peer's multicast may still be on its way to it.
    __syncthreads();
    if (a.mode == MCAST) cluster_sync();
}

// The consumers' rounds (above).
__device__ void consume(const Args& a, unsigned char* xs, unsigned long long* xbar_p) {
    unsigned long long& xbar = *xbar_p;
    const int pieces = a.m * (ROW_BYTES / 16);
    const unsigned total = gridDim.x;
    // Let the stream reach its steady state.
    if (threadIdx.x == 0) {
        const unsigned long long w0 = now_ns();
        while (now_ns() - w0 < 20000ull) {
        }
    }
    const long long c0 = clock64();
    const unsigned long long n0 = now_ns();
    for (int rep = 0; rep < REPS; ++rep) {
        // Every CTA starts the round together, as the CTAs of a stage do after its counter.
        consumers_sync();
        if (threadIdx.x == 0) grid_barrier(a.ctr, a.base + (unsigned long long)(rep + 1) * total);
        consumers_sync();
        const long long t0 = clock64();
        if (a.mode == ORDER || a.mode == ROTATED) {
            const int rot = a.mode == ROTATED ? (int)(((unsigned)pieces * blockIdx.x / total) & ~7u) : 0;
            for (int i0 = threadIdx.x; i0 < pieces; i0 += CONSUMERS) {
                const int i = i0 + rot < pieces ? i0 + rot : i0 + rot - pieces;
                cp_async16(xs + (size_t)i * 16, a.rows + (size_t)i * 16);
            }
            asm volatile("cp.async.commit_group;\n\tcp.async.wait_group 0;" ::: "memory");
            consumers_sync();
        } else {
            const unsigned rank = a.mode == MCAST ? cluster_rank() : 0, csize = a.mode == MCAST ? cluster_size() : 1;
            if (threadIdx.x == 0) {
                mbar_expect(&xbar, (unsigned)(a.m * ROW_BYTES));
                for (int r = (int)rank; r < a.m; r += (int)csize) {
                    if (a.mode == MCAST) {
                        bulk_copy_multicast(xs + (size_t)r * ROW_BYTES, a.rows + (size_t)r * ROW_BYTES, ROW_BYTES, &xbar,
                                            (unsigned short)((1u << csize) - 1u));
                    } else {
                        bulk_copy(xs + (size_t)r * ROW_BYTES, a.rows + (size_t)r * ROW_BYTES, ROW_BYTES, &xbar);
                    }
                }
                mbar_wait(&xbar, (unsigned)rep & 1u);
            }
            consumers_sync();
        }
        const long long t1 = clock64();
        // The next round's grid barrier also keeps a cluster's multicasts out of a peer still in this round:
        // a CTA arrives there only after all of this round's bytes have reached it.
        if (threadIdx.x == 0) a.out[(size_t)blockIdx.x * (REPS + 2) + rep] = (unsigned long long)(t1 - t0);
    }
    if (threadIdx.x == 0) {
        a.out[(size_t)blockIdx.x * (REPS + 2) + REPS] = (unsigned long long)(clock64() - c0);
        a.out[(size_t)blockIdx.x * (REPS + 2) + REPS + 1] = now_ns() - n0;
    }
}

int main() {
    cudaDeviceProp prop;
    const int sms = open_device(&prop);
    const size_t region = 24ull << 20;  // per CTA: 24 MB of weights (~3 GB over 132 SMs: no L2 reuse)
    unsigned char *w, *rows;
    unsigned long long *ctr, *out;
    w = weight_regions(sms, region);
    CHECK(cudaMalloc(&rows, MAX_ROWS * ROW_BYTES));
    CHECK(cudaMemset(rows, 2, MAX_ROWS * ROW_BYTES));
    CHECK(cudaMalloc(&ctr, 8));
    CHECK(cudaMemset(ctr, 0, 8));
    CHECK(cudaMalloc(&out, (size_t)sms * (REPS + 2) * 8));
    const size_t smem = MAX_ROWS * ROW_BYTES + 2 * (32 << 10);  // 128 KB: one CTA per SM
    CHECK(cudaFuncSetAttribute(share_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    CHECK(cudaFuncSetAttribute(share_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    printf("GPU %s, %d SMs; one CTA per SM (8 consumer warps + a producer warp); per round every CTA stages M rows"
           " of 4 KB (bf16, K = 2048) from L2 after a grid barrier; %d rounds; stream: one 32 KB bulk copy in flight"
           " per CTA, L2 evict-first\n\n",
           prop.name, sms, REPS);
    printf("| mode | rows | stream | CTAs | mean CTA us (median over rounds) | slowest CTA us | grid GB/s (slowest) |\n");
    printf("|---|---:|---|---:|---:|---:|---:|\n");
    struct Mode {
        const char* name;
        int mode, cluster;
    };
    const Mode modes[] = {{"order (shipped)", ORDER, 1}, {"rotated (rot)", ROTATED, 1}, {"bulk, a copy a row", BULK, 1},
                          {"multicast, clusters of 2", MCAST, 2}, {"multicast, clusters of 4", MCAST, 4}};
    unsigned long long base = 0;
    for (const Mode& md : modes) {
        // The grid: one CTA per SM, or as many whole clusters as can be resident at once (the grid barrier
        // needs every CTA resident).
        int grid = sms;
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute attr[1];
        cfg.blockDim = dim3(THREADS);
        cfg.dynamicSmemBytes = smem;
        if (md.cluster > 1) {
            attr[0].id = cudaLaunchAttributeClusterDimension;
            attr[0].val.clusterDim.x = md.cluster;
            attr[0].val.clusterDim.y = 1;
            attr[0].val.clusterDim.z = 1;
            cfg.attrs = attr;
            cfg.numAttrs = 1;
            cfg.gridDim = dim3(sms / md.cluster * md.cluster);
            int clusters = 0;
            CHECK(cudaOccupancyMaxActiveClusters(&clusters, share_kernel, &cfg));
            grid = std::min(sms / md.cluster, clusters) * md.cluster;
        }
        cfg.gridDim = dim3(grid);
        for (int m : {1, 8, 16}) {
            for (int stream = 0; stream < 2; ++stream) {
                Args a = {w, region, rows, m, md.mode, stream, ctr, base, out};
                CHECK(cudaMemset(out, 0, (size_t)sms * (REPS + 2) * 8));
                CHECK(cudaLaunchKernelEx(&cfg, share_kernel, a));
                CHECK(cudaGetLastError());
                CHECK(cudaDeviceSynchronize());
                base += (unsigned long long)REPS * grid;
                std::vector<unsigned long long> h((size_t)grid * (REPS + 2));
                CHECK(cudaMemcpy(h.data(), out, h.size() * 8, cudaMemcpyDeviceToHost));
                std::vector<double> mean_us, max_us;
                for (int rep = 2; rep < REPS; ++rep) {  // the first rounds warm the lines into L2
                    double sum = 0, mx = 0;
                    for (int c = 0; c < grid; ++c) {
                        const unsigned long long* r = &h[(size_t)c * (REPS + 2)];
                        const double ghz = r[REPS + 1] > 0 ? (double)r[REPS] / (double)r[REPS + 1] : 1.0;
                        const double us = (double)r[rep] / ghz * 1e-3;
                        sum += us;
                        mx = std::max(mx, us);
                    }
                    mean_us.push_back(sum / grid);
                    max_us.push_back(mx);
                }
                std::sort(mean_us.begin(), mean_us.end());
                std::sort(max_us.begin(), max_us.end());
                const double mean = mean_us[mean_us.size() / 2], slow = max_us[max_us.size() / 2];
                printf("| %s | %d | %s | %d | %.2f | %.2f | %.0f |\n", md.name, m, stream ? "32 KB a CTA" : "none", grid,
                       mean, slow, (double)m * ROW_BYTES * grid / (slow * 1e-6) * 1e-9);
            }
        }
    }
    return 0;
}
