// attention.cu - the backward pass of causal attention, for training: versions 1 and 2 (version 3, the same
// on tensor cores, is attention_tc.cu). The forward pass is step 2's flash attention (flash_attention.cu),
// which also writes each query row's log-sum-exp lse (B, H, T): all the backward needs to rebuild P.
//
// Layouts: qkv is GPT-2's fused (B, T, 3C) buffer WITHOUT its bias: the kernels add it while loading (no bias
// pass, no permute kernel). lse is the natural log; delta_i = dO_i . O_i is the softmax backward's row term.
//
//   v1  materialise: S = QK^T again (cuBLAS, in ops.py), attention_probs: P from lse, written as a T x T
//       matrix; dV = P^T dO, dP = dO V^T (cuBLAS); attention_dscores: dS = P (dP - delta); dQ, dK (cuBLAS).
//       Simple, and 2 * B*H*T^2 floats to DRAM and back each way.
//   v2  flash-style, never writes T x T: attention_delta, then attention_backward_dkv (a block owns 64 keys,
//       walks the queries tile by tile, recomputes P from lse: dK, dV in registers) and attention_backward_dq
//       (a block owns 64 queries, walks the keys). No atomics: each output has one owner. Two threads per row
//       (each half of the head dims: half the registers, one shuffle per dot product), tiles in shared memory,
//       exponentials in the exp2 domain.
//
// Compile-time knobs: HEAD_DIM (32 or 64, default 64); ATT_ROWS (query or key rows per v2 block: 2 * ATT_ROWS
// threads) comes from ops.py as a define (no default, so Python and the kernels agree by construction).
#include "course.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#ifndef ATT_ROWS
#error "ATT_ROWS is passed by ops.py"
#endif
#define D HEAD_DIM
#define HALF (D / 2)               // head dims per thread: two threads share a row
#define SROW (D + 8)               // shared row: the two halves 4 floats apart, so the pair's float4 loads
#define HOFF(half) ((half) * (HALF + 4))   // hit different banks
#define ATT_TILE 32                // keys (or queries) per shared-memory tile
#define NAN_F __int_as_float(0x7fffffff)
#define LOG2E 1.4426950408889634f

static_assert(D == 32 || D == 64, "HEAD_DIM must be 32 or 64");

// ------------------------------------------------------------------------------- every version's row term
// delta (B, H, T): delta_i = dO_i . O_i, the row term of the softmax backward. One warp per (b, t, h).
// Versions 1, 2 and 3 (attention_tc.cu) all start from it.
extern "C" __global__ void attention_delta(const float* __restrict__ dout, const float* __restrict__ out,
                                           float* __restrict__ delta, int T, int H, long long rows) {
    const long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (r >= rows) return;
    float s = 0.0f;
#pragma unroll
    for (int d = lane; d < D; d += 32) s += dout[r * D + d] * out[r * D + d];
    s = warp_sum(s);
    if (lane == 0) {
        const long long bt = r / H;
        const int h = (int)(r % H), t = (int)(bt % T);
        delta[((bt / T) * H + h) * T + t] = s;
    }
}

// ------------------------------------------------------------------------------------------------- v1
// v1 pieces. s (BH, T, T) holds the raw scores Q K^T; in place: P = exp(s * scale - lse) on and below the
// diagonal, 0 above it. Then dscores: dS = P (dP - delta) * scale, in place over dP.
extern "C" __global__ void attention_probs(float* s, const float* __restrict__ lse, int T, long long n, float scale) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        const long long row = e / T;
        const int j = (int)(e % T), i = (int)(row % T);
        s[e] = j <= i ? expf(s[e] * scale - lse[row]) : 0.0f;
    }
}

extern "C" __global__ void attention_dscores(const float* __restrict__ p, float* dp, const float* __restrict__ delta,
                                             int T, long long n, float scale) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x)
        dp[e] = p[e] * (dp[e] - delta[e / T]) * scale;
}

// ------------------------------------------------------------------------------------------------- v2
// Loads HALF floats (+ bias) of a row into registers, times `mul`.
__device__ __forceinline__ void load_half(const float* __restrict__ src, const float* __restrict__ bias, float mul,
                                          float* dst) {
#pragma unroll
    for (int d = 0; d < HALF; d += 4) {
        float4 a = *reinterpret_cast<const float4*>(src + d);
        if (bias) {
            const float4 bb = *reinterpret_cast<const float4*>(bias + d);
            a.x += bb.x; a.y += bb.y; a.z += bb.z; a.w += bb.w;
        }
        dst[d] = a.x * mul; dst[d + 1] = a.y * mul; dst[d + 2] = a.z * mul; dst[d + 3] = a.w * mul;
    }
}

