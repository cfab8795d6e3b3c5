// flash_attention.cu - fused causal attention in fp32: one launch, the T x T scores never leave the chip.
//
// Naive attention writes S = Q K^T (B*H*T*T floats), reads it back for the softmax, writes P, reads P
// again for P V. At T = 1024 that is 4 * 4 MB per head of traffic for 64 KB of useful output. Flash
// attention (Dao et al. 2022) walks over K/V in tiles and keeps a running max m and running sum l per
// query row ("online softmax"): when a new tile raises the max, the old partial output is rescaled by
// exp(m_old - m_new). Memory traffic drops to reading Q, K, V and writing O; the kernel becomes
// compute bound, so the later versions are about feeding the FMA units.
//
//   v1  one warp per query row, 4 rows per block. K/V tiles of 32 keys go through shared memory; lane j
//       scores key j, the warp does the online softmax with shuffles, then each lane accumulates D/32
//       output dims. Causal: tiles after the block's last row are skipped. One launch.
//   v2  a block owns BR query rows x BC keys per step and each thread a TM x TN register tile of S
//       (TM rows, TN = BC/8 keys) and of O (TM rows, D/8 dims, pv_tile). Q, K, V and P sit in shared
//       memory; every value loaded from shared memory feeds TM or TN FMAs instead of one.
//   v3  v2 + float4 loads, global (load4) and shared (pv_tile4): one instruction moves 16 bytes; padded
//       shared rows keep the float4 reads of K bank-conflict free; only the tile crossing the diagonal
//       or the end of the sequence is masked; the heaviest causal query blocks start first; and
//       __launch_bounds__(THREADS, 2) asks the compiler to fit two blocks per SM in registers.
//
// All versions read q/k/v through (batch, head, time) strides, so the same kernels serve (B, H, T, D)
// tensors and GPT-2's fused QKV buffer (B, T, 3C) with the c_attn bias added while loading (no permute
// kernel), and write either (B, H, T, D) or the merged-heads (B, T, C) output. Given an lse buffer, they
// also write each row's log-sum-exp (one float per row): all that a backward pass needs to rebuild the
// probabilities (step 4b's training).
//
// Compile-time knobs: HEAD_DIM (32 or 64; default 64), BR (query rows per block, 64), BC (keys per
// tile, 64), TM (query rows per thread, 4), V1_ROWS (v1 query rows = warps per block, 4). v2/v3 use
// (BR / TM) * 8 threads and dynamic shared memory.
#include "course.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#ifndef BR
#define BR 64
#endif
#ifndef BC
#define BC 64
#endif
#ifndef TM
#define TM 4
#endif
#ifndef V1_ROWS
#define V1_ROWS 4              // v1: query rows (warps) per block
#endif

#define D HEAD_DIM
#define NEG_INF __int_as_float(0xff800000)
#define TN (BC / 8)            // keys per thread in S
#define TD (D / 8)             // output dims per thread in O
#define THREADS ((BR / TM) * 8)
#define V1_BC 32               // v1: keys per tile (one per lane)
#define ZERO4 make_float4(0.f, 0.f, 0.f, 0.f)
#define LN2 0.6931471805599453f  // scores are in log2 units (scale_log2); lse is a natural log

static_assert(D % 32 == 0 && D <= 128, "HEAD_DIM must be 32, 64 or 128");
static_assert(BC % 32 == 0 && BR % TM == 0 && TD % 4 == 0, "tile sizes must fit the thread layout");
static_assert(THREADS % 32 == 0 && THREADS <= 1024, "(BR / TM) * 8 must be a multiple of 32");

// Arguments shared by every version. Element (b, h, t, d) of q is q[b*s_b + h*s_h + t*s_t + d] (k and v
// have the same strides); o uses o_b/o_h/o_t. bq/bk/bv are per-head bias vectors (nullptr: none).
// lse (B*H, T): log sum_j exp(scale * q_i . k_j) of each row (nullptr: not written).
#define ATTN_ARGS                                                                                        \
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,               \
    const float* __restrict__ bq, const float* __restrict__ bk, const float* __restrict__ bv,            \
    float* __restrict__ o, float* __restrict__ lse, int T, int H, long long s_b, long long s_h,         \
    long long s_t, long long o_b, long long o_h, long long o_t, float scale_log2, int causal

