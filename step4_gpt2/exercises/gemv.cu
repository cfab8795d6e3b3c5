// gemv.cu - Exercise 4a.3: the GEMV of GPT-2's decode step, then swapped into the decode step.
//
// x is (B, K), W is (N, K) (each output's weights contiguous), y is (B, N), float32, B <= MAXB (8).
// Write, for every b < B and n < N:
//
//   y[b, n] = sum over k of x[b, k] * W[n, k]  +  (bias ? bias[n] : 0)        (bias may be a null pointer)
//
// Launch: blocks of 128 threads = 4 warps, ceil(N / 4) blocks: warp w of block g owns output n = g * 4 + w
// (warps with n >= N return, all lanes together). K is a multiple of 4 and every row starts 16 bytes
// aligned: lane l can read float4 number l, l + 32, ... of W's row n (reinterpret_cast<const float4*>),
// use each weight for all B rows of x, and warp_sum (course.cuh) adds the 32 lanes' partial sums.
// Napkin math: at B = 1 each weight (4 bytes) is used for 2 FLOPs; the time floor is N * K * 4 bytes at
// the copy bandwidth (a 3072 x 768 matrix: 9.4 MB).
// The checker tests the kernel alone, then runs the model's decode step with YOUR kernel for every
// plain GEMV (attention and MLP projections, the LM head) and compares the greedy tokens and logits
// with the course's own decode step.
//
// Hint 1 (where to look): Lesson 4a builds this GEMV version by version in step4_gpt2/gpt2.cu: the float4, one warp
//   per row version is the one to follow. Which row n does this warp own, and which float4s of it does each lane
//   read?
// Hint 2 (the shape of the code): float acc[MAXB] = {0}; for (k4 = lane; k4 < K / 4; k4 += 32) { float4 w = W4[n * (K
//   / 4) + k4]; for b < B: float4 xv = x4[b * (K / 4) + k4]; acc[b] += w.x * xv.x + ... } then for b < B: s =
//   warp_sum(acc[b]); lane 0 writes y[b * N + n] = s + (bias ? bias[n] : 0).
// The solution: solution("step4/gemv") gives its path (read it after trying).
// Check it with: from common.exercises import check; check("step4/gemv")
#include "course.cuh"

#ifndef MAXB
#define MAXB 8
#endif

extern "C" __global__ void gemv(const float* __restrict__ x, const float* __restrict__ W,
                                const float* __restrict__ bias, float* __restrict__ y, int B, int N, int K) {
    // TODO: your code here
}
