// gemv_lowp.cu - the decode GEMV reading fewer bytes per weight: bf16 and int8 weights, fp32 arithmetic.
//
// A decode step at batch 1 reads every weight once and does 2 FLOPs with it, so its time is the weight
// bytes over the memory bandwidth. Halving the bytes halves the bound; the arithmetic can stay fp32, because
// a weight is widened to float in registers, after the load, where it costs no bandwidth at all:
//
//   bytes per token, GPT-2 124M (123.5M matrix weights, 0.12M biases and LayerNorm parameters kept fp32)
//     fp32   494.6 MB                               the bound at 3 TB/s: 165 us per token
//     bf16   247.6 MB                                                     83 us
//     int8   124.6 MB (with 133K fp32 row scales)                         42 us
//   GPT-2 XL (1.5B): 6224 / 3114 / 1562 MB.
//   At batch B a weight serves B rows: 2B FLOPs per 4, 2 or 1 bytes. An H100 (about 60 TFLOP/s of fp32 FMA
//   against about 3.35 TB/s) breaks even near 18 FLOPs per byte: B ~ 36 for fp32 weights, ~18 for bf16, ~9
//   for int8 (fewer still, counting the instructions that widen each weight). Below it, bytes set the floor.
//
// The versions continue gpt2.cu's gemv_v1..v5 (same (N, K) = (out, in) layout, same epilogues, same
// LayerNorm prologue, same launch). They live in their own file because only the weight format changes:
// gpt2.cu teaches how to keep every fp32 byte in flight, this file how to make the bytes fewer, and v5's
// kernel stays readable without a weight-type parameter threaded through it.
//
//   gemv_v6      v5 with bf16 weights (uint16 bit patterns). One 16-byte load brings 8 weights instead of 4;
//                a bf16 is the top half of a float32, so widening it is a shift: __uint_as_float(u << 16)
//                (plain integer work, no sm_80 instruction: this runs on every GPU the course supports).
//   gemv_v7      v5 with int8 weights and one fp32 scale per output row (w ~= q * scale[n], symmetric,
//                round to nearest, scale = max|w_row| / 127). One load brings 16 weights; each is widened
//                to float and the sum is multiplied by the row's scale once, after the dot product (the
//                scale is constant along the row, so it factors out of sum_k x[k] q[n,k]).
//                Widening without a conversion instruction: int -> float (I2F) runs at a quarter of the
//                FMA rate on recent GPUs, and an int8 weight needs one per weight. Instead, put the byte
//                (q ^ 0x80 = q + 128, in 0..255) into the low mantissa bits of 2^23 with one byte permute
//                (__byte_perm): the float 0x4B0000hh is exactly 8388608 + q + 128, and one FADD of
//                -8388736 leaves q, exactly (every integer below 2^24 is a float). Per weight: a byte
//                permute (integer pipe) and an FADD (FMA pipe) instead of a shift and an I2F (a quarter-
//                rate pipe on Hopper).
//                Why one scale per row and not per group of 64-128 weights: at 8 bits the rounding error of
//                a weight is at most max|w_row| / 254, small unless a row's maximum (an outlier) dwarfs the
//                rest; per-group scales pay off at 4 bits, where the step is 16x coarser. The lesson's
//                perplexity table measures what per-row costs on a trained model.
//   gemv_v8/v9   v6/v7 on the tensor cores (bf16 / int8 weights): one mma.sync.m16n8k16 takes 8 rows of W
//                against up to 8 batch rows of x, so batch 8 costs the instructions of batch 1; x is rounded to
//                bf16 / fp16 for it. ops.lowp_version picks them from batch 2 on, and at batch 1 for short rows.
//   dequant_bf16_v1, dequant_int8_v1
//                the prefill path: widen a whole matrix to fp32 once, then cuBLAS multiplies (ops.matmul_lowp).
//
// Both GEMVs are one template, gemv_lowp<WT, EPI, LN>, over the weight format WT: unpack4<WT> widens a load,
// PER_LOAD<WT> counts its weights and int8 multiplies by its row scale. Weights travel as uint4 (16 bytes),
// whatever they hold, so K must be a multiple of 8 (bf16) or 16 (int8) for every row to start 16-byte aligned.
//
// Programmatic dependent launch (common/include/pdl.cuh): each GEMV issues its first weight loads, which no
// kernel writes, then waits for the kernel before it (pdl_wait) before it reads x or writes anything, and lets
// the next kernel start (pdl_launch_dependents). Launched that way (ops.programmatic, sm_90), the next GEMV's
// first DRAM round trip overlaps this one's reduction and drain; launched plainly, both calls cost nothing.
//
// Compile-time knobs (ops.py passes them; the defaults are its values): MAXB (batch rows per launch), ROWS
// (output rows per block), UNROLL (16-byte weight loads per row a lane has in flight), MAXWARPS (largest
// block, in warps: its __launch_bounds__).
//
// Batch 1 (ops.gemv_module): a decode step at batch 1 launches a module compiled with MAXB=1, batches of 2
// and more the MAXB=8 one. At MAXB=8, acc[ROWS][MAXB] and the unrolled batch loop hold registers a batch of
// 1 never uses (sm_90, int8: 165-173 per lane, 102-128 at MAXB=1), so fewer blocks are resident and a large
// matrix takes more rounds of tiles. x is read the same way in both: from shared memory behind the LayerNorm
// prologue, else with __ldg inside the FMA loop. Copying x to shared memory without LN too would delay every
// block's first FMA until the whole row has arrived, and was not faster. At the same launch shape, each sum
// adds the same products in the same order either way.
#include "course.cuh"
#include "pdl.cuh"
#include "lowp.cuh"         // word, bf16x4_to_float4, i8x4_to_float4, i8x2_to_half2: the widening

