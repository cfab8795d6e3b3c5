// train_gpt2.cu - the backward pass of GPT-2: every kernel a training step needs besides the GEMMs (cuBLAS),
// attention (step 2's flash attention forward; the backward in attention.cu and attention_tc.cu) and the fused
// classifier and AdamW (reused from step 3: train_forward.cu, train_update.cu).
//
// Layouts: activations are (N, C) rows, N = B*T. qkv is GPT-2's fused (B, T, 3C) buffer WITHOUT its bias:
// the attention kernels add it while loading (no bias pass, no permute kernel). Attention's softmax
// statistics are one float per query row, lse (B, H, T), natural log.
//
//   encoder_forward         x = wte[idx] + wpe[t]
//   encoder_backward_v1     dwte[idx] += dx with atomicAdd: simple, but the order of the additions (and so
//                           the last bits of dwte) changes from run to run when a token repeats.
//   encoder_backward_v2     deterministic: positions sorted by token id (cupy.argsort, on the GPU); block
//                           (v, column strip) sums token v's rows in a fixed order. No atomics. Indexed by
//                           token when V <= N, else by sorted position (the first of each token sums it): a
//                           grid of V strips would be nearly all absent tokens (1.2M blocks for GPT-2).
//   column_partial<T> /     bias gradients = column sums of dy. 2-D grid: (32-column strip, chunk of rows),
//   column_finish           each block writes a partial, a second tiny kernel adds the partials in order.
//                           Deterministic, and enough blocks to fill the GPU (a block per strip is not).
//   gelu_bias_forward<T>    out = gelu(h + b): one pass (h is kept, h + b is recomputed in the backward).
//   gelu_backward_partial<T> dpre = dout * gelu'(h + b) AND the column partials of dpre (the c_fc bias grad).
//   layernorm_forward       warp per row; optionally fused with the residual: r = x + y + bias, LN(r).
//                           Saves mean and rstd (2 floats per row) for the backward pass.
//   layernorm_backward      dx, dweight, dbias in one kernel: warp per row, dweight/dbias accumulated in
//                           per-warp shared-memory rows (no atomics), one partial per block.
//   bf16 outputs            mixed.py's GEMMs read bf16: the kernel that makes such a value rounds it itself
//                           (common/include/lowp.cuh's bf16_bits, the bits of mixed.cu's casts) instead of
//                           writing fp32 for a cast kernel to read back. layernorm_forward(_vec) writes out16
//                           instead of out; gelu_backward_partial<T, O>, O the bf16 bits, writes only those
//                           (its bias partials still add the fp32 values), and <T, O, H> reads h in bf16 too
//                           (mixed.py stores the GELU's input as its GEMM wrote it); layernorm_backward(_vec)
//                           writes dx16 beside dx, which the bias sums and the next LayerNorm backward still
//                           read. Null pointers and O = H = T (the fp32 model's calls) leave each kernel as it was.
//   T = float4, ..._vec     16-byte loads where C % 4 == 0 and the buffers are 16-byte aligned (a bf16 h: an
//                           8-byte load, 8-byte aligned; ops.py checks): a quarter of the load instructions and
//                           four times the bytes in flight per thread. The column kernels take T = float or
//                           float4 (the same order of additions per column, so the same bits);
//                           layernorm_forward_vec/backward_vec<VEC> hold the row in registers (VEC float4 per
//                           lane): each byte is read from DRAM once and every load of a row is issued before the
//                           first is used.
//   attention               not here: the forward is step 2's flash attention (flash_attention.cu, which also
//                           writes lse per row when given a buffer), the backward attention.cu (v1, v2) and
//                           attention_tc.cu (v3, tensor cores).
//   adamw_schedule          one thread: the step's learning rate, AdamW's bias corrections and the clipping
//                           factor, computed on the GPU from step counters and the gradient norm that live
//                           there, so a CUDA graph of the step can replay it.
//
// The launch shapes come from ops.py as defines (no defaults, so Python and the kernels agree by
// construction): COLS x ROWS (the column kernels' blocks), FINISH_ROWS (column_finish's row lanes), LN_WARPS
// (layernorm_backward's warps per block).
#include "course.cuh"
#include "lowp.cuh"         // bf16_bits, bf16x4_bits: the bf16 outputs round as mixed.cu's casts do

