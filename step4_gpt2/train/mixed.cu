// mixed.cu - the casts and bias kernels of mixed-precision training (mixed.py): bf16 out (uint16 bit patterns).
//
// A bf16 GEMM reads bf16 operands; everything else of the step (LayerNorm, GELU, the loss, AdamW) computes in
// fp32. These kernels are where the two meet, one idea more each:
//   to_bf16         y = bf16(x): the weights' bf16 copy, one launch for wte (into the LM head's padded copy)
//                   and one over the rest of the flat parameter buffer. Round to nearest even (flash.to_bf16's
//                   bits); a NaN stays NaN.
//   bias_bf16       y = bf16(y + bias[column]) in place, y bf16: the bias of the qkv GEMM, which writes bf16
//                   itself (an fp32 output would cost twice the bytes written, then read back by a cast). So q, k
//                   and v are rounded twice, bf16(bf16(x W) + b), where torch.autocast's GEMM adds the bias
//                   before its one rounding: half a bf16 step more error at most, inside the checks' tolerance.
//   gelu_bias_bf16  y = bf16(gelu(x + bias[column])), x bf16 (the c_fc GEMM's output, bias not yet added, stored
//                   for the backward in half the bytes): the sum and the GELU in fp32, the output for the next
//                   GEMM in bf16 (and, with recomputation, made again in the backward from x).
//   classifier_bf16 step 3's fused classifier (softmax + cross-entropy + gradient, one block per row) on bf16
//                   logits, widened as read, in fp32 arithmetic, with the gradient written in bf16 to a buffer of
//                   its own: the two LM-head GEMMs after it read bf16. The logits and their gradient are the
//                   step's largest tensors; in fp32 they would cost twice the bytes written and read back.
// The other activations and gradients a GEMM reads need no cast: the kernels that make them write bf16
// themselves (train_gpt2.cu's LayerNorm forward and backward and GELU backward, attention_bf16.cu's backward),
// where a cast would read 4 bytes and write 2 for each value its producer had just written in 4. All of them
// round with common/include/lowp.cuh's bf16_bits, so a fused output has the bits to_bf16 would give it.
// Grid-stride loops over n elements (common.launch_grid); every architecture (bit operations only).
// Each thread takes four neighbours at a time (a 16-byte load of fp32 x or an 8-byte one of bf16, an 8-byte store
// of four bf16) where x and y are aligned for it, and one at a time otherwise: these kernels only stream, and the
// casts, one element per thread (a 4-byte load, a 2-byte store), moved less than a third of the DRAM's bandwidth
// in a GPT-2 124M step (Nsight Compute).
#include "course.cuh"       // gelu_tanh: the same formula as train_gpt2.cu's fp32 GELU
#include "lowp.cuh"         // bf16_bits, bf16x4_bits: the rounding every bf16 output of the step shares;
                            // bf16_to_float, bf16x4_to_float4: the widening of a bf16 input

typedef unsigned short u16;

__device__ __forceinline__ bool vec4(const void* x, const void* y, unsigned xalign = 16) {
    return ((reinterpret_cast<unsigned long long>(x) & (xalign - 1)) | (reinterpret_cast<unsigned long long>(y) & 7))
           == 0;
}

#define GRID_STRIDE const long long tid = blockIdx.x * (long long)blockDim.x + threadIdx.x, \
                                stride = (long long)gridDim.x * blockDim.x

extern "C" __global__ void to_bf16(const float* __restrict__ x, u16* __restrict__ y, long long n) {
    GRID_STRIDE;
    const long long n4 = vec4(x, y) ? n / 4 : 0;
    for (long long v = tid; v < n4; v += stride) {
        const float4 a = reinterpret_cast<const float4*>(x)[v];
        reinterpret_cast<uint2*>(y)[v] = bf16x4_bits(a);
    }
    for (long long i = 4 * n4 + tid; i < n; i += stride)
        y[i] = bf16_bits(x[i]);
}