#ifndef MAXB
#define MAXB 8
#endif
#ifndef ROWS
#define ROWS 4
#endif
#ifndef UNROLL
#define UNROLL 4
#endif
#ifndef MAXWARPS
#define MAXWARPS 8
#endif

// The same epilogues as gpt2.cu (the two files compile separately, so the enum is written again).
enum { EPI_NONE = 0, EPI_BIAS = 1, EPI_BIAS_GELU = 2, EPI_QKV = 3, EPI_RESID = 4 };
enum { W_BF16 = 1, W_I8 = 2 };

// Weights per 16-byte load.
template <int WT> struct WeightFormat { static constexpr int PER_LOAD = WT == W_BF16 ? 8 : 16; };

// Weights 4j .. 4j+3 of a 16-byte load, widened to float (matching the float4 number j of x it multiplies).
template <int WT>
__device__ __forceinline__ float4 unpack4(const uint4& u, int j) {
    if constexpr (WT == W_BF16) {
        // little-endian: the lower 16 bits of a word hold the earlier weight
        return bf16x4_to_float4(word(u, 2 * j), word(u, 2 * j + 1));
    } else {
        return i8x4_to_float4(word(u, j));
    }
}

// What happens to the sum s of output n of batch row b: gpt2.cu's gemv_store, unchanged.
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

// v5_load with 16-byte weight vectors: thread t owns vectors t, t + NT, ... of a chunk of NT*UNROLL.
__device__ __forceinline__ void lowp_load(uint4 (&w)[ROWS][UNROLL], const uint4* __restrict__ Wv, int n0, int N,
                                          int KV, int base) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const uint4* row = Wv + (long long)(n0 + r < N ? n0 + r : N - 1) * KV;   // past N: a valid row, dropped
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int k = base + threadIdx.x + u * blockDim.x;
            w[r][u] = k < KV ? __ldcs(row + k) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// gemv_v5's body over weight format WT. scale: (N,) row scales (W_I8), else unused.
