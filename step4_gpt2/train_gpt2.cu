// train_gpt2.cu - the backward pass of GPT-2: every kernel a training step needs besides the GEMMs (cuBLAS),
// the attention forward (step 2's flash_attention.cu, which also writes the log-sum-exp) and the fused
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
//                           (v, column strip) sums token v's rows in a fixed order. No atomics.
//   column_partial<T> /     bias gradients = column sums of dy. 2-D grid: (32-column strip, chunk of rows),
//   column_finish           each block writes a partial, a second tiny kernel adds the partials in order.
//                           Deterministic, and enough blocks to fill the GPU (a block per strip is not).
//   gelu_bias_forward<T>    out = gelu(h + b): one pass (h is kept, h + b is recomputed in the backward).
//   gelu_backward_partial<T> dpre = dout * gelu'(h + b) AND the column partials of dpre (the c_fc bias grad).
//   layernorm_forward       warp per row; optionally fused with the residual: r = x + y + bias, LN(r).
//                           Saves mean and rstd (2 floats per row) for the backward pass.
//   layernorm_backward      dx, dweight, dbias in one kernel: warp per row, dweight/dbias accumulated in
//                           per-warp shared-memory rows (no atomics), one partial per block.
//   T = float4, ..._vec     16-byte loads where C % 4 == 0 and the buffers are 16-byte aligned (train_ops
//                           checks): a quarter of the load instructions and four times the bytes in flight
//                           per thread. The column kernels take T = float or float4 (the same order of
//                           additions per column, so the same bits); layernorm_forward_vec/backward_vec<VEC>
//                           hold the row in registers (VEC float4 per lane): each byte is read from DRAM once
//                           and every load of a row is issued before the first is used.
//   attention forward       not here: step 2's flash attention (flash_attention.cu, flash_attention_qkv),
//                           which also writes lse per row when given a buffer.
//   attention backward v1   (Python + cuBLAS) S = QK^T again, attention_probs: P from lse, written as a
//                           T x T matrix; dV = P^T dO, dP = dO V^T; attention_dscores: dS = P (dP - delta).
//   attention backward v2   flash-style, never writes T x T: attention_delta (delta_i = dO_i . O_i), then
//                           attention_backward_dkv (a block owns 64 keys, walks the queries tile by tile,
//                           recomputes P from lse: dK, dV in registers) and attention_backward_dq (a block
//                           owns 64 queries, walks the keys). No atomics: each output has one owner. Two
//                           threads per row (each half of the head dims: half the registers, one shuffle
//                           per dot product), tiles in shared memory, exponentials in the exp2 domain.
//   adamw_schedule          one thread: the step's learning rate, AdamW's bias corrections and the clipping
//                           factor, computed on the GPU from step counters and the gradient norm that live
//                           there, so a CUDA graph of the step can replay it.
//
// Compile-time knobs: HEAD_DIM (32 or 64, default 64). The launch shapes come from train_ops.py as defines
// (no defaults, so Python and the kernels agree by construction): ATT_ROWS (query or key rows per attention
// block: 2 * ATT_ROWS threads), COLS x ROWS (the column kernels' blocks), FINISH_ROWS (column_finish's row
// lanes), LN_WARPS (layernorm_backward's warps per block).
#include "course.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#ifndef ATT_ROWS
#error "ATT_ROWS is passed by train_ops.py"
#endif
#ifndef COLS
#error "COLS is passed by train_ops.py"
#endif
#ifndef ROWS
#error "ROWS is passed by train_ops.py"
#endif
#ifndef FINISH_ROWS
#error "FINISH_ROWS is passed by train_ops.py"
#endif
#ifndef LN_WARPS
#error "LN_WARPS is passed by train_ops.py"
#endif
#define D HEAD_DIM
#define HALF (D / 2)               // head dims per thread: two threads share a row
#define SROW (D + 8)               // shared row: the two halves 4 floats apart, so the pair's float4 loads
#define HOFF(half) ((half) * (HALF + 4))   // hit different banks
#define ATT_TILE 32                // keys (or queries) per shared-memory tile
#define NAN_F __int_as_float(0x7fffffff)
#define LOG2E 1.4426950408889634f

static_assert(D == 32 || D == 64, "HEAD_DIM must be 32 or 64");

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

