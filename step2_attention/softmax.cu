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
//   v4a one warp per row + the online rule: each lane keeps a running (max m, sum s), and two partial
//       results merge as  m = max(m1, m2), s = s1 e^(m1-m) + s2 e^(m2-m),  so max and sum need ONE
//       pass: 2 reads + 1 write. It takes any cols and any alignment (the fallback of v4: the kernel
//       softmax_v4_scalar), and a scale and causal mask (below).
//   v4  v4a + the row kept in registers + float4 (16-byte) loads. When the row fits (<= 32*CACHE floats
//       per warp, 1024 with CACHE=32) it is read once, kept in registers, and written once: the
//       8-bytes-per-element floor. All of a lane's loads are issued before any value is used, so 8
//       float4 per lane are in flight at once (a load followed by its use, 8 times in a row, would wait
//       for DRAM 8 times). Longer rows: softmax_v4_long streams them, 2 reads + 1 write, in float4.
//       Needs cols % 4 == 0 and 16-byte-aligned buffers (the Python side checks; else it runs v4a).
//   v4 and v4a also take a scale (softmax(scale * x)) and an optional causal mask (row i of every
//   `period` rows sees columns 0 .. i + offset; the rest read as -inf and are never loaded): the masked
//   softmax of attention (see ops.attention_cublas).
//
// Masked rows: a row that is all -inf gives zeros (common.reference.softmax's convention); e^(-inf - m)
// is computed as 0 explicitly when m is itself -inf, so no NaN from (-inf) - (-inf) ever appears.
// Every kernel may run in place (y == x): a row is fully read before any element of it is written
// (v1..v3, v4 cached), or each element is read right before it is overwritten (v4a, v4 streaming).
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

// Columns 0 .. n-1 of row r are visible: all of them, or under a causal mask (row i of every `period`
// rows sees columns 0 .. i + offset) fewer. Masked columns read as -inf and are never loaded.
__device__ __forceinline__ int visible(int r, int cols, int causal, int period, int offset) {
    return causal ? max(0, min(cols, r % period + offset + 1)) : cols;
}

// ------------------------------------------------------------------ v4a: the online rule (any cols, any alignment)
// v3 plus one idea: max and sum in ONE pass. Each lane keeps a running (m, s); a new element x gives
// m' = max(m, x), s' = s e^(m - m') + e^(x - m'). Then the 32 lanes' pairs merge with the same rule.
// 2 reads + 1 write. Also the scaled, causally masked softmax of attention (ops.attention_cublas).
extern "C" __global__ void __launch_bounds__(WARPS * 32)
softmax_v4_scalar(const float* x, float* y, int rows, int cols, float scale, int causal, int period, int offset) {
    const int lane = threadIdx.x % 32;
    const int r = blockIdx.x * WARPS + threadIdx.x / 32;
    if (r >= rows) return;                   // whole warps leave together: the shuffles stay full-mask
    const float* xr = x + (long long)r * cols;
    float* yr = y + (long long)r * cols;
    const int n = visible(r, cols, causal, period, offset);
    float m = NEG_INF, s = 0.0f;
    for (int j = lane; j < n; j += 32) {
        const float xj = xr[j] * scale;
        const float mn = fmaxf(m, xj);
        s = s * exp_shifted(m, mn) + exp_shifted(xj, mn);   // rescale the old sum to the new max
        m = mn;
    }
    const float mrow = warp_max(m);
    const float srow = warp_sum(s * exp_shifted(m, mrow));  // each lane's sum, rescaled to the row's max
    const float inv = srow > 0.0f ? 1.0f / srow : 0.0f;
    for (int j = lane; j < cols; j += 32) yr[j] = j < n ? exp_shifted(xr[j] * scale, mrow) * inv : 0.0f;
}

// ------------------------------------------------------------------ v4: + the row in registers, float4 loads
#define NV (CACHE / 4)                 // float4s per lane kept in registers: rows up to 128 * NV floats

// One 16-byte load of floats 4*i .. 4*i+3 of a row, unless all four are masked (at or past n).
// Only the load: the caller issues several before it uses any, so they are in flight together.
__device__ __forceinline__ float4 load4(const float* xr, int i, int n) {
    return 4 * i < n ? reinterpret_cast<const float4*>(xr)[i] : make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
}

// The four values of load4(xr, i, n), scaled, into a[0..3]; those at or past n become -inf.
__device__ __forceinline__ void unpack4(float4 v, int i, int n, float scale, float* a) {
    a[0] = v.x; a[1] = v.y; a[2] = v.z; a[3] = v.w;
#pragma unroll
    for (int e = 0; e < 4; e++) a[e] = 4 * i + e < n ? a[e] * scale : NEG_INF;
}

