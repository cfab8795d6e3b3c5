// decode_attention.cu - attention for one new token per sequence against a KV cache (generation).
//
// While generating, each step has ONE query row per (sequence, head) and L cached keys/values. There is
// no reuse to tile for: every cached byte is read once, so the floor is (K + V bytes) / bandwidth, and
// the danger is too little parallelism. B=1, H=12 gives only 12 (sequence, head) pairs for 132 SMs.
//
//   v1  one block per (sequence, head): 4 warps stride over the cache. A key is scored by D/8 lanes
//       (8 dims each, two float4 loads), so a warp scores 32/(D/8) keys per step; every lane group keeps
//       its own online-softmax state (m, l, 8 output dims), merged at the end by shuffles and shared
//       memory. Writes the output directly.
//   v2  split-K ("flash-decoding"): the same kernel with gridDim.y = n_split blocks per pair, each
//       taking `chunk` cache rows and writing an unnormalised partial (acc[D], m, l); decode_combine
//       merges the n_split partials with the same rescaling rule as the online softmax.
//
// The valid length of every sequence is read from `lengths` on the device, never on the host, so a
// CUDA graph captured once replays with new lengths; blocks whose chunk starts past the length write
// an empty partial (m = -inf, l = 0) and return. Layout: q (B, H, D), caches (B, H, Lmax, D), out (B, H, D).
// Both kernels start with pdl_wait() (common/include/pdl.cuh): launched with programmatic dependent launch, as
// step 4's decode does on sm_90, a kernel may start while the one before it drains, and waits there before it
// reads q, the caches or the lengths; launched plainly, the wait costs nothing.
// Compile-time knobs: HEAD_DIM (32, 64 or 128; default 64), WARPS (warps per block of decode_split, 4).
#include "course.cuh"
#include "pdl.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#ifndef WARPS
#define WARPS 4
#endif
#define D HEAD_DIM
#define G (D / 8)                 // lanes per key
#define KPW (32 / G)              // keys per warp step
#define NEG_INF __int_as_float(0xff800000)

static_assert(D % 32 == 0 && D <= 128, "HEAD_DIM must be 32, 64 or 128");
static_assert(WARPS * 32 >= D, "the final merge needs a thread per output dim");

