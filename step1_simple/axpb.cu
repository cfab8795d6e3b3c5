// axpb.cu - the first kernel, y = a*x + b, and how to make a memory-bound kernel reach the copy ceiling.
//
// Every version reads 4 bytes and writes 4 bytes per element and does 2 FLOPs, so the best any version
// can do is the device's copy bandwidth. Each version adds one idea:
//
//   v1  one thread per element: global index = blockIdx.x * blockDim.x + threadIdx.x, bounds check.
//   v2  grid-stride loop: a fixed grid (a few blocks per SM) walks over any n; launch size is a choice.
//   v3  vectorized: float4 loads/stores (16 bytes per instruction) inside the grid-stride loop, with
//       a scalar head (for views that start off a 16-byte boundary) and a scalar tail (n % 4 != 0).
//   v4  more bytes in flight: each thread issues UNROLL independent float4 loads before using any of
//       them, so fewer threads are needed to hide DRAM latency.
//
// Compile-time knob: UNROLL (v4, default 4).

#ifndef UNROLL
#define UNROLL 4
#endif

// v1: one thread per element. The grid must cover n; the bounds check handles the last partial block.
extern "C" __global__ void axpb_v1(const float* __restrict__ x, float* __restrict__ y,
                                   float a, float b, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + b;
}

// v2: grid-stride loop. Consecutive threads still touch consecutive addresses (coalesced) on every trip.
extern "C" __global__ void axpb_v2(const float* __restrict__ x, float* __restrict__ y,
                                   float a, float b, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = a * x[i] + b;
}

__device__ __forceinline__ float4 axpb4(float4 v, float a, float b) {
    return make_float4(a * v.x + b, a * v.y + b, a * v.z + b, a * v.w + b);
}

// v3: float4 body. `head` (0..3) elements come before the first 16-byte-aligned element of x; the
// caller guarantees y has the same alignment (else it uses v2), so x + head and y + head are float4s.
extern "C" __global__ void axpb_v3(const float* __restrict__ x, float* __restrict__ y,
                                   float a, float b, long long n, int head) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    if (tid < head) y[tid] = a * x[tid] + b;
    const long long nvec = (n - head) / 4;
    const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x + head);
    float4* __restrict__ y4 = reinterpret_cast<float4*>(y + head);
    for (long long i = tid; i < nvec; i += stride) y4[i] = axpb4(x4[i], a, b);
    const long long t = head + nvec * 4 + tid;          // at most 3 leftover elements
    if (t < n) y[t] = a * x[t] + b;
}

// v4: like v3, but each thread loads UNROLL float4s (spaced a grid apart, so still coalesced) before
// it computes and stores any: UNROLL independent 16-byte loads in flight per thread.
extern "C" __global__ void axpb_v4(const float* __restrict__ x, float* __restrict__ y,
                                   float a, float b, long long n, int head) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    if (tid < head) y[tid] = a * x[tid] + b;
    const long long nvec = (n - head) / 4;
    const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x + head);
    float4* __restrict__ y4 = reinterpret_cast<float4*>(y + head);
    for (long long base = tid; base < nvec; base += stride * UNROLL) {
        float4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long i = base + u * stride;
            if (i < nvec) v[u] = __ldcs(x4 + i);     // streaming load: read once, don't keep in cache
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long i = base + u * stride;
            if (i < nvec) __stcs(y4 + i, axpb4(v[u], a, b));
        }
    }
    const long long t = head + nvec * 4 + tid;
    if (t < n) y[t] = a * x[t] + b;
}
