// residual_layernorm.cu (solution) - exercise 11 of step 3: bias + residual + LayerNorm in one kernel.
//
//   r = x + proj + bias         (the residual stream, written: the next sublayer adds to it)
//   y = LayerNorm(r) * w + b    (the next sublayer's input)
//
// Unfused that is three kernels and 7 row-sized transfers; fused, x and proj are read once and r and y
// written once: 16 bytes per element, the floor. One warp per row. Pass 1 writes r and sums it; pass 2
// re-reads r (this thread's own writes, from L1/L2, not DRAM) for the sum of squared deviations (two
// passes: exact, no cancellation); pass 3 writes y. The variance is biased (divide by C), like PyTorch.
#include "course.cuh"

#ifndef BLOCK
#define BLOCK 256
#endif

extern "C" __global__ void bias_residual_layernorm(const float* __restrict__ x, const float* __restrict__ proj,
                                                   const float* __restrict__ bias, const float* __restrict__ w,
                                                   const float* __restrict__ b, float* __restrict__ r,
                                                   float* __restrict__ y, int N, int C, float eps) {
    const int row = blockIdx.x * (BLOCK / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    const long long off = (long long)row * C;
    float s = 0.0f;
    for (int i = lane; i < C; i += 32) {
        const float v = x[off + i] + proj[off + i] + bias[i];
        r[off + i] = v;
        s += v;
    }
    const float mean = warp_sum(s) / C;
    float q = 0.0f;
    for (int i = lane; i < C; i += 32) { const float d = r[off + i] - mean; q += d * d; }
    const float rstd = rsqrtf(warp_sum(q) / C + eps);
    for (int i = lane; i < C; i += 32) y[off + i] = (r[off + i] - mean) * rstd * w[i] + b[i];
}
