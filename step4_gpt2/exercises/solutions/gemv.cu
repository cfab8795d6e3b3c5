// gemv.cu (solution) - exercise 16 of step 4: the decode step's matrix-vector product.
//
//   y[b, n] = sum_k x[b, k] * W[n, k]  (+ bias[n] when bias is not null)      b < B <= MAXB
//
// Generating one token multiplies a few activation rows by every weight matrix: each weight is read
// once and used for 2 FLOPs per row, so the kernel is bound by how fast W streams from DRAM. One warp
// per output n: lane l reads float4 number l, l + 32, ... of W's row n (512 contiguous bytes per warp
// instruction), uses each weight float4 for all B rows before the next load, and warp_sum adds the 32
// partial sums. K % 4 == 0 and 16-byte aligned rows let every load be a float4.
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
                const float4 xv = __ldg(x4 + (long long)b * K4 + k);
                acc[b] += w.x * xv.x + w.y * xv.y + w.z * xv.z + w.w * xv.w;
            }
    }
#pragma unroll
    for (int b = 0; b < MAXB; ++b) {
        const float total = warp_sum(acc[b]);  // every lane gets the sum; lane 0 writes it
        if (b < B && lane == 0) y[(long long)b * N + n] = total + (bias ? bias[n] : 0.0f);
    }
}