template <int WT, int EPI, bool LN>
__device__ __forceinline__ void gemv_lowp(const float* __restrict__ x, const void* __restrict__ W,
                                          const float* __restrict__ scale, const float* __restrict__ bias,
                                          float* __restrict__ y, int B, int N, int K, const float* __restrict__ ln_w,
                                          const float* __restrict__ ln_b, float eps, float* __restrict__ k_cache,
                                          float* __restrict__ v_cache, const int* __restrict__ pos, int H, int L) {
    constexpr int G = WeightFormat<WT>::PER_LOAD / 4;        // float4s of x per weight load
    extern __shared__ float4 xs4[];                           // LN only: the normalised rows, B x K/4
    __shared__ float red[2][MAXWARPS][ROWS][MAXB];            // two buffers: one barrier per tile
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    const int K4 = K / 4, KV = K / WeightFormat<WT>::PER_LOAD, chunk = blockDim.x * UNROLL;
    const int ntiles = (N + ROWS - 1) / ROWS;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const uint4* Wv = reinterpret_cast<const uint4*>(W);
    int tile = blockIdx.x;
    uint4 w[ROWS][UNROLL];
    if (tile < ntiles) lowp_load(w, Wv, tile * ROWS, N, KV, 0);
    pdl_wait();                   // every thread, even one without a tile: x and y are the last kernel's
    pdl_launch_dependents();      // after the wait: at most one kernel runs ahead of the one finishing
    if (LN)                                                   // as in v5, while the weight loads fly
        layernorm_to_shared(xs4, x4, reinterpret_cast<const float4*>(ln_w), reinterpret_cast<const float4*>(ln_b),
                            B, K, eps);
    for (int it = 0; tile < ntiles; tile += gridDim.x, ++it) {
        const int n0 = tile * ROWS;
        float acc[ROWS][MAXB];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int b = 0; b < MAXB; ++b) acc[r][b] = 0.0f;
        for (int base = 0; base < KV; base += chunk) {
            if (base > 0) lowp_load(w, Wv, n0, N, KV, base);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int k = base + threadIdx.x + u * blockDim.x;
                if (k >= KV) {              // MAXB 1: continue, so u's x loads can issue before u-1's FMAs
                    if (MAXB == 1) continue; // (at MAXB 8 that costs registers: break)
                    break;
                }
#pragma unroll
                for (int j = 0; j < G; ++j) {
                    float4 wf[ROWS];                          // widened once, used for every batch row
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) wf[r] = unpack4<WT>(w[r][u], j);
                    const long long kx = (long long)k * G + j;
#pragma unroll
                    for (int b = 0; b < MAXB; ++b) {
                        if (MAXB == 1 || b < B) {            // MAXB 1: no branch between x's loads
                            const float4 xv = LN ? xs4[b * K4 + kx] : __ldg(x4 + (long long)b * K4 + kx);
#pragma unroll
                            for (int r = 0; r < ROWS; ++r) acc[r][b] += dot4(wf[r], xv);
                        }
                    }
                }
            }
        }
        if (tile + (int)gridDim.x < ntiles) lowp_load(w, Wv, (tile + gridDim.x) * ROWS, N, KV, 0);   // prefetch
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
                if (WT == W_I8) s *= scale[n];                // the row's scale, once per output
                gemv_store<EPI>(s, b, n, N, bias, y, k_cache, v_cache, pos, H, L);
            }
        }
    }
}

// ------------------------------------------------------------------------------------------ GEMV
// v6: W (N, K) bf16 bit patterns. Arguments as gpt2.cu's gemv_v5.
template <int EPI, bool LN>
__global__ void __launch_bounds__(32 * MAXWARPS)
gemv_v6(const float* __restrict__ x, const unsigned short* __restrict__ W, const float* __restrict__ bias,
        float* __restrict__ y, int B, int N, int K, const float* __restrict__ ln_w, const float* __restrict__ ln_b,
        float eps, float* __restrict__ k_cache, float* __restrict__ v_cache, const int* __restrict__ pos,
        int H, int L) {
    gemv_lowp<W_BF16, EPI, LN>(x, W, nullptr, bias, y, B, N, K, ln_w, ln_b, eps, k_cache, v_cache, pos, H, L);
}

// v7: W (N, K) int8 with scale (N,): y[b, n] = scale[n] * sum_k x[b, k] W[n, k], then the epilogue.
template <int EPI, bool LN>
__global__ void __launch_bounds__(32 * MAXWARPS)
gemv_v7(const float* __restrict__ x, const signed char* __restrict__ W, const float* __restrict__ scale,
        const float* __restrict__ bias, float* __restrict__ y, int B, int N, int K, const float* __restrict__ ln_w,
        const float* __restrict__ ln_b, float eps, float* __restrict__ k_cache, float* __restrict__ v_cache,
        const int* __restrict__ pos, int H, int L) {
    gemv_lowp<W_I8, EPI, LN>(x, W, scale, bias, y, B, N, K, ln_w, ln_b, eps, k_cache, v_cache, pos, H, L);
}

