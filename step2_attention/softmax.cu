// softmax.cu - row softmax y = exp(x - max) / sum(exp(x - max)), from one thread per row to one read.
//
// Softmax over the last axis of a (rows, cols) float32 matrix is memory-bound: the floor is one read
// and one write of every element (8 bytes per element). The versions differ in how many times they
// read the row and in how the threads of a row cooperate on its max and its sum.
//
//   v1  one thread per row, three passes (max, sum of exp, write). Neighbouring threads walk
//       neighbouring rows, so a warp's loads are `cols` floats apart: uncoalesced. Reads 3x, writes 1x.
//       (Its long sequential sum is kept in double for accuracy.)
//   v2  one block per row: threads stride across the row (coalesced) and combine their partial max and
//       sum with a shared-memory tree (__syncthreads at every halving). Still 3 reads + 1 write, but the
//       2nd and 3rd reads of a row mostly hit L1/L2.
//   v3  one warp per row: the tree becomes 5 register shuffles (__shfl_xor_sync), no shared memory and
//       no barriers; a block holds WARPS rows. Still three passes.
//   v4  online softmax + float4 + the row in registers. Each lane keeps a running (max m, sum s); two
//       partial results merge with the online rule  m = max(m1, m2), s = s1 e^(m1-m) + s2 e^(m2-m),
//       so max and sum need ONE pass. When the row fits in registers (<= 32*CACHE floats per warp,
//       e.g. 1024 floats with CACHE=32) the row is read once, kept in registers, and written once:
//       the 8-bytes-per-element floor. Longer rows stream: one online pass + one writing pass
//       (2 reads + 1 write instead of 3 + 1). float4 loads when cols % 4 == 0 and both buffers are
//       16-byte aligned (the Python side checks), plain floats otherwise. All of a lane's loads are
//       issued before any value is used, so 8 float4 per lane are in flight at once (a load followed
//       by its use, 8 times in a row, waits for DRAM 8 times).
//       v4 also takes a scale (softmax(scale * x)) and an optional causal mask (row i of every
//       `period` rows sees columns 0 .. i + offset; the rest read as -inf and are never loaded), which
//       is the masked softmax of attention (see ops.attention_cublas).
//
// Masked rows: a row that is all -inf gives zeros (common.reference.softmax's convention); e^(-inf - m)
// is computed as 0 explicitly when m is itself -inf, so no NaN from (-inf) - (-inf) ever appears.
// Every kernel may run in place (y == x): a row is fully read before any element of it is written
// (v1..v3, v4 cached), or each element is read right before it is overwritten (v4 streaming).
//
// Compile-time knobs: BLOCK (v2 threads per row, power of two, default 256), WARPS (v3/v4 rows per
// block, default 4), CACHE (v4 floats per lane kept in registers, multiple of 4, default 32).
#include "course.cuh"

#ifndef BLOCK
#define BLOCK 256
#endif
#ifndef WARPS
#define WARPS 4
#endif
#ifndef CACHE
#define CACHE 32
#endif

#define NEG_INF __int_as_float(0xff800000)

// e^(x - m), with e^(anything - (-inf)) defined as 0: m == -inf only when everything seen is masked.
// A select, not a branch, so that consecutive exponentials can overlap.
__device__ __forceinline__ float exp_shifted(float x, float m) {
    const float e = expf(x - m);
    return m == NEG_INF ? 0.0f : e;
}

// ------------------------------------------------------------------ v1: one thread per row
extern "C" __global__ void softmax_v1(const float* x, float* y, int rows, int cols) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* xr = x + (long long)r * cols;
    float* yr = y + (long long)r * cols;
    float m = NEG_INF;
    for (int j = 0; j < cols; j++) m = fmaxf(m, xr[j]);
    // One thread adds all `cols` terms in sequence; a float running sum would drift by ~cols * 2^-24
    // (7e-6 at 8192 columns), so it is kept in double. (v2..v4 add short partial sums in a tree.)
    double s = 0.0;
    for (int j = 0; j < cols; j++) s += exp_shifted(xr[j], m);
    const float inv = s > 0.0 ? (float)(1.0 / s) : 0.0f;
    for (int j = 0; j < cols; j++) yr[j] = exp_shifted(xr[j], m) * inv;
}