// A tile of ATT_TILE rows (first row r0) of a (B, T, stride) buffer, D columns from col, plus bias[col..]
// (bias indexed like the buffer's columns), into shared memory sh[ATT_TILE][SROW] with the halves split; rows past T are zero.
__device__ __forceinline__ void load_tile(float (*sh)[SROW], const float* __restrict__ base, long long stride,
                                          int col, const float* __restrict__ bias, int r0, int T) {
    for (int e = threadIdx.x; e < ATT_TILE * D / 4; e += blockDim.x) {
        const int r = e / (D / 4), c = (e % (D / 4)) * 4;
        float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r0 + r < T) {
            a = *reinterpret_cast<const float4*>(base + (long long)(r0 + r) * stride + col + c);
            if (bias) {
                const float4 bb = *reinterpret_cast<const float4*>(bias + col + c);
                a.x += bb.x; a.y += bb.y; a.z += bb.z; a.w += bb.w;
            }
        }
        *reinterpret_cast<float4*>(&sh[r][c < HALF ? c : c + 4]) = a;
    }
}

// The pair's dot product: each thread HALF products from registers x shared row, one shuffle.
__device__ __forceinline__ float pair_dot(const float* reg, const float* __restrict__ row) {
    float s = 0.0f;
#pragma unroll
    for (int d = 0; d < HALF; d += 4) {
        const float4 r = *reinterpret_cast<const float4*>(row + d);
        s += reg[d] * r.x + reg[d + 1] * r.y + reg[d + 2] * r.z + reg[d + 3] * r.w;
    }
    return s + __shfl_xor_sync(FULL_MASK, s, 1);
}

__device__ __forceinline__ void axpy_half(float* acc, float a, const float* __restrict__ row) {
#pragma unroll
    for (int d = 0; d < HALF; d += 4) {
        const float4 r = *reinterpret_cast<const float4*>(row + d);
        acc[d] += a * r.x; acc[d + 1] += a * r.y; acc[d + 2] += a * r.z; acc[d + 3] += a * r.w;
    }
}

// v2, keys: a block owns ATT_ROWS keys j (two threads each), walks the queries i >= its first key in tiles,
// recomputes p_ij = exp(s_ij - lse_i) and accumulates dV_j += p dO_i, dK_j += p (dP_ij - delta_i) q_i.
extern "C" __global__ void __launch_bounds__(2 * ATT_ROWS) attention_backward_dkv(
        const float* __restrict__ qkv, const float* __restrict__ bias, const float* __restrict__ dout,
        const float* __restrict__ lse, const float* __restrict__ delta, float* __restrict__ dqkv,
        int T, int H, float scale) {
    __shared__ __align__(16) float qs[ATT_TILE][SROW];
    __shared__ __align__(16) float dos[ATT_TILE][SROW];
    __shared__ float ls[ATT_TILE], dl[ATT_TILE];
    const int C = H * D, bh = blockIdx.y, b = bh / H, h = bh % H;
    const int j0 = blockIdx.x * ATT_ROWS;           // blockIdx 0 has the most queries: it starts first
    const int j = j0 + threadIdx.x / 2, half = threadIdx.x % 2;
    const float* base = qkv + (long long)b * T * 3 * C;
    const float* dbase = dout + (long long)b * T * C;
    float k[HALF], v[HALF], dk[HALF], dv[HALF];
    if (j < T) {
        load_half(base + (long long)j * 3 * C + C + h * D + half * HALF, bias ? bias + C + h * D + half * HALF : nullptr, scale * LOG2E, k);
        load_half(base + (long long)j * 3 * C + 2 * C + h * D + half * HALF, bias ? bias + 2 * C + h * D + half * HALF : nullptr, 1.0f, v);
    } else {
#pragma unroll
        for (int d = 0; d < HALF; ++d) k[d] = v[d] = 0.0f;
    }
#pragma unroll
    for (int d = 0; d < HALF; ++d) dk[d] = dv[d] = 0.0f;
    for (int i0 = j0; i0 < T; i0 += ATT_TILE) {
        __syncthreads();
        load_tile(qs, base, 3 * C, h * D, bias, i0, T);
        load_tile(dos, dbase, C, h * D, nullptr, i0, T);
        if (threadIdx.x < ATT_TILE) {
            const int i = i0 + threadIdx.x;
            ls[threadIdx.x] = i < T ? lse[(long long)bh * T + i] * LOG2E : 0.0f;
            dl[threadIdx.x] = i < T ? delta[(long long)bh * T + i] : 0.0f;
        }
        __syncthreads();
#pragma unroll 4
        for (int ii = 0; ii < ATT_TILE; ++ii) {
            const int i = i0 + ii;
            const float s = pair_dot(k, &qs[ii][HOFF(half)]);
            const float dp = pair_dot(v, &dos[ii][HOFF(half)]);
            const float p = (j <= i && i < T) ? exp2f(s - ls[ii]) : 0.0f;
            axpy_half(dv, p, &dos[ii][HOFF(half)]);
            axpy_half(dk, p * (dp - dl[ii]), &qs[ii][HOFF(half)]);
        }
    }
    if (j >= T) return;
    float* o = dqkv + ((long long)b * T + j) * 3 * C + h * D + half * HALF;
#pragma unroll
    for (int d = 0; d < HALF; d += 4) {
        *reinterpret_cast<float4*>(o + C + d) = make_float4(dk[d] * scale, dk[d + 1] * scale, dk[d + 2] * scale, dk[d + 3] * scale);
        *reinterpret_cast<float4*>(o + 2 * C + d) = make_float4(dv[d], dv[d + 1], dv[d + 2], dv[d + 3]);
    }
}