// ------------------------------------------------------------------------------------------------- v1
extern "C" __global__ void __launch_bounds__(V1_ROWS * 32) flash_v1(ATTN_ARGS) {
    __shared__ float qs[V1_ROWS][D];
    __shared__ float ks[V1_BC][D + 1];   // +1: lane j reads row j, column d -> 32 different banks
    __shared__ float vs[V1_BC][D];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const long long base = b * s_b + h * s_h;
    const int row0 = blockIdx.x * V1_ROWS, row = row0 + warp;
    const float* bq_h = bq ? bq + h * D : nullptr;
    const float* bk_h = bk ? bk + h * D : nullptr;
    const float* bv_h = bv ? bv + h * D : nullptr;
    for (int i = threadIdx.x; i < V1_ROWS * D; i += blockDim.x) {
        const int r = row0 + i / D, d = i % D;
        // scale * log2(e) is applied to q once, so the scores come out ready for exp2f
        qs[i / D][d] = r < T ? (q[base + r * s_t + d] + (bq_h ? bq_h[d] : 0.0f)) * scale_log2 : 0.0f;
    }
    float m = NEG_INF, l = 0.0f, acc[D / 32];
#pragma unroll
    for (int i = 0; i < D / 32; ++i) acc[i] = 0.0f;
    const int last_row = min(T - 1, row0 + V1_ROWS - 1);
    const int kv_end = causal ? last_row + 1 : T;           // later keys are never seen by this block
    for (int k0 = 0; k0 < kv_end; k0 += V1_BC) {
        __syncthreads();                                    // previous tile fully consumed (and qs written)
        for (int i = threadIdx.x; i < V1_BC * D; i += blockDim.x) {
            const int j = k0 + i / D, d = i % D;
            const bool in = j < T;
            ks[i / D][d] = in ? k[base + j * s_t + d] + (bk_h ? bk_h[d] : 0.0f) : 0.0f;
            vs[i / D][d] = in ? v[base + j * s_t + d] + (bv_h ? bv_h[d] : 0.0f) : 0.0f;
        }
        __syncthreads();
        const int j = k0 + lane;
        float s = 0.0f;
#pragma unroll 16
        for (int d = 0; d < D; ++d) s += qs[warp][d] * ks[lane][d];
        if (j >= T || (causal && j > row)) s = NEG_INF;
        const float m_new = fmaxf(m, warp_max(s));
        const float m_use = m_new == NEG_INF ? 0.0f : m_new;  // a fully masked row so far: keep zeros
        const float p = exp2f(s - m_use);
        const float alpha = exp2f(m - m_use);
        l = l * alpha + warp_sum(p);
        m = m_new;
#pragma unroll
        for (int i = 0; i < D / 32; ++i) acc[i] *= alpha;
        for (int jj = 0; jj < V1_BC; ++jj) {
            const float pj = __shfl_sync(FULL_MASK, p, jj);
#pragma unroll
            for (int i = 0; i < D / 32; ++i) acc[i] += pj * vs[jj][lane + 32 * i];
        }
    }
    if (row < T) {
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        float* o_row = o + b * o_b + h * o_h + row * o_t;
#pragma unroll
        for (int i = 0; i < D / 32; ++i) o_row[lane + 32 * i] = acc[i] * inv;
        if (lse && lane == 0) lse[(long long)blockIdx.y * T + row] = (m + log2f(l)) * LN2;
    }
}

// ------------------------------------------------------------------------------------------------- v2
// Thread layout: ty = tid / 8 owns query rows ty*TM .. ty*TM+TM-1; tx = tid % 8 owns keys tx + 8*c
// (c < TN) of S and output dims tx + 8*c of O. The 8 threads of one row group are 8 consecutive lanes,
// so a row's max and sum take 3 shuffles. Shared memory (floats): Q [BR][D+4], K or P, V [BC][D].
// P reuses K's buffer: K is dead once S is computed.
#define QS_STRIDE (D + 4)
#define KS_STRIDE (D + 4)      // v3's float4 rows tx, tx+8, ...: (D+4)/4 is odd -> 8 lanes, 8 bank groups
#define PS_STRIDE (BC + 8)     // scalar P writes by 8 lanes x 4 row groups land in 32 different banks
#define KP_FLOATS (BC * KS_STRIDE > BR * PS_STRIDE ? BC * KS_STRIDE : BR * PS_STRIDE)
// In all (BR * QS_STRIDE + KP_FLOATS + BC * D) * 4 bytes of dynamic shared memory: flash.py computes the
// same number (52 KB at the defaults, so the launch opts in above the 48 KB default).

