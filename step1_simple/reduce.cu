// reduce.cu - summing n floats: from a shared-memory tree to one pass with one atomic per block.
//
// A sum reads 4 bytes per element and writes almost nothing, so its ceiling is read bandwidth. The
// hard part is combining the partial sums of many threads without serialising them.
//
//   v1  shared-memory tree: each thread sums a grid-stride slice in a register, then the block halves
//       its active threads each step through shared memory (__syncthreads between steps). Writes one
//       partial per block; a second launch of the same kernel with one block sums the partials.
//   v2  warp shuffles: the first 5 halvings happen inside a warp with __shfl_xor_sync (no shared memory,
//       no barriers); only one value per warp goes through shared memory. Still two launches.
//   v3  one pass: float4 loads, UNROLL of them in flight per thread (contiguous tiles per block, as
//       axpb_v4), block_sum (v2's idea), then ONE atomicAdd per block into the result, so there is no
//       second launch. (Float atomics make the order of the last
//       few additions vary from run to run: results may differ in the last bits.)
//
// Compile-time knobs: BLOCK (threads per block, a power of two between 64 and 1024; default 256),
// UNROLL (v3's loads in flight per thread, default 4).
#include "course.cuh"

#ifndef BLOCK
#define BLOCK 256
#endif
#ifndef UNROLL
#define UNROLL 4
#endif

extern "C" __global__ void sum_v1(const float* __restrict__ x, float* __restrict__ partial, long long n) {
    __shared__ float s[BLOCK];
    float v = 0.0f;
    for (long long i = (long long)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (long long)gridDim.x * BLOCK)
        v += x[i];
    s[threadIdx.x] = v;
    __syncthreads();
    for (int half = BLOCK / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) s[threadIdx.x] += s[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = s[0];
}

extern "C" __global__ void sum_v2(const float* __restrict__ x, float* __restrict__ partial, long long n) {
    __shared__ float scratch[32];
    float v = 0.0f;
    for (long long i = (long long)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (long long)gridDim.x * BLOCK)
        v += x[i];
    v = block_sum(v, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = v;
}

// `head` (0..3) scalar elements come before the first 16-byte-aligned one; out must be zeroed first.
// Each block streams contiguous tiles of UNROLL * BLOCK float4s; each thread keeps UNROLL independent
// loads in flight and UNROLL separate accumulators (one chain of dependent adds would serialise them).
extern "C" __global__ void sum_v3(const float* __restrict__ x, float* __restrict__ out, long long n, int head) {
    __shared__ float scratch[32];
    const long long tid = (long long)blockIdx.x * BLOCK + threadIdx.x;
    float acc[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc[u] = 0.0f;
    if (tid < head) acc[0] = x[tid];
    const long long nvec = (n - head) / 4;
    const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x + head);
    const long long tile = (long long)UNROLL * BLOCK, full_tiles = nvec / tile;
    for (long long t = blockIdx.x; t < full_tiles; t += gridDim.x) {
        float4 q[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) q[u] = x4[t * tile + u * BLOCK + threadIdx.x];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc[u] += (q[u].x + q[u].y) + (q[u].z + q[u].w);
    }
    for (long long i = full_tiles * tile + tid; i < nvec; i += (long long)gridDim.x * BLOCK) {
        const float4 q = x4[i];
        acc[0] += (q.x + q.y) + (q.z + q.w);
    }
    const long long t = head + nvec * 4 + tid;
    if (t < n) acc[0] += x[t];
    float v = 0.0f;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) v += acc[u];
    v = block_sum(v, scratch);
    if (threadIdx.x == 0) atomicAdd(out, v);
}
