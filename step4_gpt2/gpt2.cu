// gpt2.cu - the kernels GPT-2 needs that steps 1-3 do not have, above all the decode-step GEMV.
//
// Generating one token at batch 1 multiplies a single activation row by every weight matrix of the
// model: each weight is read once and used for 2 FLOPs, so decode is bound by weight bandwidth
// (124M fp32 = ~500 MB per token). The GEMV versions show how to read weights at full bandwidth;
// the small kernels fuse the glue so that one decode step is a fixed sequence of our own launches,
// which a CUDA graph can capture and replay (cuBLAS calls cannot be captured in a CuPy graph).
//
//   embedding_v1        one block per token: x = wte[token] + wpe[position], threads stride over C.
//   embedding_v2        float4 loads and stores (C % 4 == 0).
//   bias_gelu_v1        prefill MLP epilogue after cuBLAS: h = gelu(h + b), in place, one element/thread.
//   bias_gelu_v2        the same with float4 in a grid-stride loop.
//   kv_cache_fill_v1    prefill: copy k and v (+ their bias) from the fused c_attn output into the cache.
//   gemv_v1             y[b, n] = sum_k x[b, k] W[n, k]: one thread per output, W stored (out, in).
//                       Neighbouring threads read addresses K floats apart: uncoalesced, slow.
//   gemv_v2             one warp per output row: lanes read a row with coalesced float4 loads, warp_sum
//                       reduces; every batch row is computed from the same weight load (acc[MAXB]).
//   gemv_v3             ROWS rows per warp (more independent 16-byte loads in flight per lane) and the
//                       epilogue fused: + bias, + bias then GELU, or q/k/v scattered into the KV cache
//                       at each sequence's position (read on the device, so a graph can replay it).
//   gemv_v4             the warps of a block split K for the same ROWS rows and combine in shared memory:
//                       a 768-row matrix gets N/ROWS blocks instead of N/(4*ROWS): more loads in flight
//                       for the small (768 x 768, 3072 -> 768) matrices of a step (04a times each version).
//   gemv_v5             all of a matrix's bytes in flight at once: a block of up to 8 warps splits K for
//                       ROWS rows and each lane issues every load of its slice up front (V5_UNROLL float4s
//                       per row, unrolled), so a 2-9 MB matrix is one DRAM round trip, not a loop of them;
//                       blocks stride over row tiles (the LM head) and prefetch the next tile before the
//                       reduction. Two more fusions remove the residual_layernorm launches of a step: a
//                       LayerNorm prologue (each block normalises the B input rows into shared memory while
//                       its weight loads are in flight: a warp a row, the whole block for a lone row, or one
//                       warp's loads would gate every warp's first FMA) and a residual epilogue (x += y + bias,
//                       in place).
//                       At batch 1 ops launches a module compiled with MAXB=1: acc[ROWS][MAXB] and the batch
//                       loop shrink to one row (sm_90: 80-108 registers instead of 122-128), more blocks are
//                       resident, and with no branch on b < B and continue (not break) past a lane's slice,
//                       x's loads can issue ahead of the FMAs (staging x in shared memory was slower). At the
//                       same launch shape, the same products summed in the same order.
//   argmax_v1           greedy choice per row (first index on ties, like torch.argmax), and optionally
//                       advance each sequence's position, all on the device.
//   argmax_v2           the same with ARGMAX_BATCH 16-byte loads in flight per thread (v1 waits for one
//                       4-byte load at a time): the one the decode step launches.
//   advance_v1          pos += 1, lens += 1 (after a token was sampled outside the graph).
//
// Programmatic dependent launch (common/include/pdl.cuh): each kernel here that a decode step launches calls
// pdl_wait() before it reads another kernel's output or writes global memory, then pdl_launch_dependents(),
// so that launched with the attribute (ops.programmatic, sm_90) it may start while the kernel before it drains
// (step 3's LayerNorms, in the split plan, launch plainly). gemv_v5 loads its first weights before the wait: no
// kernel writes them, so that DRAM round trip overlaps the previous kernel's tail. Launched plainly, both are free.
//
// Compile-time knobs, passed by ops.py as defines (the defaults below are ops.py's values, so the file also
// compiles alone, e.g. with nvcc): MAXB (batch rows per GEMV launch), ROWS (output rows per warp in gemv_v3, per block in
// gemv_v4/v5), V4_WARPS (warps sharing a row block in gemv_v4), V5_UNROLL (float4 loads per row a lane has
// in flight in gemv_v5), V5_MAXWARPS (gemv_v5's largest block, in warps: its __launch_bounds__).
#include "course.cuh"
#include "pdl.cuh"

