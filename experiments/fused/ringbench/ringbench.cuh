// Helpers shared by the ringbench programs (ring_stream.cu, l2_latency.cu, wide_stage.cu): the runtime-call
// check, the global timer, the mbarrier and bulk-copy primitives the fused step's weight ring uses (sm_90),
// the ring's set-up, a grid barrier and the plain read kernel that measures the floor.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                                  \
    do {                                                                                          \
        cudaError_t e_ = (x);                                                                     \
        if (e_ != cudaSuccess) {                                                                  \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));   \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(unsigned long long* b, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect(unsigned long long* b, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* b, unsigned parity) {
    unsigned done = 0;
    while (!done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(smem_addr(b)), "r"(parity)
                     : "memory");
    }
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* b) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(b))
                 : "memory");
}
// The fused step's weight copy: bulk, completing on an mbarrier, tagged L2 evict-first (fused_step.cu
// fused_bulk_copy_hint).
__device__ __forceinline__ void bulk_copy_evict_first(void* dst, const void* src, unsigned bytes, unsigned long long* b) {
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
            smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(b)), "l"(policy)
        : "memory");
}

// The fused step's weight stream, from one CTA's own region (`region_bytes` at `base`): bulk copies of `part`
// bytes through two slots of `ring` (full barriers `full[2]`, initialised with one arrival each), one in
// flight, tagged L2 evict-first, wrapping within the region (evict-first, so its lines are gone from L2
// when they come round), until `stop()` is true. `stop` is read while each copy flies (its value is used
// only after the copy has landed, so polling does not slow the stream), and every copy is waited for
// before returning. Returns the bytes copied. One thread calls it.
template <class Stop>
__device__ unsigned long long stream_region(const unsigned char* base, size_t region_bytes, unsigned part,
                                           unsigned char* ring, unsigned long long* full, Stop stop) {
    const size_t parts = region_bytes / part;
    unsigned long long bytes = 0;
    for (size_t i = 0;; ++i) {
        const int s = (int)(i & 1);
        mbar_expect(&full[s], part);
        bulk_copy_evict_first(ring + (size_t)s * part, base + (i % parts) * part, part, &full[s]);
        const bool done = stop();
        mbar_wait(&full[s], (unsigned)(i >> 1) & 1u);
        bytes += part;
        if (done) return bytes;
    }
}

// The device's SM count and properties (device 0, made current).
static int open_device(cudaDeviceProp* prop) {
    int sms = 0;
    CHECK(cudaSetDevice(0));
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CHECK(cudaGetDeviceProperties(prop, 0));
    return sms;
}
// `ctas` weight regions of `region` bytes each for stream_region, filled so that the copies read real
// lines (24 MB a CTA is ~3 GB over 132 SMs: nothing is left in L2 from one lap to the next).
static unsigned char* weight_regions(int ctas, size_t region) {
    unsigned char* w;
    CHECK(cudaMalloc(&w, region * ctas));
    CHECK(cudaMemset(w, 1, region * ctas));
    return w;
}

// Thread 0 sets up each slot's full and empty barriers (one arrival each); then the whole CTA syncs.
__device__ inline void init_ring(unsigned long long* full, unsigned long long* empty, int slots) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < slots; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
}

// All CTAs arrive, then wait for all: the counter only grows (from the host's zero; targets count from its
// value at the launch).
__device__ inline void grid_barrier(unsigned long long* ctr, unsigned long long target) {
    __threadfence();
    atomicAdd(ctr, 1ull);
    while (*(volatile unsigned long long*)ctr < target) {
    }
    __threadfence();
}

// Whole-buffer read: the GPU's plain read bandwidth, the floor the bursts are compared with.
__global__ void read_all(const uint4* w, size_t n, unsigned* out) {
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = __ldcs(w + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc;
}

// The plain read floor: read_all over `bytes` of `buf` on `sms` x 8 CTAs, the median of 5 timed runs after
// one warm-up, in milliseconds. `sink` is a device word read_all may write.
static double median_read_ms(const void* buf, size_t bytes, int sms, unsigned* sink) {
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    std::vector<float> ms;
    for (int r = 0; r < 6; ++r) {
        CHECK(cudaEventRecord(e0));
        read_all<<<sms * 8, 512>>>(reinterpret_cast<const uint4*>(buf), bytes / 16, sink);
        CHECK(cudaEventRecord(e1));
        CHECK(cudaEventSynchronize(e1));
        float m;
        CHECK(cudaEventElapsedTime(&m, e0, e1));
        if (r > 0) ms.push_back(m);
    }
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}
