// block_max.cu (solution) - exercise 4 of step 1: the maximum of n floats with warp shuffles.
//
//   out[blockIdx.x] = max of the elements this block visits
//
// Launched twice, as the course's sum_v2: first G blocks each reduce a grid-stride slice of x into
// partial[0..G-1], then one block reduces the G partials into out[0]. Inside a block:
//   1. each thread keeps a running max in a register (starting at -inf: the inputs may all be negative),
//   2. the warp combines its 32 values with 5 __shfl_xor_sync steps (no shared memory, no barrier),
//   3. lane 0 of each warp writes its value to shared memory, one barrier, and the first warp reduces
//      those (at most 32) values the same way.
#ifndef BLOCK
#define BLOCK 256
#endif
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float warp_max_xor(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

extern "C" __global__ void block_max(const float* __restrict__ x, float* __restrict__ out, long long n) {
    __shared__ float warp_best[BLOCK / 32];
    float m = NEG_INF;
    for (long long i = (long long)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (long long)gridDim.x * BLOCK)
        m = fmaxf(m, x[i]);
    m = warp_max_xor(m);                               // every lane of the warp now holds the warp's max
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) warp_best[warp] = m;
    __syncthreads();                                   // all warps have written before warp 0 reads
    if (warp == 0) {
        m = lane < BLOCK / 32 ? warp_best[lane] : NEG_INF;
        m = warp_max_xor(m);
        if (lane == 0) out[blockIdx.x] = m;
    }
}
