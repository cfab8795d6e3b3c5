// gelu_backward.cu (solution) - Exercise 4b.2: the backward pass of bias + GELU, then swapped into training.
//
// The forward pass computed out = gelu(h + b) and kept h (the c_fc GEMM's output). Backward, for every
// element i < total (c = i % C its column):
//   x = h[i] + bias[c]
//   dpre[i] = dout[i] * gelu'(x)
// With u = k (x + a x^3), k = sqrt(2/pi), a = 0.044715, t = tanh(u) and gelu(x) = 0.5 x (1 + t), the product
// rule and tanh' = 1 - t^2 give
//   gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 a x^2).
// tanhf saturates to +-1 for large |u|; writing tanh through expf (e^{2u} - 1) / (e^{2u} + 1) would give
// inf / inf = NaN from |x| around 10 on. dpre may be dout itself (the course runs it in place): each element
// is read before it is written, by the same thread, so that is safe; the pointers are not __restrict__.
// The bias gradient, the column sums of dpre, is the course's column_sum (lesson 4b's bias rule).
#include "course.cuh"

__device__ __forceinline__ float gelu_grad(float x) {
    const float k = 0.7978845608028654f, a = 0.044715f;
    const float t = tanhf(k * (x + a * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * a * x * x);
}

extern "C" __global__ void gelu_backward(const float* dout, const float* __restrict__ h,
                                         const float* __restrict__ bias, float* dpre, long long total, int C) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride)
        dpre[i] = dout[i] * gelu_grad(h[i] + bias[i % C]);
}