#ifndef MAXB
#define MAXB 8
#endif
#ifndef ROWS
#define ROWS 2
#endif
#ifndef V4_WARPS
#define V4_WARPS 4
#endif
#ifndef V5_UNROLL
#define V5_UNROLL 4
#endif
#ifndef V5_MAXWARPS
#define V5_MAXWARPS 8
#endif
#ifndef ARGMAX_BATCH
#define ARGMAX_BATCH 4
#endif

// ------------------------------------------------------------------------------------------ embedding
// v1: token i of n gets wte[tokens[i]] + wpe[positions[i]] (positions come from the host for a prompt,
// from the device position buffer for a decode step).
extern "C" __global__ void embedding_v1(const int* __restrict__ tokens, const int* __restrict__ positions,
                                        const float* __restrict__ wte, const float* __restrict__ wpe,
                                        float* __restrict__ out, int n, int C) {
    const int i = blockIdx.x;
    pdl_wait();                  // tokens and positions come from the last step's argmax
    pdl_launch_dependents();
    if (i >= n) return;
    const float* te = wte + (long long)tokens[i] * C;
    const float* pe = wpe + (long long)positions[i] * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) out[(long long)i * C + c] = te[c] + pe[c];
}

// v2: the same rows moved 16 bytes at a time (C % 4 == 0 keeps every row 16-byte aligned).
extern "C" __global__ void embedding_v2(const int* __restrict__ tokens, const int* __restrict__ positions,
                                        const float* __restrict__ wte, const float* __restrict__ wpe,
                                        float* __restrict__ out, int n, int C) {
    const int i = blockIdx.x;
    pdl_wait();                  // tokens and positions come from the last step's argmax
    pdl_launch_dependents();
    if (i >= n) return;
    const int C4 = C / 4;
    const float4* te = reinterpret_cast<const float4*>(wte + (long long)tokens[i] * C);
    const float4* pe = reinterpret_cast<const float4*>(wpe + (long long)positions[i] * C);
    float4* o = reinterpret_cast<float4*>(out + (long long)i * C);
    for (int c = threadIdx.x; c < C4; c += blockDim.x) {
        const float4 a = __ldg(te + c), b = __ldg(pe + c);
        o[c] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
    }
}

// ------------------------------------------------------------------------------------------ bias + GELU
// v1: h (n rows of C) = gelu(h + b), in place. Fusing the bias into the GELU pass reads h once, not twice.
extern "C" __global__ void bias_gelu_v1(float* __restrict__ h, const float* __restrict__ b, long long total, int C) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) h[i] = gelu_tanh(h[i] + b[i % C]);
}

// v2: float4 in a grid-stride loop (C % 4 == 0, so a float4 never straddles two rows).
extern "C" __global__ void bias_gelu_v2(float* __restrict__ h, const float* __restrict__ b, long long total, int C) {
    const long long n4 = total / 4;
    const int C4 = C / 4;
    float4* h4 = reinterpret_cast<float4*>(h);
    const float4* b4 = reinterpret_cast<const float4*>(b);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x) {
        float4 v = h4[i];
        const float4 w = __ldg(b4 + i % C4);
        v.x = gelu_tanh(v.x + w.x); v.y = gelu_tanh(v.y + w.y);
        v.z = gelu_tanh(v.z + w.z); v.w = gelu_tanh(v.w + w.w);
        h4[i] = v;
    }
}

// ------------------------------------------------------------------------------------------ KV cache (prefill)
// qkv: (B, T, 3C) = [q | k | v] without bias (cuBLAS output); caches (B, H, L, D). One block per (b, t).
extern "C" __global__ void kv_cache_fill_v1(const float* __restrict__ qkv, const float* __restrict__ bias,
                                            float* __restrict__ k_cache, float* __restrict__ v_cache,
                                            int B, int T, int H, int D, int L) {
    const int bt = blockIdx.x;
    if (bt >= B * T) return;
    const int b = bt / T, t = bt % T, C = H * D;
    const float* row = qkv + (long long)bt * 3 * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const int h = c / D, d = c % D;
        const long long dst = (((long long)b * H + h) * L + t) * D + d;
        k_cache[dst] = row[C + c] + bias[C + c];
        v_cache[dst] = row[2 * C + c] + bias[2 * C + c];
    }
}