// ------------------------------------------------------------------------------------------ tensor cores
// v8 (bf16) and v9 (int8): the same GEMV on the tensor cores. At batch B, v6/v7 spend B FMA instructions per
// weight, plus the widening (v7: a byte permute and an FADD): the bytes stay, the instructions grow with the
// batch, and from batch 2 on the SM's issue rate rather than DRAM sets the pace (lesson 4f measures it).
// One mma.sync.m16n8k16 does 16 x 8 x 16 multiply-adds; here it takes 8 rows of W (its B operand, 8 columns)
// against the batch's rows of x (its A operand, 16 rows, those past the batch zero): one warp instruction for
// the 128 multiply-adds of batch 1 (4 warp-wide FMA instructions) or the 1024 of batch 8 (32 of them).
//
//   lane (g, t) = (lane / 4, lane % 4) of a warp: W row n0 + g, x row (batch) g, and 16 bytes of each row at
//   k = c*KC + t*PER .. + PER - 1 in chunk c of KC = 4*PER weights (PER = 8 bf16 or 16 int8: one 16-byte load).
//
// The k order inside an mma does not matter, so long as x and W agree: the mma wants lane t to hold k = 2t,
// 2t+1, 2t+8, 2t+9 of each 16-wide k step; we give it the lane's own four contiguous weights instead (one
// 16-byte load from the row, no shuffling) and read x's matching four. Weight -> mma operand:
//   bf16: as stored (bf16 pairs are the operand's format); x is rounded to bf16 once, in shared memory.
//   int8: byte permute into the fp16 1024 + (q + 128), minus 1152 (a half2 subtract): q, exactly; two weights per
//         permute and subtract. x is rounded to fp16 (an |x| past 65504 would be inf; GPT-2's stay far below).
// The products are summed in fp32 by the tensor core; the row scale (int8) and the epilogue as in v6/v7.
// Blocks (TC_* in tc_gemv.py): TC_ROWS rows (TC_ROWS / 8 tiles) by TC_WARPS warps splitting K chunk by chunk,
// each lane holding TC_UNROLL chunks' 16-byte loads per tile in flight; the warps' sums meet in shared memory.
// The LayerNorm prologue is shared by the block's threads (the statistics reduced across warps).
// Needs sm_80 for bf16 (mma.sync bf16), sm_75 for int8 (fp16 mma: two m16n8k8 there); ops.py checks.
#ifndef TC_ROWS
#define TC_ROWS 16
#endif
#ifndef TC_WARPS
#define TC_WARPS 8
#endif
#ifndef TC_UNROLL
#define TC_UNROLL 4
#endif
#include "mma.cuh"

template <int WT> struct Tc {
    static constexpr int PER = WeightFormat<WT>::PER_LOAD;   // a lane's weights per chunk and row
    static constexpr int KC = 4 * PER;                        // k per chunk (4 lanes side by side)
    static constexpr int MMAS = PER / 4;                      // k16 mma steps per chunk: 4 k per lane each
    // Words (operand pairs) per x row in shared memory: the chunks, rounded up to 32 words, plus a shift of
    // 16 (bf16) or 4 (int8) banks, so that the lanes of one 16-byte read (t = 0..3 of rows g, g+1) hit distinct
    // banks at every batch size. tc_gemv.py's tc_row_words is the same formula.
    static __device__ __forceinline__ int row_words(int nchunks) {
        return (nchunks * KC / 2 + 31) / 32 * 32 + (WT == W_BF16 ? 16 : 4);
    }
};
constexpr int TC_TILES = TC_ROWS / 8;

// Two floats as one register of two 16-bit operands, the first in the low half: bf16 (round to nearest even,
// lowp.cuh) or fp16.
template <int WT>
__device__ __forceinline__ unsigned pack_x2(float lo, float hi) {
    if constexpr (WT == W_BF16) {
        return bf16x2_bits(lo, hi);
    } else {
        unsigned short a, b;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(a) : "f"(lo));
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(hi));
        return (unsigned)a | ((unsigned)b << 16);
    }
}