#ifndef COLS
#error "COLS is passed by ops.py"
#endif
#ifndef ROWS
#error "ROWS is passed by ops.py"
#endif
#ifndef FINISH_ROWS
#error "FINISH_ROWS is passed by ops.py"
#endif
#ifndef LN_WARPS
#error "LN_WARPS is passed by ops.py"
#endif
#define NAN_F __int_as_float(0x7fffffff)

typedef unsigned short u16;

__device__ __forceinline__ float gelu_tanh_grad(float x) {
    const float k = 0.7978845608028654f;
    const float t = tanhf(k * (x + 0.044715f * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * 0.044715f * x * x);
}

// The column kernels' element: T = float (one column) or float4 (four neighbouring columns, 16-byte loads).
__device__ __forceinline__ float gelu_bias(float x, float b) { return gelu_tanh(x + b); }
__device__ __forceinline__ float4 gelu_bias(float4 x, float4 b) {
    return make_float4(gelu_tanh(x.x + b.x), gelu_tanh(x.y + b.y), gelu_tanh(x.z + b.z), gelu_tanh(x.w + b.w));
}
__device__ __forceinline__ float dgelu_bias(float d, float x, float b) { return d * gelu_tanh_grad(x + b); }
__device__ __forceinline__ float4 dgelu_bias(float4 d, float4 x, float4 b) {
    return make_float4(d.x * gelu_tanh_grad(x.x + b.x), d.y * gelu_tanh_grad(x.y + b.y),
                       d.z * gelu_tanh_grad(x.z + b.z), d.w * gelu_tanh_grad(x.w + b.w));
}

// A column kernel's output element: the fp32 value itself, or its bf16 bits (a u16, or four in a uint2 for
// T = float4). Any other pairing does not compile. wide() is the way back for an input stored in bf16 (exact).
__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(float4* p, float4 v) { *p = v; }
__device__ __forceinline__ void put(u16* p, float v) { *p = bf16_bits(v); }
__device__ __forceinline__ void put(uint2* p, float4 v) { *p = bf16x4_bits(v); }
__device__ __forceinline__ float wide(float v) { return v; }
__device__ __forceinline__ float4 wide(float4 v) { return v; }
__device__ __forceinline__ float wide(u16 v) { return bf16_to_float(v); }
__device__ __forceinline__ float4 wide(uint2 v) { return bf16x4_to_float4(v.x, v.y); }

// Row lane threadIdx.y of a (COLS, LANES) block holds a partial sum s for column threadIdx.x: add the LANES
// partials in a fixed order (no atomics: the same bits every run). The result is valid in row lane 0.
template <int LANES, typename T>
__device__ __forceinline__ T sum_row_lanes(T s, T (*part)[COLS + 1]) {
    part[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    T t{};
    if (threadIdx.y == 0)
#pragma unroll
        for (int r = 0; r < LANES; ++r) t = t + part[r][threadIdx.x];
    return t;
}

// ------------------------------------------------------------------------------------------- embeddings
extern "C" __global__ void encoder_forward(const int* __restrict__ idx, const float* __restrict__ wte,
                                           const float* __restrict__ wpe, float* __restrict__ out,
                                           long long n, int T, int C, int V) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / C;
        const int c = (int)(i % C), tok = idx[row], t = (int)(row % T);
        out[i] = (tok < 0 || tok >= V) ? NAN_F : wte[(long long)tok * C + c] + wpe[(long long)t * C + c];
    }
}

extern "C" __global__ void encoder_backward_v1(const float* __restrict__ dx, const int* __restrict__ idx,
                                               float* __restrict__ dwte, long long n, int C, int V) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const int tok = idx[i / C];
        if (tok >= 0 && tok < V) atomicAdd(dwte + (long long)tok * C + i % C, dx[i]);
    }
}

