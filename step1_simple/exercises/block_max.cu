// block_max.cu - Exercise 1b.1: a block-level max reduction with warp shuffles.
//
// Write out[blockIdx.x] = the maximum of the elements this block visits:
//   x[blockIdx.x * BLOCK + threadIdx.x], then + gridDim.x * BLOCK, ... while < n (a grid-stride loop).
//
// The checker launches it twice, like the course's sum_v2: G blocks write G partial maxima, then one
// block reduces those G values into out[0] (so with n = G and one block it must also be right).
// Blocks have BLOCK (256) threads. The steps:
//   1. each thread keeps a running max in a register. The inputs can all be negative, so the start
//      value is -infinity (NEG_INF below), not 0;
//   2. a warp combines its 32 values with __shfl_xor_sync(0xffffffff, v, offset) for offset = 16, 8,
//      4, 2, 1 (fmaxf each time): afterwards every lane has the warp's max;
//   3. lane 0 of every warp stores its value in shared memory, __syncthreads(), then warp 0 reduces
//      the BLOCK / 32 values the same way and lane 0 writes out[blockIdx.x].
// n can be anything from 1 up, not a multiple of 32 or of BLOCK.
//
// Hint 1 (where to look): Lesson 1b's sum_v2 in step1_simple/sum.cu is the same plan with + instead of fmaxf and 0
//   instead of -inf. Step 1 (the running max) is a grid-stride loop; which value must a thread with no element
//   contribute?
// Hint 2 (the shape of the code): v = NEG_INF; loop v = fmaxf(v, x[i]); five __shfl_xor_sync steps; `__shared__ float
//   warp_max[BLOCK / 32]`, lane 0 stores; __syncthreads(); warp 0 loads warp_max[lane] (NEG_INF for lane >= BLOCK /
//   32), five more steps, and thread 0 writes out[blockIdx.x].
// The solution: solution("step1/block_max") gives its path (read it after trying).
// Check it with: from common.exercises import check; check("step1/block_max")
#ifndef BLOCK
#define BLOCK 256
#endif
#define NEG_INF __int_as_float(0xff800000)

extern "C" __global__ void block_max(const float* __restrict__ x, float* __restrict__ out, long long n) {
    // TODO: your code here
}
