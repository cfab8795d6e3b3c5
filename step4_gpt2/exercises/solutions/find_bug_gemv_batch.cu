// find_bug_gemv_batch.cu (solution) - find the bug, step 4: the decode step's GEMV for a batch of rows.
//
//   y[b, n] = sum_k x[b, k] * W[n, k]  (+ bias[n] when bias is not null)      b < B <= MAXB
//
// The bug: the inner loop read x4 + k for every b, i.e. row 0 of x, so every batch row got row 0's
// answer: y[b, n] = y[0, n]. With B = 1 that is exactly right, and in a decode loop it shows only when two
// prompts are decoded together (they would all continue the first prompt). Why it bit: the loop over b
// changed nothing in the address, and a single-row test cannot tell. The fix: row b of x starts b * K4
// float4s in (K4 = K / 4, the row length in float4s). A second row that differs from the first in every
// input is the cheapest test of any batched kernel.
#include "course.cuh"

#ifndef MAXB
#define MAXB 8
#endif

extern "C" __global__ void gemv(const float* __restrict__ x, const float* __restrict__ W,
                                const float* __restrict__ bias, float* __restrict__ y, int B, int N, int K) {
    const int lane = threadIdx.x % 32;
    const int n = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if (n >= N) return;                        // whole warps leave together
    const int K4 = K / 4;
    const float4* w4 = reinterpret_cast<const float4*>(W + (long long)n * K);
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float acc[MAXB];
#pragma unroll
    for (int b = 0; b < MAXB; ++b) acc[b] = 0.0f;
    for (int k = lane; k < K4; k += 32) {
        const float4 w = __ldg(w4 + k);
#pragma unroll
        for (int b = 0; b < MAXB; ++b)
            if (b < B) {
                const float4 xv = __ldg(x4 + (long long)b * K4 + k);     // FIX: row b of x, not row 0
                acc[b] += w.x * xv.x + w.y * xv.y + w.z * xv.z + w.w * xv.w;
            }
    }
#pragma unroll
    for (int b = 0; b < MAXB; ++b) {
        const float total = warp_sum(acc[b]);  // every lane gets the sum; lane 0 writes it
        if (b < B && lane == 0) y[(long long)b * N + n] = total + (bias ? bias[n] : 0.0f);
    }
}