// order: the positions 0..N-1 sorted by token id; tok: the ids in that order (idx[order]); start (V + 1): where
// token v's positions begin in order. Block (x, strip): token v = x (by_position 0), or v = tok[x] when sorted
// position x is v's first (by_position 1; the other positions' blocks leave). ROWS row lanes sum v's rows for 32
// columns, then one fixed-order sum; dwte += . The same additions in the same order either way.
extern "C" __global__ void encoder_backward_v2(const float* __restrict__ dx, const int* __restrict__ order,
                                               const int* __restrict__ tok, const int* __restrict__ start,
                                               float* __restrict__ dwte, int C, int V, int by_position) {
    __shared__ float part[ROWS][COLS + 1];
    const int c = blockIdx.y * COLS + threadIdx.x;
    int v = blockIdx.x, s0;
    if (by_position) {
        s0 = blockIdx.x;
        v = tok[s0];
        if (v < 0 || v >= V || (s0 > 0 && tok[s0 - 1] == v)) return;   // out of range (as v1), or not v's first
    } else {
        s0 = start[v];
    }
    const int s1 = start[v + 1];
    if (s0 == s1) return;                       // token not in the batch (the whole block leaves)
    float s = 0.0f;
    if (c < C)
        for (int k = s0 + threadIdx.y; k < s1; k += ROWS) s += dx[(long long)order[k] * C + c];
    const float t = sum_row_lanes<ROWS>(s, part);
    if (threadIdx.y == 0 && c < C) dwte[(long long)v * C + c] += t;
}

// ------------------------------------------------------------------------------------- column sums
// partial[chunk, c] = sum of a[r, c] over the rows of this chunk. Block (COLS, ROWS), grid (strips, chunks).
// cols counts T elements: with T = float4 a block covers 4 * COLS columns, each column added in the same order.
template <typename T>
__global__ void column_partial(const T* __restrict__ a, float* __restrict__ partial, int rows, int cols,
                               int chunk_rows) {
    __shared__ T part[ROWS][COLS + 1];
    const int c = blockIdx.x * COLS + threadIdx.x;
    const int r1 = min(rows, (int)blockIdx.y * chunk_rows + chunk_rows);
    T s{};
    if (c < cols)
#pragma unroll 4
        for (int r = blockIdx.y * chunk_rows + threadIdx.y; r < r1; r += ROWS) s = s + a[(long long)r * cols + c];
    const T t = sum_row_lanes<ROWS>(s, part);
    if (threadIdx.y == 0 && c < cols) reinterpret_cast<T*>(partial)[(long long)blockIdx.y * cols + c] = t;
}

// The c_fc backward: dpre = dout * gelu'(h + bias) (dpre may be dout itself), and its column partials.
// O = T stores dpre in fp32; O = u16 (T = float) or uint2 (T = float4) stores only its bf16 bits, all that
// mixed.py's GEMMs read of it, while the partials add the same fp32 values in the same order. H: h's element,
// T (fp32) or the bf16 bits (as O), widened as read.
template <typename T, typename O = T, typename H = T>
__global__ void gelu_backward_partial(const T* dout, const H* __restrict__ h, const T* __restrict__ bias, O* dpre,
                                      float* __restrict__ partial, int rows, int cols, int chunk_rows) {
    __shared__ T part[ROWS][COLS + 1];
    const int c = blockIdx.x * COLS + threadIdx.x;
    const int r1 = min(rows, (int)blockIdx.y * chunk_rows + chunk_rows);
    T s{};
    const T bc = c < cols ? bias[c] : T{};
    if (c < cols)
#pragma unroll 4
        for (int r = blockIdx.y * chunk_rows + threadIdx.y; r < r1; r += ROWS) {
            const long long i = (long long)r * cols + c;
            const T d = dgelu_bias(dout[i], wide(h[i]), bc);
            put(dpre + i, d);
            s = s + d;
        }
    const T t = sum_row_lanes<ROWS>(s, part);
    if (threadIdx.y == 0 && c < cols) reinterpret_cast<T*>(partial)[(long long)blockIdx.y * cols + c] = t;
}

// out[c] (c < split) or out2[c - split] (c >= split) = sum over chunks of partial[k, c]; accumulate = 1 adds
// to what is there. Block (COLS, FINISH_ROWS): the row lanes share the chunks, then a fixed-order sum in shared
// memory (one thread per column walking all chunks would be a chain of dependent DRAM latencies).
extern "C" __global__ void column_finish(const float* __restrict__ partial, float* out, float* out2, int chunks,
                                         int cols, int split, int accumulate) {
    __shared__ float part[FINISH_ROWS][COLS + 1];
    const int c = blockIdx.x * COLS + threadIdx.x;
    float s = 0.0f;
    if (c < cols)
        for (int k = threadIdx.y; k < chunks; k += FINISH_ROWS) s += partial[(long long)k * cols + c];
    const float t = sum_row_lanes<FINISH_ROWS>(s, part);
    if (threadIdx.y == 0 && c < cols) {
        float* dst = c < split ? out + c : out2 + (c - split);
        *dst = accumulate ? *dst + t : t;
    }
}