// order: the positions 0..N-1 sorted by token id; start (V + 1): where token v's positions begin in order.
// Block (v, strip): ROWS row lanes sum token v's rows for 32 columns, then one fixed-order sum. dwte += .
extern "C" __global__ void encoder_backward_v2(const float* __restrict__ dx, const int* __restrict__ order,
                                               const int* __restrict__ start, float* __restrict__ dwte, int C) {
    __shared__ float part[ROWS][COLS + 1];
    const int v = blockIdx.x, c = blockIdx.y * COLS + threadIdx.x;
    const int s0 = start[v], s1 = start[v + 1];
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
template <typename T>
__global__ void gelu_backward_partial(const T* dout, const T* __restrict__ h, const T* __restrict__ bias, T* dpre,
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
            const T d = dgelu_bias(dout[i], h[i], bc);
            dpre[i] = d;
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
extern "C" __global__ void layernorm_forward(const float* x, const float* y, const float* __restrict__ ybias,
                                             float* resid, const float* __restrict__ w, const float* __restrict__ b,
                                             float* __restrict__ out, float* __restrict__ mean,
                                             float* __restrict__ rstd, int N, int C, float eps) {
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
    for (int c = lane; c < C; c += 32) out[off + c] = (src[c] - m) * r * w[c] + b[c];
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
extern "C" __global__ void __launch_bounds__(LN_WARPS * 32) layernorm_backward(
        const float* __restrict__ dy, const float* __restrict__ x, const float* __restrict__ w,
        const float* __restrict__ mean, const float* __restrict__ rstd, float* dx, float* __restrict__ partial,
        int N, int C, int rows_per_block, int accumulate) {
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
            dx[off + c] = accumulate ? dx[off + c] + v : v;
            dw[c] += d * xh;
            db[c] += d;
        }
    }
    ln_block_partial(sm, partial, C);
}

// The row in registers: lane l holds float4 columns l, l + 32, ... (VEC of them, C <= 128 * VEC, C % 4 == 0).
// The same arithmetic per element as layernorm_forward; the sums add in another order (last bits differ).
template <int VEC>
__global__ void layernorm_forward_vec(const float* x, const float* y, const float* __restrict__ ybias,
                                      float* resid, const float* __restrict__ w, const float* __restrict__ b,
                                      float* __restrict__ out, float* __restrict__ mean, float* __restrict__ rstd,
                                      int N, int C, float eps) {
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
            reinterpret_cast<float4*>(out)[off + c] = make_float4((v[k].x - m) * r * g.x + bb.x,
                (v[k].y - m) * r * g.y + bb.y, (v[k].z - m) * r * g.z + bb.z, (v[k].w - m) * r * g.w + bb.w);
        }
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

// layernorm_backward with the row in registers (as layernorm_forward_vec): dy, x (and dx when accumulating)
// loaded once, all at the start of a row. The per-warp dweight | dbias rows are the same floats as there,
// seen as float4.
template <int VEC>
__global__ void __launch_bounds__(LN_WARPS * 32) layernorm_backward_vec(
        const float* __restrict__ dy, const float* __restrict__ x, const float* __restrict__ w,
        const float* __restrict__ mean, const float* __restrict__ rstd, float* dx, float* __restrict__ partial,
        int N, int C, int rows_per_block, int accumulate) {
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
                const float4 a = dw[c], e = db[c];
                dw[c] = make_float4(a.x + d[k].x * xh.x, a.y + d[k].y * xh.y, a.z + d[k].z * xh.z, a.w + d[k].w * xh.w);
                db[c] = e + d[k];
            }
        }
    }
    ln_block_partial(reinterpret_cast<const float*>(sm4), partial, C);
}

// ----------------------------------------------------------------------------------------- attention
// Loads HALF floats (+ bias) of a row into registers, times `mul`.
__device__ __forceinline__ void load_half(const float* __restrict__ src, const float* __restrict__ bias, float mul,
                                          float* dst) {
#pragma unroll
    for (int d = 0; d < HALF; d += 4) {
        float4 a = *reinterpret_cast<const float4*>(src + d);
        if (bias) {
            const float4 bb = *reinterpret_cast<const float4*>(bias + d);
            a.x += bb.x; a.y += bb.y; a.z += bb.z; a.w += bb.w;
        }
        dst[d] = a.x * mul; dst[d + 1] = a.y * mul; dst[d + 2] = a.z * mul; dst[d + 3] = a.w * mul;
    }
}

// A tile of ATT_TILE rows (first row r0) of a (B, T, stride) buffer, D columns from col, plus bias[col..]
// (bias indexed like the buffer's columns), into shared memory sh[ATT_TILE][SROW] with the halves split; rows past T are zero.
__device__ __forceinline__ void load_tile(float (*sh)[SROW], const float* __restrict__ base, long long stride,
                                          int col, const float* __restrict__ bias, int r0, int T) {
    for (int e = threadIdx.x; e < ATT_TILE * D / 4; e += blockDim.x) {
        const int r = e / (D / 4), c = (e % (D / 4)) * 4;
        float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r0 + r < T) {
            a = *reinterpret_cast<const float4*>(base + (long long)(r0 + r) * stride + col + c);
            if (bias) {
                const float4 bb = *reinterpret_cast<const float4*>(bias + col + c);
                a.x += bb.x; a.y += bb.y; a.z += bb.z; a.w += bb.w;
            }
        }
        *reinterpret_cast<float4*>(&sh[r][c < HALF ? c : c + 4]) = a;
    }
}