// v2, queries: a block owns ATT_ROWS queries i, walks the keys j <= i in tiles: dQ_i += p (dP_ij - delta_i) k_j.
extern "C" __global__ void __launch_bounds__(2 * ATT_ROWS) attention_backward_dq(
        const float* __restrict__ qkv, const float* __restrict__ bias, const float* __restrict__ dout,
        const float* __restrict__ lse, const float* __restrict__ delta, float* __restrict__ dqkv,
        int T, int H, float scale) {
    __shared__ __align__(16) float ks[ATT_TILE][SROW];
    __shared__ __align__(16) float vs[ATT_TILE][SROW];
    const int C = H * D, bh = blockIdx.y, b = bh / H, h = bh % H;
    const int row0 = (gridDim.x - 1 - blockIdx.x) * ATT_ROWS;
    const int i = row0 + threadIdx.x / 2, half = threadIdx.x % 2;
    const bool valid = i < T;
    const float* base = qkv + (long long)b * T * 3 * C;
    float q[HALF], dO[HALF], dq[HALF];
    float l2 = 0.0f, dl = 0.0f;
    if (valid) {
        load_half(base + (long long)i * 3 * C + h * D + half * HALF, bias ? bias + h * D + half * HALF : nullptr, scale * LOG2E, q);
        load_half(dout + ((long long)b * T + i) * C + h * D + half * HALF, nullptr, 1.0f, dO);
        l2 = lse[(long long)bh * T + i] * LOG2E;
        dl = delta[(long long)bh * T + i];
    } else {
#pragma unroll
        for (int d = 0; d < HALF; ++d) q[d] = dO[d] = 0.0f;
    }
#pragma unroll
    for (int d = 0; d < HALF; ++d) dq[d] = 0.0f;
    const int last = min(T, row0 + ATT_ROWS);
    for (int j0 = 0; j0 < last; j0 += ATT_TILE) {
        __syncthreads();
        load_tile(ks, base, 3 * C, C + h * D, bias, j0, T);
        load_tile(vs, base, 3 * C, 2 * C + h * D, bias, j0, T);
        __syncthreads();
#pragma unroll 8
        for (int jj = 0; jj < ATT_TILE; ++jj) {
            const float s = pair_dot(q, &ks[jj][HOFF(half)]);
            const float dp = pair_dot(dO, &vs[jj][HOFF(half)]);
            const float p = (valid && j0 + jj <= i) ? exp2f(s - l2) : 0.0f;
            axpy_half(dq, p * (dp - dl), &ks[jj][HOFF(half)]);
        }
    }
    if (!valid) return;
    float* o = dqkv + ((long long)b * T + i) * 3 * C + h * D + half * HALF;
#pragma unroll
    for (int d = 0; d < HALF; d += 4)
        *reinterpret_cast<float4*>(o + d) = make_float4(dq[d] * scale, dq[d + 1] * scale, dq[d + 2] * scale, dq[d + 3] * scale);
}
