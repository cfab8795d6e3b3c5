// attention_naive.cu - multi-head attention as three kernels that materialise the (B, H, Tq, Tk) scores.
//
//   out = softmax(mask(Q K^T * scale)) V      for every (batch, head); q (B,H,Tq,D), k, v (B,H,Tk,D)
//
//   1. attn_scores:  S = Q K^T * scale       a batched matmul with K read transposed; writes B*H*Tq*Tk floats
//   2. attn_softmax: P = softmax(mask(S))    in place, one warp per row, three passes (softmax.cu's v3
//                                            plus the causal mask): reads S three times, writes it once
//   3. attn_pv:      O = P V                 a batched matmul; reads all of P again
//
// Every step round-trips the T x T matrix through DRAM: at B=8, H=12, T=1024 that is 403 MB per
// trip, against 25 MB for q, k, v and out together. That traffic (and the memory it occupies) is what
// flash attention removes.
//
// The two matmuls use the shared-memory tiling of matmul.cu v2 (TILE x TILE threads, TILE x TILE
// tiles); gridDim.z runs over the B*H heads. They compute the masked (upper) triangle too, the
// softmax writes zeros there, and P V multiplies by those zeros: naive on purpose.
//
// Causal: query i sees keys 0 .. i + (Tk - Tq) (the same convention as common.reference.attention);
// a fully masked row gives zeros.
//
// Compile-time knob: TILE (default 32), WARPS (softmax rows per block, default 4).
#include "course.cuh"

#ifndef TILE
#define TILE 32
#endif
#ifndef WARPS
#define WARPS 4
#endif

#define NEG_INF __int_as_float(0xff800000)

// S[h][i][j] = scale * sum_d Q[h][i][d] * K[h][j][d]
extern "C" __global__ void __launch_bounds__(TILE * TILE)
attn_scores(const float* __restrict__ q, const float* __restrict__ k, float* __restrict__ s,
            int Tq, int Tk, int D, float scale) {
    __shared__ float Qs[TILE][TILE];
    __shared__ float Ks[TILE][TILE + 1];    // read down a column below: +1 puts each row in another bank
    const int tx = threadIdx.x, ty = threadIdx.y;
    const long long h = blockIdx.z;
    const float* qh = q + h * Tq * D;
    const float* kh = k + h * Tk * D;
    const int i = blockIdx.y * TILE + ty;            // query row of this thread
    const int j0 = blockIdx.x * TILE;
    float acc = 0.0f;
    for (int d0 = 0; d0 < D; d0 += TILE) {
        Qs[ty][tx] = i < Tq && d0 + tx < D ? qh[(long long)i * D + d0 + tx] : 0.0f;
        Ks[ty][tx] = j0 + ty < Tk && d0 + tx < D ? kh[(long long)(j0 + ty) * D + d0 + tx] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int d = 0; d < TILE; d++) acc += Qs[ty][d] * Ks[tx][d];
        __syncthreads();
    }
    if (i < Tq && j0 + tx < Tk) s[(h * Tq + i) * Tk + j0 + tx] = acc * scale;
}

// In place: P = softmax over each row of S, columns past the causal limit set to 0.
extern "C" __global__ void attn_softmax(float* s, int rows, int Tq, int Tk, int causal) {
    const int lane = threadIdx.x % 32;
    const int r = blockIdx.x * WARPS + threadIdx.x / 32;
    if (r >= rows) return;
    float* row = s + (long long)r * Tk;
    const int n = causal ? max(0, min(Tk, r % Tq + (Tk - Tq) + 1)) : Tk;   // visible keys
    float m = NEG_INF;
    for (int j = lane; j < n; j += 32) m = fmaxf(m, row[j]);
    m = warp_max(m);
    float sum = 0.0f;
    for (int j = lane; j < n; j += 32) sum += expf(row[j] - m);   // n > 0 here means m is finite
    sum = warp_sum(sum);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int j = lane; j < Tk; j += 32) row[j] = j < n ? expf(row[j] - m) * inv : 0.0f;
}

// O[h][i][d] = sum_j P[h][i][j] * V[h][j][d]
extern "C" __global__ void __launch_bounds__(TILE * TILE)
attn_pv(const float* __restrict__ p, const float* __restrict__ v, float* __restrict__ o, int Tq, int Tk, int D) {
    __shared__ float Ps[TILE][TILE];
    __shared__ float Vs[TILE][TILE];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const long long h = blockIdx.z;
    const float* ph = p + h * Tq * Tk;
    const float* vh = v + h * Tk * D;
    const int i = blockIdx.y * TILE + ty, d = blockIdx.x * TILE + tx;
    float acc = 0.0f;
    for (int j0 = 0; j0 < Tk; j0 += TILE) {
        Ps[ty][tx] = i < Tq && j0 + tx < Tk ? ph[(long long)i * Tk + j0 + tx] : 0.0f;
        Vs[ty][tx] = j0 + ty < Tk && d < D ? vh[(long long)(j0 + ty) * D + d] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int j = 0; j < TILE; j++) acc += Ps[ty][j] * Vs[j][tx];
        __syncthreads();
    }
    if (i < Tq && d < D) o[(h * Tq + i) * D + d] = acc;
}