// ------------------------------------------------------------------ v2: one block per row, shared-memory tree
extern "C" __global__ void softmax_v2(const float* x, float* y, int cols) {
    __shared__ float red[BLOCK];
    const int t = threadIdx.x;
    const float* xr = x + (long long)blockIdx.x * cols;
    float* yr = y + (long long)blockIdx.x * cols;

    float m = NEG_INF;
    for (int j = t; j < cols; j += BLOCK) m = fmaxf(m, xr[j]);
    red[t] = m;
    __syncthreads();
    for (int half = BLOCK / 2; half > 0; half >>= 1) {
        if (t < half) red[t] = fmaxf(red[t], red[t + half]);
        __syncthreads();
    }
    m = red[0];
    __syncthreads();                         // everyone has read red[0] before it is reused below

    float s = 0.0f;
    for (int j = t; j < cols; j += BLOCK) s += exp_shifted(xr[j], m);
    red[t] = s;
    __syncthreads();
    for (int half = BLOCK / 2; half > 0; half >>= 1) {
        if (t < half) red[t] += red[t + half];
        __syncthreads();
    }
    const float inv = red[0] > 0.0f ? 1.0f / red[0] : 0.0f;
    for (int j = t; j < cols; j += BLOCK) yr[j] = exp_shifted(xr[j], m) * inv;
}

// ------------------------------------------------------------------ v3: one warp per row, shuffles
extern "C" __global__ void softmax_v3(const float* x, float* y, int rows, int cols) {
    const int lane = threadIdx.x % 32;
    const int r = blockIdx.x * WARPS + threadIdx.x / 32;
    if (r >= rows) return;                   // whole warps leave together: the shuffles stay full-mask
    const float* xr = x + (long long)r * cols;
    float* yr = y + (long long)r * cols;
    float m = NEG_INF;
    for (int j = lane; j < cols; j += 32) m = fmaxf(m, xr[j]);
    m = warp_max(m);
    float s = 0.0f;
    for (int j = lane; j < cols; j += 32) s += exp_shifted(xr[j], m);
    s = warp_sum(s);
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
    for (int j = lane; j < cols; j += 32) yr[j] = exp_shifted(xr[j], m) * inv;
}

// ------------------------------------------------------------------ v4: online, vectorized, cached
template <int VEC> struct VecOf;
template <> struct VecOf<4> { using T = float4; };
template <> struct VecOf<1> { using T = float; };

__device__ __forceinline__ void to_array(float4 v, float* a) { a[0] = v.x; a[1] = v.y; a[2] = v.z; a[3] = v.w; }
__device__ __forceinline__ void to_array(float v, float* a) { a[0] = v; }
__device__ __forceinline__ float4 from_array(const float* a, float4) { return make_float4(a[0], a[1], a[2], a[3]); }
__device__ __forceinline__ float from_array(const float* a, float) { return a[0]; }

__device__ __forceinline__ void neg_inf_vec(float4& v) { v = make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF); }
__device__ __forceinline__ void neg_inf_vec(float& v) { v = NEG_INF; }

// Load vector `idx` of a row unless it lies entirely at or past `n` (the unmasked length): masked
// vectors are never read. Only the load, so that several can be in flight before any is used.
template <int VEC>
__device__ __forceinline__ typename VecOf<VEC>::T load_raw(const float* xr, int idx, int n) {
    using V = typename VecOf<VEC>::T;
    V r;
    neg_inf_vec(r);
    if (idx * VEC < n) r = reinterpret_cast<const V*>(xr)[idx];
    return r;
}

// Scale the loaded values; elements at or past `n` become -inf.
template <int VEC, typename V>
__device__ __forceinline__ void unpack_masked(V r, int idx, int n, float scale, float* a) {
    to_array(r, a);
#pragma unroll
    for (int e = 0; e < VEC; e++) a[e] = idx * VEC + e < n ? a[e] * scale : NEG_INF;
}

