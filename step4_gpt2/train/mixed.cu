// mixed.cu - the casts of mixed-precision training (mixed.py): fp32 in, bf16 (uint16 bit patterns) out.
//
// A bf16 GEMM reads bf16 operands; everything else of the step (LayerNorm, GELU, the loss, AdamW) computes in
// fp32. These kernels are where the two meet, one idea more each:
//   to_bf16         y = bf16(x): the weights' bf16 copy (one launch over the flat parameter buffer), and the
//                   gradients a GEMM reads next. Round to nearest even (flash.to_bf16's bits); a NaN stays NaN.
//   bias_to_bf16    y = bf16(x + bias[column]): the qkv GEMM's fp32 output with its bias, as the attention reads it.
//   gelu_bias_bf16  y = bf16(gelu(x + bias[column])): the GELU in fp32, its output stored for the next GEMM
//                   in half the bytes (and, with recomputation, made again in the backward from x).
// Grid-stride loops over n elements (common.launch_grid); every architecture (bit operations only).
#include "course.cuh"       // gelu_tanh: the same formula as train_gpt2.cu's fp32 GELU

typedef unsigned short u16;

// fp32 -> bf16 bits, round to nearest even: add 0x7fff plus the lowest kept bit, keep the top 16 bits. A NaN
// would round into the sign bit or to infinity: it is made the quiet NaN instead.
__device__ __forceinline__ u16 bf16_bits(float x) {
    const unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)0x7fc0;
    return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

extern "C" __global__ void to_bf16(const float* __restrict__ x, u16* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = bf16_bits(x[i]);
}

extern "C" __global__ void bias_to_bf16(const float* __restrict__ x, const float* __restrict__ bias,
                                        u16* __restrict__ y, long long n, int cols) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = bf16_bits(x[i] + bias[i % cols]);
}

extern "C" __global__ void gelu_bias_bf16(const float* __restrict__ x, const float* __restrict__ bias,
                                          u16* __restrict__ y, long long n, int cols) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = bf16_bits(gelu_tanh(x[i] + bias[i % cols]));
}
