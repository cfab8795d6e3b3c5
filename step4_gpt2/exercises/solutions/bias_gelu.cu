// bias_gelu.cu (solution) - exercise 15 of step 4: GPT-2's MLP epilogue, h = gelu(h + b), in place.
//
//   h[i] = gelu_tanh(h[i] + b[i % C])        h is (rows, C) row-major, b (C,)
//
// GPT-2's GELU is the tanh approximation ("gelu_new"): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
// course.cuh's gelu_tanh. Fusing the bias into the GELU pass reads and writes h once (8 bytes per
// element) instead of twice. A grid-stride loop over every element; b is tiny and stays in cache.
#include "course.cuh"

extern "C" __global__ void bias_gelu(float* __restrict__ h, const float* __restrict__ b, long long total, int C) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x)
        h[i] = gelu_tanh(h[i] + b[i % C]);
}
