// gemv.cu - exercise 16 of step 4: the GEMV of GPT-2's decode step, then swapped into the decode step.
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
// Check it with: from common.exercises import check; check("step4/gemv")
#include "course.cuh"

#ifndef MAXB
#define MAXB 8
#endif

extern "C" __global__ void gemv(const float* __restrict__ x, const float* __restrict__ W,
                                const float* __restrict__ bias, float* __restrict__ y, int B, int N, int K) {
    // TODO: your code here
}
