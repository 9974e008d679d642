// l2_latency: how long one dependent L2 load takes while the card streams weights the way the fused step
// does (issue 6, session 29). A diagnostic, not part of the engine.
//
// Why: in session 29's timeline (NOTES v0.33) gate/up's one-pass norm staging spends 2.7 us in one load of
// an 8 KB activation row that L2 holds, while its CTA's producer has a 32 KB weight copy in flight. The
// fused step's chain has ~15 such dependent round trips per layer. Two readings predict different fixes:
//   - per-SM queueing: the load's reply waits behind the same SM's in-flight copy (32 KB at the SM's share
//     of the read bandwidth drains in ~1.4 us). Then CTAs that stream nothing would see near-idle latency,
//     and a step whose latency chain runs on such CTAs could be faster;
//   - card-wide queueing: every load waits in L2 / HBM queues shared by all SMs. Then a quiet SM sees the
//     same latency, and only fewer bytes in flight over the whole card would help.
// Each CTA (one per SM) has a producer warp that streams its own fresh weight region through bulk copies
// into a two-slot ring, at most one copy of `part` bytes in flight (the fused step: 32 KB,
// FV2_MAX_INFLIGHT 1), tagged L2 evict-first as the fused step's are, and a chaser warp whose lane 0
// follows a pointer chain through its own L2-resident lines (ld.global.cg, each load's address from the
// one before) until it has made `loads` loads. Streaming stops when every chaser is done. Per mode it prints
// the chasing CTAs' mean and P90 latency per load and the streaming CTAs' aggregate bandwidth.
//
// Build and run on the GPU machine (run_fused_h200.sh's `l2lat` part):
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/l2_latency experiments/fused/ringbench/l2_latency.cu && /tmp/l2_latency
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ringbench.cuh"

// One pass over the chain, `loads` dependent loads: returns the last index (so nothing is optimised away).
__device__ __forceinline__ unsigned chase(const unsigned* chain, unsigned start, int loads) {
    unsigned i = start;
    for (int n = 0; n < loads; ++n) i = __ldcg(chain + i);
    return i;
}