// ------------------------------------------------------------------------------------------ GEMV
// All versions: x (B, K), W (N, K) (each output's weights contiguous: Conv1D weights transposed once
// at load), y (B, N). B <= MAXB for v2/v3.

// v1: one thread per output element. Thread n reads W[n, :], its neighbour W[n + 1, :] K floats away:
// every load of a warp touches 32 different cache lines.
extern "C" __global__ void gemv_v1(const float* __restrict__ x, const float* __restrict__ W,
                                   const float* __restrict__ bias, float* __restrict__ y, int B, int N, int K) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)B * N) return;
    const int b = (int)(i / N), n = (int)(i % N);
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) acc += x[(long long)b * K + k] * W[(long long)n * K + k];
    y[i] = acc + (bias ? bias[n] : 0.0f);
}


// v2: one warp per output row n. Lane l reads float4 number l, l + 32, ... of the row: a warp reads 512
// contiguous bytes per instruction. Each weight float4 is used for every batch row before the next load.
extern "C" __global__ void gemv_v2(const float* __restrict__ x, const float* __restrict__ W,
                                   const float* __restrict__ bias, float* __restrict__ y, int B, int N, int K) {
    const int lane = threadIdx.x % 32;
    const int n = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if (n >= N) return;
    const int K4 = K / 4;
    const float4* w4 = reinterpret_cast<const float4*>(W + (long long)n * K);
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float acc[MAXB];
#pragma unroll
    for (int b = 0; b < MAXB; ++b) acc[b] = 0.0f;
    for (int k = lane; k < K4; k += 32) {
        const float4 w = __ldg(w4 + k);
#pragma unroll
        for (int b = 0; b < MAXB; ++b)
            if (b < B) acc[b] += dot4(w, __ldg(x4 + (long long)b * K4 + k));
    }
#pragma unroll
    for (int b = 0; b < MAXB; ++b) {
        if (b < B) {
            const float s = warp_sum(acc[b]);
            if (lane == 0) y[(long long)b * N + n] = s + (bias ? bias[n] : 0.0f);
        }
    }
}

// v3..v5 are templates on their epilogue, EPI: what happens to sum_k x[b,k] W[n,k] for output n of batch
// row b (and v5 on LN, its LayerNorm prologue). ops.py names the instantiation it launches, e.g.
// "gemv_v5<EPI_BIAS_GELU, true>", and CuPy compiles it through name_expressions. Unused pointer arguments
// (bias without EPI_BIAS..., the caches without EPI_QKV) are passed as null.
enum { EPI_NONE = 0, EPI_BIAS = 1, EPI_BIAS_GELU = 2, EPI_QKV = 3, EPI_RESID = 4 };

// The epilogue every fused GEMV version (v3..v5) ends with, once the sum s for output n of batch row b
// is known. EPI_QKV: n < C is q (written to y as (B, H, D)); C <= n < 2C is k and 2C <= n < 3C is v,
// written into the caches (B, H, L, D) at row pos[b], read on the device. EPI_RESID: y += s (in place).
template <int EPI>
__device__ __forceinline__ void gemv_store(float s, int b, int n, int N, const float* bias, float* y,
                                           float* k_cache, float* v_cache, const int* pos, int H, int L) {
    if (EPI != EPI_NONE) s += bias[n];
    if (EPI == EPI_BIAS_GELU) s = gelu_tanh(s);
    if (EPI == EPI_QKV) {
        const int C = N / 3, D = C / H;
        const int part = n / C, c = n - part * C, h = c / D, d = c - h * D;
        if (part == 0) {
            y[(long long)b * C + c] = s;
        } else {
            float* cache = part == 1 ? k_cache : v_cache;
            cache[(((long long)b * H + h) * L + pos[b]) * D + d] = s;
        }
    } else if (EPI == EPI_RESID) {
        y[(long long)b * N + n] += s;
    } else {
        y[(long long)b * N + n] = s;
    }
}

