// flash_attention_tc.cu - flash attention on tensor cores: fp16 or bf16 inputs, fp32 accumulation.
//
// The fp32 kernel (flash_attention.cu) is limited by the FMA units (common.fp32_peak_tflops()). Tensor
// cores multiply 16x16 by 16x8 tiles in one instruction (mma.sync), at a multiple of the FMA rate (which
// multiple depends on the chip: 02c_tensor_cores.ipynb measures it), but they want their operands in a
// fixed "fragment" layout spread over the 32 lanes of a warp. This file
// is the FlashAttention-2 forward pass written with inline PTX (no <mma.h>, which NVRTC cannot use
// with the pip headers):
//
//   * a block of WARPS warps owns 16*WARPS query rows; each warp owns 16 rows, so the row max and row sum
//     of the online softmax never leave the warp (4 lanes share a row: 2 shuffles);
//   * Q is loaded once into A fragments (ldmatrix); K tiles give the B fragments of S = Q K^T directly
//     (ldmatrix), V tiles through ldmatrix.trans (V is row-major in keys, mma wants it column-major);
//   * the S accumulator fragments of two neighbouring 8-key tiles are exactly the A fragment of P for
//     the P V product, so P is converted to fp16/bf16 in registers and never touches shared memory;
//   * K/V tiles are double-buffered with cp.async (sm_80+): tile j+1 streams in while tile j computes;
//   * shared rows are padded by 16 bytes so the 8 row addresses of each ldmatrix hit 8 different banks.
//
// The mma instruction as a function (mma16816) and smem_addr live in common/include/mma.cuh, where
// mma_tile.cu (whose v1 writes the instruction out) finds them too.
//
// Architectures: mma.sync m16n8k16 with fp16 or bf16 inputs needs sm_80. fp16 also runs on sm_75 (T4):
// there one m16n8k16 is issued as two m16n8k8 (same fragments, split in k) and the cp.async copies
// become plain loads. sm_70 (V100) has neither ldmatrix nor these mma shapes: the kernels trap there,
// so flash.py never launches them on sm_70: fp16 inputs run through the fp32 flash kernel instead (upcast,
// no tensor cores, with a warning). bf16 needs sm_80: compiled only for sm_80+ (#if __CUDA_ARCH__), and
// flash.py refuses older GPUs with a message.
//
// Layout: q, k, v, o are (B, H, T, D) contiguous, dtype fp16 or bf16 (bf16 bit patterns as uint16).
// Compile-time knobs: HEAD_DIM (32, 64 or 128; default 64), WARPS (4: 64 query rows per block),
// BC (keys per tile, 64).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "mma.cuh"      // mma16816 and smem_addr, shared with mma_tile.cu

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#ifndef WARPS
#define WARPS 4
#endif
#ifndef BC
#define BC 64
#endif

#define D HEAD_DIM
#define BRT (16 * WARPS)          // query rows per block
#define SROW (D + 8)              // shared row length in 16-bit elements: +16 bytes breaks bank conflicts
#define NEG_INF __int_as_float(0xff800000)
#define FULL_MASK 0xffffffffu

static_assert(D % 16 == 0 && D <= 128, "HEAD_DIM must be a multiple of 16, at most 128");
static_assert(BC % 16 == 0, "BC must be a multiple of 16");

typedef unsigned short u16;

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 750
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

template <bool BF16>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned u;
#if __CUDA_ARCH__ >= 800
    if (BF16) {
        __nv_bfloat162 x = __floats2bfloat162_rn(lo, hi);
        u = *reinterpret_cast<unsigned*>(&x);
        return u;
    }
#endif
    __half2 x = __floats2half2_rn(lo, hi);
    u = *reinterpret_cast<unsigned*>(&x);
    return u;
}

// rows [r0, r0 + rows) of a (T, D) matrix into shared memory (row stride SROW), zeros past T
template <int ROWS, int NT>
__device__ __forceinline__ void load_tile(u16* dst, const u16* src, int r0, int T, int tid) {
    constexpr int CHUNKS = D / 8;   // 16-byte chunks per row
#pragma unroll
    for (int i = tid; i < ROWS * CHUNKS; i += NT) {
        const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
        const bool valid = r0 + r < T;
        copy16(dst + r * SROW + c, src + (long long)(valid ? r0 + r : 0) * D + c, valid);
    }
}

