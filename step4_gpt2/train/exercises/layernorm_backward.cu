// layernorm_backward.cu - Exercise 4b.1: the LayerNorm backward pass, then swapped into a training run.
//
// TODO: write the kernel below. Lesson 4b, section 2b, derives the formula.
//
// Inputs: dy, x (N, C) row-major; w (C,), the LayerNorm's weight; mean, rstd (N,), saved by the forward pass.
// Per row n, with xhat = (x - mean[n]) * rstd[n] and g = dy * w:
//   dx[n, c] = rstd[n] * (g[c] - mean_c(g) - xhat[c] * mean_c(g * xhat))
//   accumulate == 0: dx = that; accumulate == 1: dx += that (the residual stream already holds a gradient).
// And each block's share of the parameter gradients, one row of 2C floats per block:
//   partial[blockIdx.x, c]     = sum of dy * xhat over the block's rows          (for d weight)
//   partial[blockIdx.x, C + c] = sum of dy over the block's rows                 (for d bias)
// The block's rows are blockIdx.x * rows_per_block ... (that + rows_per_block - 1), stopping at N; a block
// with fewer rows still writes its whole partial row. The caller adds the partial rows up.
//
// Launch: blocks of LN_WARPS * 32 threads (LN_WARPS warps; LN_WARPS is a define), ceil(N / rows_per_block)
// blocks, and LN_WARPS * 2 * C floats of dynamic shared memory (`extern __shared__ float sm[];`).
// C can be anything from 1 to 1536, N from 1 up.
//
// Hint 1 (the plan): one warp per row (warp w of the block takes rows start + w, start + w + LN_WARPS, ...).
//   The two means need the whole row: each lane adds its columns (lane, lane + 32, ...), then warp_sum
//   (course.cuh) adds the 32 lanes; divide by C. A second loop over the same columns writes dx.
// Hint 2 (the column sums without atomics): give each warp its own 2C floats of shared memory, zeroed first;
//   in the second loop lane l adds d * xhat and d into columns l, l + 32, ... of ITS warp's row only, so no
//   two threads write the same word. Then __syncthreads(), and the block's threads add the LN_WARPS rows
//   column by column, in a fixed order, into partial.
// The solution: solution("step4/layernorm_backward") gives its path.
//
// Check it with: from common.exercises import check; check("step4/layernorm_backward")
#include "course.cuh"

#ifndef LN_WARPS
#error "LN_WARPS is passed by the exercise's spec"
#endif

extern "C" __global__ void __launch_bounds__(LN_WARPS * 32) layernorm_backward(
        const float* __restrict__ dy, const float* __restrict__ x, const float* __restrict__ w,
        const float* __restrict__ mean, const float* __restrict__ rstd, float* dx, float* __restrict__ partial,
        int N, int C, int rows_per_block, int accumulate) {
    extern __shared__ float sm[];
    // TODO: your code here
}