// ---------------------------------------------------------------------------------------------- GELU
// h (the c_fc GEMM's output) stays as it is: the backward adds the bias again rather than have the forward
// write h + b back (one pass fewer over the biggest activation).
// The bias index is the column, i % cols: two 64-bit divisions per thread (i % cols, stride % cols), then the
// column moves on by stride % cols each step (a 64-bit division per element costs about as much as the memory
// traffic). n and cols count T elements.
template <typename T>
__global__ void gelu_bias_forward(const T* __restrict__ h, const T* __restrict__ bias, T* __restrict__ out,
                                  long long n, int cols) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const int step = (int)(stride % cols);
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (int c = (int)(i % cols); i < n; i += stride) {
        out[i] = gelu_bias(h[i], bias[c]);
        c += step;
        if (c >= cols) c -= cols;
    }
}

// ----------------------------------------------------------------------------------------- LayerNorm
// One warp per row. y == nullptr: plain LayerNorm of x. Otherwise the residual is fused in:
// resid = x + y (+ ybias), written out, and normalised. The row is re-read from L1 in passes 2 and 3.
// out16 != nullptr: the output's bf16 bits go there instead of out (mixed.py's GEMMs read only those).
extern "C" __global__ void layernorm_forward(const float* x, const float* y, const float* __restrict__ ybias,
                                             float* resid, const float* __restrict__ w, const float* __restrict__ b,
                                             float* __restrict__ out, u16* __restrict__ out16,
                                             float* __restrict__ mean, float* __restrict__ rstd, int N, int C,
                                             float eps) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;                      // whole warps leave: the shuffles below see all 32 lanes
    const long long off = (long long)row * C;
    const float* src = x + off;
    float s = 0.0f;
    if (y) {
        for (int c = lane; c < C; c += 32) {
            const float v = x[off + c] + y[off + c] + (ybias ? ybias[c] : 0.0f);
            resid[off + c] = v;                // each lane re-reads only what it wrote itself
            s += v;
        }
        src = resid + off;
    } else {
        for (int c = lane; c < C; c += 32) s += src[c];
    }
    const float m = warp_sum(s) / C;
    float q = 0.0f;
    for (int c = lane; c < C; c += 32) {
        const float d = src[c] - m;
        q += d * d;                            // two passes: no catastrophic E[x^2] - E[x]^2
    }
    const float r = 1.0f / sqrtf(warp_sum(q) / C + eps);
    for (int c = lane; c < C; c += 32) {
        const float v = (src[c] - m) * r * w[c] + b[c];
        if (out16) out16[off + c] = bf16_bits(v);
        else out[off + c] = v;
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

// The LayerNorm backwards' end: the block's LN_WARPS per-warp dweight | dbias rows in shared memory (sm) added in
// a fixed order into its partial row, partial[blockIdx.x] (2C floats).
__device__ __forceinline__ void ln_block_partial(const float* sm, float* __restrict__ partial, int C) {
    __syncthreads();
    for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) {
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < LN_WARPS; ++k) s += sm[k * 2 * C + c];
        partial[(long long)blockIdx.x * 2 * C + c] = s;
    }
}