// The pair's dot product: each thread HALF products from registers x shared row, one shuffle.
__device__ __forceinline__ float pair_dot(const float* reg, const float* __restrict__ row) {
    float s = 0.0f;
#pragma unroll
    for (int d = 0; d < HALF; d += 4) {
        const float4 r = *reinterpret_cast<const float4*>(row + d);
        s += reg[d] * r.x + reg[d + 1] * r.y + reg[d + 2] * r.z + reg[d + 3] * r.w;
    }
    return s + __shfl_xor_sync(FULL_MASK, s, 1);
}

__device__ __forceinline__ void axpy_half(float* acc, float a, const float* __restrict__ row) {
#pragma unroll
    for (int d = 0; d < HALF; d += 4) {
        const float4 r = *reinterpret_cast<const float4*>(row + d);
        acc[d] += a * r.x; acc[d + 1] += a * r.y; acc[d + 2] += a * r.z; acc[d + 3] += a * r.w;
    }
}

// delta (B, H, T): delta_i = dO_i . O_i, the row term of the softmax backward. One warp per (b, t, h).
extern "C" __global__ void attention_delta(const float* __restrict__ dout, const float* __restrict__ out,
                                           float* __restrict__ delta, int T, int H, long long rows) {
    const long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (r >= rows) return;
    float s = 0.0f;
#pragma unroll
    for (int d = lane; d < D; d += 32) s += dout[r * D + d] * out[r * D + d];
    s = warp_sum(s);
    if (lane == 0) {
        const long long bt = r / H;
        const int h = (int)(r % H), t = (int)(bt % T);
        delta[((bt / T) * H + h) * T + t] = s;
    }
}

// v2, keys: a block owns ATT_ROWS keys j (two threads each), walks the queries i >= its first key in tiles,
// recomputes p_ij = exp(s_ij - lse_i) and accumulates dV_j += p dO_i, dK_j += p (dP_ij - delta_i) q_i.
extern "C" __global__ void __launch_bounds__(2 * ATT_ROWS) attention_backward_dkv(
        const float* __restrict__ qkv, const float* __restrict__ bias, const float* __restrict__ dout,
        const float* __restrict__ lse, const float* __restrict__ delta, float* __restrict__ dqkv,
        int T, int H, float scale) {
    __shared__ __align__(16) float qs[ATT_TILE][SROW];
    __shared__ __align__(16) float dos[ATT_TILE][SROW];
    __shared__ float ls[ATT_TILE], dl[ATT_TILE];
    const int C = H * D, bh = blockIdx.y, b = bh / H, h = bh % H;
    const int j0 = blockIdx.x * ATT_ROWS;           // blockIdx 0 has the most queries: it starts first
    const int j = j0 + threadIdx.x / 2, half = threadIdx.x % 2;
    const float* base = qkv + (long long)b * T * 3 * C;
    const float* dbase = dout + (long long)b * T * C;
    float k[HALF], v[HALF], dk[HALF], dv[HALF];
    if (j < T) {
        load_half(base + (long long)j * 3 * C + C + h * D + half * HALF, bias ? bias + C + h * D + half * HALF : nullptr, scale * LOG2E, k);
        load_half(base + (long long)j * 3 * C + 2 * C + h * D + half * HALF, bias ? bias + 2 * C + h * D + half * HALF : nullptr, 1.0f, v);
    } else {
#pragma unroll
        for (int d = 0; d < HALF; ++d) k[d] = v[d] = 0.0f;
    }
#pragma unroll
    for (int d = 0; d < HALF; ++d) dk[d] = dv[d] = 0.0f;
    for (int i0 = j0; i0 < T; i0 += ATT_TILE) {
        __syncthreads();
        load_tile(qs, base, 3 * C, h * D, bias, i0, T);
        load_tile(dos, dbase, C, h * D, nullptr, i0, T);
        if (threadIdx.x < ATT_TILE) {
            const int i = i0 + threadIdx.x;
            ls[threadIdx.x] = i < T ? lse[(long long)bh * T + i] * LOG2E : 0.0f;
            dl[threadIdx.x] = i < T ? delta[(long long)bh * T + i] : 0.0f;
        }
        __syncthreads();
#pragma unroll 4
        for (int ii = 0; ii < ATT_TILE; ++ii) {
            const int i = i0 + ii;
            const float s = pair_dot(k, &qs[ii][HOFF(half)]);
            const float dp = pair_dot(v, &dos[ii][HOFF(half)]);
            const float p = (j <= i && i < T) ? exp2f(s - ls[ii]) : 0.0f;
            axpy_half(dv, p, &dos[ii][HOFF(half)]);
            axpy_half(dk, p * (dp - dl[ii]), &qs[ii][HOFF(half)]);
        }
    }
    if (j >= T) return;
    float* o = dqkv + ((long long)b * T + j) * 3 * C + h * D + half * HALF;
#pragma unroll
    for (int d = 0; d < HALF; d += 4) {
        *reinterpret_cast<float4*>(o + C + d) = make_float4(dk[d] * scale, dk[d + 1] * scale, dk[d + 2] * scale, dk[d + 3] * scale);
        *reinterpret_cast<float4*>(o + 2 * C + d) = make_float4(dv[d], dv[d + 1], dv[d + 2], dv[d + 3]);
    }
}

