// layernorm_backward.cu (solution) - Exercise 4b.1: the LayerNorm backward pass, then swapped into a training run.
//
// Per row n of C values, with xhat = (x - mean[n]) * rstd[n] and g = dy * w:
//   dx[n, c]  = rstd[n] * (g[c] - mean_c(g) - xhat[c] * mean_c(g * xhat))      (= with accumulate == 0, += else)
// and per block of rows_per_block rows, its share of the parameter gradients:
//   partial[block, c]     = sum over the block's rows of dy * xhat              (d weight)
//   partial[block, C + c] = sum over the block's rows of dy                     (d bias)
//
// Two reductions in two directions. Along a row (the two means): one warp per row, each lane strides over the
// columns and warp_sum adds the 32 lanes. Down the columns (dweight, dbias): each warp keeps its own two rows
// of C floats in shared memory; lane l only touches columns l, l + 32, ..., so no two threads ever write the
// same word and no atomics are needed. After a barrier, the block adds its warps' rows in a fixed order (the
// same bits every run) and writes one partial row; ops.py adds the blocks' partials the same way.
#include "course.cuh"

#ifndef LN_WARPS
#error "LN_WARPS is passed by the exercise's spec"
#endif

extern "C" __global__ void __launch_bounds__(LN_WARPS * 32) layernorm_backward(
        const float* __restrict__ dy, const float* __restrict__ x, const float* __restrict__ w,
        const float* __restrict__ mean, const float* __restrict__ rstd, float* dx, float* __restrict__ partial,
        int N, int C, int rows_per_block, int accumulate) {
    extern __shared__ float sm[];                         // LN_WARPS rows of 2C floats: [dweight | dbias] per warp
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float* dw = sm + warp * 2 * C;
    float* db = dw + C;
    for (int c = lane; c < C; c += 32) {
        dw[c] = 0.0f;
        db[c] = 0.0f;
    }
    const int r1 = min(N, (int)blockIdx.x * rows_per_block + rows_per_block);
    for (int row = blockIdx.x * rows_per_block + warp; row < r1; row += LN_WARPS) {
        const long long off = (long long)row * C;
        const float m = mean[row], r = rstd[row];
        float sg = 0.0f, sgx = 0.0f;                      // this lane's share of sum(g), sum(g * xhat)
        for (int c = lane; c < C; c += 32) {
            const float g = dy[off + c] * w[c];
            sg += g;
            sgx += g * (x[off + c] - m) * r;
        }
        sg = warp_sum(sg) / C;                            // every lane gets the row's means
        sgx = warp_sum(sgx) / C;
        for (int c = lane; c < C; c += 32) {
            const float d = dy[off + c], xh = (x[off + c] - m) * r;
            const float v = r * (d * w[c] - sg - xh * sgx);
            dx[off + c] = accumulate ? dx[off + c] + v : v;
            dw[c] += d * xh;
            db[c] += d;
        }
    }
    __syncthreads();                                      // every warp's rows are complete
    for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) {
        float s = 0.0f;
        for (int k = 0; k < LN_WARPS; ++k) s += sm[k * 2 * C + c];
        partial[(long long)blockIdx.x * 2 * C + c] = s;
    }
}