template <int VEC>
__device__ __forceinline__ void softmax_online(const float* x, float* y, int rows, int cols, float scale,
                                               int causal, int period, int offset) {
    using V = typename VecOf<VEC>::T;
    constexpr int NV = CACHE / VEC;          // vectors per lane kept in registers
    const int lane = threadIdx.x % 32;
    const int r = blockIdx.x * WARPS + threadIdx.x / 32;
    if (r >= rows) return;
    const float* xr = x + (long long)r * cols;
    float* yr = y + (long long)r * cols;
    const int nvec = cols / VEC;
    const int n = causal ? max(0, min(cols, r % period + offset + 1)) : cols;   // unmasked prefix length

    if (nvec <= 32 * NV) {
        // The whole row fits in the warp's registers: read once, write once.
        V raw[NV];
#pragma unroll
        for (int c = 0; c < NV; c++) raw[c] = load_raw<VEC>(xr, lane + 32 * c, n);   // all loads in flight
        float v[NV][VEC];
        float m = NEG_INF;
#pragma unroll
        for (int c = 0; c < NV; c++) {
            unpack_masked<VEC>(raw[c], lane + 32 * c, n, scale, v[c]);
#pragma unroll
            for (int e = 0; e < VEC; e++) m = fmaxf(m, v[c][e]);
        }
        float s = 0.0f;
#pragma unroll
        for (int c = 0; c < NV; c++)
#pragma unroll
            for (int e = 0; e < VEC; e++) { v[c][e] = exp_shifted(v[c][e], m); s += v[c][e]; }
        // Each lane holds (m, s) of its own slice; merge the 32 of them with the online rule.
        const float mrow = warp_max(m);
        const float f = exp_shifted(m, mrow);
        const float srow = warp_sum(s * f);
        const float k = srow > 0.0f ? f / srow : 0.0f;
#pragma unroll
        for (int c = 0; c < NV; c++) {
            const int idx = lane + 32 * c;
            if (idx < nvec) {
                float o[VEC];
#pragma unroll
                for (int e = 0; e < VEC; e++) o[e] = v[c][e] * k;
                reinterpret_cast<V*>(yr)[idx] = from_array(o, V{});
            }
        }
        return;
    }

    // Long row: pass 1 keeps a running (max, sum) per lane (online), pass 2 re-reads and writes.
    // UNROLL vectors are loaded before any is used, to keep several loads in flight per lane.
    constexpr int UNROLL = 16 / VEC;
    float m = NEG_INF, s = 0.0f;
    for (int base = lane; base * VEC < n; base += 32 * UNROLL) {
        V raw[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) raw[u] = load_raw<VEC>(xr, base + 32 * u, n);
        float a[UNROLL][VEC];
        float lm = NEG_INF;
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            unpack_masked<VEC>(raw[u], base + 32 * u, n, scale, a[u]);
#pragma unroll
            for (int e = 0; e < VEC; e++) lm = fmaxf(lm, a[u][e]);
        }
        const float mn = fmaxf(m, lm);          // the online rule: rescale the old sum to the new max
        float ls = 0.0f;
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
#pragma unroll
            for (int e = 0; e < VEC; e++) ls += exp_shifted(a[u][e], mn);
        s = s * exp_shifted(m, mn) + ls;
        m = mn;
    }
    const float mrow = warp_max(m);
    const float srow = warp_sum(s * exp_shifted(m, mrow));
    const float inv = srow > 0.0f ? 1.0f / srow : 0.0f;
    for (int idx = lane; idx < nvec; idx += 32) {
        float a[VEC];
        unpack_masked<VEC>(load_raw<VEC>(xr, idx, n), idx, n, scale, a);
#pragma unroll
        for (int e = 0; e < VEC; e++) a[e] = exp_shifted(a[e], mrow) * inv;
        reinterpret_cast<V*>(yr)[idx] = from_array(a, V{});
    }
}

// x and y 16-byte aligned, cols % 4 == 0.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
softmax_v4(const float* x, float* y, int rows, int cols, float scale, int causal, int period, int offset) {
    softmax_online<4>(x, y, rows, cols, scale, causal, period, offset);
}

// Any cols, any alignment.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
softmax_v4_scalar(const float* x, float* y, int rows, int cols, float scale, int causal, int period, int offset) {
    softmax_online<1>(x, y, rows, cols, scale, causal, period, offset);
}
