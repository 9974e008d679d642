// ring_stream: how fast one CTA per SM streams weights in bursts, through a ring of bulk copies like the
// fused step's (issue 6, session 19), or by plain loads. A diagnostic, not part of the engine.
//
// Why: in the fused step's timeline (NOTES v0.18) the gate/up stage streams ~508 KB per CTA at 1 x 1 and
// takes 24 us from the last O tile to the slowest CTA's last gate/up tile (mean CTA 16.4 us). With no MMAs
// and no epilogues it still takes 25 us. HBM would move that stage's bytes in ~15 us, and the LM head, 4 MB
// per CTA through the same ring, streams at the full rate. This program separates the ring from the rest:
// each CTA streams bursts of BURST bytes, with a grid barrier and an idle gap between bursts (as the
// attention chain stalls the real stages). In the gap the producer runs ahead by the whole ring. Per burst
// it records each CTA's start and end (%globaltimer), so it reports the mean and slowest CTA and the
// burst's span against the GPU's plain read bandwidth, measured in the same run.
//
// Build and run on the GPU machine (it has nvcc; the repository's binaries do not need this file):
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/ring_stream experiments/fused/ringbench/ring_stream.cu && /tmp/ring_stream
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "ringbench.cuh"

// CTA c's bytes of burst b: contiguous, and fresh for every (burst, CTA), so L2 never holds them.
__device__ __forceinline__ const unsigned char* burst_src(const unsigned char* w, int b, int burst_bytes) {
    return w + ((size_t)b * gridDim.x + blockIdx.x) * (size_t)burst_bytes;
}

