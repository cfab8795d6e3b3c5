// attention_bf16.cu - the training step's attention, forward and backward, on bf16 tensor cores: the attention
// of mixed-precision training (mixed.py). attention_tc.cu runs the same products at fp32 accuracy (3xTF32,
// three tensor-core products for one); here every operand is bf16 and each product is ONE mma, accumulated in
// fp32. bf16 keeps fp32's 8 exponent bits and 7 of its 23 mantissa bits: a product is off by about 4e-3
// relative, the accumulation adds nothing to that, and training does not notice (the checks are at 1e-2).
//
// The instruction: mma.sync.m16n8k16 with bf16 inputs (common/include/mma.cuh's mma16816<true>), with
// g = lane / 4, t = lane % 4:
//     A (16x16): a0 (g, 2t..2t+1)  a1 (g+8, 2t..2t+1)  a2 (g, 2t+8..2t+9)  a3 (g+8, 2t+8..2t+9)
//     C (16x8):  c0 (g, 2t)  c1 (g, 2t+1)  c2 (g+8, 2t)  c3 (g+8, 2t+1)
// The accumulators of two neighbouring 8-column tiles ARE the A fragment of the next product once packed to
// bf16 (step 2's flash_attention_tc.cu does this for P V): no shuffle, no shared memory, in every product below.
//
// The numbered versions of the training attention (ops.ATTENTION_VERSIONS) are fp32; this file is their bf16
// counterpart, one idea at a time:
//   attention_forward_bf16  step 2's bf16 flash forward (flash_attention_tc.cu), reading q, k, v straight from
//                           the fused (B, T, 3C) buffer and writing each row's log-sum-exp for the backward.
//   attention_delta_bf16    delta = rowsum(dO * O), the softmax backward's row term, one warp per row.
//   attention_dkv_bf16      a warp owns 16 keys (K, V as A fragments, in registers); over the query tiles from
//                           its first key: S^T = K Q^T, P^T = exp2(S^T - lse), dV += P^T dO, dP^T = V dO^T,
//                           dS^T = P^T (dP^T - delta), dK += dS^T Q. Every product is one of the forward's shapes.
//   attention_dq_bf16       a warp owns 16 queries: recomputes S and dP over the key tiles, dQ += dS K.
//                           dkv and dq write their parts of dqkv in fp32 and, given dqkv16, in bf16 too, from
//                           the same registers (Layouts).
// Recompute or store? attention_tc.cu writes dS to memory once for its dQ kernel; at one mma per product, the
// two products dq recomputes cost less than the round trip of dS through DRAM, and the kernels stay simpler.
// Each output row has one owner: no atomics, the same bits every run.
//
// Layouts (mixed.py): qkv (B, T, 3C) bf16 with its bias already added (mixed.cu's bias_bf16, after the GEMM);
// out and dout (B, T, C) bf16; lse and delta (B, H, T) fp32, lse in natural log; dqkv (B, T, 3C) fp32, which the
// bias gradient sums, and optionally dqkv16, its bf16 bits for the two qkv GEMMs (common/include/lowp.cuh's
// bf16_bits, a separate cast's bits), written from the same registers rather than by a cast that reads dqkv
// back. bf16 is stored as uint16 bit patterns. Shared rows are D + 8 elements
// long: the 8 row addresses of each ldmatrix then fall in 8 different banks.
//
// Architectures: bf16 mma needs sm_80. Compiled for older GPUs the kernels trap; ops_bf16.py refuses those GPUs
// with a message before launching. Compile-time knob: HEAD_DIM (32 or 64; default 64).
#include "mma.cuh"          // mma16816, smem_addr, copy16 / copy_commit / copy_wait (cp.async)
#include "lowp.cuh"         // bf16x2_bits: dqkv16's rounding, the same as mixed.cu's casts

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#define D HEAD_DIM
#define WARPS 4
#define NT (WARPS * 32)      // threads per block
#define ROWS (16 * WARPS)    // queries (or keys) a block owns
#define BC 64                // keys per tile in the forward
#define BT 32                // queries (dkv) or keys (dq) per tile in the backward: fewer live registers
#define SROW (D + 8)         // shared row length in bf16 elements
#define NEG_INF __int_as_float(0xff800000)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define FULL_MASK 0xffffffffu

static_assert(D == 32 || D == 64, "HEAD_DIM must be 32 or 64");

