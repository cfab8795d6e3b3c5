// residual_layernorm.cu - Exercise 3a.3: fused bias + residual + LayerNorm.
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
//
// Hint 1 (where to look): Two loops over the row with the same lane stride: the first computes r, writes it and adds
//   it up; the second reads r back and writes y. Lesson 3a, section 2, shows the course's kernel.
// Hint 2 (the shape of the code): loop 1: v = x + proj + bias[c]; r[c] = v; s += v; mean = warp_sum(s) / C; loop 2
//   over r: q += (v - mean)^2; var = warp_sum(q) / C; loop 3: y = (r - mean) * rsqrtf(var + eps) * w + b. The
//   variance of centred values does not cancel like E[x^2] - mean^2.
// The solution: solution("step3/residual_layernorm") gives its path (read it after trying).
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
