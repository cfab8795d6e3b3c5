// sublayer_decode.cu - the decode step's attention sublayer tail, from separate kernels to ONE kernel.
//
// Generating one token per sequence, a GPT-2 block's attention sublayer after the QKV projection is
//     o = attention(q, K_cache, V_cache)     (B, H, D): reads the whole cache, B*H*L*D*8 bytes
//     r = x + o @ W_proj + b_proj            (B, C):    reads W_proj, C*C*4 bytes (2.4 MB for GPT-2)
//     y = LayerNorm(r)                       (B, C)
// Every tensor except the cache and W_proj is tiny (B*C floats), so the separate pipeline's cost is
// mostly launches and the GEMM's poor shape (M = B rows), not DRAM traffic. Versions:
//
//   decode_attention_merged one block per (head, sequence): 8 warps split the cache rows, each warp
//                           keeps an online softmax (8 keys per step for ILP), warps merge through
//                           shared memory; writes the heads merged, (B, C). Then cupy.matmul + residual_layernorm
//                           = the separate pipeline.
//   decode_proj_ln          kernel 2 of a two-kernel version: projection + bias + residual + LayerNorm.
//   decode_sublayer_fused   everything in one kernel. The trick that makes it possible: the projection
//                           is linear in the heads, o @ W = sum_h o_h @ W[h*D:(h+1)*D, :], so the block
//                           that computed head h multiplies it by its D rows of W and atomically adds a
//                           partial row into `accum`. The LAST block of each sequence (an atomic counter
//                           per sequence, after a __threadfence) adds bias and residual, normalises,
//                           and resets accum and the counter to zero, so the next call (or a CUDA graph
//                           replay) finds them clean. Cost of the trick: every (b, h) block reads its
//                           slice of W, so W is read B times (from L2) instead of once, and B*H*C atomics.
//
// Knobs: HEAD_DIM (a multiple of 32) and BLOCK (threads per block), both passed by ops.py.
// Float atomics make the order of the H partial sums vary: results differ from run to run in the last bits.
#include "course.cuh"

#ifndef HEAD_DIM
#error "HEAD_DIM is passed by ops.py"
#endif
#ifndef BLOCK
#error "BLOCK is passed by ops.py"
#endif
#define NWARPS (BLOCK / 32)
#define DPL (HEAD_DIM / 32)      // head dimensions per lane
#define KPS 8                    // keys per warp step
#define NEG_INF __int_as_float(0xff800000)

struct DecodeSmem {
    float m[NWARPS], l[NWARPS];
    float acc[NWARPS][HEAD_DIM];
    float o[HEAD_DIM];
    float scratch[32];
    int last;
};

// Attention of one new query against the first L rows of this (b, h)'s cache; result in s.o[0..D).
__device__ __forceinline__ void attend(const float* __restrict__ q, const float* __restrict__ kc,
                                       const float* __restrict__ vc, int L, float scale, DecodeSmem& s) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float qv[DPL], acc[DPL];
