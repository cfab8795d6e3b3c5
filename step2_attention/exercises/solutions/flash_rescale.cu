// flash_rescale.cu (solution) - exercise 9 of step 2: the online-softmax update inside flash attention.
//
//   o[h, i, :] = softmax_j(scale * q_i . k_j, causal) @ v        lse[h, i] = log sum_j exp(scale * q_i . k_j)
//
// One warp per query row, 4 rows per block (the course's flash_v1 layout, fp32, natural exp). The keys
// arrive in tiles of 32 (lane j scores key k0 + j). After each tile the running state of the row is
//   m = max score so far,  l = sum of exp(score - m) so far,  acc = sum of exp(score - m) * v so far.
// A new tile may raise the max: everything accumulated so far was relative to the old max, so l and
// acc are multiplied by alpha = exp(m_old - m_new) (<= 1) before the tile's own terms are added. At the
// end o = acc / l. Until a row has seen one visible key its max is -inf; m_use = 0 then keeps
// exp(-inf - m_use) = 0 instead of exp(-inf - -inf) = NaN.
#include "course.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#define D HEAD_DIM
#define ROWS 4                     // query rows (warps) per block
#define BC 32                      // keys per tile: one per lane
#define NEG_INF __int_as_float(0xff800000)

extern "C" __global__ void __launch_bounds__(ROWS * 32)
flash_rescale(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
              float* __restrict__ o, float* __restrict__ lse, int T, float scale, int causal) {
    __shared__ float qs[ROWS][D];
    __shared__ float ks[BC][D + 1];        // +1: lane j reads row j, column d -> 32 different banks
    __shared__ float vs[BC][D];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long head = (long long)blockIdx.y * T * D;
    const int row0 = blockIdx.x * ROWS, row = row0 + warp;
    for (int i = threadIdx.x; i < ROWS * D; i += blockDim.x) {
        const int r = row0 + i / D;
        qs[i / D][i % D] = r < T ? q[head + (long long)r * D + i % D] * scale : 0.0f;
    }
    float m = NEG_INF, l = 0.0f, acc[D / 32];
#pragma unroll
    for (int i = 0; i < D / 32; ++i) acc[i] = 0.0f;
    const int kv_end = causal ? min(T, row0 + ROWS) : T;     // later keys are masked for every row here
    for (int k0 = 0; k0 < kv_end; k0 += BC) {
        __syncthreads();                   // the previous tile is consumed (and qs is written)
        for (int i = threadIdx.x; i < BC * D; i += blockDim.x) {
            const int j = k0 + i / D;
            ks[i / D][i % D] = j < T ? k[head + (long long)j * D + i % D] : 0.0f;
            vs[i / D][i % D] = j < T ? v[head + (long long)j * D + i % D] : 0.0f;
        }
        __syncthreads();
        const int j = k0 + lane;
        float s = 0.0f;
#pragma unroll 16
        for (int d = 0; d < D; ++d) s += qs[warp][d] * ks[lane][d];
        if (j >= T || (causal && j > row)) s = NEG_INF;

        // ---- the online-softmax update
        const float m_new = fmaxf(m, warp_max(s));
        const float m_use = m_new == NEG_INF ? 0.0f : m_new;  // nothing visible yet: keep zeros, no NaN
        const float p = expf(s - m_use);                        // this lane's key, relative to the new max
        const float alpha = expf(m - m_use);                    // old state -> new max (1 if unchanged)
        l = l * alpha + warp_sum(p);
        m = m_new;
#pragma unroll
        for (int i = 0; i < D / 32; ++i) acc[i] *= alpha;
        // ---- end of the update

        for (int jj = 0; jj < BC; ++jj) {  // acc += p_jj * v[jj, :], p broadcast from lane jj
            const float pj = __shfl_sync(FULL_MASK, p, jj);
#pragma unroll
            for (int i = 0; i < D / 32; ++i) acc[i] += pj * vs[jj][lane + 32 * i];
        }
    }
    if (row < T) {
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
        for (int i = 0; i < D / 32; ++i) o[head + (long long)row * D + lane + 32 * i] = acc[i] * inv;
        if (lane == 0) lse[(long long)blockIdx.y * T + row] = m + logf(l);
    }
}