// merge online-softmax state (m, l, acc) with another one (mo, lo, acco)
__device__ __forceinline__ void merge(float& m, float& l, float (&acc)[8], float mo, float lo, const float (&acco)[8]) {
    const float mn = fmaxf(m, mo);
    const float mu = mn == NEG_INF ? 0.0f : mn;
    const float a = exp2f(m - mu), b = exp2f(mo - mu);
    l = l * a + lo * b;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = acc[i] * a + acco[i] * b;
    m = mn;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
decode_split(const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc,
             const int* __restrict__ lengths, float* __restrict__ out, float* __restrict__ partial,
             int H, int Lmax, int chunk, float scale_log2) {
    __shared__ float st[WARPS][D + 2];
    pdl_wait();                  // every thread: q, the caches and lengths are earlier kernels' outputs
    pdl_launch_dependents();
    const int bh = blockIdx.x, b = bh / H, split = blockIdx.y;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, grp = lane / G, sub = lane % G;
    const int len = min(max(lengths[b], 0), Lmax);
    const int start = split * chunk, end = min(len, start + chunk);
    const float* kb = kc + (long long)bh * Lmax * D + sub * 8;
    const float* vb = vc + (long long)bh * Lmax * D + sub * 8;

    float qv[8];
    {
        const float4 a = *reinterpret_cast<const float4*>(q + bh * D + sub * 8);
        const float4 c = *reinterpret_cast<const float4*>(q + bh * D + sub * 8 + 4);
        qv[0] = a.x * scale_log2; qv[1] = a.y * scale_log2; qv[2] = a.z * scale_log2; qv[3] = a.w * scale_log2;
        qv[4] = c.x * scale_log2; qv[5] = c.y * scale_log2; qv[6] = c.z * scale_log2; qv[7] = c.w * scale_log2;
    }
    float m = NEG_INF, l = 0.0f, acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.0f;

    // the loop bound is the same for the whole warp: the shuffles below need every lane
#pragma unroll 2
    for (int j0 = start + warp * KPW; j0 < end; j0 += WARPS * KPW) {
        const int j = j0 + grp;
        const bool valid = j < end;
        float4 k0 = make_float4(0.f, 0.f, 0.f, 0.f), k1 = k0, v0 = k0, v1 = k0;
        if (valid) {
            k0 = __ldcs(reinterpret_cast<const float4*>(kb + (long long)j * D));
            k1 = __ldcs(reinterpret_cast<const float4*>(kb + (long long)j * D + 4));
            v0 = __ldcs(reinterpret_cast<const float4*>(vb + (long long)j * D));
            v1 = __ldcs(reinterpret_cast<const float4*>(vb + (long long)j * D + 4));
        }
        float s = qv[0] * k0.x + qv[1] * k0.y + qv[2] * k0.z + qv[3] * k0.w
                + qv[4] * k1.x + qv[5] * k1.y + qv[6] * k1.z + qv[7] * k1.w;
#pragma unroll
        for (int off = 1; off < G; off <<= 1) s += __shfl_xor_sync(FULL_MASK, s, off);
        if (!valid) s = NEG_INF;
        const float mn = fmaxf(m, s);
        const float mu = mn == NEG_INF ? 0.0f : mn;
        const float alpha = exp2f(m - mu), p = exp2f(s - mu);
        l = l * alpha + p;
        m = mn;
        acc[0] = acc[0] * alpha + p * v0.x; acc[1] = acc[1] * alpha + p * v0.y;
        acc[2] = acc[2] * alpha + p * v0.z; acc[3] = acc[3] * alpha + p * v0.w;
        acc[4] = acc[4] * alpha + p * v1.x; acc[5] = acc[5] * alpha + p * v1.y;
        acc[6] = acc[6] * alpha + p * v1.z; acc[7] = acc[7] * alpha + p * v1.w;
    }
    // merge the KPW key groups of the warp (lanes with the same `sub` hold the same dims)
#pragma unroll
    for (int off = G; off < 32; off <<= 1) {
        float acco[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) acco[i] = __shfl_xor_sync(FULL_MASK, acc[i], off);
        const float mo = __shfl_xor_sync(FULL_MASK, m, off), lo = __shfl_xor_sync(FULL_MASK, l, off);
        merge(m, l, acc, mo, lo, acco);
    }
    if (grp == 0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) st[warp][sub * 8 + i] = acc[i];
        if (sub == 0) { st[warp][D] = m; st[warp][D + 1] = l; }
    }
    __syncthreads();
    // merge the warps: thread d < D owns output dim d
    if (tid < D) {
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) M = fmaxf(M, st[w][D]);
        const float mu = M == NEG_INF ? 0.0f : M;
        float L = 0.0f, O = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float e = exp2f(st[w][D] - mu);
            L += e * st[w][D + 1];
            O += e * st[w][tid];
        }
        if (gridDim.y == 1) {
            out[bh * D + tid] = L > 0.0f ? O / L : 0.0f;
        } else {
            float* p = partial + ((long long)bh * gridDim.y + split) * (D + 2);
            p[tid] = O;
            if (tid == 0) { p[D] = M; p[D + 1] = L; }
        }
    }
}

// out[bh, d] = sum_s e_s * acc_s[d] / sum_s e_s * l_s with e_s = exp2(m_s - max_s m_s); one block per pair.
extern "C" __global__ void __launch_bounds__(D)
decode_combine(const float* __restrict__ partial, float* __restrict__ out, int n_split) {
    pdl_wait();                  // the partials are decode_split's
    pdl_launch_dependents();
    const int bh = blockIdx.x, d = threadIdx.x;
    const float* p = partial + (long long)bh * n_split * (D + 2);
    float M = NEG_INF;
    for (int s = 0; s < n_split; ++s) M = fmaxf(M, p[s * (D + 2) + D]);
    const float mu = M == NEG_INF ? 0.0f : M;
    float L = 0.0f, O = 0.0f;
    for (int s = 0; s < n_split; ++s) {
        const float e = exp2f(p[s * (D + 2) + D] - mu);
        L += e * p[s * (D + 2) + D + 1];
        O += e * p[s * (D + 2) + d];
    }
    out[bh * D + d] = L > 0.0f ? O / L : 0.0f;
}
