// residual_layernorm.cu - exercise 11 of step 3: fused bias + residual + LayerNorm.
//
// The tail of every GPT-2 sublayer. For every row n < N of the (N, C) arrays:
//
//   r[n, :] = x[n, :] + proj[n, :] + bias        (the new residual stream: write it)
//   y[n, :] = (r[n, :] - mean) / sqrt(var + eps) * w + b      (mean and biased variance of r's row)
//
// bias, w, b have C elements. Launch: blocks of BLOCK (256) threads, one warp per row (8 rows per
// block; warps without a row return). Read x and proj once each; a thread may re-read the elements of
// r it wrote itself (they come from cache). warp_sum (course.cuh) adds over the warp.
// Napkin math: 16 bytes per element must move (x, proj in; r, y out), nothing else is large.
// Check it with: from common.exercises import check; check("step3/residual_layernorm")
#include "course.cuh"

#ifndef BLOCK
#define BLOCK 256
#endif

extern "C" __global__ void bias_residual_layernorm(const float* __restrict__ x, const float* __restrict__ proj,
                                                   const float* __restrict__ bias, const float* __restrict__ w,
                                                   const float* __restrict__ b, float* __restrict__ r,
                                                   float* __restrict__ y, int N, int C, float eps) {
    // TODO: your code here
}
