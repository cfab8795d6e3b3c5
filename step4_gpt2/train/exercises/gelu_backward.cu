// gelu_backward.cu - Exercise 4b.2: the backward pass of bias + GELU, then swapped into a training run.
//
// TODO: write the kernel below.
//
// The forward pass computed out = gelu(h + bias) with GPT-2's tanh GELU,
//   gelu(x) = 0.5 x (1 + tanh(k (x + a x^3))),   k = sqrt(2/pi), a = 0.044715,
// and kept h (rows, C) row-major, the c_fc GEMM's output before its bias. Backward, for every i < total
// (total = rows * C, c = i % C the column):
//   dpre[i] = dout[i] * gelu'(h[i] + bias[c])
// dpre may be the same array as dout (the training step runs it in place).
// Launch: a fixed grid of 256-thread blocks (grid-stride loop over i). The bias gradient (the column sums of
// dpre) is not yours: the course's column_sum adds it up.
// Cases include |h + bias| up to 20.
//
// Hint 1 (the derivative): call u = k (x + a x^3) and t = tanh(u). gelu(x) = 0.5 x (1 + t) is a product:
//   differentiate 0.5 x, then (1 + t), and use tanh'(u) = 1 - t^2 with du/dx = k (1 + 3 a x^2).
// Hint 2 (the result, and large |x|): gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 a x^2). Use tanhf:
//   tanh written with expf overflows to inf / inf = NaN once |u| passes about 44.
// The solution: solution("step4/gelu_backward") gives its path.
//
// Check it with: from common.exercises import check; check("step4/gelu_backward")
#include "course.cuh"

extern "C" __global__ void gelu_backward(const float* dout, const float* __restrict__ h,
                                         const float* __restrict__ bias, float* dpre, long long total, int C) {
    // TODO: your code here
}
