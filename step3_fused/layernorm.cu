// layernorm.cu - LayerNorm over the rows of an (N, C) matrix, four ways.
//
// y = (x - mean) / sqrt(var + eps) * w + b, per row (GPT-2: C = 768, eps = 1e-5). The floor is reading
// x once and writing y once (8 bytes per element; w and b are tiny and stay in cache). Each version
// adds one idea:
//
//   v1  one thread per row: three serial passes over its row (mean, variance, write). Neighbouring
//       threads read addresses C floats apart, so no load is coalesced; few rows means few threads.
//   v2  one warp per row, two-pass: lanes stride through the row (coalesced), warp_sum gives the mean,
//       a second read of the row gives sum((x - mean)^2), a third writes y. x is read three times
//       (the re-reads mostly hit L1/L2).
//   v3  Welford: mean and M2 in ONE pass (each lane keeps a running count/mean/M2, lanes merge with
//       Chan's formula through shuffles), then the write pass: x is read twice.
//   v4  the row cached in registers (ln_row.cuh): one read of x, float4 loads when the row is 16-byte
//       aligned (layernorm_v4; layernorm_v4_scalar is the float version for any C), the variance as an exact
//       second pass over the registers, one write. This is the kernel the fused ones build on.
//
// Compile-time knob: BLOCK (threads per block, a multiple of 32: BLOCK / 32 rows per block in v2..v4), passed
// by ops.py (LN_BLOCK), which also sizes the grid with it.
#include "course.cuh"
#include "ln_row.cuh"

#ifndef BLOCK
#error "BLOCK is passed by ops.py"
#endif

extern "C" __global__ void layernorm_v1(const float* __restrict__ x, const float* __restrict__ w,
                                        const float* __restrict__ b, float* __restrict__ y,
                                        int N, int C, float eps) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= N) return;
    const float* xr = x + (long long)row * C;
    float* yr = y + (long long)row * C;
    float s = 0.0f;
    for (int i = 0; i < C; i++) s += xr[i];
    const float mean = s / C;
    float q = 0.0f;
    for (int i = 0; i < C; i++) { const float d = xr[i] - mean; q += d * d; }
    const float rstd = rsqrtf(q / C + eps);
    for (int i = 0; i < C; i++) yr[i] = (xr[i] - mean) * rstd * w[i] + b[i];
}

extern "C" __global__ void layernorm_v2(const float* __restrict__ x, const float* __restrict__ w,
                                        const float* __restrict__ b, float* __restrict__ y,
                                        int N, int C, float eps) {
    const int row = blockIdx.x * (BLOCK / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;                   // whole warps leave together: the shuffles stay full-warp
    const float* xr = x + (long long)row * C;
    float* yr = y + (long long)row * C;
    float s = 0.0f;
    for (int i = lane; i < C; i += 32) s += xr[i];
    const float mean = warp_sum(s) / C;
    float q = 0.0f;
    for (int i = lane; i < C; i += 32) { const float d = xr[i] - mean; q += d * d; }
    const float rstd = rsqrtf(warp_sum(q) / C + eps);
    for (int i = lane; i < C; i += 32) yr[i] = (xr[i] - mean) * rstd * w[i] + b[i];
}

extern "C" __global__ void layernorm_v3(const float* __restrict__ x, const float* __restrict__ w,
                                        const float* __restrict__ b, float* __restrict__ y,
                                        int N, int C, float eps) {
    const int row = blockIdx.x * (BLOCK / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    const float* xr = x + (long long)row * C;
    float* yr = y + (long long)row * C;
    // Welford: a running mean and sum of squared deviations, numerically safe in one pass.
    float n = 0.0f, mean = 0.0f, m2 = 0.0f;
    for (int i = lane; i < C; i += 32) {
        const float v = xr[i];
        n += 1.0f;
        const float d = v - mean;
        mean += d / n;
        m2 += d * (v - mean);
    }
    // Chan et al.: merge (n, mean, m2) of two halves; a lane with n = 0 (C < 32) merges as a no-op.
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float n2 = __shfl_xor_sync(FULL_MASK, n, offset);
        const float mean2 = __shfl_xor_sync(FULL_MASK, mean, offset);
        const float m22 = __shfl_xor_sync(FULL_MASK, m2, offset);
        const float nt = n + n2;
        const float d = mean2 - mean;
        const float f = nt > 0.0f ? n2 / nt : 0.0f;
        mean += d * f;
        m2 += m22 + d * d * n * f;
        n = nt;
    }
    const float rstd = rsqrtf(m2 / C + eps);
    for (int i = lane; i < C; i += 32) yr[i] = (xr[i] - mean) * rstd * w[i] + b[i];
}

template <int V>
__device__ __forceinline__ void layernorm_v4_body(const float* __restrict__ x, const float* __restrict__ w,
                                                  const float* __restrict__ b, float* __restrict__ y,
                                                  int N, int C, float eps) {
    const int row = blockIdx.x * (BLOCK / 32) + threadIdx.x / 32;
    if (row >= N) return;
    const float* xr = x + (long long)row * C;
    auto load = [&](int i, float* r) { ln_load<V>(xr + i, r); };
    ln_warp_row<V>(C, eps, w, b, y + (long long)row * C, load, [](int, const float*) {}, load);
}

// x, w, b, y 16-byte aligned and C % 4 == 0 (the wrapper checks and otherwise launches layernorm_v4_scalar).
extern "C" __global__ void layernorm_v4(const float* __restrict__ x, const float* __restrict__ w,
                                        const float* __restrict__ b, float* __restrict__ y,
                                        int N, int C, float eps) {
    layernorm_v4_body<4>(x, w, b, y, N, C, eps);
}

extern "C" __global__ void layernorm_v4_scalar(const float* __restrict__ x, const float* __restrict__ w,
                                                const float* __restrict__ b, float* __restrict__ y,
                                                int N, int C, float eps) {
    layernorm_v4_body<1>(x, w, b, y, N, C, eps);
}