typedef unsigned short u16;

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// two floats -> one register of two bf16 (round to nearest even), lo in the low half. One cvt instruction (sm_80),
// for the A fragments of the hot loops; it rounds as lowp.cuh's bf16x2_bits does but for NaN's payload, and
// bf16x2_bits (integer work) writes dqkv16, whose bits must be a separate cast's exactly.
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned u;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(u) : "f"(hi), "f"(lo));
    return u;
}

__device__ __forceinline__ void zero(float (&d)[4]) { d[0] = d[1] = d[2] = d[3] = 0.0f; }

// Two neighbouring columns of dqkv at element i, and their bf16 bits at the same place of dqkv16 when asked for.
__device__ __forceinline__ void store_pair(float* __restrict__ f, u16* __restrict__ h, long long i, float lo, float hi) {
    *reinterpret_cast<float2*>(f + i) = make_float2(lo, hi);
    if (h) *reinterpret_cast<unsigned*>(h + i) = bf16x2_bits(lo, hi);
}

// rows [r0, r0 + R) of a (T, D) slice whose rows are `stride` elements apart, into shared memory; zeros past T
template <int R>
__device__ __forceinline__ void load_rows(u16* dst, const u16* src, int r0, int T, long long stride, int tid) {
    constexpr int CHUNKS = D / 8;   // 16-byte chunks per row
#pragma unroll
    for (int i = tid; i < R * CHUNKS; i += NT) {
        const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
        const bool valid = r0 + r < T;
        copy16(dst + r * SROW + c, src + (long long)(valid ? r0 + r : 0) * stride + c, valid);
    }
}

// The warp's 16 rows of a shared tile (from row r0) as A fragments, one per 16 head dims.
__device__ __forceinline__ void a_fragments(unsigned (&a)[D / 16][4], const u16* tile, int r0, int lane) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        ldsm_x4(a[kk], tile + (r0 + lane % 16) * SROW + kk * 16 + (lane / 16) * 8);
}

// s (16 x R) = A B^T: A the warp's 16 rows (fragments), B the R rows of a shared tile (S = Q K^T: B = K).
template <int R>
__device__ __forceinline__ void product_t(float (&s)[R / 8][4], const unsigned (&a)[D / 16][4], const u16* tile,
                                          int lane) {
#pragma unroll
    for (int n = 0; n < R / 8; ++n) zero(s[n]);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < R / 16; ++np) {
            unsigned b[4];
            ldsm_x4(b, tile + (np * 16 + (lane / 16) * 8 + lane % 8) * SROW + kk * 16 + ((lane / 8) % 2) * 8);
            mma16816<true>(s[2 * np], a[kk], b[0], b[1]);
            mma16816<true>(s[2 * np + 1], a[kk], b[2], b[3]);
        }
    }
}

// acc (16 x D) += C B: C (16 x R) an accumulator, packed to bf16 as the A fragment; B the R rows of a shared
// tile, read transposed (O += P V: B = V, its rows the keys).
template <int R>
__device__ __forceinline__ void product_acc(float (&acc)[D / 8][4], const float (&c)[R / 8][4], const u16* tile,
                                            int lane) {
#pragma unroll
    for (int kk = 0; kk < R / 16; ++kk) {
        const unsigned a[4] = {pack_bf16(c[2 * kk][0], c[2 * kk][1]), pack_bf16(c[2 * kk][2], c[2 * kk][3]),
                               pack_bf16(c[2 * kk + 1][0], c[2 * kk + 1][1]), pack_bf16(c[2 * kk + 1][2], c[2 * kk + 1][3])};
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            unsigned b[4];
            ldsm_x4_trans(b, tile + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * SROW + dp * 16 + (lane / 16) * 8);
            mma16816<true>(acc[2 * dp], a, b[0], b[1]);
            mma16816<true>(acc[2 * dp + 1], a, b[2], b[3]);
        }
    }
}
#endif