// dx (= or += with accumulate), and per-block partials of dweight | dbias: partial (blocks, 2C).
// Dynamic shared memory: LN_WARPS * 2C floats; lane l only ever touches columns l, l+32, ... of its
// warp's rows, so the accumulation needs neither atomics nor barriers.
// dx16 != nullptr: also the bf16 bits of the final dx (after accumulating), for mixed.py's next GEMM; dx stays
// fp32 for the bias column sums and the next LayerNorm backward, which add into it.
extern "C" __global__ void __launch_bounds__(LN_WARPS * 32) layernorm_backward(
        const float* __restrict__ dy, const float* __restrict__ x, const float* __restrict__ w,
        const float* __restrict__ mean, const float* __restrict__ rstd, float* dx, u16* __restrict__ dx16,
        float* __restrict__ partial, int N, int C, int rows_per_block, int accumulate) {
    extern __shared__ float sm[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float* dw = sm + warp * 2 * C;
    float* db = dw + C;
    for (int c = lane; c < C; c += 32) {
        dw[c] = 0.0f;
        db[c] = 0.0f;
    }
    const int r1 = min(N, (int)blockIdx.x * rows_per_block + rows_per_block);
    for (int row = blockIdx.x * rows_per_block + warp; row < r1; row += LN_WARPS) {
        const long long off = (long long)row * C;
        const float m = mean[row], r = rstd[row];
        float sg = 0.0f, sgx = 0.0f;
        for (int c = lane; c < C; c += 32) {
            const float g = dy[off + c] * w[c];
            sg += g;
            sgx += g * (x[off + c] - m) * r;
        }
        sg = warp_sum(sg) / C;
        sgx = warp_sum(sgx) / C;
        for (int c = lane; c < C; c += 32) {
            const float d = dy[off + c], xh = (x[off + c] - m) * r;
            const float v = r * (d * w[c] - sg - xh * sgx);
            const float o = accumulate ? dx[off + c] + v : v;
            dx[off + c] = o;
            if (dx16) dx16[off + c] = bf16_bits(o);
            dw[c] += d * xh;
            db[c] += d;
        }
    }
    ln_block_partial(sm, partial, C);
}

// The row in registers: lane l holds float4 columns l, l + 32, ... (VEC of them, C <= 128 * VEC, C % 4 == 0).
// The same arithmetic per element as layernorm_forward; the sums add in another order (last bits differ).
// out16: as there, four bf16 in one 8-byte store (out16 8-byte aligned: ops.py checks).
template <int VEC>
__global__ void layernorm_forward_vec(const float* x, const float* y, const float* __restrict__ ybias,
                                      float* resid, const float* __restrict__ w, const float* __restrict__ b,
                                      float* __restrict__ out, u16* __restrict__ out16, float* __restrict__ mean,
                                      float* __restrict__ rstd, int N, int C, float eps) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    const int C4 = C / 4;
    const long long off = (long long)row * C4;
    float4 v[VEC];
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
        const int c = lane + 32 * k;
        if (c < C4) {
            v[k] = reinterpret_cast<const float4*>(x)[off + c];
            if (y) {
                v[k] = v[k] + reinterpret_cast<const float4*>(y)[off + c];
                if (ybias) v[k] = v[k] + reinterpret_cast<const float4*>(ybias)[c];
                reinterpret_cast<float4*>(resid)[off + c] = v[k];
            }
            s += v[k].x + v[k].y + v[k].z + v[k].w;
        }
    }
    const float m = warp_sum(s) / C;
    float q = 0.0f;
#pragma unroll
    for (int k = 0; k < VEC; ++k)
        if (lane + 32 * k < C4) {
            const float4 d = make_float4(v[k].x - m, v[k].y - m, v[k].z - m, v[k].w - m);
            q += d.x * d.x + d.y * d.y + d.z * d.z + d.w * d.w;
        }
    const float r = 1.0f / sqrtf(warp_sum(q) / C + eps);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
        const int c = lane + 32 * k;
        if (c < C4) {
            const float4 g = reinterpret_cast<const float4*>(w)[c], bb = reinterpret_cast<const float4*>(b)[c];
            const float4 o = make_float4((v[k].x - m) * r * g.x + bb.x, (v[k].y - m) * r * g.y + bb.y,
                                         (v[k].z - m) * r * g.z + bb.z, (v[k].w - m) * r * g.w + bb.w);
            if (out16) reinterpret_cast<uint2*>(out16)[off + c] = bf16x4_bits(o);
            else reinterpret_cast<float4*>(out)[off + c] = o;
        }
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

