// residual_layernorm.cu - the pre-LN transformer's block tail in one kernel:
//
//     r = x + proj + proj_bias        (the residual stream, written back: the next sublayer needs it)
//     y = LayerNorm(r) * w + b        (the next sublayer's input)
//
// Unfused, that is three kernels: bias add (read proj, write proj), residual add (read x and proj,
// write r), LayerNorm (read r, write y): 7 row-sized transfers. Fused: read x and proj, write r and y:
// 4 transfers, the floor (FasterTransformer's addBiasResidualLayerNorm, llm.c's fused_residual_forward).
// One warp per row with the row in registers (ln_row.cuh), so r is never re-read.
//
//   residual_layernorm    float4 loads/stores (all six arrays 16-byte aligned, C % 4 == 0)
//   residual_layernorm_scalar  float loads, any C and any alignment
//
// r may be x itself (in place): each element is read before the same thread writes it, and x/r are
// deliberately not __restrict__. proj_bias may be null (has_bias = 0).
// Compile-time knob: BLOCK (threads per block, one warp per row), passed by ops.py (LN_BLOCK).
#include "course.cuh"
#include "ln_row.cuh"

#ifndef BLOCK
#error "BLOCK is passed by ops.py"
#endif

template <int V>
__device__ __forceinline__ void residual_layernorm_body(const float* x, const float* __restrict__ proj,
                                                        const float* __restrict__ proj_bias, int has_bias,
                                                        const float* __restrict__ w, const float* __restrict__ b,
                                                        float* r, float* __restrict__ y, int N, int C, float eps) {
    const int row = blockIdx.x * (BLOCK / 32) + threadIdx.x / 32;
    if (row >= N) return;
    const long long off = (long long)row * C;
    auto first = [&](int i, float* v) {
        float p[V];
        ln_load<V>(x + off + i, v);
        ln_load<V>(proj + off + i, p);
#pragma unroll
        for (int u = 0; u < V; u++) v[u] += p[u];
        if (has_bias) {
            ln_load<V>(proj_bias + i, p);
#pragma unroll
            for (int u = 0; u < V; u++) v[u] += p[u];
        }
    };
    // The residual is stored after every cached load was issued (see ln_row.cuh).
    auto keep = [&](int i, const float* v) { ln_store<V>(r + off + i, v); };
    // Long rows only: this thread already wrote r for the uncached tail (x may be gone if r == x).
    auto again = [&](int i, float* v) { ln_load<V>(r + off + i, v); };
    ln_warp_row<V>(C, eps, w, b, y + off, first, keep, again);
}

extern "C" __global__ void residual_layernorm(const float* x, const float* __restrict__ proj,
                                              const float* __restrict__ proj_bias, int has_bias,
                                              const float* __restrict__ w, const float* __restrict__ b,
                                              float* r, float* __restrict__ y, int N, int C, float eps) {
    residual_layernorm_body<4>(x, proj, proj_bias, has_bias, w, b, r, y, N, C, eps);
}

extern "C" __global__ void residual_layernorm_scalar(const float* x, const float* __restrict__ proj,
                                                     const float* __restrict__ proj_bias, int has_bias,
                                                     const float* __restrict__ w, const float* __restrict__ b,
                                                     float* r, float* __restrict__ y, int N, int C, float eps) {
    residual_layernorm_body<1>(x, proj, proj_bias, has_bias, w, b, r, y, N, C, eps);
}