// v3: ROWS output rows per warp, so each lane has ROWS independent 16-byte weight loads in flight per
// step, and the epilogue fused (gemv_store).
template <int EPI>
__global__ void gemv_v3(const float* __restrict__ x, const float* __restrict__ W, const float* __restrict__ bias,
                        float* __restrict__ y, int B, int N, int K, float* __restrict__ k_cache,
                        float* __restrict__ v_cache, const int* __restrict__ pos, int H, int L) {
    const int lane = threadIdx.x % 32;
    const int n0 = ((blockIdx.x * blockDim.x + threadIdx.x) / 32) * ROWS;
    pdl_wait();                  // its loads interleave weights and x: nothing to start before the wait
    pdl_launch_dependents();
    if (n0 >= N) return;
    const int K4 = K / 4;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const float4* w4[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)   // rows past N re-read row n0 (valid memory); their sums are dropped
        w4[r] = reinterpret_cast<const float4*>(W + (long long)(n0 + r < N ? n0 + r : n0) * K);
    float acc[ROWS][MAXB];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int b = 0; b < MAXB; ++b) acc[r][b] = 0.0f;
#pragma unroll 2
    for (int k = lane; k < K4; k += 32) {
        float4 w[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) w[r] = __ldcs(w4[r] + k);   // streamed: 500 MB never fits in L2
#pragma unroll
        for (int b = 0; b < MAXB; ++b) {
            if (b < B) {
                const float4 xv = __ldg(x4 + (long long)b * K4 + k);
#pragma unroll
                for (int r = 0; r < ROWS; ++r) acc[r][b] += dot4(w[r], xv);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int n = n0 + r;
#pragma unroll
        for (int b = 0; b < MAXB; ++b) {
            if (b >= B) continue;
            const float s = warp_sum(acc[r][b]);
            if (lane == 0 && n < N) gemv_store<EPI>(s, b, n, N, bias, y, k_cache, v_cache, pos, H, L);
        }
    }
}

// v4: the V4_WARPS warps of a block all work on rows n0 .. n0+ROWS-1, warp w taking float4 columns
// w*32 + lane, w*32 + lane + blockDim.x, ...; partial sums meet in shared memory.
template <int EPI>
__global__ void gemv_v4(const float* __restrict__ x, const float* __restrict__ W, const float* __restrict__ bias,
                        float* __restrict__ y, int B, int N, int K, float* __restrict__ k_cache,
                        float* __restrict__ v_cache, const int* __restrict__ pos, int H, int L) {
    __shared__ float red[V4_WARPS][ROWS][MAXB];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int n0 = blockIdx.x * ROWS;
    pdl_wait();                  // as v3: the weights are loaded in the loop, next to x
    pdl_launch_dependents();
    const int K4 = K / 4;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const float4* w4[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
        w4[r] = reinterpret_cast<const float4*>(W + (long long)(n0 + r < N ? n0 + r : n0) * K);
    float acc[ROWS][MAXB];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int b = 0; b < MAXB; ++b) acc[r][b] = 0.0f;
#pragma unroll 2
    for (int k = threadIdx.x; k < K4; k += V4_WARPS * 32) {
        float4 w[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) w[r] = __ldcs(w4[r] + k);
#pragma unroll
        for (int b = 0; b < MAXB; ++b) {
            if (b < B) {
                const float4 xv = __ldg(x4 + (long long)b * K4 + k);
#pragma unroll
                for (int r = 0; r < ROWS; ++r) acc[r][b] += dot4(w[r], xv);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int b = 0; b < MAXB; ++b)
            if (b < B) {
                const float s = warp_sum(acc[r][b]);
                if (lane == 0) red[warp][r][b] = s;
            }
    __syncthreads();
    if (threadIdx.x >= ROWS * MAXB) return;
    const int r = threadIdx.x / MAXB, b = threadIdx.x % MAXB, n = n0 + r;
    if (b >= B || n >= N) return;
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < V4_WARPS; ++w) s += red[w][r][b];
    gemv_store<EPI>(s, b, n, N, bias, y, k_cache, v_cache, pos, H, L);
}

// v5: block = NT = blockDim.x threads (a multiple of 32, <= 256) for ROWS rows; thread t owns float4
// columns t, t + NT, ..., t + (V5_UNROLL-1) NT of each row in a chunk of NT*V5_UNROLL columns (one chunk
// covers K = 768 with 64 threads and K = 3072 with 192). w holds chunk 0 of the current tile whenever
// a tile starts, so its loads overlap the LayerNorm prologue and the previous tile's reduction.
__device__ __forceinline__ void v5_load(float4 (&w)[ROWS][V5_UNROLL], const float4* __restrict__ W4, int n0,
                                        int N, int K4, int base) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const float4* row = W4 + (long long)(n0 + r < N ? n0 + r : N - 1) * K4;   // past N: a valid row, dropped
#pragma unroll
        for (int u = 0; u < V5_UNROLL; ++u) {
            const int k = base + threadIdx.x + u * blockDim.x;
            w[r][u] = k < K4 ? __ldcs(row + k) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
}

// LN: x is replaced by LayerNorm(x; ln_w, ln_b) (course.cuh's layernorm_to_shared: two passes, like step 3).
// EPI_RESID: y (the residual stream, B x N) += x W^T + bias, in place (x is another buffer).
template <int EPI, bool LN>
__global__ void __launch_bounds__(32 * V5_MAXWARPS)
gemv_v5(const float* __restrict__ x, const float* __restrict__ W, const float* __restrict__ bias,
        float* __restrict__ y, int B, int N, int K, const float* __restrict__ ln_w, const float* __restrict__ ln_b,
        float eps, float* __restrict__ k_cache, float* __restrict__ v_cache, const int* __restrict__ pos,
        int H, int L) {
    extern __shared__ float4 xs4[];                           // LN only: the normalised rows, B x K/4
    __shared__ float red[2][V5_MAXWARPS][ROWS][MAXB];         // two buffers: one barrier per tile
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    const int K4 = K / 4, chunk = blockDim.x * V5_UNROLL;
    const int ntiles = (N + ROWS - 1) / ROWS;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const float4* W4 = reinterpret_cast<const float4*>(W);
    int tile = blockIdx.x;
    float4 w[ROWS][V5_UNROLL];
    if (tile < ntiles) v5_load(w, W4, tile * ROWS, N, K4, 0);
    pdl_wait();                  // every thread, even one without a tile: x and y are the last kernel's
    pdl_launch_dependents();     // after the wait: at most one kernel runs ahead of the one finishing
    if (LN)
        layernorm_to_shared(xs4, x4, reinterpret_cast<const float4*>(ln_w), reinterpret_cast<const float4*>(ln_b),
                            B, K, eps);
    for (int it = 0; tile < ntiles; tile += gridDim.x, ++it) {
        const int n0 = tile * ROWS;
        float acc[ROWS][MAXB];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int b = 0; b < MAXB; ++b) acc[r][b] = 0.0f;
        for (int base = 0; base < K4; base += chunk) {
            if (base > 0) v5_load(w, W4, n0, N, K4, base);
#pragma unroll
            for (int u = 0; u < V5_UNROLL; ++u) {
                const int k = base + threadIdx.x + u * blockDim.x;
                if (k >= K4) {              // MAXB 1: continue, so u's x loads can issue before u-1's FMAs
                    if (MAXB == 1) continue; // (at MAXB 8 that costs registers: break)
                    break;
                }
#pragma unroll
                for (int b = 0; b < MAXB; ++b) {
                    if (MAXB == 1 || b < B) {            // MAXB 1: no branch between x's loads
                        const float4 xv = LN ? xs4[(long long)b * K4 + k] : __ldg(x4 + (long long)b * K4 + k);
#pragma unroll
                        for (int r = 0; r < ROWS; ++r) acc[r][b] += dot4(w[r][u], xv);
                    }
                }
            }
        }
        if (tile + (int)gridDim.x < ntiles) v5_load(w, W4, (tile + gridDim.x) * ROWS, N, K4, 0);   // prefetch
        float (*rd)[ROWS][MAXB] = red[it & 1];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int b = 0; b < MAXB; ++b)
                if (b < B) {
                    const float s = warp_sum(acc[r][b]);
                    if (lane == 0) rd[warp][r][b] = s;
                }
        __syncthreads();
        for (int t = threadIdx.x; t < ROWS * MAXB; t += blockDim.x) {   // a loop: a block may be one warp
            const int r = t / MAXB, b = t % MAXB, n = n0 + r;               // and ROWS * MAXB more than 32
            if (b < B && n < N) {
                float s = 0.0f;
                for (int v = 0; v < nwarps; ++v) s += rd[v][r][b];
                gemv_store<EPI>(s, b, n, N, bias, y, k_cache, v_cache, pos, H, L);
            }
        }
    }
}