// O += P V for this thread's TM rows x output dims tx + 8*c (c < TD), over the tile's first jmax keys:
// P (in K's buffer, rows of PS_STRIDE) and V in shared memory, acc in registers.
__device__ __forceinline__ void pv_tile(float (&acc)[TM][TD], const float* kp, const float* vs, int ty, int tx, int jmax) {
    for (int j = 0; j < jmax; ++j) {
        float pf[TM], vf[TD];
#pragma unroll
        for (int i = 0; i < TM; ++i) pf[i] = kp[(ty * TM + i) * PS_STRIDE + j];
#pragma unroll
        for (int c = 0; c < TD; ++c) vf[c] = vs[j * D + tx + 8 * c];
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int c = 0; c < TD; ++c) acc[i][c] += pf[i] * vf[c];   // each loaded value feeds TM or TD FMAs
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) flash_v2(ATTN_ARGS) {
    extern __shared__ float4 smem4[];
    float* qs = reinterpret_cast<float*>(smem4);
    float* kp = qs + BR * QS_STRIDE;
    float* vs = kp + KP_FLOATS;
    const int tid = threadIdx.x, tx = tid % 8, ty = tid / 8;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const long long base = b * s_b + h * s_h;
    const int q0 = blockIdx.x * BR;
    const float* bq_h = bq ? bq + h * D : nullptr;
    const float* bk_h = bk ? bk + h * D : nullptr;
    const float* bv_h = bv ? bv + h * D : nullptr;
    for (int i = tid; i < BR * D; i += THREADS) {
        const int r = i / D, d = i % D;
        qs[r * QS_STRIDE + d] = q0 + r < T ? (q[base + (q0 + r) * s_t + d] + (bq_h ? bq_h[d] : 0.0f)) * scale_log2 : 0.0f;
    }
    float m[TM], l[TM], acc[TM][TD];
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        m[i] = NEG_INF; l[i] = 0.0f;
#pragma unroll
        for (int c = 0; c < TD; ++c) acc[i][c] = 0.0f;
    }
    const int kv_end = causal ? min(T, q0 + BR) : T;
    for (int k0 = 0; k0 < kv_end; k0 += BC) {
        __syncthreads();   // the previous tile's P and V are consumed (and Q is written, first time)
        for (int i = tid; i < BC * D; i += THREADS) {
            const int j = i / D, d = i % D;
            const bool in = k0 + j < T;
            kp[j * KS_STRIDE + d] = in ? k[base + (k0 + j) * s_t + d] + (bk_h ? bk_h[d] : 0.0f) : 0.0f;
            vs[j * D + d] = in ? v[base + (k0 + j) * s_t + d] + (bv_h ? bv_h[d] : 0.0f) : 0.0f;
        }
        __syncthreads();
        float s[TM][TN];   // S = Q K^T for this thread's TM x TN tile
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int c = 0; c < TN; ++c) s[i][c] = 0.0f;
#pragma unroll 2
        for (int d = 0; d < D; ++d) {
            float qf[TM], kf[TN];
#pragma unroll
            for (int i = 0; i < TM; ++i) qf[i] = qs[(ty * TM + i) * QS_STRIDE + d];
#pragma unroll
            for (int c = 0; c < TN; ++c) kf[c] = kp[(tx + 8 * c) * KS_STRIDE + d];
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int c = 0; c < TN; ++c) s[i][c] += qf[i] * kf[c];   // each loaded value feeds TM or TN FMAs
        }
        const bool edge = true;   // v3 masks only the tile crossing the diagonal or the end of the sequence
        if (edge) {               // keys past T, and (causal) keys after the query, get -inf
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int c = 0; c < TN; ++c) {
                    const int j = k0 + tx + 8 * c, r = q0 + ty * TM + i;
                    if (j >= T || (causal && j > r)) s[i][c] = NEG_INF;
                }
        }
        // online softmax, one row at a time; the row's 8 owners are lanes 8*g .. 8*g+7
#pragma unroll
        for (int i = 0; i < TM; ++i) {
            float mx = s[i][0];
#pragma unroll
            for (int c = 1; c < TN; ++c) mx = fmaxf(mx, s[i][c]);
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 4));
            const float m_new = fmaxf(m[i], mx);
            const float m_use = m_new == NEG_INF ? 0.0f : m_new;   // a fully masked row so far: keep zeros
            const float alpha = exp2f(m[i] - m_use);
            float sum = 0.0f;
#pragma unroll
            for (int c = 0; c < TN; ++c) { s[i][c] = exp2f(s[i][c] - m_use); sum += s[i][c]; }
            l[i] = l[i] * alpha + sum;   // per-thread partial sum; the 8 partials are added at the end
            m[i] = m_new;