// x and y 16-byte aligned, cols % 4 == 0 and cols <= 32 * CACHE (the Python side checks; otherwise it
// launches softmax_v4_long or v4a).
extern "C" __global__ void __launch_bounds__(WARPS * 32)
softmax_v4(const float* x, float* y, int rows, int cols, float scale, int causal, int period, int offset) {
    const int lane = threadIdx.x % 32;
    const int r = blockIdx.x * WARPS + threadIdx.x / 32;
    if (r >= rows) return;
    const float* xr = x + (long long)r * cols;
    float* yr = y + (long long)r * cols;
    const int n = visible(r, cols, causal, period, offset);
    const int n4 = cols / 4;
    float4 raw[NV];                              // the row, in the warp's registers: read once, write once
#pragma unroll
    for (int c = 0; c < NV; c++) raw[c] = load4(xr, lane + 32 * c, n);   // all NV loads in flight at once
    float v[NV][4];
    float m = NEG_INF;
#pragma unroll
    for (int c = 0; c < NV; c++) {
        unpack4(raw[c], lane + 32 * c, n, scale, v[c]);
#pragma unroll
        for (int e = 0; e < 4; e++) m = fmaxf(m, v[c][e]);
    }
    float s = 0.0f;                              // this lane's (m, s), its values kept as e^(x - m)
#pragma unroll
    for (int c = 0; c < NV; c++)
#pragma unroll
        for (int e = 0; e < 4; e++) { v[c][e] = exp_shifted(v[c][e], m); s += v[c][e]; }
    const float mrow = warp_max(m);              // merge the 32 lanes' (m, s) with the online rule
    const float f = exp_shifted(m, mrow);
    const float srow = warp_sum(s * f);
    const float k = srow > 0.0f ? f / srow : 0.0f;   // e^(x - m) * k = e^(x - mrow) / srow
#pragma unroll
    for (int c = 0; c < NV; c++) {
        const int i = lane + 32 * c;
        if (i < n4) reinterpret_cast<float4*>(yr)[i] = make_float4(v[c][0] * k, v[c][1] * k, v[c][2] * k, v[c][3] * k);
    }
}

// Rows longer than the registers hold (cols > 32 * CACHE): v4a's two passes with 4 float4 loads in flight
// per lane: pass 1 keeps the online (m, s), pass 2 re-reads and writes. 2 reads + 1 write. Same arguments
// and alignment as softmax_v4; the Python side launches it for long rows.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
softmax_v4_long(const float* x, float* y, int rows, int cols, float scale, int causal, int period, int offset) {
    const int lane = threadIdx.x % 32;
    const int r = blockIdx.x * WARPS + threadIdx.x / 32;
    if (r >= rows) return;
    const float* xr = x + (long long)r * cols;
    float* yr = y + (long long)r * cols;
    const int n = visible(r, cols, causal, period, offset);
    const int n4 = cols / 4;
    float m = NEG_INF, s = 0.0f;
    for (int base = lane; 4 * base < n; base += 32 * 4) {
        float4 raw[4];
#pragma unroll
        for (int u = 0; u < 4; u++) raw[u] = load4(xr, base + 32 * u, n);
        float a[4][4];
        float lm = NEG_INF;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            unpack4(raw[u], base + 32 * u, n, scale, a[u]);
#pragma unroll
            for (int e = 0; e < 4; e++) lm = fmaxf(lm, a[u][e]);
        }
        const float mn = fmaxf(m, lm);           // the online rule, 16 elements at a time
        float ls = 0.0f;
#pragma unroll
        for (int u = 0; u < 4; u++)
#pragma unroll
            for (int e = 0; e < 4; e++) ls += exp_shifted(a[u][e], mn);
        s = s * exp_shifted(m, mn) + ls;
        m = mn;
    }
    const float mrow = warp_max(m);
    const float srow = warp_sum(s * exp_shifted(m, mrow));
    const float inv = srow > 0.0f ? 1.0f / srow : 0.0f;
    for (int i = lane; i < n4; i += 32) {
        float a[4];
        unpack4(load4(xr, i, n), i, n, scale, a);
        reinterpret_cast<float4*>(yr)[i] = make_float4(exp_shifted(a[0], mrow) * inv, exp_shifted(a[1], mrow) * inv,
                                                       exp_shifted(a[2], mrow) * inv, exp_shifted(a[3], mrow) * inv);
    }
}
