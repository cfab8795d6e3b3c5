// ln_row.cuh - one warp normalises one row with the row cached in registers (layernorm.cu v4 and
// residual_layernorm.cu share it). V = 4 loads float4 (row start and C must be 16-byte aligned), V = 1
// loads floats. A lane caches 4 * LN_MAXV floats: C <= 128 * LN_MAXV stays in registers; longer
// rows re-read the rest from global memory (L1/L2) in the later passes, so every C works.
#pragma once
#include "course.cuh"

#ifndef LN_MAXV
#define LN_MAXV 8          // float4 chunks per lane: C <= 1024 cached with V = 4 (GPT-2: 768 .. 1600 = 1024+576)
#endif

template <int V>
__device__ __forceinline__ void ln_load(const float* p, float* r) {
    if constexpr (V == 4) {
        const float4 q = *reinterpret_cast<const float4*>(p);
        r[0] = q.x; r[1] = q.y; r[2] = q.z; r[3] = q.w;
    } else {
        r[0] = *p;
    }
}

template <int V>
__device__ __forceinline__ void ln_store(float* p, const float* r) {
    if constexpr (V == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(r[0], r[1], r[2], r[3]);
    } else {
        *p = r[0];
    }
}

// Normalise the row: `first(i, r)` loads input elements i..i+V-1 (once per element), `keep(i, r)` is
// then shown them (e.g. to write the residual stream), `again(i, r)` produces them again for the
// uncached tail of long rows. The output row y = (v - mean) * rstd * w + b is stored. The variance is
// a second pass over the cached values (exact, and free: no memory traffic).
// All cached loads are issued before the first keep(): a store in between would have to wait for the
// loads before it and would stop the compiler from hoisting later loads above it (the residual may
// alias x), which cuts the bytes in flight per warp - the one thing a memory-bound kernel needs.
template <int V, typename First, typename Keep, typename Again>
__device__ __forceinline__ void ln_warp_row(int C, float eps, const float* __restrict__ w,
                                            const float* __restrict__ b, float* y, First first, Keep keep,
                                            Again again) {
    constexpr int NCH = LN_MAXV * 4 / V;   // chunks per lane: 32 * LN_MAXV * 4 floats cached for either V
    const int lane = threadIdx.x % 32;
    float cache[NCH][V];
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < NCH; j++) {
        const int i = (j * 32 + lane) * V;
        if (i < C) first(i, cache[j]);
    }
#pragma unroll
    for (int j = 0; j < NCH; j++) {
        const int i = (j * 32 + lane) * V;
        if (i < C) {
            keep(i, cache[j]);
#pragma unroll
            for (int u = 0; u < V; u++) s += cache[j][u];
        }
    }
    for (int i = (NCH * 32 + lane) * V; i < C; i += 32 * V) {   // rows longer than the cache
        float r[V];
        first(i, r);
        keep(i, r);
#pragma unroll
        for (int u = 0; u < V; u++) s += r[u];
    }
    const float mean = warp_sum(s) / C;
    float q = 0.0f;
#pragma unroll
    for (int j = 0; j < NCH; j++) {
        if ((j * 32 + lane) * V < C) {
#pragma unroll
            for (int u = 0; u < V; u++) { const float d = cache[j][u] - mean; q += d * d; }
        }
    }
    for (int i = (NCH * 32 + lane) * V; i < C; i += 32 * V) {
        float r[V];
        again(i, r);
#pragma unroll
        for (int u = 0; u < V; u++) { const float d = r[u] - mean; q += d * d; }
    }
    const float rstd = rsqrtf(warp_sum(q) / C + eps);
#pragma unroll
    for (int j = 0; j < NCH; j++) {
        const int i = (j * 32 + lane) * V;
        if (i < C) {
            float wv[V], bv[V], o[V];
            ln_load<V>(w + i, wv);
            ln_load<V>(b + i, bv);
#pragma unroll
            for (int u = 0; u < V; u++) o[u] = (cache[j][u] - mean) * rstd * wv[u] + bv[u];
            ln_store<V>(y + i, o);
        }
    }
    for (int i = (NCH * 32 + lane) * V; i < C; i += 32 * V) {
        float r[V], wv[V], bv[V], o[V];
        again(i, r);
        ln_load<V>(w + i, wv);
        ln_load<V>(b + i, bv);
#pragma unroll
        for (int u = 0; u < V; u++) o[u] = (r[u] - mean) * rstd * wv[u] + bv[u];
        ln_store<V>(y + i, o);
    }
}