__device__ __forceinline__ void prefetch_l2(const void* src, unsigned bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

// Ring mode: warp 0 lane 0 consumes (waits for each slot, releases it at once: no compute), warp 1 lane 0
// produces (refills a slot once released, running ahead through the barrier and the gap). With l2_lead > 0
// the producer also asks L2 for the chunk l2_lead chunks past each one it copies (bulk prefetch), so a gap
// leaves l2_lead more chunks waiting in L2 beyond the ring's slots.
__global__ void ring_kernel(const unsigned char* w, int slots, int slot_bytes, int burst_bytes, int bursts, int gap_ns,
                            int l2_lead, unsigned long long* ctr, unsigned long long* times) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ unsigned long long full[32], empty[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    init_ring(full, empty, slots);
    const int per_burst = burst_bytes / slot_bytes;
    const int chunks = per_burst * bursts;
    auto chunk_src = [&](int i) {
        return burst_src(w, i / per_burst, burst_bytes) + (size_t)(i % per_burst) * slot_bytes;
    };
    if (warp == 1 && lane == 0) {
        for (int i = 0; i < l2_lead && i < chunks; ++i) prefetch_l2(chunk_src(i), slot_bytes);
        for (int i = 0; i < chunks; ++i) {
            const int s = i % slots;
            if (i >= slots) mbar_wait(&empty[s], (unsigned)(i / slots - 1) & 1u);
            mbar_expect(&full[s], slot_bytes);
            bulk_copy(ring + (size_t)s * slot_bytes, chunk_src(i), slot_bytes, &full[s]);
            if (l2_lead > 0 && i + l2_lead < chunks) prefetch_l2(chunk_src(i + l2_lead), slot_bytes);
        }
    } else if (warp == 0 && lane == 0) {
        unsigned sink = 0;
        for (int b = 0; b < bursts; ++b) {
            grid_barrier(ctr, (unsigned long long)(b + 1) * gridDim.x);
            const unsigned long long g0 = now_ns();
            while (now_ns() - g0 < (unsigned long long)gap_ns) {
            }
            const unsigned long long t0 = now_ns();
            for (int j = 0; j < per_burst; ++j) {
                const int i = b * per_burst + j, s = i % slots;
                mbar_wait(&full[s], (unsigned)(i / slots) & 1u);
                sink += ring[(size_t)s * slot_bytes + (j & 127)];
                mbar_arrive(&empty[s]);
            }
            const unsigned long long t1 = now_ns();
            times[((size_t)blockIdx.x * bursts + b) * 2] = t0;
            times[((size_t)blockIdx.x * bursts + b) * 2 + 1] = t1 + (sink == 0xffffffffu);
        }
    }
}

// Kernel-like ring (session 20): the fused step's CTA shape around the same ring. Eight consumer warps
// (threads 0-255) wait on each chunk's full barrier together, spin `work_ns` (standing in for the MMAs),
// meet at named barrier 1 and thread 0 releases the slot, as fv2_gemm does; one producer warp (warp 8,
// lane 0) refills. `tiles` 64 KB tiles per burst are split over the grid as fused_tile_range splits the
// gate/up stage (1024 tiles: 100 CTAs take 8, 32 take 7 on 132 SMs), or every CTA takes `tiles` when
// `uniform`. After each burst's start the consumers spin `stage_ns` before their first chunk (standing
// in for the norm staging, during which the ring cannot refill). Times are thread 0's, burst start to
// its last release.
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }
__device__ __forceinline__ void spin_ns(int ns) {
    const unsigned long long t0 = now_ns();
    while (now_ns() - t0 < (unsigned long long)ns) {
    }
}
__global__ void kring_kernel(const unsigned char* w, int slots, int tiles, int uniform, int bursts, int gap_ns,
                             int stage_ns, int work_ns, unsigned long long* ctr, unsigned long long* times) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ unsigned long long full[32], empty[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned tile_bytes = 64u << 10;
    int t0, t1;
    if (uniform) {
        t0 = blockIdx.x * tiles;
        t1 = t0 + tiles;
    } else {
        t0 = (int)((long long)tiles * blockIdx.x / gridDim.x);
        t1 = (int)((long long)tiles * (blockIdx.x + 1) / gridDim.x);
    }
    const size_t burst_stride = (size_t)tile_bytes * (uniform ? (size_t)tiles * gridDim.x : (size_t)tiles);
    const int per_burst = t1 - t0, chunks = per_burst * bursts;
    init_ring(full, empty, slots);
    if (warp == 8) {
        if (lane == 0) {
            for (int i = 0; i < chunks; ++i) {
                const int s = i % slots;
                if (i >= slots) mbar_wait(&empty[s], (unsigned)(i / slots - 1) & 1u);
                mbar_expect(&full[s], tile_bytes);
                const unsigned char* src = w + (size_t)(i / per_burst) * burst_stride +
                                           (size_t)(t0 + i % per_burst) * tile_bytes;
                bulk_copy(ring + (size_t)s * tile_bytes, src, tile_bytes, &full[s]);
            }
        }
        return;
    }
    unsigned sink = 0;
    for (int b = 0; b < bursts; ++b) {
        if (threadIdx.x == 0) {
            grid_barrier(ctr, (unsigned long long)(b + 1) * gridDim.x);
            spin_ns(gap_ns);
        }
        consumers_sync();
        const unsigned long long start = now_ns();
        if (stage_ns > 0) spin_ns(stage_ns);
        consumers_sync();
        for (int j = 0; j < per_burst; ++j) {
            const int i = b * per_burst + j, s = i % slots;
            mbar_wait(&full[s], (unsigned)(i / slots) & 1u);
            sink += ring[(size_t)s * tile_bytes + threadIdx.x * 16];
            if (work_ns > 0) spin_ns(work_ns);
            consumers_sync();
            if (threadIdx.x == 0) mbar_arrive(&empty[s]);
        }
        if (threadIdx.x == 0) {
            times[((size_t)blockIdx.x * bursts + b) * 2] = start;
            times[((size_t)blockIdx.x * bursts + b) * 2 + 1] = now_ns() + (sink == 0xffffffffu);
        }
    }
}

// Load mode: the CTA's 256 threads read the burst by 16-byte loads, UNROLL in flight per thread, no ring
// and nothing fetched ahead through the gap.
template <int UNROLL>
__global__ void load_kernel(const unsigned char* w, int burst_bytes, int bursts, int gap_ns, unsigned long long* ctr,
                            unsigned long long* times, unsigned* out) {
    unsigned acc = 0;
    for (int b = 0; b < bursts; ++b) {
        if (threadIdx.x == 0) {
            grid_barrier(ctr, (unsigned long long)(b + 1) * gridDim.x);
            const unsigned long long g0 = now_ns();
            while (now_ns() - g0 < (unsigned long long)gap_ns) {
            }
        }
        __syncthreads();
        const unsigned long long t0 = now_ns();
        const uint4* src = reinterpret_cast<const uint4*>(burst_src(w, b, burst_bytes));
        const int n = burst_bytes / 16;
        // Every burst size here is a multiple of UNROLL x 256 x 16 bytes: no bounds check, so the loads issue
        // back to back.
        for (int base = threadIdx.x; base < n; base += UNROLL * blockDim.x) {
            uint4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) v[u] = __ldcs(src + base + u * blockDim.x);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            times[((size_t)blockIdx.x * bursts + b) * 2] = t0;
            times[((size_t)blockIdx.x * bursts + b) * 2 + 1] = now_ns();
        }
    }
    if (acc == 0x12345678u) out[0] = acc;
}