#pragma unroll
            for (int c = 0; c < TD; ++c) acc[i][c] *= alpha;
        }
        __syncthreads();   // everyone is done reading K: P overwrites it
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int c = 0; c < TN; ++c) kp[(ty * TM + i) * PS_STRIDE + tx + 8 * c] = s[i][c];
        __syncthreads();
        pv_tile(acc, kp, vs, ty, tx, min(BC, T - k0));    // O += P V
    }
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        float li = l[i];
        li += __shfl_xor_sync(FULL_MASK, li, 1);
        li += __shfl_xor_sync(FULL_MASK, li, 2);
        li += __shfl_xor_sync(FULL_MASK, li, 4);
        const int r = q0 + ty * TM + i;
        if (r >= T) continue;
        const float inv = li > 0.0f ? 1.0f / li : 0.0f;
        float* o_row = o + b * o_b + h * o_h + r * o_t;
#pragma unroll
        for (int c = 0; c < TD; ++c) o_row[tx + 8 * c] = acc[i][c] * inv;
        if (lse && tx == 0) lse[(long long)blockIdx.y * T + r] = (m[i] + log2f(li)) * LN2;   // m: the same in all 8
    }
}

// ------------------------------------------------------------------------------------------------- v3
// v2 with 16-byte float4 loads (global and shared memory), the mask only on the edge tile, the heaviest
// causal query blocks first, and __launch_bounds__(THREADS, 2): the compiler fits two blocks per SM.

// Four floats at p (16-byte aligned) in one load, plus the bias's four at dims d..d+3 (nullptr: none).
__device__ __forceinline__ float4 load4(const float* p, const float* bias, int d) {
    float4 x = *reinterpret_cast<const float4*>(p);
    if (bias) {
        const float4 c = *reinterpret_cast<const float4*>(bias + d);
        x.x += c.x; x.y += c.y; x.z += c.z; x.w += c.w;
    }
    return x;
}