#pragma unroll
    for (int u = 0; u < DPL; u++) { qv[u] = q[lane + 32 * u] * scale; acc[u] = 0.0f; }
    float m = NEG_INF, l = 0.0f;
    for (int base = warp * KPS; base < L; base += NWARPS * KPS) {
        // Issue every load of the step (K and V of KPS keys) before the first shuffle: many independent
        // requests in flight per warp is what hides DRAM latency when only B*H blocks exist.
        float kv[KPS][DPL], vv[KPS][DPL];
#pragma unroll
        for (int c = 0; c < KPS; c++) {
            const int j = min(base + c, L - 1);      // past the end: a valid row, masked out below
#pragma unroll
            for (int u = 0; u < DPL; u++) {
                kv[c][u] = kc[(long long)j * HEAD_DIM + lane + 32 * u];
                vv[c][u] = vc[(long long)j * HEAD_DIM + lane + 32 * u];
            }
        }
        float sc[KPS];
#pragma unroll
        for (int c = 0; c < KPS; c++) {
            float d = 0.0f;
#pragma unroll
            for (int u = 0; u < DPL; u++) d += qv[u] * kv[c][u];
            sc[c] = d;
        }
#pragma unroll
        for (int c = 0; c < KPS; c++) sc[c] = base + c < L ? warp_sum(sc[c]) : NEG_INF;
        float mnew = m;
#pragma unroll
        for (int c = 0; c < KPS; c++) mnew = fmaxf(mnew, sc[c]);
        const float corr = __expf(m - mnew);        // m = -inf on the first step: corr = 0
        l *= corr;
#pragma unroll
        for (int u = 0; u < DPL; u++) acc[u] *= corr;
#pragma unroll
        for (int c = 0; c < KPS; c++) {
            const float p = base + c < L ? __expf(sc[c] - mnew) : 0.0f;
            l += p;
#pragma unroll
            for (int u = 0; u < DPL; u++) acc[u] += p * vv[c][u];
        }
        m = mnew;
    }
    if (lane == 0) { s.m[warp] = m; s.l[warp] = l; }
#pragma unroll
    for (int u = 0; u < DPL; u++) s.acc[warp][lane + 32 * u] = acc[u];
    __syncthreads();
    for (int d = threadIdx.x; d < HEAD_DIM; d += BLOCK) {
        float mx = NEG_INF;
        for (int w = 0; w < NWARPS; w++) mx = fmaxf(mx, s.m[w]);
        float num = 0.0f, den = 0.0f;
        for (int w = 0; w < NWARPS; w++) {
            const float f = s.m[w] == NEG_INF ? 0.0f : __expf(s.m[w] - mx);   // warps that saw no key
            num += f * s.acc[w][d];
            den += f * s.l[w];
        }
        s.o[d] = den > 0.0f ? num / den : 0.0f;     // L = 0: an empty cache attends to nothing
    }
    __syncthreads();
}

__device__ __forceinline__ int clamp_len(const int* lengths, int b, int Lmax) {
    return min(max(lengths[b], 0), Lmax);
}

// grid (H, B): out[b, h*D + d] (heads merged, ready for the projection GEMM).
extern "C" __global__ void __launch_bounds__(BLOCK) decode_attention_merged(
        const float* __restrict__ q, const float* __restrict__ k_cache, const float* __restrict__ v_cache,
        const int* __restrict__ lengths, float* __restrict__ out, int H, int Lmax, float scale) {
    __shared__ DecodeSmem s;
    const int h = blockIdx.x, b = blockIdx.y;
    const long long bh = (long long)b * H + h;
    attend(q + bh * HEAD_DIM, k_cache + bh * Lmax * HEAD_DIM, v_cache + bh * Lmax * HEAD_DIM,
           clamp_len(lengths, b, Lmax), scale, s);
    for (int d = threadIdx.x; d < HEAD_DIM; d += BLOCK) out[bh * HEAD_DIM + d] = s.o[d];
}