// ---------------------------------------------------------------------------------------------------- forward
// grid (ceil(T / 64), B * H), NT threads. out (B, T, C) bf16, lse (B, H, T) fp32 (natural log).
extern "C" __global__ void __launch_bounds__(NT)
attention_forward_bf16(const u16* __restrict__ qkv, u16* __restrict__ out, float* __restrict__ lse, int T, int H,
                       float scale) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) u16 qs[ROWS * SROW];
    __shared__ __align__(16) u16 ks[2][BC * SROW];
    __shared__ __align__(16) u16 vs[2][BC * SROW];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, C = H * D;
    const long long stride = 3LL * C;
    const u16* q = qkv + (long long)b * T * stride + h * D;
    const u16 *k = q + C, *v = q + 2 * C;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * ROWS;     // heaviest causal blocks first
    const int n_tiles = (min(T, q0 + ROWS) + BC - 1) / BC;
    const float scale_log2 = scale * LOG2E;

    load_rows<ROWS>(qs, q, q0, T, stride, tid);
    copy_commit();
    load_rows<BC>(ks[0], k, 0, T, stride, tid);
    load_rows<BC>(vs[0], v, 0, T, stride, tid);
    copy_commit();
    copy_wait<1>();
    __syncthreads();
    unsigned qf[D / 16][4];
    a_fragments(qf, qs, warp * 16, lane);

    float acc[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) zero(acc[n]);
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    const int row_a = q0 + warp * 16 + g, row_b = row_a + 8;

    for (int kt = 0; kt < n_tiles; ++kt) {
        const int stage = kt & 1;
        if (kt + 1 < n_tiles) {   // the next tile streams in while this one computes
            load_rows<BC>(ks[stage ^ 1], k, (kt + 1) * BC, T, stride, tid);
            load_rows<BC>(vs[stage ^ 1], v, (kt + 1) * BC, T, stride, tid);
            copy_commit();
            copy_wait<1>();
        } else {
            copy_wait<0>();
        }
        __syncthreads();
        float s[BC / 8][4];
        product_t<BC>(s, qf, ks[stage], lane);
        const int k0 = kt * BC;
        if (k0 + BC > T || k0 + BC - 1 > q0 + warp * 16) {     // the tile crosses the diagonal or the end
#pragma unroll
            for (int n = 0; n < BC / 8; ++n) {
                const int c = k0 + n * 8 + 2 * t;
                if (c >= T || c > row_a) s[n][0] = NEG_INF;
                if (c + 1 >= T || c + 1 > row_a) s[n][1] = NEG_INF;
                if (c >= T || c > row_b) s[n][2] = NEG_INF;
                if (c + 1 >= T || c + 1 > row_b) s[n][3] = NEG_INF;
            }
        }
        // online softmax, rows g (elements 0, 1) and g + 8 (2, 3); a row's 4 lanes are a quad
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = NEG_INF;
#pragma unroll
            for (int n = 0; n < BC / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
            const float m_new = fmaxf(m[r], mx * scale_log2);
            const float m_use = m_new == NEG_INF ? 0.0f : m_new;
            const float alpha = exp2f(m[r] - m_use);
            float sum = 0.0f;
#pragma unroll
            for (int n = 0; n < BC / 8; ++n) {
                s[n][2 * r] = exp2f(fmaf(s[n][2 * r], scale_log2, -m_use));
                s[n][2 * r + 1] = exp2f(fmaf(s[n][2 * r + 1], scale_log2, -m_use));
                sum += s[n][2 * r] + s[n][2 * r + 1];
            }
            l[r] = l[r] * alpha + sum;
            m[r] = m_new;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) { acc[n][2 * r] *= alpha; acc[n][2 * r + 1] *= alpha; }
        }
        product_acc<BC>(acc, s, vs[stage], lane);
        __syncthreads();   // this stage is refilled by the prefetch of the next iteration but one
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 1);
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 2);
    }
    const float inv_a = l[0] > 0.0f ? 1.0f / l[0] : 0.0f, inv_b = l[1] > 0.0f ? 1.0f / l[1] : 0.0f;
    u16* o = out + (long long)b * T * C + h * D;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        const int c = n * 8 + 2 * t;
        if (row_a < T) *reinterpret_cast<unsigned*>(o + (long long)row_a * C + c) = pack_bf16(acc[n][0] * inv_a, acc[n][1] * inv_a);
        if (row_b < T) *reinterpret_cast<unsigned*>(o + (long long)row_b * C + c) = pack_bf16(acc[n][2] * inv_b, acc[n][3] * inv_b);
    }
    if (t == 0) {       // lse = ln(sum_j exp(s_ij)) = (m + log2 l) ln 2, m in the exp2 domain
        if (row_a < T) lse[(long long)bh * T + row_a] = (m[0] + log2f(l[0])) * LN2;
        if (row_b < T) lse[(long long)bh * T + row_b] = (m[1] + log2f(l[1])) * LN2;
    }
#else
    __trap();   // bf16 mma needs sm_80: ops_bf16.py refuses older GPUs before launching
#endif
}