// O += P V for this thread's TM rows x dims tx*4 + 32*c4 + 0..3 (c4 < TD/4), contiguous float4s across the 8
// lanes of a row group; four keys per step, P read as float4. P rows are zero past jmax (masked: exp2 = 0).
__device__ __forceinline__ void pv_tile4(float (&acc)[TM][TD], const float* kp, const float* vs, int ty, int tx, int jmax) {
    for (int j = 0; j < jmax; j += 4) {
        float4 pf[TM];
#pragma unroll
        for (int i = 0; i < TM; ++i) pf[i] = *reinterpret_cast<const float4*>(kp + (ty * TM + i) * PS_STRIDE + j);
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
            for (int c4 = 0; c4 < TD / 4; ++c4) {
                const float4 vf = *reinterpret_cast<const float4*>(vs + (j + jj) * D + tx * 4 + 32 * c4);
#pragma unroll
                for (int i = 0; i < TM; ++i) {
                    const float p = jj == 0 ? pf[i].x : jj == 1 ? pf[i].y : jj == 2 ? pf[i].z : pf[i].w;
                    acc[i][4 * c4 + 0] += p * vf.x;
                    acc[i][4 * c4 + 1] += p * vf.y;
                    acc[i][4 * c4 + 2] += p * vf.z;
                    acc[i][4 * c4 + 3] += p * vf.w;
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 2) flash_v3(ATTN_ARGS) {
    extern __shared__ float4 smem4[];
    float* qs = reinterpret_cast<float*>(smem4);
    float* kp = qs + BR * QS_STRIDE;
    float* vs = kp + KP_FLOATS;
    const int tid = threadIdx.x, tx = tid % 8, ty = tid / 8;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    const long long base = b * s_b + h * s_h;
    const int q0 = (causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BR;
    const float* bq_h = bq ? bq + h * D : nullptr;
    const float* bk_h = bk ? bk + h * D : nullptr;
    const float* bv_h = bv ? bv + h * D : nullptr;
    for (int i = tid; i < BR * D / 4; i += THREADS) {
        const int r = i / (D / 4), d = (i % (D / 4)) * 4;
        float4 x = q0 + r < T ? load4(q + base + (q0 + r) * s_t + d, bq_h, d) : ZERO4;
        x.x *= scale_log2; x.y *= scale_log2; x.z *= scale_log2; x.w *= scale_log2;
        *reinterpret_cast<float4*>(qs + r * QS_STRIDE + d) = x;
    }
    float m[TM], l[TM], acc[TM][TD];
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        m[i] = NEG_INF; l[i] = 0.0f;
#pragma unroll
        for (int c = 0; c < TD; ++c) acc[i][c] = 0.0f;
    }
    const int kv_end = causal ? min(T, q0 + BR) : T;
    for (int k0 = 0; k0 < kv_end; k0 += BC) {
        __syncthreads();   // the previous tile's P and V are consumed (and Q is written, first time)
        for (int i = tid; i < BC * D / 4; i += THREADS) {
            const int j = i / (D / 4), d = (i % (D / 4)) * 4;
            const bool in = k0 + j < T;
            *reinterpret_cast<float4*>(kp + j * KS_STRIDE + d) = in ? load4(k + base + (k0 + j) * s_t + d, bk_h, d) : ZERO4;
            *reinterpret_cast<float4*>(vs + j * D + d) = in ? load4(v + base + (k0 + j) * s_t + d, bv_h, d) : ZERO4;
        }
        __syncthreads();
        float s[TM][TN];   // S = Q K^T for this thread's TM x TN tile
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int c = 0; c < TN; ++c) s[i][c] = 0.0f;
#pragma unroll 4
        for (int d = 0; d < D; d += 4) {
            float4 qf[TM];
#pragma unroll
            for (int i = 0; i < TM; ++i) qf[i] = *reinterpret_cast<const float4*>(qs + (ty * TM + i) * QS_STRIDE + d);
#pragma unroll
            for (int c = 0; c < TN; ++c) {
                const float4 kf = *reinterpret_cast<const float4*>(kp + (tx + 8 * c) * KS_STRIDE + d);
#pragma unroll
                for (int i = 0; i < TM; ++i)
                    s[i][c] += qf[i].x * kf.x + qf[i].y * kf.y + qf[i].z * kf.z + qf[i].w * kf.w;
            }
        }
        const bool edge = k0 + BC > T || (causal && k0 + BC - 1 > q0);   // the diagonal's tile or the last
        if (edge) {               // keys past T, and (causal) keys after the query, get -inf
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int c = 0; c < TN; ++c) {
                    const int j = k0 + tx + 8 * c, r = q0 + ty * TM + i;
                    if (j >= T || (causal && j > r)) s[i][c] = NEG_INF;
                }
        }
        // online softmax, one row at a time; the row's 8 owners are lanes 8*g .. 8*g+7
#pragma unroll
        for (int i = 0; i < TM; ++i) {
            float mx = s[i][0];
#pragma unroll
            for (int c = 1; c < TN; ++c) mx = fmaxf(mx, s[i][c]);
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 4));
            const float m_new = fmaxf(m[i], mx);
            const float m_use = m_new == NEG_INF ? 0.0f : m_new;   // a fully masked row so far: keep zeros
            const float alpha = exp2f(m[i] - m_use);
            float sum = 0.0f;
#pragma unroll
            for (int c = 0; c < TN; ++c) { s[i][c] = exp2f(s[i][c] - m_use); sum += s[i][c]; }
            l[i] = l[i] * alpha + sum;   // per-thread partial sum; the 8 partials are added at the end
            m[i] = m_new;
#pragma unroll
            for (int c = 0; c < TD; ++c) acc[i][c] *= alpha;
        }
        __syncthreads();   // everyone is done reading K: P overwrites it
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int c = 0; c < TN; ++c) kp[(ty * TM + i) * PS_STRIDE + tx + 8 * c] = s[i][c];
        __syncthreads();
        pv_tile4(acc, kp, vs, ty, tx, min(BC, T - k0));   // O += P V
    }
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        float li = l[i];
        li += __shfl_xor_sync(FULL_MASK, li, 1);
        li += __shfl_xor_sync(FULL_MASK, li, 2);
        li += __shfl_xor_sync(FULL_MASK, li, 4);
        const int r = q0 + ty * TM + i;
        if (r >= T) continue;
        const float inv = li > 0.0f ? 1.0f / li : 0.0f;
        float* o_row = o + b * o_b + h * o_h + r * o_t;
#pragma unroll
        for (int c4 = 0; c4 < TD / 4; ++c4)
            *reinterpret_cast<float4*>(o_row + tx * 4 + 32 * c4) =
                make_float4(acc[i][4 * c4] * inv, acc[i][4 * c4 + 1] * inv, acc[i][4 * c4 + 2] * inv, acc[i][4 * c4 + 3] * inv);
        if (lse && tx == 0) lse[(long long)blockIdx.y * T + r] = (m[i] + log2f(li)) * LN2;   // m: the same in all 8
    }
}