// Block (h, b) owns head h of sequence b, whose output is s.o. Adds s.o @ W[h*D:(h+1)*D, :] into
// accum[b, :]; the last of the H blocks of sequence b finishes the row: r = x + accum + bias, y = LN(r).
__device__ __forceinline__ void project_and_finish(
        DecodeSmem& s, int h, int b, int H, const float* __restrict__ w_proj, const float* __restrict__ b_proj,
        int has_bias, const float* x, const float* __restrict__ ln_w, const float* __restrict__ ln_b,
        float* __restrict__ accum, int* __restrict__ counter, float* r, float* __restrict__ y, float eps) {
    const int C = H * HEAD_DIM;
    const float* wh = w_proj + (long long)h * HEAD_DIM * C;
    float* arow = accum + (long long)b * C;
    // Only B*H blocks share this work, so each thread must keep many loads in flight: 32 rows of W
    // are loaded before the first multiply-add (latency, not bandwidth, bounds a few blocks).
    for (int c = threadIdx.x; c < C; c += BLOCK) {
        float a = 0.0f;
        for (int d0 = 0; d0 < HEAD_DIM; d0 += 32) {
            float wv[32];
#pragma unroll
            for (int k = 0; k < 32; k++) wv[k] = wh[(long long)(d0 + k) * C + c];
#pragma unroll
            for (int k = 0; k < 32; k++) a += s.o[d0 + k] * wv[k];
        }
        atomicAdd(arow + c, a);
    }
    __threadfence();                 // our partial sums are visible device-wide before we are counted
    __syncthreads();
    if (threadIdx.x == 0) s.last = atomicAdd(counter + b, 1) == H - 1;
    __syncthreads();
    if (!s.last) return;
    __threadfence();                 // ... and we see everybody's before reading accum
    const long long off = (long long)b * C;
    float sum = 0.0f;
    for (int c = threadIdx.x; c < C; c += BLOCK) {
        const float v = x[off + c] + __ldcg(arow + c) + (has_bias ? b_proj[c] : 0.0f);
        arow[c] = 0.0f;              // leave the workspace clean for the next call
        r[off + c] = v;              // r may be x: this thread read x[off + c] just above
        sum += v;
    }
    const float mean = block_sum(sum, s.scratch) / C;
    float q = 0.0f;
    for (int c = threadIdx.x; c < C; c += BLOCK) { const float d = r[off + c] - mean; q += d * d; }
    const float rstd = rsqrtf(block_sum(q, s.scratch) / C + eps);
    for (int c = threadIdx.x; c < C; c += BLOCK) y[off + c] = (r[off + c] - mean) * rstd * ln_w[c] + ln_b[c];
    if (threadIdx.x == 0) counter[b] = 0;
}

// Kernel 2 of the two-kernel version: attn (B, C) from decode_attention_merged. grid (H, B).
extern "C" __global__ void __launch_bounds__(BLOCK) decode_proj_ln(
        const float* __restrict__ attn, const float* __restrict__ w_proj, const float* __restrict__ b_proj,
        int has_bias, const float* x, const float* __restrict__ ln_w, const float* __restrict__ ln_b,
        float* __restrict__ accum, int* __restrict__ counter, float* r, float* __restrict__ y,
        int H, float eps) {
    __shared__ DecodeSmem s;
    const int h = blockIdx.x, b = blockIdx.y;
    for (int d = threadIdx.x; d < HEAD_DIM; d += BLOCK) s.o[d] = attn[((long long)b * H + h) * HEAD_DIM + d];
    __syncthreads();
    project_and_finish(s, h, b, H, w_proj, b_proj, has_bias, x, ln_w, ln_b, accum, counter, r, y, eps);
}

// The single kernel. grid (H, B).
extern "C" __global__ void __launch_bounds__(BLOCK) decode_sublayer_fused(
        const float* __restrict__ q, const float* __restrict__ k_cache, const float* __restrict__ v_cache,
        const int* __restrict__ lengths, const float* __restrict__ w_proj, const float* __restrict__ b_proj,
        int has_bias, const float* x, const float* __restrict__ ln_w, const float* __restrict__ ln_b,
        float* __restrict__ accum, int* __restrict__ counter, float* r, float* __restrict__ y,
        int H, int Lmax, float scale, float eps) {
    __shared__ DecodeSmem s;
    const int h = blockIdx.x, b = blockIdx.y;
    const long long bh = (long long)b * H + h;
    attend(q + bh * HEAD_DIM, k_cache + bh * Lmax * HEAD_DIM, v_cache + bh * Lmax * HEAD_DIM,
           clamp_len(lengths, b, Lmax), scale, s);
    project_and_finish(s, h, b, H, w_proj, b_proj, has_bias, x, ln_w, ln_b, accum, counter, r, y, eps);
}