// v2, queries: a block owns ATT_ROWS queries i, walks the keys j <= i in tiles: dQ_i += p (dP_ij - delta_i) k_j.
extern "C" __global__ void __launch_bounds__(2 * ATT_ROWS) attention_backward_dq(
        const float* __restrict__ qkv, const float* __restrict__ bias, const float* __restrict__ dout,
        const float* __restrict__ lse, const float* __restrict__ delta, float* __restrict__ dqkv,
        int T, int H, float scale) {
    __shared__ __align__(16) float ks[ATT_TILE][SROW];
    __shared__ __align__(16) float vs[ATT_TILE][SROW];
    const int C = H * D, bh = blockIdx.y, b = bh / H, h = bh % H;
    const int row0 = (gridDim.x - 1 - blockIdx.x) * ATT_ROWS;
    const int i = row0 + threadIdx.x / 2, half = threadIdx.x % 2;
    const bool valid = i < T;
    const float* base = qkv + (long long)b * T * 3 * C;
    float q[HALF], dO[HALF], dq[HALF];
    float l2 = 0.0f, dl = 0.0f;
    if (valid) {
        load_half(base + (long long)i * 3 * C + h * D + half * HALF, bias ? bias + h * D + half * HALF : nullptr, scale * LOG2E, q);
        load_half(dout + ((long long)b * T + i) * C + h * D + half * HALF, nullptr, 1.0f, dO);
        l2 = lse[(long long)bh * T + i] * LOG2E;
        dl = delta[(long long)bh * T + i];
    } else {
#pragma unroll
        for (int d = 0; d < HALF; ++d) q[d] = dO[d] = 0.0f;
    }
#pragma unroll
    for (int d = 0; d < HALF; ++d) dq[d] = 0.0f;
    const int last = min(T, row0 + ATT_ROWS);
    for (int j0 = 0; j0 < last; j0 += ATT_TILE) {
        __syncthreads();
        load_tile(ks, base, 3 * C, C + h * D, bias, j0, T);
        load_tile(vs, base, 3 * C, 2 * C + h * D, bias, j0, T);
        __syncthreads();
#pragma unroll 8
        for (int jj = 0; jj < ATT_TILE; ++jj) {
            const float s = pair_dot(q, &ks[jj][HOFF(half)]);
            const float dp = pair_dot(dO, &vs[jj][HOFF(half)]);
            const float p = (valid && j0 + jj <= i) ? exp2f(s - l2) : 0.0f;
            axpy_half(dq, p * (dp - dl), &ks[jj][HOFF(half)]);
        }
    }
    if (!valid) return;
    float* o = dqkv + ((long long)b * T + i) * 3 * C + h * D + half * HALF;
#pragma unroll
    for (int d = 0; d < HALF; d += 4)
        *reinterpret_cast<float4*>(o + d) = make_float4(dq[d] * scale, dq[d + 1] * scale, dq[d + 2] * scale, dq[d + 3] * scale);
}

// v1 pieces. s (BH, T, T) holds the raw scores Q K^T; in place: P = exp(s * scale - lse) on and below the
// diagonal, 0 above it. Then dscores: dS = P (dP - delta) * scale, in place over dP.
extern "C" __global__ void attention_probs(float* s, const float* __restrict__ lse, int T, long long n, float scale) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        const long long row = e / T;
        const int j = (int)(e % T), i = (int)(row % T);
        s[e] = j <= i ? expf(s[e] * scale - lse[row]) : 0.0f;
    }
}

extern "C" __global__ void attention_dscores(const float* __restrict__ p, float* dp, const float* __restrict__ delta,
                                             int T, long long n, float scale) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x)
        dp[e] = p[e] * (dp[e] - delta[e / T]) * scale;
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