// layernorm_backward with the row in registers (as layernorm_forward_vec): dy, x (and dx when accumulating)
// loaded once, all at the start of a row. The per-warp dweight | dbias rows are the same floats as there,
// seen as float4. dx16: as there, four bf16 in one 8-byte store.
template <int VEC>
__global__ void __launch_bounds__(LN_WARPS * 32) layernorm_backward_vec(
        const float* __restrict__ dy, const float* __restrict__ x, const float* __restrict__ w,
        const float* __restrict__ mean, const float* __restrict__ rstd, float* dx, u16* __restrict__ dx16,
        float* __restrict__ partial, int N, int C, int rows_per_block, int accumulate) {
    extern __shared__ float4 sm4[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, C4 = C / 4;
    float4* dw = sm4 + warp * 2 * C4;
    float4* db = dw + C4;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int c = lane; c < C4; c += 32) dw[c] = db[c] = zero;   // each lane zeroes only the columns it adds to
    float4 wv[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) wv[k] = lane + 32 * k < C4 ? reinterpret_cast<const float4*>(w)[lane + 32 * k] : zero;
    const int r1 = min(N, (int)blockIdx.x * rows_per_block + rows_per_block);
    for (int row = blockIdx.x * rows_per_block + warp; row < r1; row += LN_WARPS) {
        const long long off = (long long)row * C4;
        float4 d[VEC], xv[VEC], old[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            const int c = lane + 32 * k;
            d[k] = xv[k] = old[k] = zero;
            if (c < C4) {
                d[k] = reinterpret_cast<const float4*>(dy)[off + c];
                xv[k] = reinterpret_cast<const float4*>(x)[off + c];
                if (accumulate) old[k] = reinterpret_cast<const float4*>(dx)[off + c];
            }
        }
        const float m = mean[row], r = rstd[row];
        float sg = 0.0f, sgx = 0.0f;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {           // columns past C are zeros: they add nothing
            const float4 g = make_float4(d[k].x * wv[k].x, d[k].y * wv[k].y, d[k].z * wv[k].z, d[k].w * wv[k].w);
            sg += g.x + g.y + g.z + g.w;
            sgx += g.x * (xv[k].x - m) * r + g.y * (xv[k].y - m) * r + g.z * (xv[k].z - m) * r + g.w * (xv[k].w - m) * r;
        }
        sg = warp_sum(sg) / C;
        sgx = warp_sum(sgx) / C;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            const int c = lane + 32 * k;
            if (c < C4) {
                const float4 xh = make_float4((xv[k].x - m) * r, (xv[k].y - m) * r, (xv[k].z - m) * r, (xv[k].w - m) * r);
                float4 v = make_float4(r * (d[k].x * wv[k].x - sg - xh.x * sgx), r * (d[k].y * wv[k].y - sg - xh.y * sgx),
                                       r * (d[k].z * wv[k].z - sg - xh.z * sgx), r * (d[k].w * wv[k].w - sg - xh.w * sgx));
                if (accumulate) v = old[k] + v;
                reinterpret_cast<float4*>(dx)[off + c] = v;
                if (dx16) reinterpret_cast<uint2*>(dx16)[off + c] = bf16x4_bits(v);
                const float4 a = dw[c], e = db[c];
                dw[c] = make_float4(a.x + d[k].x * xh.x, a.y + d[k].y * xh.y, a.z + d[k].z * xh.z, a.w + d[k].w * xh.w);
                db[c] = e + d[k];
            }
        }
    }
    ln_block_partial(reinterpret_cast<const float*>(sm4), partial, C);
}

// ------------------------------------------------------------------------------------------- optimiser schedule
// One thread: the learning rate of step counters[0] (linear warm-up, then cosine decay to min_lr at max_steps:
// common/reference/train_gpt2.py's lr_at) and AdamW's bias corrections 1 - b^t for t = counters[1] + 1, in
// double as Python computes them, rounded once to float32 into sched (lr, bc1, bc2); then both counters step on.
// sched[3] is global-norm clipping's factor min(1, max_norm / (norm + 1e-6)) (torch.nn.utils.clip_grad_norm_'s;
// 1 with max_norm = 0), which AdamW applies to each gradient as it reads it. The step reads them from the GPU, so
// a CUDA graph of it replays a new learning rate every time.
extern "C" __global__ void adamw_schedule(long long* counters, float* sched, double lr, double min_lr,
                                          long long warmup, long long max_steps, double b1, double b2,
                                          const float* __restrict__ norm, float max_norm) {
    const long long step = counters[0], t = counters[1] + 1;
    double r;
    if (step < warmup) r = lr * (double)(step + 1) / (double)warmup;
    else if (step >= max_steps) r = min_lr;
    else {
        const double ratio = (double)(step - warmup) / (double)max(1LL, max_steps - warmup);
        r = min_lr + 0.5 * (1.0 + cos(3.141592653589793 * ratio)) * (lr - min_lr);
    }
    sched[0] = (float)r;
    sched[1] = (float)(1.0 - pow(b1, (double)t));
    sched[2] = (float)(1.0 - pow(b2, (double)t));
    sched[3] = max_norm > 0.0f ? fminf(1.0f, max_norm / (*norm + 1e-6f)) : 1.0f;
    counters[0] = step + 1;
    counters[1] = t;
}
