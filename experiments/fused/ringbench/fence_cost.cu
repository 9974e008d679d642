// fence_cost: what one counter hop's release costs while the SMs stream weights the way the fused step does
// (issue 6, session 36). A diagnostic, not part of the engine.
//
// Why: every hop between the fused step's stages publishes with a release (fv2_arrive: a barrier of the 8
// consumer warps, then thread 0's `atom.add.release.gpu`; SASS: MEMBAR.ALL.GPU, ERRBAR, then the atomic),
// and the attention's split counter with `__threadfence()` (MEMBAR.SC.GPU) in every thread. In session 33's
// timeline (H100, 1 x 1) the combining item's bare fence took 0.6 us and the items' "partials written and
// fenced" 1.0 us, against 0.2 us for one dependent L2 load under the stream (l2_latency, session 30). A layer
// has ~7 such releases on its chain. Two readings predict different fixes:
//   - the fence waits for this SM's own outstanding traffic, the producer warp's 32 KB weight copy included
//     (~1.4 us to land at the SM's share of the bandwidth: a fence at a random moment would wait ~0.7 us).
//     Then pausing the copies around a release, or fewer releases per layer, would pay;
//   - the fence waits only for this thread's (and, through the barrier, this CTA's) stores to be
//     acknowledged, which queue card-wide behind the weight stream. Then a CTA that streams nothing sees the
//     same cost when others stream, and only fewer releases (or fewer bytes in flight) help.
//
// Each CTA (one per SM) has 8 consumer warps and a producer warp. The producer streams the CTA's own fresh
// weight region through bulk copies into two slots, one copy of `part` bytes in flight, L2 evict-first (the
// fused step's copies), until every CTA's measurements are done. The consumers run `iters` rounds of: every
// consumer thread stores one float (a tile epilogue's outputs: 1 KB a round per CTA, into the CTA's own
// lines) or not, the consumers' barrier, then thread 0 times one publishing operation with clock64:
//   0 atom.add.release.gpu on the CTA's own counter, its old value consumed (fv2_arrive);
//   1 __threadfence() then a relaxed atomicAdd (the attention split counter's pattern, thread 0 only);
//   2 a relaxed atom.add.gpu alone (the atomic's own round trip: what a release adds is 0 minus 2);
//   3 fence.acq_rel.gpu alone;
//   4 one ld.global.cg of a line the CTA wrote in an earlier round (a plain L2 round trip, for scale).
// Per mode and operation it prints the mean over CTAs of the mean cycles (and ns at the measured SM clock) per
// operation, the P90 and max over CTAs, and the streaming CTAs' aggregate bandwidth.
//
// Build and run on the GPU machine (run_fused_h200.sh's `fence` part):
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/fence_cost experiments/fused/ringbench/fence_cost.cu && /tmp/fence_cost
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ringbench.cuh"

#define CONSUMERS 256
#define OPS 5

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory"); }

// One publishing operation (above) by thread 0; returns a value that depends on its result.
__device__ __forceinline__ unsigned long long publish(int op, unsigned long long* ctr, const float* line) {
    unsigned long long old = 0;
    switch (op) {
        case 0: asm volatile("atom.add.release.gpu.u64 %0, [%1], 1;" : "=l"(old) : "l"(ctr) : "memory"); break;
        case 1:
            __threadfence();
            old = atomicAdd(ctr, 1ull);
            break;
        case 2: asm volatile("atom.add.relaxed.gpu.u64 %0, [%1], 1;" : "=l"(old) : "l"(ctr) : "memory"); break;
        case 3: asm volatile("fence.acq_rel.gpu;" ::: "memory"); break;
        default: old = (unsigned long long)__float_as_uint(__ldcg(line)); break;
    }
    return old;
}

