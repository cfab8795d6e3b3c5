// axpb.cu - the first kernel, y = a*x + b, and how to make a memory-bound kernel reach the copy ceiling.
//
// Every version reads 4 bytes and writes 4 bytes per element and does 2 FLOPs, so the best any version
// can do is the device's copy bandwidth. Each version adds one idea:
//
//   v1  one thread per element: global index = blockIdx.x * blockDim.x + threadIdx.x, bounds check.
//   v2  grid-stride loop: a fixed grid (a few blocks per SM) walks over any n; launch size is a choice.
//   v3  vectorized: float4 loads/stores (16 bytes per instruction) inside the grid-stride loop, with
//       a scalar head (for views that start off a 16-byte boundary) and a scalar tail (n % 4 != 0).
//   v4  more bytes in flight: each block streams a contiguous tile, each thread issuing UNROLL
//       independent float4 loads before using any of them. By Little's law, bandwidth = bytes in flight
//       / latency: one 16-byte load per thread is not enough to cover DRAM latency on a fast GPU.
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

// v4: like v3, but each block owns a contiguous tile of UNROLL * blockDim float4s per trip, and each
// thread issues its UNROLL loads (blockDim apart, so every load instruction of a warp is still one
// coalesced 512-byte request) before it computes and stores any of them: UNROLL independent 16-byte
// loads in flight per thread, on neighbouring DRAM pages. Full tiles need no bounds checks.
extern "C" __global__ void axpb_v4(const float* __restrict__ x, float* __restrict__ y,
                                   float a, float b, long long n, int head) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (tid < head) y[tid] = a * x[tid] + b;
    const long long nvec = (n - head) / 4;
    const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x + head);
    float4* __restrict__ y4 = reinterpret_cast<float4*>(y + head);
    const long long tile = (long long)UNROLL * blockDim.x;
    const long long full_tiles = nvec / tile;
    for (long long t = blockIdx.x; t < full_tiles; t += gridDim.x) {
        const long long base = t * tile + threadIdx.x;
        float4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = x4[base + u * blockDim.x];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) y4[base + u * blockDim.x] = axpb4(v[u], a, b);
    }
    // the last partial tile: plain grid-stride over what is left
    for (long long i = full_tiles * tile + tid; i < nvec; i += (long long)gridDim.x * blockDim.x)
        y4[i] = axpb4(x4[i], a, b);
    const long long t = head + nvec * 4 + tid;          // at most 3 leftover elements
    if (t < n) y[t] = a * x[t] + b;
}