// ---------------------------------------------------------------------------------------------------- delta
// delta[b, h, t] = sum_d dO[b, t, h, d] * O[b, t, h, d] in fp32; one warp per row, rows = B * H * T.
extern "C" __global__ void attention_delta_bf16(const u16* __restrict__ dout, const u16* __restrict__ out,
                                                float* __restrict__ delta, int T, int H, long long rows) {
    const long long row = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const long long bh = row / T;
    const int t = (int)(row % T), b = (int)(bh / H), h = (int)(bh % H), C = H * D;
    const long long base = ((long long)b * T + t) * C + h * D;
    float sum = 0.0f;
#pragma unroll
    for (int d = lane; d < D; d += 32)
        sum += __uint_as_float((unsigned)dout[base + d] << 16) * __uint_as_float((unsigned)out[base + d] << 16);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(FULL_MASK, sum, o);
    if (lane == 0) delta[row] = sum;
}

// ---------------------------------------------------------------------------------------------------- dK, dV
// grid (ceil(T / 64), B * H), NT threads. Writes dK and dV of the block's 64 keys into dqkv (fp32), and into
// dqkv16 (bf16) unless it is null.
extern "C" __global__ void __launch_bounds__(NT)
attention_dkv_bf16(const u16* __restrict__ qkv, const u16* __restrict__ dout, const float* __restrict__ lse,
                   const float* __restrict__ delta, float* __restrict__ dqkv, u16* __restrict__ dqkv16, int T, int H,
                   float scale) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) u16 ks[ROWS * SROW];
    __shared__ __align__(16) u16 vs[ROWS * SROW];
    __shared__ __align__(16) u16 qs[BT * SROW];
    __shared__ __align__(16) u16 dos[BT * SROW];
    __shared__ float ls[BT], dl[BT];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, C = H * D;
    const long long stride = 3LL * C;
    const u16* q = qkv + (long long)b * T * stride + h * D;
    const u16 *k = q + C, *v = q + 2 * C;
    const u16* dO = dout + (long long)b * T * C + h * D;
    const int k0 = blockIdx.x * ROWS;                        // the first keys have the most query tiles: first
    const int kw = k0 + warp * 16;                           // this warp's first key
    const float scale_log2 = scale * LOG2E;

    load_rows<ROWS>(ks, k, k0, T, stride, tid);
    load_rows<ROWS>(vs, v, k0, T, stride, tid);
    copy_commit();
    copy_wait<0>();
    __syncthreads();
    unsigned kf[D / 16][4], vf[D / 16][4];
    a_fragments(kf, ks, warp * 16, lane);
    a_fragments(vf, vs, warp * 16, lane);
    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) zero(dk[n]), zero(dv[n]);
    const int key_a = kw + g, key_b = key_a + 8;

    for (int q0 = k0; q0 < T; q0 += BT) {       // queries before k0 see none of these keys
        __syncthreads();                         // every warp is done with the last tile
        load_rows<BT>(qs, q, q0, T, stride, tid);
        load_rows<BT>(dos, dO, q0, T, C, tid);
        copy_commit();
        if (tid < BT) {                          // lse in the exp2 domain
            const int qi = q0 + tid;
            ls[tid] = qi < T ? lse[(long long)bh * T + qi] * LOG2E : 0.0f;
            dl[tid] = qi < T ? delta[(long long)bh * T + qi] : 0.0f;
        }
        copy_wait<0>();
        __syncthreads();
        if (q0 + BT - 1 < kw) continue;          // every query of the tile is before the warp's keys (warp-uniform)
        float s[BT / 8][4], dp[BT / 8][4];
        product_t<BT>(s, kf, qs, lane);          // S^T = K Q^T
        product_t<BT>(dp, vf, dos, lane);        // dP^T = V dO^T
#pragma unroll
        for (int n = 0; n < BT / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = n * 8 + 2 * t + (e & 1), qi = q0 + j, key = e < 2 ? key_a : key_b;
                const float p = (qi < T && qi >= key) ? exp2f(fmaf(s[n][e], scale_log2, -ls[j])) : 0.0f;
                s[n][e] = p;                      // P^T
                dp[n][e] = p * (dp[n][e] - dl[j]);  // dS^T
            }
        }
        product_acc<BT>(dv, s, dos, lane);       // dV += P^T dO
        product_acc<BT>(dk, dp, qs, lane);       // dK += dS^T Q (times scale below)
    }
    const long long dk0 = (long long)b * T * stride + C + h * D, dv0 = dk0 + C;   // dK, dV of key 0, column 0
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        const int c = n * 8 + 2 * t;
        if (key_a < T) {
            store_pair(dqkv, dqkv16, dk0 + key_a * stride + c, dk[n][0] * scale, dk[n][1] * scale);
            store_pair(dqkv, dqkv16, dv0 + key_a * stride + c, dv[n][0], dv[n][1]);
        }
        if (key_b < T) {
            store_pair(dqkv, dqkv16, dk0 + key_b * stride + c, dk[n][2] * scale, dk[n][3] * scale);
            store_pair(dqkv, dqkv16, dv0 + key_b * stride + c, dv[n][2], dv[n][3]);
        }
    }