// The bias kernels: element i is in column i % cols; a thread's four neighbours may wrap into the next row.
__device__ __forceinline__ int next_col(int c, int cols) { return c + 1 == cols ? 0 : c + 1; }

// y = bf16(act(x + bias[column])), x bf16; act = GELU or nothing. x may be y (bias_bf16 works in place), so
// neither pointer is __restrict__: a thread reads its elements before it writes them.
template <bool GELU>
__device__ __forceinline__ void bias_act_bf16(const u16* x, const float* __restrict__ bias, u16* y, long long n,
                                              int cols) {
    GRID_STRIDE;
    const long long n4 = vec4(x, y, 8) ? n / 4 : 0;
    for (long long v = tid; v < n4; v += stride) {
        const uint2 u = reinterpret_cast<const uint2*>(x)[v];
        const float4 a = bf16x4_to_float4(u.x, u.y);
        const int c0 = (int)(4 * v % cols), c1 = next_col(c0, cols), c2 = next_col(c1, cols), c3 = next_col(c2, cols);
        float4 r = make_float4(a.x + bias[c0], a.y + bias[c1], a.z + bias[c2], a.w + bias[c3]);
        if (GELU) r = make_float4(gelu_tanh(r.x), gelu_tanh(r.y), gelu_tanh(r.z), gelu_tanh(r.w));
        reinterpret_cast<uint2*>(y)[v] = bf16x4_bits(r);
    }
    for (long long i = 4 * n4 + tid; i < n; i += stride) {
        const float r = bf16_to_float(x[i]) + bias[i % cols];
        y[i] = bf16_bits(GELU ? gelu_tanh(r) : r);
    }
}

extern "C" __global__ void bias_bf16(u16* y, const float* __restrict__ bias, long long n, int cols) {
    bias_act_bf16<false>(y, bias, y, n, cols);
}

extern "C" __global__ void gelu_bias_bf16(const u16* __restrict__ x, const float* __restrict__ bias,
                                          u16* __restrict__ y, long long n, int cols) {
    bias_act_bf16<true>(x, bias, y, n, cols);
}

// As step3_fused/train_forward.cu's classifier_fused in its training mode, without a bias, on bf16 logits z (the
// LM head's GEMM writes them in bf16, as torch.autocast does): each logit is widened to fp32 (exactly), then the
// loss of each row from one online pass (running max, rescaled sum), and dz = bf16((softmax - onehot(target)) *
// scale), the fp32 value classifier_fused would store for the widened row, rounded. z is only read; dz null: the
// losses alone (evaluation). An out-of-range target gives NaN (loss and row).

extern "C" __global__ void classifier_bf16(const u16* __restrict__ z, const int* __restrict__ targets,
                                           float* __restrict__ loss, u16* __restrict__ dz, int cols, float scale) {
    __shared__ float scratch[32];
    const u16* zr = z + (long long)blockIdx.x * cols;
    const int t = targets[blockIdx.x];
    const bool valid = t >= 0 && t < cols;
    float m = __int_as_float(0xff800000), s = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float v = bf16_to_float(zr[i]);
        if (v > m) { s *= expf(m - v); m = v; }
        s += expf(v - m);
    }
    const float mb = block_max(m, scratch);
    s = block_sum(m == __int_as_float(0xff800000) ? 0.0f : s * expf(m - mb), scratch);
    const float lse = mb + logf(s);
    if (threadIdx.x == 0) loss[blockIdx.x] = valid ? lse - bf16_to_float(zr[t]) : __int_as_float(0x7fffffff);
    if (dz == nullptr) return;
    u16* dr = dz + (long long)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        dr[i] = valid ? bf16_bits((expf(bf16_to_float(zr[i]) - lse) - (i == t ? 1.0f : 0.0f)) * scale) : (u16)0x7fc0;
}