template <bool BF16>
__device__ __forceinline__ void flash_tc(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                                         u16* __restrict__ o, int T, float scale_log2, int causal) {
    extern __shared__ uint4 smem_tc[];
    u16* qs = reinterpret_cast<u16*>(smem_tc);
    u16* ks = qs + BRT * SROW;            // [2][BC][SROW]
    u16* vs = ks + 2 * BC * SROW;         // [2][BC][SROW]
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const long long base = (long long)blockIdx.y * T * D;
    const int qb = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;   // heaviest causal blocks first
    const int q0 = qb * BRT;
    const int kv_end = causal ? min(T, q0 + BRT) : T;
    const int n_tiles = (kv_end + BC - 1) / BC;

    load_tile<BRT, WARPS * 32>(qs, q + base, q0, T, tid);
    copy_commit();
    load_tile<BC, WARPS * 32>(ks, k + base, 0, T, tid);
    load_tile<BC, WARPS * 32>(vs, v + base, 0, T, tid);
    copy_commit();
    copy_wait<1>();        // Q has landed (K/V tile 0 may still be in flight)
    __syncthreads();
    unsigned qf[D / 16][4];   // this warp's 16 query rows as mma A fragments, for the whole kernel
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        ldsm_x4(qf[kk], qs + (warp * 16 + lane % 16) * SROW + kk * 16 + (lane / 16) * 8);

    float acc[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    const int row_a = q0 + warp * 16 + g, row_b = row_a + 8;

    for (int kt = 0; kt < n_tiles; ++kt) {
        const int stage = kt & 1;
        if (kt + 1 < n_tiles) {   // prefetch the next tile into the other buffer, then wait for this one
            load_tile<BC, WARPS * 32>(ks + (stage ^ 1) * BC * SROW, k + base, (kt + 1) * BC, T, tid);
            load_tile<BC, WARPS * 32>(vs + (stage ^ 1) * BC * SROW, v + base, (kt + 1) * BC, T, tid);
            copy_commit();
            copy_wait<1>();
        } else {
            copy_wait<0>();
        }
        __syncthreads();
        const u16* kst = ks + stage * BC * SROW;
        const u16* vst = vs + stage * BC * SROW;

        // S = Q K^T (16 rows x BC keys per warp), fp32 accumulators
        float s[BC / 8][4];
#pragma unroll
        for (int n = 0; n < BC / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int np = 0; np < BC / 16; ++np) {
                unsigned b[4];
                ldsm_x4(b, kst + (np * 16 + (lane / 16) * 8 + lane % 8) * SROW + kk * 16 + ((lane / 8) % 2) * 8);
                mma16816<BF16>(s[2 * np], qf[kk], b[0], b[1]);
                mma16816<BF16>(s[2 * np + 1], qf[kk], b[2], b[3]);
            }
        }
        // masks only on the tile that crosses this warp's diagonal or the end of the sequence
        const int k0 = kt * BC;
        if (k0 + BC > T || (causal && k0 + BC - 1 > q0 + warp * 16)) {
#pragma unroll
            for (int n = 0; n < BC / 8; ++n) {
                const int c = k0 + n * 8 + 2 * t;
                if (c >= T || (causal && c > row_a)) s[n][0] = NEG_INF;
                if (c + 1 >= T || (causal && c + 1 > row_a)) s[n][1] = NEG_INF;
                if (c >= T || (causal && c > row_b)) s[n][2] = NEG_INF;
                if (c + 1 >= T || (causal && c + 1 > row_b)) s[n][3] = NEG_INF;
            }
        }
        // online softmax for rows g (elements 0, 1) and g + 8 (elements 2, 3); a row's 4 lanes are a quad
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
            l[r] = l[r] * alpha + sum;    // this lane's partial; the quad is summed once at the end
            m[r] = m_new;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) { acc[n][2 * r] *= alpha; acc[n][2 * r + 1] *= alpha; }
        }
        // O += P V: the S fragments of key tiles 2kk and 2kk+1 are the A fragment of P for k-step kk
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            unsigned a[4];
            a[0] = pack2<BF16>(s[2 * kk][0], s[2 * kk][1]);
            a[1] = pack2<BF16>(s[2 * kk][2], s[2 * kk][3]);
            a[2] = pack2<BF16>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = pack2<BF16>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                unsigned b[4];
                ldsm_x4_trans(b, vst + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * SROW + dp * 16 + (lane / 16) * 8);
                mma16816<BF16>(acc[2 * dp], a, b[0], b[1]);
                mma16816<BF16>(acc[2 * dp + 1], a, b[2], b[3]);
            }
        }
        __syncthreads();   // this stage is refilled by the prefetch two iterations from now
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 1);
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 2);
    }
    const float inv_a = l[0] > 0.0f ? 1.0f / l[0] : 0.0f, inv_b = l[1] > 0.0f ? 1.0f / l[1] : 0.0f;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        const int c = n * 8 + 2 * t;
        if (row_a < T) *reinterpret_cast<unsigned*>(o + base + (long long)row_a * D + c) = pack2<BF16>(acc[n][0] * inv_a, acc[n][1] * inv_a);
        if (row_b < T) *reinterpret_cast<unsigned*>(o + base + (long long)row_b * D + c) = pack2<BF16>(acc[n][2] * inv_b, acc[n][3] * inv_b);
    }
}
#endif

// Dynamic shared memory: (BRT + 4 * BC) * SROW * 2 bytes (46 KB at the defaults, 87 KB at HEAD_DIM 128:
// more than a T4's 64 KB); flash.tc_smem_bytes computes it and the wrapper refuses tiles that don't fit.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
flash_tc_fp16(const u16* q, const u16* k, const u16* v, u16* o, int T, float scale_log2, int causal) {
#if __CUDA_ARCH__ >= 750
    flash_tc<false>(q, k, v, o, T, scale_log2, causal);
#else
    __trap();   // needs ldmatrix and mma.sync m16n8k8 (sm_75+); on sm_70 flash.py uses the fp32 kernel instead
#endif
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
flash_tc_bf16(const u16* q, const u16* k, const u16* v, u16* o, int T, float scale_log2, int causal) {
#if __CUDA_ARCH__ >= 800
    flash_tc<true>(q, k, v, o, T, scale_log2, causal);
#else
    __trap();   // bf16 mma.sync needs sm_80; flash.py refuses before launching
#endif
}