// mode bits per CTA: stream (its producer copies) and chase (its chaser measures). chain: per CTA,
// `chain_words` words whose values form one cycle over 128-byte lines of the CTA's own region.
// done_ctr: chasers done so far (zeroed before each launch); the stream runs until all `chasers` are.
__global__ void probe(const unsigned char* w, size_t region_bytes, int part, const unsigned* chain, int chain_words,
                      int loads, int stream_mask, int chase_mask, unsigned long long* done_ctr,
                      unsigned long long chasers, unsigned long long* out) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ unsigned long long full[2];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // CTA class: even or odd block index, each with its own bit in the masks (1: even, 2: odd).
    const int cls = 1 << (blockIdx.x & 1);
    const bool streams = (stream_mask & cls) != 0, chases = (chase_mask & cls) != 0;
    if (threadIdx.x == 0) {
        mbar_init(&full[0], 1);
        mbar_init(&full[1], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    unsigned long long* o = out + (size_t)blockIdx.x * 4;
    if (warp == 0 && lane == 0 && streams) {
        // The stream runs while any chaser still runs: it must cover every measurement.
        const unsigned long long t0 = now_ns();
        o[0] = stream_region(w + (size_t)blockIdx.x * region_bytes, region_bytes, (unsigned)part, ring, full,
                             [&] { return *(volatile unsigned long long*)done_ctr >= chasers; });
        o[1] = now_ns() - t0;
    } else if (warp == 1 && lane == 0 && chases) {
        const unsigned* c = chain + (size_t)blockIdx.x * chain_words;
        unsigned i = chase(c, 0, chain_words / 32);  // warm: every line of the chain into L2
        // Let the stream reach its steady state first.
        const unsigned long long w0 = now_ns();
        while (now_ns() - w0 < 20000ull) {
        }
        const unsigned long long t0 = now_ns();
        i = chase(c, i, loads);
        o[2] = now_ns() - t0 + (i == 0xffffffffu);
        o[3] = 1;
        atomicAdd(done_ctr, 1ull);
    }
}

struct Mode {
    const char* name;
    int stream_mask, chase_mask, part_kb;
};

int main() {
    cudaDeviceProp prop;
    const int sms = open_device(&prop);
    const size_t region = 24ull << 20;  // per CTA: 24 MB of weights, ~3 GB over 132 SMs (no L2 reuse)
    const int chain_words = 32 * 256;   // per CTA: 256 lines of 128 bytes (32 KB; 4.2 MB over 132 SMs)
    const int loads = 4000;
    unsigned char* w;
    unsigned* chain;
    unsigned long long *out, *done_ctr;
    CHECK(cudaMalloc(&done_ctr, 8));
    w = weight_regions(sms, region);
    CHECK(cudaMalloc(&chain, (size_t)chain_words * sms * 4));
    CHECK(cudaMalloc(&out, (size_t)sms * 4 * 8));
    // Each CTA's chain: a random cycle over its 256 lines (word 0 of each line points to the next line's
    // word 0), so consecutive loads hit different lines in no order the hardware could prefetch.
    {
        std::vector<unsigned> h((size_t)chain_words * sms, 0u);
        uint64_t seed = 12345;
        auto rnd = [&]() {
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            return (unsigned)(seed >> 33);
        };
        for (int c = 0; c < sms; ++c) {
            std::vector<unsigned> order(chain_words / 32);
            for (unsigned k = 0; k < order.size(); ++k) order[k] = k;
            for (size_t k = order.size() - 1; k > 0; --k) std::swap(order[k], order[rnd() % (k + 1)]);
            for (size_t k = 0; k < order.size(); ++k) {
                h[(size_t)c * chain_words + order[k] * 32] = order[(k + 1) % order.size()] * 32;
            }
        }
        CHECK(cudaMemcpy(chain, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    }
    // 128 KB of dynamic shared memory whatever the copy size: one CTA per SM (the streamers wait for every
    // chaser, so all CTAs must be resident at once, and each SM's traffic must be one CTA's).
    const size_t smem = 2 * (64 << 10);
    CHECK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    printf("GPU %s, %d SMs; one CTA per SM; per chasing CTA %d dependent ld.global.cg loads over 256 L2-resident"
           " lines; copies one in flight, two slots, L2 evict-first\n\n",
           prop.name, sms, loads);
    printf("| mode | streaming CTAs | copy KB in flight per streaming CTA | chasing CTAs | load ns (mean over CTAs) |"
           " P90 over CTAs | max | stream TB/s (streaming CTAs' bytes / their mean time) |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|---:|\n");
    const Mode modes[] = {
        {"idle: nothing streams", 0, 3, 32},
        {"all stream 32 KB, all chase (the fused step)", 3, 3, 32},
        {"all stream 16 KB, all chase", 3, 3, 16},
        {"all stream 64 KB, all chase", 3, 3, 64},
        {"even stream 32 KB, odd chase", 1, 2, 32},
        {"even stream 64 KB, odd chase (the card's bytes in flight as all at 32)", 1, 2, 64},
        {"even stream 64 KB, even chase", 1, 1, 64},
    };
    for (const Mode& m : modes) {
        std::vector<double> lat;
        double bytes = 0, secs = 0;
        int streaming = 0, chasing = 0;
        for (int rep = 0; rep < 3; ++rep) {
            CHECK(cudaMemset(out, 0, (size_t)sms * 4 * 8));
            CHECK(cudaMemset(done_ctr, 0, 8));
            // Chasing CTAs: even block indices are class 1, odd ones class 2.
            unsigned long long n_chase = 0;
            for (int c = 0; c < sms; ++c) n_chase += (m.chase_mask & (1 << (c & 1))) != 0;
            probe<<<sms, 64, smem>>>(w, region, m.part_kb << 10, chain, chain_words, loads,
                                                      m.stream_mask, m.chase_mask, done_ctr, n_chase, out);
            CHECK(cudaGetLastError());
            CHECK(cudaDeviceSynchronize());
            std::vector<unsigned long long> h((size_t)sms * 4);
            CHECK(cudaMemcpy(h.data(), out, h.size() * 8, cudaMemcpyDeviceToHost));
            streaming = chasing = 0;
            double t_sum = 0;
            for (int c = 0; c < sms; ++c) {
                if (h[c * 4 + 0] > 0) {
                    ++streaming;
                    bytes += (double)h[c * 4 + 0];
                    t_sum += (double)h[c * 4 + 1];
                }
                if (h[c * 4 + 3] > 0) {
                    ++chasing;
                    lat.push_back((double)h[c * 4 + 2] / loads);
                }
            }
            if (streaming > 0) secs += t_sum / streaming * 1e-9;
        }
        std::sort(lat.begin(), lat.end());
        double mean = 0;
        for (double v : lat) mean += v;
        mean /= lat.empty() ? 1 : (double)lat.size();
        const double p90 = lat.empty() ? 0 : lat[(size_t)(0.9 * (lat.size() - 1))];
        const double mx = lat.empty() ? 0 : lat.back();
        const double tbs = secs > 0 ? bytes / secs * 1e-12 : 0;  // bytes over 3 reps / summed mean times
        printf("| %s | %d | %d | %d | %.0f | %.0f | %.0f | %.2f |\n", m.name, streaming,
               m.stream_mask ? m.part_kb : 0, chasing, mean, p90, mx, tbs);
    }
    return 0;
}
