// find_bug_gemv_batch.cu - Exercise 4a.4, find the bug: the decode step's GEMV for a batch of rows.
//
// TODO: this kernel compiles and looks right, but it has ONE bug. Find it and fix it (a small change).
//
// What it should do: x is (B, K), W is (N, K), y is (B, N), float32, B <= MAXB (8); for every b < B, n < N:
//   y[b, n] = sum over k of x[b, k] * W[n, k]  +  (bias ? bias[n] : 0)        (bias may be a null pointer)
// Blocks of 128 threads = 4 warps, ceil(N / 4) blocks, one warp per output n. Lane l reads float4 number
// l, l + 32, ... of W's row n and uses each weight float4 for all B rows of x (that sharing is why a batch
// costs little more than one row), then warp_sum adds the lanes. K % 4 == 0 and rows are 16-byte aligned.
// As in step4/gemv, once every case passes the checker runs a 12-token greedy decode of a small GPT-2
// with this kernel in every plain matrix product (2 prompts: B = 2) and compares it with the course's.
//
// Symptom: check("step4/find_bug_gemv_batch") passes the cases with B = 1 and fails every case with
// B > 1, first at y[1, 0]: what row 1 gets is exactly row 0's answer.
//
// Hint 1 (where to look): B = 1 is right, so the dot product, the reduction and the bias are right. Look at
//   everything that depends on b: which row of x does the inner loop read for b = 1?
// Hint 2 (the class of bug): a missing stride. A pointer into a 2-D array needs row * row_length + column;
//   here the row is b and the row length, counted in float4s, is K / 4.
// The solution: solution("step4/find_bug_gemv_batch") gives its path; it names the bug and why it bit.
//
// Check it with: from common.exercises import check; check("step4/find_bug_gemv_batch")
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
                const float4 xv = __ldg(x4 + k);
                acc[b] += w.x * xv.x + w.y * xv.y + w.z * xv.z + w.w * xv.w;
            }
    }
#pragma unroll
    for (int b = 0; b < MAXB; ++b) {
        const float total = warp_sum(acc[b]);  // every lane gets the sum; lane 0 writes it
        if (b < B && lane == 0) y[(long long)b * N + n] = total + (bias ? bias[n] : 0.0f);
    }
}