struct Stats {
    double cta_mean_us, cta_max_us, span_us, gbs;
};

// Bursts 1.. (burst 0 starts cold), per burst: mean and max CTA duration, span = last end - first start;
// medians over bursts.
static Stats summarize(const std::vector<unsigned long long>& t, int grid, int bursts, size_t burst_bytes) {
    std::vector<double> means, maxes, spans;
    for (int b = 1; b < bursts; ++b) {
        double sum = 0, mx = 0;
        unsigned long long first = ~0ull, last = 0;
        for (int c = 0; c < grid; ++c) {
            const unsigned long long t0 = t[((size_t)c * bursts + b) * 2], t1 = t[((size_t)c * bursts + b) * 2 + 1];
            const double d = (double)(t1 - t0) / 1e3;
            sum += d;
            mx = std::max(mx, d);
            first = std::min(first, t0);
            last = std::max(last, t1);
        }
        means.push_back(sum / grid);
        maxes.push_back(mx);
        spans.push_back((double)(last - first) / 1e3);
    }
    auto med = [](std::vector<double> v) {
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
    };
    Stats s{med(means), med(maxes), med(spans), 0};
    s.gbs = (double)grid * burst_bytes / (s.span_us * 1e3);
    return s;
}

int main(int argc, char** argv) {
    // "kernel": only the 3 x 64 KB ring and the kernel-like rows (session 20's question, ~1 minute less).
    const bool kernel_only = argc > 1 && std::string(argv[1]) == "kernel";
    int dev = 0, sms = 0;
    CHECK(cudaSetDevice(dev));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, dev));
    sms = prop.multiProcessorCount;
    const size_t buf_bytes = (size_t)3 << 30;
    unsigned char* w;
    unsigned long long *ctr, *times_d;
    unsigned* out;
    CHECK(cudaMalloc(&w, buf_bytes));
    CHECK(cudaMemset(w, 1, buf_bytes));
    CHECK(cudaMalloc(&ctr, 8));
    CHECK(cudaMalloc(&out, 4));
    const int max_bursts = 64;
    CHECK(cudaMalloc(&times_d, (size_t)sms * max_bursts * 2 * 8));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    printf("GPU %s, %d SMs; one CTA per SM in every burst test\n", prop.name, sms);

    // The read floor: the whole buffer, median of 5.
    const double read_gbs = buf_bytes / (median_read_ms(w, buf_bytes, sms, out) * 1e6);
    printf("plain read bandwidth (whole %zu MB buffer, median of 5): %.0f GB/s = %.1f KB/us per SM\n\n",
           buf_bytes >> 20, read_gbs, read_gbs / sms);

    CHECK(cudaFuncSetAttribute(ring_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    struct Cfg {
        const char* mode;
        int slots, slot_kb, burst_kb, gap_us, l2_lead;
    };
    std::vector<Cfg> cfgs;
    if (kernel_only) cfgs.push_back({"ring", 3, 64, 512, 10, 0});
    for (int burst_kb : {512, 256, 4096}) {
        if (kernel_only) break;
        for (int gap_us : {10, 0}) {
            if (burst_kb == 4096 && gap_us == 0) continue;
            for (auto sk : {std::pair<int, int>{3, 64}, {2, 64}, {6, 32}, {12, 16}, {1, 64}}) {
                cfgs.push_back({"ring", sk.first, sk.second, burst_kb, gap_us, 0});
            }
            // The 3 x 64 KB ring with chunks asked of L2 ahead of it: a gap leaves 192 KB in shared memory and
            // lead x 64 KB more in L2 per SM (over 132 SMs: 33, 50 and 67 MB at leads 4, 6 and 8, against a
            // 50 MB L2, so lead 8 must thrash).
            for (int lead : {4, 6, 8}) cfgs.push_back({"ring+L2", 3, 64, burst_kb, gap_us, lead});
            cfgs.push_back({"load8", 0, 0, burst_kb, gap_us, 0});
            cfgs.push_back({"load16", 0, 0, burst_kb, gap_us, 0});
        }
    }
    printf("| mode | ring | L2 lead | burst KB per CTA | gap us | mean CTA us | slowest CTA us | span us | GB/s | of read bw | "
           "span at read bw us |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    std::vector<unsigned long long> t((size_t)sms * max_bursts * 2);
    for (const Cfg& c : cfgs) {
        const size_t burst = (size_t)c.burst_kb << 10;
        const int bursts = (int)std::min<size_t>(max_bursts, buf_bytes / (burst * sms));
        Stats st{};
        for (int rep = 0; rep < 2; ++rep) {  // the first launch warms up
            CHECK(cudaMemset(ctr, 0, 8));
            if (c.mode[0] == 'r') {
                ring_kernel<<<sms, 64, (size_t)c.slots * (c.slot_kb << 10)>>>(w, c.slots, c.slot_kb << 10, (int)burst,
                                                                              bursts, c.gap_us * 1000, c.l2_lead, ctr, times_d);
            } else if (c.mode[4] == '8') {
                load_kernel<8><<<sms, 256>>>(w, (int)burst, bursts, c.gap_us * 1000, ctr, times_d, out);
            } else {
                load_kernel<16><<<sms, 256>>>(w, (int)burst, bursts, c.gap_us * 1000, ctr, times_d, out);
            }
            CHECK(cudaGetLastError());
            CHECK(cudaDeviceSynchronize());
        }
        CHECK(cudaMemcpy(t.data(), times_d, t.size() * 8, cudaMemcpyDeviceToHost));
        st = summarize(t, sms, bursts, burst);
        char ring[32] = "-";
        if (c.mode[0] == 'r') snprintf(ring, sizeof ring, "%d x %d KB", c.slots, c.slot_kb);
        printf("| %s | %s | %d | %d | %d | %.1f | %.1f | %.1f | %.0f | %.0f%% | %.1f |\n", c.mode, ring, c.l2_lead, c.burst_kb, c.gap_us,
               st.cta_mean_us, st.cta_max_us, st.span_us, st.gbs, 100.0 * st.gbs / read_gbs,
               (double)sms * burst / (read_gbs * 1e3));
    }
    // Kernel-like rows: the gate/up stage of llama3.2-1b at 1 x 1 is 1024 tiles of 64 KB.
    CHECK(cudaFuncSetAttribute(kring_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    struct KCfg {
        const char* what;
        int uniform, tiles, stage_ns, work_ns;
    };
    const KCfg kcfgs[] = {
        {"8 warps, 8 tiles each", 1, 8, 0, 0},
        {"8 warps, gate/up split (7 or 8)", 0, 1024, 0, 0},
        {"+ 2 us staging first", 0, 1024, 2000, 0},
        {"+ 2 us staging, 0.7 us work per tile", 0, 1024, 2000, 700},
        {"gate/up split, 0.7 us work per tile", 0, 1024, 0, 700},
        {"gate/up split, 1.5 us work per tile", 0, 1024, 0, 1500},
    };
    printf("\nKernel-like: 3 x 64 KB ring, 8 consumer warps + a producer warp (block 288), gap 10 us\n\n"
           "| consumers and tiles | mean CTA us | slowest CTA us | span us | GB/s | span at read bw us |\n"
           "|---|---:|---:|---:|---:|---:|\n");
    for (const KCfg& k : kcfgs) {
        const size_t total = (size_t)(k.uniform ? k.tiles * sms : k.tiles) << 16;
        const int bursts = (int)std::min<size_t>(max_bursts, buf_bytes / total);
        for (int rep = 0; rep < 2; ++rep) {
            CHECK(cudaMemset(ctr, 0, 8));
            kring_kernel<<<sms, 288, 3 * (64 << 10)>>>(w, 3, k.tiles, k.uniform, bursts, 10000, k.stage_ns, k.work_ns,
                                                        ctr, times_d);
            CHECK(cudaGetLastError());
            CHECK(cudaDeviceSynchronize());
        }
        CHECK(cudaMemcpy(t.data(), times_d, t.size() * 8, cudaMemcpyDeviceToHost));
        Stats st = summarize(t, sms, bursts, total / sms);
        printf("| %s | %.1f | %.1f | %.1f | %.0f | %.1f |\n", k.what, st.cta_mean_us, st.cta_max_us, st.span_us,
               st.gbs, (double)total / (read_gbs * 1e3));
    }
    printf("\nspan: the first CTA's burst start to the last CTA's burst end, median over bursts 1..; a ring that "
           "ran ahead through the gap starts each burst with up to slots x slot bytes already landed.\n");
    return 0;
}