// ------------------------------------------------------------------------------------------ choosing a token
// One block per batch row. Each thread scans a strided slice, keeping the first index of its maximum;
// warps and then the block combine (value, index) pairs, preferring the smaller index on a tie.
__device__ __forceinline__ void better(float& v, int& i, float v2, int i2) {
    if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
}

// The block's (value, index) pairs to one, then tokens[b] (and the position update). v1 and v2 differ only in
// how a thread reads its slice of the row.
__device__ __forceinline__ void argmax_finish(float v, int idx, int V, int b, int* __restrict__ tokens,
                                              int* __restrict__ pos, int* __restrict__ lens, int advance) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
        better(v, idx, __shfl_xor_sync(FULL_MASK, v, off), __shfl_xor_sync(FULL_MASK, idx, off));
    if (lane == 0) { sv[warp] = v; si[warp] = idx; }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x / 32;
        v = lane < nw ? sv[lane] : __int_as_float(0xff800000);
        idx = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)
            better(v, idx, __shfl_xor_sync(FULL_MASK, v, off), __shfl_xor_sync(FULL_MASK, idx, off));
        if (lane == 0) {
            tokens[b] = idx < V ? idx : 0;    // an all-NaN row cannot name a token; 0 keeps indexing safe
            if (advance) { pos[b] += 1; lens[b] += 1; }
        }
    }
}

