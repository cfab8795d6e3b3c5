// flash_rescale.cu - Exercise 2b.2: the rescaling step inside the flash attention loop.
//
//   o[h, i, :] = softmax_j(scale * q_i . k_j, causal) @ v        lse[h, i] = log sum_j exp(scale * q_i . k_j)
//
// q, k, v, o are (H, T, D) float32 (batch and heads flattened, D = HEAD_DIM = 64). One warp per query
// row, 4 rows per block (the course's flash_v1 layout, fp32, natural exp). Keys come in tiles of 32:
// lane j scores key k0 + j into s (-inf where masked or past T). The loop, the loads and the final
// o = acc / l and lse = m + log(l) are written (so m and l are checked too). What is missing is the
// heart of flash attention, the running state update after each tile. The state of a row (kept identical in all 32 lanes):
//   m   = the largest score seen so far (starts at -inf)
//   l   = sum of exp(score - m) over the keys seen so far
//   acc = sum of exp(score - m) * v[key, :] so far (lane owns dims lane and lane + 32)
// For the new tile: m_new = max(m, max of s over the warp); this lane's weight p = exp(s - m_new);
// everything accumulated before was relative to m, so multiply l AND acc by alpha = exp(m - m_new);
// then l += sum of p over the warp, and m = m_new. (acc += p * v is done after your code.)
// Careful: while a row has seen no visible key, m_new is -inf and exp(-inf - (-inf)) is NaN; use 0
// in place of m_new for the exponentials then. warp_max / warp_sum come from course.cuh.
//
// Hint 1 (where to look): The state update is the online-softmax rule of lesson 2b, once per tile of 32 keys instead
//   of once per key. Write the order down first: the tile's max, m_new, alpha, p, then l.
// Hint 2 (the shape of the code): m_new = fmaxf(m, warp_max(s)); ms = (m_new == NEG_INF) ? 0.f : m_new; p = expf(s -
//   ms); alpha = expf(m - ms); l = l * alpha + warp_sum(p); every acc[i] *= alpha; m = m_new. (Use the names
//   of the stub's variables.)
// The solution: solution("step2/flash_rescale") gives its path (read it after trying).
// Check it with: from common.exercises import check; check("step2/flash_rescale")
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

        float p = 0.0f;                    // this lane's weight exp(s - max), used by the loop below
        // TODO: update m, l and acc for this tile, and set p

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
