// mixed.cu - the casts of mixed-precision training (mixed.py): fp32 in, bf16 (uint16 bit patterns) out.
//
// A bf16 GEMM reads bf16 operands; everything else of the step (LayerNorm, GELU, the loss, AdamW) computes in
// fp32. These kernels are where the two meet, one idea more each:
//   to_bf16         y = bf16(x): the weights' bf16 copy (one launch over the flat parameter buffer), and the
//                   gradients a GEMM reads next. Round to nearest even (flash.to_bf16's bits); a NaN stays NaN.
//   bias_to_bf16    y = bf16(x + bias[column]): the qkv GEMM's fp32 output with its bias, as the attention reads it.
//   gelu_bias_bf16  y = bf16(gelu(x + bias[column])): the GELU in fp32, its output stored for the next GEMM
//                   in half the bytes (and, with recomputation, made again in the backward from x).
//   classifier_bf16 step 3's fused classifier (softmax + cross-entropy + gradient, one block per row) with the
//                   gradient written in bf16 to a buffer of its own: the two LM-head GEMMs after it read bf16,
//                   and an fp32 gradient would cost a write and a cast of the step's largest tensor.
// Grid-stride loops over n elements (common.launch_grid); every architecture (bit operations only).
// Each thread casts four neighbours at a time (one 16-byte load of x, one 8-byte store of four bf16) where x and y
// are aligned for it, and one at a time otherwise: these kernels only stream, and with a 4-byte load and a 2-byte
// store per thread they moved less than a third of the DRAM's bandwidth in a GPT-2 124M step (Nsight Compute).
#include "course.cuh"       // gelu_tanh: the same formula as train_gpt2.cu's fp32 GELU

typedef unsigned short u16;

// fp32 -> bf16 bits, round to nearest even: add 0x7fff plus the lowest kept bit, keep the top 16 bits. A NaN
// would round into the sign bit or to infinity: it is made the quiet NaN instead.
__device__ __forceinline__ u16 bf16_bits(float x) {
    const unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)0x7fc0;
    return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ bool vec4(const void* x, const void* y) {
    return ((reinterpret_cast<unsigned long long>(x) & 15) | (reinterpret_cast<unsigned long long>(y) & 7)) == 0;
}

__device__ __forceinline__ uint2 pack4(u16 a, u16 b, u16 c, u16 d) {
    return make_uint2(a | ((unsigned)b << 16), c | ((unsigned)d << 16));
}

#define GRID_STRIDE const long long tid = blockIdx.x * (long long)blockDim.x + threadIdx.x, \
                                stride = (long long)gridDim.x * blockDim.x

extern "C" __global__ void to_bf16(const float* __restrict__ x, u16* __restrict__ y, long long n) {
    GRID_STRIDE;
    const long long n4 = vec4(x, y) ? n / 4 : 0;
    for (long long v = tid; v < n4; v += stride) {
        const float4 a = reinterpret_cast<const float4*>(x)[v];
        reinterpret_cast<uint2*>(y)[v] = pack4(bf16_bits(a.x), bf16_bits(a.y), bf16_bits(a.z), bf16_bits(a.w));
    }
    for (long long i = 4 * n4 + tid; i < n; i += stride)
        y[i] = bf16_bits(x[i]);
}

// The bias kernels: element i is in column i % cols; a thread's four neighbours may wrap into the next row.
__device__ __forceinline__ int next_col(int c, int cols) { return c + 1 == cols ? 0 : c + 1; }

extern "C" __global__ void bias_to_bf16(const float* __restrict__ x, const float* __restrict__ bias,
                                        u16* __restrict__ y, long long n, int cols) {
    GRID_STRIDE;
    const long long n4 = vec4(x, y) ? n / 4 : 0;
    for (long long v = tid; v < n4; v += stride) {
        const float4 a = reinterpret_cast<const float4*>(x)[v];
        const int c0 = (int)(4 * v % cols), c1 = next_col(c0, cols), c2 = next_col(c1, cols), c3 = next_col(c2, cols);
        reinterpret_cast<uint2*>(y)[v] = pack4(bf16_bits(a.x + bias[c0]), bf16_bits(a.y + bias[c1]),
                                               bf16_bits(a.z + bias[c2]), bf16_bits(a.w + bias[c3]));
    }
    for (long long i = 4 * n4 + tid; i < n; i += stride)
        y[i] = bf16_bits(x[i] + bias[i % cols]);
}

extern "C" __global__ void gelu_bias_bf16(const float* __restrict__ x, const float* __restrict__ bias,
                                          u16* __restrict__ y, long long n, int cols) {
    GRID_STRIDE;
    const long long n4 = vec4(x, y) ? n / 4 : 0;
    for (long long v = tid; v < n4; v += stride) {
        const float4 a = reinterpret_cast<const float4*>(x)[v];
        const int c0 = (int)(4 * v % cols), c1 = next_col(c0, cols), c2 = next_col(c1, cols), c3 = next_col(c2, cols);
        reinterpret_cast<uint2*>(y)[v] = pack4(bf16_bits(gelu_tanh(a.x + bias[c0])),
                                               bf16_bits(gelu_tanh(a.y + bias[c1])),
                                               bf16_bits(gelu_tanh(a.z + bias[c2])),
                                               bf16_bits(gelu_tanh(a.w + bias[c3])));
    }
    for (long long i = 4 * n4 + tid; i < n; i += stride)
        y[i] = bf16_bits(gelu_tanh(x[i] + bias[i % cols]));
}

// As step3_fused/train_forward.cu's classifier_fused in its training mode, without a bias: the loss of each row
// from one online pass (running max, rescaled sum), then dz = bf16((softmax - onehot(target)) * scale), the same
// fp32 value classifier_fused would store, rounded. z is only read. An out-of-range target gives NaN (loss and row).
extern "C" __global__ void classifier_bf16(const float* __restrict__ z, const int* __restrict__ targets,
                                           float* __restrict__ loss, u16* __restrict__ dz, int cols, float scale) {
    __shared__ float scratch[32];
    const float* zr = z + (long long)blockIdx.x * cols;
    u16* dr = dz + (long long)blockIdx.x * cols;
    const int t = targets[blockIdx.x];
    const bool valid = t >= 0 && t < cols;
    float m = __int_as_float(0xff800000), s = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float v = zr[i];
        if (v > m) { s *= expf(m - v); m = v; }
        s += expf(v - m);
    }
    const float mb = block_max(m, scratch);
    s = block_sum(m == __int_as_float(0xff800000) ? 0.0f : s * expf(m - mb), scratch);
    const float lse = mb + logf(s);
    if (threadIdx.x == 0) loss[blockIdx.x] = valid ? lse - zr[t] : __int_as_float(0x7fffffff);
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        dr[i] = valid ? bf16_bits((expf(zr[i] - lse) - (i == t ? 1.0f : 0.0f)) * scale) : (u16)0x7fc0;
}