#else
    __trap();   // bf16 mma needs sm_80: ops_bf16.py refuses older GPUs before launching
#endif
}

// ---------------------------------------------------------------------------------------------------- dQ
// grid (ceil(T / 64), B * H), NT threads. Writes dQ of the block's 64 queries into dqkv (fp32), and into dqkv16
// (bf16) unless it is null.
extern "C" __global__ void __launch_bounds__(NT)
attention_dq_bf16(const u16* __restrict__ qkv, const u16* __restrict__ dout, const float* __restrict__ lse,
                  const float* __restrict__ delta, float* __restrict__ dqkv, u16* __restrict__ dqkv16, int T, int H,
                  float scale) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) u16 qs[ROWS * SROW];
    __shared__ __align__(16) u16 dos[ROWS * SROW];
    __shared__ __align__(16) u16 ks[BT * SROW];
    __shared__ __align__(16) u16 vs[BT * SROW];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, C = H * D;
    const long long stride = 3LL * C;
    const u16* q = qkv + (long long)b * T * stride + h * D;
    const u16 *k = q + C, *v = q + 2 * C;
    const u16* dO = dout + (long long)b * T * C + h * D;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * ROWS;     // heaviest causal blocks first
    const float scale_log2 = scale * LOG2E;

    load_rows<ROWS>(qs, q, q0, T, stride, tid);
    load_rows<ROWS>(dos, dO, q0, T, C, tid);
    copy_commit();
    copy_wait<0>();
    __syncthreads();
    unsigned qf[D / 16][4], dof[D / 16][4];
    a_fragments(qf, qs, warp * 16, lane);
    a_fragments(dof, dos, warp * 16, lane);
    const int row_a = q0 + warp * 16 + g, row_b = row_a + 8;
    const float lse_r[2] = {row_a < T ? lse[(long long)bh * T + row_a] * LOG2E : 0.0f,
                            row_b < T ? lse[(long long)bh * T + row_b] * LOG2E : 0.0f};
    const float delta_r[2] = {row_a < T ? delta[(long long)bh * T + row_a] : 0.0f,
                              row_b < T ? delta[(long long)bh * T + row_b] : 0.0f};
    float dq[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) zero(dq[n]);

    const int kv_end = min(T, q0 + ROWS);
    for (int kt0 = 0; kt0 < kv_end; kt0 += BT) {
        __syncthreads();                         // every warp is done with the last tile
        load_rows<BT>(ks, k, kt0, T, stride, tid);
        load_rows<BT>(vs, v, kt0, T, stride, tid);
        copy_commit();
        copy_wait<0>();
        __syncthreads();
        if (kt0 > q0 + warp * 16 + 15) continue;  // every key of the tile is after the warp's queries (warp-uniform)
        float s[BT / 8][4], dp[BT / 8][4];
        product_t<BT>(s, qf, ks, lane);          // S = Q K^T
        product_t<BT>(dp, dof, vs, lane);        // dP = dO V^T
#pragma unroll
        for (int n = 0; n < BT / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = kt0 + n * 8 + 2 * t + (e & 1), r = e / 2, row = r ? row_b : row_a;
                const float p = (key < T && key <= row) ? exp2f(fmaf(s[n][e], scale_log2, -lse_r[r])) : 0.0f;
                dp[n][e] = p * (dp[n][e] - delta_r[r]);   // dS
            }
        }
        product_acc<BT>(dq, dp, ks, lane);       // dQ += dS K (times scale below)
    }
    // Row by row: column by column (as dkv's epilogue), the bf16 stores made this kernel spill on sm_90.
    const long long dq0 = (long long)b * T * stride + h * D;      // dQ of query 0, column 0
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = r ? row_b : row_a;
        if (row >= T) continue;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            store_pair(dqkv, dqkv16, dq0 + row * stride + n * 8 + 2 * t, dq[n][2 * r] * scale,
                       dq[n][2 * r + 1] * scale);
    }
#else
    __trap();   // bf16 mma needs sm_80: ops_bf16.py refuses older GPUs before launching
#endif
}