// out per CTA: [0] streamed bytes, [1] stream ns, [2] summed op cycles, [3] rounds timed (0: not measuring),
// [4] SM cycles and [5] ns over the timed loop (the clock's rate).
__global__ void __launch_bounds__(CONSUMERS + 32, 1)
fence_probe(const unsigned char* w, size_t region_bytes, int part, int stream_mask, int measure_mask, int op, int store,
            int iters, float* lines, unsigned long long* ctrs, unsigned long long* done_ctr,
            unsigned long long measurers, unsigned long long* out) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ unsigned long long full[2];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int cls = 1 << (blockIdx.x & 1);  // even CTAs class 1, odd class 2
    const bool streams = (stream_mask & cls) != 0, measures = (measure_mask & cls) != 0;
    if (threadIdx.x == 0) {
        mbar_init(&full[0], 1);
        mbar_init(&full[1], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    unsigned long long* o = out + (size_t)blockIdx.x * 8;
    if (warp == CONSUMERS / 32) {
        if (lane != 0 || !streams) return;
        // Until every measurer is done.
        const unsigned long long t0 = now_ns();
        o[0] = stream_region(w + (size_t)blockIdx.x * region_bytes, region_bytes, (unsigned)part, ring, full,
                             [&] { return *(volatile unsigned long long*)done_ctr >= measurers; });
        o[1] = now_ns() - t0;
        return;
    }
    if (!measures) return;
    // The CTA's lines: 64 rounds' worth of 1 KB, reused round-robin.
    float* mine = lines + (size_t)blockIdx.x * 64 * CONSUMERS;
    unsigned long long* ctr = ctrs + (size_t)blockIdx.x * 16;  // its own 128-byte line
    // Warm: every line written once and in L2; then let the stream reach its steady state.
    for (int r = 0; r < 64; ++r) mine[r * CONSUMERS + threadIdx.x] = 1.0f;
    __threadfence();
    consumers_sync();
    const unsigned long long w0 = now_ns();
    while (now_ns() - w0 < 20000ull) {
    }
    consumers_sync();
    unsigned long long cycles = 0, sink = 0;
    const long long c_start = clock64();
    const unsigned long long n_start = now_ns();
    for (int it = 0; it < iters; ++it) {
        if (store) mine[(it & 63) * CONSUMERS + threadIdx.x] = (float)it;
        consumers_sync();
        if (threadIdx.x == 0) {
            const long long t0 = clock64();
            const unsigned long long v = publish(op, ctr, mine + ((it + 32) & 63) * CONSUMERS);
            // The value is consumed before the clock is read again, so the operation has completed.
            sink += v;
            asm volatile("" ::"l"(sink));
            const long long t1 = clock64();
            cycles += (unsigned long long)(t1 - t0);
        }
        consumers_sync();
    }
    const long long c_end = clock64();
    const unsigned long long n_end = now_ns();
    if (threadIdx.x == 0) {
        o[2] = cycles + (sink == 0xffffffffffffffffull);
        o[3] = (unsigned long long)iters;
        o[4] = (unsigned long long)(c_end - c_start);
        o[5] = n_end - n_start;
        atomicAdd(done_ctr, 1ull);
    }
}

struct Mode {
    const char* name;
    int stream_mask, measure_mask, part_kb, store;
};

int main() {
    cudaDeviceProp prop;
    const int sms = open_device(&prop);
    const size_t region = 24ull << 20;  // per CTA: 24 MB of weights, ~3 GB over 132 SMs (no L2 reuse)
    const int iters = 2000;
    unsigned char* w;
    float* lines;
    unsigned long long *out, *done_ctr, *ctrs;
    CHECK(cudaMalloc(&done_ctr, 8));
    w = weight_regions(sms, region);
    CHECK(cudaMalloc(&lines, (size_t)sms * 64 * CONSUMERS * 4));
    CHECK(cudaMemset(lines, 0, (size_t)sms * 64 * CONSUMERS * 4));
    CHECK(cudaMalloc(&ctrs, (size_t)sms * 16 * 8));
    CHECK(cudaMemset(ctrs, 0, (size_t)sms * 16 * 8));
    CHECK(cudaMalloc(&out, (size_t)sms * 8 * 8));
    const size_t smem = 2 * (64 << 10);  // one CTA per SM whatever the copy size
    CHECK(cudaFuncSetAttribute(fence_probe, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    const char* op_names[OPS] = {"atom.add.release.gpu (fv2_arrive)", "__threadfence + atomicAdd (split counter)",
                                 "atom.add.relaxed.gpu (round trip)", "fence.acq_rel.gpu alone",
                                 "ld.global.cg of an own line (L2 round trip)"};
    printf("GPU %s, %d SMs; one CTA per SM (8 consumer warps + a producer warp); %d timed rounds per measuring"
           " CTA; copies one in flight, two slots, L2 evict-first\n\n",
           prop.name, sms, iters);
    printf("| mode | operation | streaming CTAs | copy KB in flight | measuring CTAs | cycles (mean over CTAs) | ns |"
           " P90 ns over CTAs | max ns | stream TB/s |\n");
    printf("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    const Mode modes[] = {
        {"idle, epilogue stores", 0, 3, 32, 1},
        {"idle, no stores", 0, 3, 32, 0},
        {"all stream 32 KB, all measure, stores (the fused step)", 3, 3, 32, 1},
        {"all stream 32 KB, all measure, no stores", 3, 3, 32, 0},
        {"all stream 64 KB, all measure, stores", 3, 3, 64, 1},
        {"even stream 32 KB, odd measure, stores", 1, 2, 32, 1},
        {"even stream 64 KB, odd measure, stores (the card's bytes in flight as all at 32)", 1, 2, 64, 1},
        {"even stream 64 KB, even measure, stores", 1, 1, 64, 1},
    };
    for (const Mode& m : modes) {
        for (int op = 0; op < OPS; ++op) {
            std::vector<double> per_op;  // ns per operation, one entry per measuring CTA and rep
            double cyc_sum = 0, bytes = 0, secs = 0;
            int streaming = 0, measuring = 0, n_cyc = 0;
            for (int rep = 0; rep < 2; ++rep) {
                CHECK(cudaMemset(out, 0, (size_t)sms * 8 * 8));
                CHECK(cudaMemset(done_ctr, 0, 8));
                unsigned long long n_meas = 0;
                for (int c = 0; c < sms; ++c) n_meas += (m.measure_mask & (1 << (c & 1))) != 0;
                fence_probe<<<sms, CONSUMERS + 32, smem>>>(w, region, m.part_kb << 10, m.stream_mask, m.measure_mask,
                                                           op, m.store, iters, lines, ctrs, done_ctr, n_meas, out);
                CHECK(cudaGetLastError());
                CHECK(cudaDeviceSynchronize());
                std::vector<unsigned long long> h((size_t)sms * 8);
                CHECK(cudaMemcpy(h.data(), out, h.size() * 8, cudaMemcpyDeviceToHost));
                streaming = measuring = 0;
                double t_sum = 0;
                for (int c = 0; c < sms; ++c) {
                    const unsigned long long* r = &h[(size_t)c * 8];
                    if (r[0] > 0) {
                        ++streaming;
                        bytes += (double)r[0];
                        t_sum += (double)r[1];
                    }
                    if (r[3] > 0) {
                        ++measuring;
                        const double cyc = (double)r[2] / (double)r[3];
                        const double ghz = r[5] > 0 ? (double)r[4] / (double)r[5] : 1.0;  // cycles per ns
                        cyc_sum += cyc;
                        ++n_cyc;
                        per_op.push_back(cyc / ghz);
                    }
                }
                if (streaming > 0) secs += t_sum / streaming * 1e-9;
            }
            std::sort(per_op.begin(), per_op.end());
            double mean = 0;
            for (double v : per_op) mean += v;
            mean /= per_op.empty() ? 1 : (double)per_op.size();
            const double p90 = per_op.empty() ? 0 : per_op[(size_t)(0.9 * (per_op.size() - 1))];
            const double mx = per_op.empty() ? 0 : per_op.back();
            const double tbs = secs > 0 ? bytes / secs * 1e-12 : 0;
            printf("| %s | %s | %d | %d | %d | %.0f | %.0f | %.0f | %.0f | %.2f |\n", m.name, op_names[op], streaming,
                   m.stream_mask ? m.part_kb : 0, measuring, n_cyc ? cyc_sum / n_cyc : 0.0, mean, p90, mx, tbs);
        }
    }
    return 0;
}
