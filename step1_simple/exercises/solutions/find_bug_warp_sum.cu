// find_bug_warp_sum.cu (solution) - find the bug, step 1: the sum of n floats with warp shuffles.
//
//   out[blockIdx.x] = sum of the elements this block visits (grid-stride), launched twice as block_max
//
// The bug: the butterfly loop ran `for (offset = 16; offset > 1; ...)`, i.e. offsets 16, 8, 4, 2 and never
// 1. Each step adds the value of the lane `offset` away (lane ^ offset), so after offsets 16..2 lane 0 holds
// the sum of the EVEN lanes only (0, 2, ..., 30) and lane 1 that of the odd ones. The same function then
// dropped the odd warps in warp 0's second stage: each launch kept about a quarter of its inputs.
// Why it bit: n = 1 (one element, in lane 0) is right, and with signed random inputs a sum that is too small
// can still look plausible. The fix: `offset > 0`, five steps, log2(32).
#ifndef BLOCK
#define BLOCK 256
#endif

__device__ __forceinline__ float warp_sum_xor(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);   // FIX: down to 1
    return v;                                          // every lane holds the warp's total
}

extern "C" __global__ void block_sum(const float* __restrict__ x, float* __restrict__ out, long long n) {
    __shared__ float warp_total[BLOCK / 32];
    float s = 0.0f;
    for (long long i = (long long)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (long long)gridDim.x * BLOCK)
        s += x[i];
    s = warp_sum_xor(s);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) warp_total[warp] = s;
    __syncthreads();                                   // all warps have written before warp 0 reads
    if (warp == 0) {
        s = lane < BLOCK / 32 ? warp_total[lane] : 0.0f;
        s = warp_sum_xor(s);
        if (lane == 0) out[blockIdx.x] = s;
    }
}