template <int WT>
__device__ __forceinline__ void tc_load(uint4 (&w)[TC_TILES][TC_UNROLL], const uint4* __restrict__ Wv, int n0, int N,
                                        int KV, int nchunks, int round) {
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3, warp = threadIdx.x / 32;
#pragma unroll
    for (int tt = 0; tt < TC_TILES; ++tt) {
        const int n = n0 + tt * 8 + g;
        const uint4* row = Wv + (long long)(n < N ? n : N - 1) * KV;       // past N: a valid row, dropped
#pragma unroll
        for (int u = 0; u < TC_UNROLL; ++u) {
            const int c = warp + (round * TC_UNROLL + u) * TC_WARPS, v = c * 4 + t;
            w[tt][u] = c < nchunks && v < KV ? __ldcs(row + v) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

template <int WT, int EPI, bool LN>
__device__ __forceinline__ void gemv_tc(const float* __restrict__ x, const void* __restrict__ W,
                                        const float* __restrict__ scale, const float* __restrict__ bias,
                                        float* __restrict__ y, int B, int N, int K, const float* __restrict__ ln_w,
                                        const float* __restrict__ ln_b, float eps, float* __restrict__ k_cache,
                                        float* __restrict__ v_cache, const int* __restrict__ pos, int H, int L) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 750
    __trap();      // ops.py launches v9 on sm_75 and newer, v8 on sm_80 (on sm_75 its bf16 mma traps)
#else
    static_assert(TC_ROWS % 8 == 0 && MAXB <= 8, "a tile is 8 rows of W; the batch fills at most 8 of the mma's 16 rows");
    using T = Tc<WT>;
    extern __shared__ float4 xs4[];          // LN: B x K floats, then the operands; else the operands only
    __shared__ float red[2][TC_WARPS][MAXB][TC_ROWS];
    __shared__ float stat[2][TC_WARPS][MAXB];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane >> 2, t = lane & 3;
    const int K4 = K / 4, KV = K / T::PER, nchunks = (K + T::KC - 1) / T::KC;
    const int SW = T::row_words(nchunks);                     // words of operand pairs per x row
    const int rounds = ((nchunks + TC_WARPS - 1) / TC_WARPS + TC_UNROLL - 1) / TC_UNROLL;
    const int ntiles = (N + TC_ROWS - 1) / TC_ROWS;
    float* xf = reinterpret_cast<float*>(xs4);
    unsigned* xh = reinterpret_cast<unsigned*>(xs4) + (LN ? B * K : 0);   // after xf: B x SW words
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const uint4* Wv = reinterpret_cast<const uint4*>(W);
    int tile = blockIdx.x;
    uint4 w[TC_TILES][TC_UNROLL];
    if (tile < ntiles) tc_load<WT>(w, Wv, tile * TC_ROWS, N, KV, nchunks, 0);
    pdl_wait();
    pdl_launch_dependents();
    // ---- x into shared memory as mma operands (LN: normalised first, the block's threads sharing each row)
    float mean[MAXB], rstd[MAXB];
    if (LN) {
        float4* xf4 = reinterpret_cast<float4*>(xf);
        float s[MAXB];
#pragma unroll
        for (int b = 0; b < MAXB; ++b) {
            s[b] = 0.0f;
            if (b < B)
                for (int k = threadIdx.x; k < K4; k += blockDim.x) {
                    const float4 v = x4[(long long)b * K4 + k];
                    xf4[b * K4 + k] = v;
                    s[b] += (v.x + v.y) + (v.z + v.w);
                }
            s[b] = warp_sum(s[b]);
            if (lane == 0) stat[0][warp][b] = s[b];
        }
        __syncthreads();
#pragma unroll
        for (int b = 0; b < MAXB; ++b) {
            float m = 0.0f;
            for (int v = 0; v < TC_WARPS; ++v) m += stat[0][v][b];
            mean[b] = m / K;
            float q = 0.0f;
            if (b < B)
                for (int k = threadIdx.x; k < K4; k += blockDim.x) {
                    const float4 v = xf4[b * K4 + k];
                    const float a = v.x - mean[b], c = v.y - mean[b], d = v.z - mean[b], e = v.w - mean[b];
                    q += (a * a + c * c) + (d * d + e * e);
                }
            q = warp_sum(q);
            if (lane == 0) stat[1][warp][b] = q;
        }
        __syncthreads();
#pragma unroll
        for (int b = 0; b < MAXB; ++b) {
            float q = 0.0f;
            for (int v = 0; v < TC_WARPS; ++v) q += stat[1][v][b];
            rstd[b] = rsqrtf(q / K + eps);
        }
    }
    const float4* g4 = reinterpret_cast<const float4*>(ln_w);
    const float4* o4 = reinterpret_cast<const float4*>(ln_b);
    for (int i = threadIdx.x; i < B * (SW / 2); i += blockDim.x) {
        const int b = i / (SW / 2), k = i - b * (SW / 2);
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);                  // zeros past K
        if (k < K4) {
            if (LN) {
                float mu = mean[0], r = rstd[0];
#pragma unroll
                for (int bb = 1; bb < MAXB; ++bb)
                    if (bb == b) { mu = mean[bb]; r = rstd[bb]; }
                const float4 u = reinterpret_cast<const float4*>(xf)[b * K4 + k], gg = __ldg(g4 + k), oo = __ldg(o4 + k);
                v = make_float4((u.x - mu) * r * gg.x + oo.x, (u.y - mu) * r * gg.y + oo.y,
                                (u.z - mu) * r * gg.z + oo.z, (u.w - mu) * r * gg.w + oo.w);
            } else {
                v = x4[(long long)b * K4 + k];
            }
        }
        *reinterpret_cast<uint2*>(xh + b * SW + 2 * k) = make_uint2(pack_x2<WT>(v.x, v.y), pack_x2<WT>(v.z, v.w));
    }
    __syncthreads();
    // ---- the tiles
    for (int it = 0; tile < ntiles; tile += gridDim.x, ++it) {
        const int n0 = tile * TC_ROWS;
        float d[TC_TILES][4];
#pragma unroll
        for (int tt = 0; tt < TC_TILES; ++tt) d[tt][0] = d[tt][1] = d[tt][2] = d[tt][3] = 0.0f;
        for (int round = 0; round < rounds; ++round) {
            uint4 wn[TC_TILES][TC_UNROLL];                    // the next loads fly while these are multiplied
            if (round + 1 < rounds) tc_load<WT>(wn, Wv, n0, N, KV, nchunks, round + 1);
            else if (tile + (int)gridDim.x < ntiles) tc_load<WT>(wn, Wv, (tile + gridDim.x) * TC_ROWS, N, KV, nchunks, 0);
#pragma unroll
            for (int u = 0; u < TC_UNROLL; ++u) {
                const int c = warp + (round * TC_UNROLL + u) * TC_WARPS;
                if (c >= nchunks) break;
                unsigned xa[T::PER / 2];                      // x row g at this lane's k: operand pairs
                const uint4* xr = reinterpret_cast<const uint4*>(xh + g * SW + (c * T::KC + t * T::PER) / 2);
#pragma unroll
                for (int j = 0; j < T::PER / 8; ++j) {
                    const uint4 v = g < B ? xr[j] : make_uint4(0u, 0u, 0u, 0u);
                    xa[4 * j] = v.x; xa[4 * j + 1] = v.y; xa[4 * j + 2] = v.z; xa[4 * j + 3] = v.w;
                }
#pragma unroll
                for (int j = 0; j < T::MMAS; ++j) {
                    const unsigned a[4] = {xa[2 * j], 0u, xa[2 * j + 1], 0u};   // A rows 8-15 (batch 8-15): zero
#pragma unroll
                    for (int tt = 0; tt < TC_TILES; ++tt) {
                        unsigned b0, b1;
                        if constexpr (WT == W_BF16) {
                            b0 = word(w[tt][u], 2 * j);
                            b1 = word(w[tt][u], 2 * j + 1);
                        } else {
                            b0 = i8x2_to_half2(word(w[tt][u], j), false);
                            b1 = i8x2_to_half2(word(w[tt][u], j), true);
                        }
                        mma16816<WT == W_BF16>(d[tt], a, b0, b1);
                    }
                }
            }
            if (round + 1 < rounds || tile + (int)gridDim.x < ntiles) {
#pragma unroll
                for (int tt = 0; tt < TC_TILES; ++tt)
#pragma unroll
                    for (int u = 0; u < TC_UNROLL; ++u) w[tt][u] = wn[tt][u];
            }
        }
        // d[tt][0..1]: batch row g, W rows n0 + tt*8 + 2t, +1 (d[tt][2..3]: batch rows 8-15, unused)
        float (*rd)[MAXB][TC_ROWS] = red[it & 1];
        if (g < B) {
#pragma unroll
            for (int tt = 0; tt < TC_TILES; ++tt) {
                rd[warp][g][tt * 8 + 2 * t] = d[tt][0];
                rd[warp][g][tt * 8 + 2 * t + 1] = d[tt][1];
            }
        }
        __syncthreads();
        for (int i = threadIdx.x; i < TC_ROWS * B; i += blockDim.x) {
            const int b = i / TC_ROWS, r = i - b * TC_ROWS, n = n0 + r;
            if (n < N) {
                float s = 0.0f;
                for (int v = 0; v < TC_WARPS; ++v) s += rd[v][b][r];
                if (WT == W_I8) s *= scale[n];
                gemv_store<EPI>(s, b, n, N, bias, y, k_cache, v_cache, pos, H, L);
            }
        }
    }
#endif
}

// v8: W (N, K) bf16 bit patterns, on the tensor cores (x rounded to bf16). Arguments as gemv_v6.
template <int EPI, bool LN>
__global__ void __launch_bounds__(32 * TC_WARPS)
gemv_v8(const float* __restrict__ x, const unsigned short* __restrict__ W, const float* __restrict__ bias,
        float* __restrict__ y, int B, int N, int K, const float* __restrict__ ln_w, const float* __restrict__ ln_b,
        float eps, float* __restrict__ k_cache, float* __restrict__ v_cache, const int* __restrict__ pos,
        int H, int L) {
    gemv_tc<W_BF16, EPI, LN>(x, W, nullptr, bias, y, B, N, K, ln_w, ln_b, eps, k_cache, v_cache, pos, H, L);
}

// v9: W (N, K) int8 with scale (N,), on the tensor cores (weights as fp16, x rounded to fp16). As gemv_v7.
template <int EPI, bool LN>
__global__ void __launch_bounds__(32 * TC_WARPS)
gemv_v9(const float* __restrict__ x, const signed char* __restrict__ W, const float* __restrict__ scale,
        const float* __restrict__ bias, float* __restrict__ y, int B, int N, int K, const float* __restrict__ ln_w,
        const float* __restrict__ ln_b, float eps, float* __restrict__ k_cache, float* __restrict__ v_cache,
        const int* __restrict__ pos, int H, int L) {
    gemv_tc<W_I8, EPI, LN>(x, W, scale, bias, y, B, N, K, ln_w, ln_b, eps, k_cache, v_cache, pos, H, L);
}

// ------------------------------------------------------------------------------------------ prefill
// Widen W to fp32 (out, N x K) once, for cuBLAS. A grid-stride loop over 16-byte loads; nvec = N*K/8.
extern "C" __global__ void dequant_bf16_v1(const uint4* __restrict__ W, float4* __restrict__ out, long long nvec) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += (long long)gridDim.x * blockDim.x) {
        const uint4 u = __ldcs(W + i);
        out[2 * i] = unpack4<W_BF16>(u, 0);
        out[2 * i + 1] = unpack4<W_BF16>(u, 1);
    }
}

// nvec = N*K/16; K % 16 == 0, so a load never straddles two rows: row = i*16 / K.
extern "C" __global__ void dequant_int8_v1(const uint4* __restrict__ W, const float* __restrict__ scale,
                                           float4* __restrict__ out, long long nvec, int K) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += (long long)gridDim.x * blockDim.x) {
        const uint4 u = __ldcs(W + i);
        const float s = __ldg(scale + i * 16 / K);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float4 f = unpack4<W_I8>(u, j);
            out[4 * i + j] = make_float4(f.x * s, f.y * s, f.z * s, f.w * s);
        }
    }
}
