// find_bug_warp_sum.cu - Exercise 1b.2, find the bug: the sum of n floats with warp shuffles.
//
// TODO: this kernel compiles and looks right, but it has ONE bug. Find it and fix it (a small change).
//
// What it should do: out[blockIdx.x] = the sum of the elements this block visits,
//   x[blockIdx.x * BLOCK + threadIdx.x], then + gridDim.x * BLOCK, ... while < n (a grid-stride loop).
// The checker launches it twice, as step1/block_max: G blocks write G partial sums, then one block adds
// the G partials into out[0]. Inside a block: each thread sums its elements, each warp combines its 32
// values with butterfly shuffles (__shfl_xor_sync), lane 0 of every warp puts the warp's total in shared
// memory, and warp 0 combines those the same way. Blocks have BLOCK (256) threads; any n >= 1.
//
// Symptom: check("step1/find_bug_warp_sum") passes n = 1 and fails every other case: the result is far
// too small (the inputs are all in [0, 1), so every element should add to the total).
//
// Hint 1 (where to look): n = 1 passes, n = 2 fails with got = x[0]: element 1 is lost. Element 1 lives in
//   lane 1. Follow lane 1's value through the warp reduction: does it ever reach lane 0? (On paper: which
//   lanes does lane 0 combine with, for each offset the loop takes?)
// Hint 2 (the class of bug): a warp reduction with a wrong set of shuffle offsets. A butterfly over 32 lanes
//   needs log2(32) = 5 steps: offsets 16, 8, 4, 2 and 1.
// The solution: solution("step1/find_bug_warp_sum") gives its path; it names the bug and why it bit.
//
// Check it with: from common.exercises import check; check("step1/find_bug_warp_sum")
#ifndef BLOCK
#define BLOCK 256
#endif

__device__ __forceinline__ float warp_sum_xor(float v) {
#pragma unroll
    for (int offset = 16; offset > 1; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
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