extern "C" __global__ void argmax_v1(const float* __restrict__ logits, int V, int* __restrict__ tokens,
                                     int* __restrict__ pos, int* __restrict__ lens, int advance) {
    const int b = blockIdx.x;
    pdl_wait();                  // the logits are the LM head's
    pdl_launch_dependents();
    const float* row = logits + (long long)b * V;
    float v = __int_as_float(0xff800000);   // -inf
    int idx = 0x7fffffff;
    for (int j = threadIdx.x; j < V; j += blockDim.x) better(v, idx, row[j], j);
    argmax_finish(v, idx, V, b, tokens, pos, lens, advance);
}

// v2: v1's loop waits for one 4-byte load at a time, V / blockDim L2 round trips in a row (the logits were
// just written). Here a thread has ARGMAX_BATCH 16-byte loads in flight. A row is 16-byte aligned only where
// b * V is a multiple of 4, so the elements before the first aligned one, and the tail, are read one by one.
// The pairs are compared by (value, then smaller index): the order they are visited in does not matter.
extern "C" __global__ void argmax_v2(const float* __restrict__ logits, int V, int* __restrict__ tokens,
                                     int* __restrict__ pos, int* __restrict__ lens, int advance) {
    const int b = blockIdx.x;
    pdl_wait();
    pdl_launch_dependents();
    const float* row = logits + (long long)b * V;
    const int head = min(V, (int)(((16 - (reinterpret_cast<unsigned long long>(row) & 15)) & 15) / 4));
    const int n4 = (V - head) / 4;
    const float4* r4 = reinterpret_cast<const float4*>(row + head);
    float v = __int_as_float(0xff800000);
    int idx = 0x7fffffff;
    if ((int)threadIdx.x < head) better(v, idx, row[threadIdx.x], threadIdx.x);
    for (int j0 = threadIdx.x; j0 < n4; j0 += blockDim.x * ARGMAX_BATCH) {
        float4 q[ARGMAX_BATCH];
#pragma unroll
        for (int i = 0; i < ARGMAX_BATCH; ++i)
            if (j0 + i * (int)blockDim.x < n4) q[i] = r4[j0 + i * blockDim.x];
#pragma unroll
        for (int i = 0; i < ARGMAX_BATCH; ++i) {
            const int j = j0 + i * blockDim.x, e = head + 4 * j;
            if (j < n4) {
                better(v, idx, q[i].x, e);
                better(v, idx, q[i].y, e + 1);
                better(v, idx, q[i].z, e + 2);
                better(v, idx, q[i].w, e + 3);
            }
        }
    }
    for (int j = head + 4 * n4 + threadIdx.x; j < V; j += blockDim.x) better(v, idx, row[j], j);
    argmax_finish(v, idx, V, b, tokens, pos, lens, advance);
}

extern "C" __global__ void advance_v1(int* __restrict__ pos, int* __restrict__ lens, int B) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    pdl_wait();                  // pos and lens are read by the kernels before it
    pdl_launch_dependents();
    if (b < B) { pos[b] += 1; lens[b] += 1; }
}
