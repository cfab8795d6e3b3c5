// layernorm_welford.cu (solution) - exercise 10 of step 3: LayerNorm with Welford's algorithm, one warp
// per row.
//
//   y[r, :] = (x[r, :] - mean) / sqrt(var + eps) * w + b        (biased variance, as PyTorch and GPT-2)
//
// Welford keeps (count, mean, M2 = sum of squared deviations from the running mean) and updates them
// with each value, so mean and variance come out of ONE pass over x, without the cancellation of
// var = E[x^2] - mean^2 (which loses every digit when |mean| >> std, e.g. activations around 1000).
// Each lane runs Welford over its strided slice; the 32 partial states merge pairwise with Chan et al.'s
// rule through shuffles:  n = na + nb,  delta = mean_b - mean_a,  mean = mean_a + delta * nb / n,
// M2 = M2a + M2b + delta^2 * na * nb / n. A second pass writes y (x is read twice).
#include "course.cuh"

#ifndef BLOCK
#define BLOCK 256
#endif

extern "C" __global__ void layernorm_welford(const float* __restrict__ x, const float* __restrict__ w,
                                             const float* __restrict__ b, float* __restrict__ y,
                                             int N, int C, float eps) {
    const int row = blockIdx.x * (BLOCK / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;                    // whole warps leave together: the shuffles stay full-mask
    const float* xr = x + (long long)row * C;
    float* yr = y + (long long)row * C;
    float n = 0.0f, mean = 0.0f, m2 = 0.0f;
    for (int i = lane; i < C; i += 32) {
        const float v = xr[i];
        n += 1.0f;
        const float d = v - mean;
        mean += d / n;
        m2 += d * (v - mean);                // old deviation times new deviation: exact update of M2
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float nb = __shfl_xor_sync(FULL_MASK, n, offset);
        const float mean_b = __shfl_xor_sync(FULL_MASK, mean, offset);
        const float m2_b = __shfl_xor_sync(FULL_MASK, m2, offset);
        const float nt = n + nb;
        const float d = mean_b - mean;
        const float f = nt > 0.0f ? nb / nt : 0.0f;      // a lane with no element (C < 32) merges as a no-op
        mean += d * f;
        m2 += m2_b + d * d * n * f;
        n = nt;
    }
    const float rstd = rsqrtf(m2 / C + eps);
    for (int i = lane; i < C; i += 32) yr[i] = (xr[i] - mean) * rstd * w[i] + b[i];
}
