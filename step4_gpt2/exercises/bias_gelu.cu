// bias_gelu.cu - Exercise 4a.2: the bias + GELU kernel of GPT-2's MLP, then swapped into the model.
//
// h is (rows, C) row-major float32 with total = rows * C elements, b has C elements. In place, for
// every i < total:
//
//   h[i] = gelu(h[i] + b[i % C])        gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
//
// That GELU is GPT-2's (the tanh approximation, "gelu_new"); course.cuh has it as gelu_tanh(x). Not the
// erf GELU: the logits would drift. Launch: a fixed grid of 256-thread blocks (grid-stride loop).
// The checker first tests the kernel alone (C = 1, 37, ...), then runs a small GPT-2 (random weights)
// with YOUR kernel in place of the course's in every MLP, and compares the logits with the float64
// reference model.
//
// Hint 1 (where to look): An element-wise kernel like Exercise 1a.2, in place: h is read and written at the same
//   index. The column of element i is i % C.
// Hint 2 (the shape of the code): a grid-stride loop over total (long long); h[i] = gelu_tanh(h[i] + b[i % C]).
//   gelu_tanh is in course.cuh: #include "course.cuh" if the stub does not already.
// The solution: solution("step4/bias_gelu") gives its path (read it after trying).
// Check it with: from common.exercises import check; check("step4/bias_gelu")
#include "course.cuh"

extern "C" __global__ void bias_gelu(float* __restrict__ h, const float* __restrict__ b, long long total, int C) {
    // TODO: your code here
}
