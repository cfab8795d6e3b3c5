// megakernel.cuh - the pieces both versions of the decode megakernel are built from (megakernel_v1.cu,
// megakernel_v2.cu): its constants, the bounded wait between blocks, the weight loads and the GEMV tiles.
// LayerNorm, the MLP's down projection and attention are in megakernel_stages.cuh.
//
// A decode step at batch <= 8 reads every weight once (494.6 MB for the 124M model) and does almost no
// arithmetic per byte, so its floor is the time to stream the weights from DRAM. Run as ~60 small kernels
// (step 4's decode), each kernel pays a launch, a DRAM round trip before its loads arrive and a drain at
// its end, and the GPU is idle in between. Here one launch keeps one block (or two) resident per SM for
// the whole step; every block takes a tile of every stage:
//
//   per layer   QKV      LayerNorm(x) (each block recomputes it for the <= 8 rows: cheaper than a stage)
//                        -> rows of c_attn -> q, and k/v appended to the cache at each sequence's position
//               ATT      attention over the cache, split over (sequence, head, chunk of positions), one warp
//                        per unit, units dealt round-robin over the blocks (one SM's loads per unit); the last
//                        unit of a (sequence, head) to finish combines the chunks, or, with few chunks, PROJ
//               PROJ     (merges the chunks) -> rows of attn c_proj, + bias + residual (+ acc) into x
//               MLP      LayerNorm(x) -> rows of c_fc -> GELU -> h rows (shared memory) -> times the same
//                        rows of mlp c_proj^T, added into acc (split-K, below); LayerNorms read x + acc
//   then        LM       LayerNorm_f(x + acc) -> rows of the tied LM head -> logits, and the greedy choice:
//                        each block's best (value, index) packed into 64 bits, combined with one atomicMax;
//                        the last block to finish writes the token and advances the position.
//
// A GEMV stage splits its N output rows into contiguous ranges, one per block; inside a block a warp takes
// ROWS rows x one segment of 32*UNROLL float4 columns and issues all its weight loads before using them.
// The MLP's down projection is split the other way (over its inputs, K): a block multiplies the h rows it has
// just made by the matching rows of mlp c_proj^T (the host passes it transposed) and adds C partial sums into
// acc with atomics, so no block waits for another's h and the MLP is one stage, not two. The next projection
// folds acc into x and zeroes it. The order of those additions, and the last bits of x, vary from run to run.
//
// Weights in fewer bytes (MK_WT for the layers' matrices, MK_WT_HEAD for the LM head): fp32 (W_F32), bf16 bit
// patterns (W_BF16) or int8 with one fp32 scale per output row (W_I8), as lesson 4f's GPT(precision=...)
// stores them. Only the loads change: a lane's 16-byte load brings 4, 8 or 16 weights, which are widened to
// float in registers (Fmt<WT>::unpack4, the same bit operations as step4_gpt2/gemv_lowp.cu's unpack4) and
// multiplied by the fp32 stage input as before; an int8 row's sum is multiplied by its scale once, before the
// epilogue (the MLP's down projection: each group's partial sum, before it is added). Everything else
// (activations, the KV cache, biases, LayerNorms, the embedding) stays fp32. The fp32 build (W_F32) is the same
// arithmetic in the same order as before the weights had a format: unpack4 of a float4 is the float4 itself.
//
// Nothing here can hang: every wait is bounded by %globaltimer (timeout_ns); on a timeout a block records
// (code 1, block, stage, layer, step) in err[] and every block leaves at its next wait; the host turns err[]
// into an exception (code 2: launched with less dynamic shared memory than the layout needs). All blocks must
// be resident at once (the host sizes the grid with the occupancy API and refuses a launch that cannot fit).
//
// Compile-time constants (defaults: GPT-2 124M, batch 1): NB (batch rows), C, NH, NL, VOCAB, MK_THREADS,
// MK_ROWS, MK_UNROLL, MK_PF_WAVES (waves of weight rows prefetched ahead, v2), ATT_MAXCL (most positions per
// attention unit), MK_ATT_PF_MAX (bytes of KV cache v2 prefetches), MK_MERGE_MAX (most NB x chunks the
// projection merges itself), MK_HCAP (most h rows a block keeps in shared memory at once), MK_EPS (LayerNorm
// epsilon), MK_WT and MK_WT_HEAD (the weight formats, W_F32 by default); MK_VERSION (1 or 2) comes from the
// version's file.
#pragma once
#include "course.cuh"
#include "lowp.cuh"           // word, bf16x4_to_float4, i8x4_to_float4: the widening of bf16 / int8 weights

#ifndef NB
#define NB 1
#endif
#ifndef C
#define C 768
#endif
#ifndef NH
#define NH 12
#endif
#ifndef NL
#define NL 12
#endif
#ifndef VOCAB
#define VOCAB 50257
#endif
#ifndef MK_THREADS
#define MK_THREADS 384
#endif
#ifndef MK_ROWS
#define MK_ROWS 2
#endif
#ifndef MK_UNROLL
#define MK_UNROLL 3
#endif
#ifndef MK_VERSION
#error "MK_VERSION: include this header from megakernel_v1.cu or megakernel_v2.cu, which define it"
#endif
#ifndef MK_PF_WAVES
#define MK_PF_WAVES 2
#endif
#ifndef ATT_MAXCL
#define ATT_MAXCL 256
#endif
#ifndef MK_ATT_PF_MAX
#define MK_ATT_PF_MAX (16ll << 20)
#endif
#ifndef MK_MERGE_MAX
#define MK_MERGE_MAX 4
#endif
#ifndef MK_HCAP
#define MK_HCAP 48
#endif
#ifndef MK_EPS
#define MK_EPS 1e-5f
#endif
#define W_F32 0             // weight formats (gemv_lowp.cu's W_BF16 and W_I8 numbers)
#define W_BF16 1
#define W_I8 2
#ifndef MK_WT
#define MK_WT W_F32
#endif
#ifndef MK_WT_HEAD
#define MK_WT_HEAD MK_WT
#endif

#define HD (C / NH)
#define NWARPS (MK_THREADS / 32)
#define R MK_ROWS
#define U MK_UNROLL

static_assert(NB >= 1 && NB <= 8, "NB: batch rows 1..8");
static_assert(C % NH == 0 && (HD == 32 || HD == 64), "head_dim must be 32 or 64");
static_assert(C % 4 == 0, "C must be a multiple of 4 (float4 loads)");
static_assert(HD % R == 0, "a row group of QKV must not straddle q/k/v or two heads");
static_assert(MK_THREADS % 32 == 0 && MK_THREADS <= 1024 && NWARPS >= NB, "MK_THREADS: a warp per batch row");
static_assert(MK_VERSION == 1 || MK_VERSION == 2, "MK_VERSION must be 1 or 2");
static_assert(ATT_MAXCL % 32 == 0, "ATT_MAXCL must be a multiple of 32");
static_assert(MK_MERGE_MAX >= 1, "MK_MERGE_MAX: at least 1");
static_assert(MK_HCAP % R == 0 && MK_HCAP % 4 == 0, "MK_HCAP: a multiple of MK_ROWS and of 4 (float4 after it)");
static_assert(MK_WT >= W_F32 && MK_WT <= W_I8 && MK_WT_HEAD >= W_F32 && MK_WT_HEAD <= W_I8,
              "MK_WT, MK_WT_HEAD: W_F32 (0), W_BF16 (1) or W_I8 (2)");
static_assert((MK_WT == W_F32) == (MK_WT_HEAD == W_F32), "MK_WT_HEAD: fp32 with fp32 layers only (one register type)");
static_assert(MK_WT == W_F32 || C % (MK_WT == W_BF16 ? 8 : 16) == 0,
              "C must be a multiple of the weights per 16-byte load (8 bf16, 16 int8): every row starts aligned");
static_assert(MK_WT_HEAD == W_F32 || C % (MK_WT_HEAD == W_BF16 ? 8 : 16) == 0,
              "C must be a multiple of the LM head's weights per 16-byte load (8 bf16, 16 int8)");

// One layer's pointers in the table the host passes (NL x LW_COUNT, as 64-bit integers). The matrices are in
// format MK_WT; the *S entries are their int8 row scales (0 for fp32 and bf16).
enum { LW_LN1W, LW_LN1B, LW_ATTNW, LW_ATTNB, LW_PROJW, LW_PROJB, LW_LN2W, LW_LN2B, LW_FCW, LW_FCB,
       LW_MPROJWT, LW_MPROJB, LW_KCACHE, LW_VCACHE, LW_ATTNS, LW_PROJS, LW_FCS, LW_MPROJS, LW_COUNT };
// Counters in sync[] (uint32, zeroed once; they only grow, so targets come from the step number).
enum { S_BAR, S_ATT_DONE, S_X_DONE, S_X2_DONE, S_LM_DONE, S_TOK_DONE, S_HEAD0 = 8 };
#ifdef MK_LW_COUNT                  // the host's sizes of the pointer table and the fixed counters (megakernel.py)
static_assert(LW_COUNT == MK_LW_COUNT, "megakernel.py's LW_COUNT differs from the LW_ enum");
#endif
#ifdef MK_SYNC_FIXED
static_assert(S_HEAD0 == MK_SYNC_FIXED, "megakernel.py's SYNC_FIXED differs from S_HEAD0");
#endif
#define S_ATTC0 (S_HEAD0 + NH)      // then NB*NH arrival counters, one per (sequence, head)
enum { ST_QKV, ST_ATT, ST_PROJ, ST_MLP, ST_LM };
#define STAGES_PER_LAYER 4
#define STAGES_PER_STEP (STAGES_PER_LAYER * NL + 1)
enum { EPI_QKV, EPI_RESID, EPI_GELU, EPI_LOGITS };

// ------------------------------------------------------------------------------------------ small helpers
__device__ __forceinline__ int ld_volatile(const int* p) { return *(const volatile int*)p; }

// Where a wait is: for the error record.
struct Where { int stage, layer, step; };

struct Ctl {
    unsigned* sync;
    int* err;
    long long timeout_ns;
};

// One thread waits until *ctr >= target (wrap-safe). False when this wait timed out (it records where) or
// another block already reported an error: the caller then leaves. The acquire orders this thread's later
// loads after the producers' writes; the caller passes that on to its other threads through a barrier.
__device__ bool wait_geq(const unsigned* ctr, unsigned target, const Ctl& ctl, Where w) {
    const unsigned long long t0 = globaltimer();
    for (unsigned it = 0;; ++it) {
        if ((int)(ld_acquire(ctr) - target) >= 0) return true;
        if ((it & 15) == 15) {
            if (ld_volatile(ctl.err) != 0) return false;
            if ((long long)(globaltimer() - t0) > ctl.timeout_ns) {
                if (atomicCAS(ctl.err, 0, 1) == 0) {
                    ctl.err[1] = blockIdx.x; ctl.err[2] = w.stage; ctl.err[3] = w.layer; ctl.err[4] = w.step;
                    ctl.err[5] = (int)target; ctl.err[6] = (int)ld_acquire(ctr);
                    __threadfence();
                }
                return false;
            }
        }
    }
}

// Whole-block versions: thread 0 waits, everyone learns the outcome from the same barrier.
__device__ __forceinline__ bool block_wait(const unsigned* ctr, unsigned target, const Ctl& ctl, Where w) {
    bool ok = true;
    if (threadIdx.x == 0) ok = wait_geq(ctr, target, ctl, w);
    return __syncthreads_and(ok);
}
// Whether this block signals (every one does). The lab's stall build (lab/megakernel_stall.cu) defines it
// false for one block, to test that every wait is bounded: the others time out and report, none hangs.
#ifndef MK_SIGNALS
#define MK_SIGNALS() true
#endif

// Release: everything this block wrote before is visible to whoever sees the counter move.
__device__ __forceinline__ void block_signal(unsigned* ctr, unsigned add, const Ctl& ctl) {
    __syncthreads();
    if (threadIdx.x == 0 && MK_SIGNALS() && add) red_release(ctr, add);
}

// v1: every block arrives, then waits for all gridDim.x arrivals; bar is the counter's value before it.
__device__ __forceinline__ bool grid_barrier(unsigned* ctr, unsigned& bar, const Ctl& ctl, Where w) {
    block_signal(ctr, 1, ctl);
    const bool ok = block_wait(ctr, bar + gridDim.x, ctl, w);
    bar += gridDim.x;
    return ok;
}

// Where a stage starts (which 0), its inputs are ready (1) and it ends (2). Nothing here; the lab's timeline
// build (lab/megakernel_timeline.cu) defines MK_STAMP before including a version, to stamp %globaltimer.
#ifndef MK_STAMP
#define MK_STAMP(idx, which) ((void)(idx))
#endif

// ------------------------------------------------------------------------------------------ weight loads
// Every weight is read once per step: streamed, evict-first in L2 (ld.global.cs), and asked from L2 ahead of
// use (prefetch.global.L2). KEEP marks a layer's weights (not the LM head's): the lab's keep-in-L2 build
// (lab/megakernel_keep_l2.cu) defines MK_WEIGHT_LOADS and its own two functions, which treat them otherwise.
#ifndef MK_WEIGHT_LOADS
template <bool KEEP>
__device__ __forceinline__ float4 ld_weight(const float4* p) { return __ldcs(p); }

template <bool KEEP = false>
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" :: "l"(p)); }
#endif
// bf16 and int8 weights travel as raw bits: 16 bytes (uint4) in the GEMV tiles, 8 or 4 bytes (four weights) in
// the MLP's down projection. Streamed like the fp32 ones (the keep-in-L2 lab build reads fp32 weights only).
template <bool KEEP> __device__ __forceinline__ uint4 ld_weight(const uint4* p) { return __ldcs(p); }
template <bool KEEP> __device__ __forceinline__ uint2 ld_weight(const uint2* p) { return __ldcs(p); }
template <bool KEEP> __device__ __forceinline__ unsigned ld_weight(const unsigned* p) { return __ldcs(p); }

// ------------------------------------------------------------------------------------------ weight formats
// Fmt<WT>: V, what a lane loads at once (16 bytes); PER, the weights in it; unpack4(v, j), weights 4j .. 4j+3
// of v widened to float (they multiply float4 number j of the input that v covers); V4 and widen4, four weights
// (one float4 column of the MLP's down projection). The widening is common/include/lowp.cuh's, as in gemv_lowp.cu.
template <int WT> struct Fmt;
template <> struct Fmt<W_F32> {
    using V = float4;
    using V4 = float4;
    static constexpr int PER = 4, BYTES = 4;
    static __device__ __forceinline__ float4 widen4(const float4& v) { return v; }
    static __device__ __forceinline__ float4 unpack4(const float4& v, int) { return v; }
};
template <> struct Fmt<W_BF16> {
    using V = uint4;
    using V4 = uint2;
    static constexpr int PER = 8, BYTES = 2;
    static __device__ __forceinline__ float4 widen4(const uint2& v) {   // little-endian: the low half comes first
        return bf16x4_to_float4(v.x, v.y);
    }
    static __device__ __forceinline__ float4 unpack4(const uint4& u, int j) {
        return widen4(make_uint2(word(u, 2 * j), word(u, 2 * j + 1)));
    }
};
template <> struct Fmt<W_I8> {
    using V = uint4;
    using V4 = unsigned;
    static constexpr int PER = 16, BYTES = 1;
    static __device__ __forceinline__ float4 widen4(unsigned a) { return i8x4_to_float4(a); }
    static __device__ __forceinline__ float4 unpack4(const uint4& u, int j) { return widen4(word(u, j)); }
};
__device__ __forceinline__ float4 vzero(float4) { return make_float4(0.f, 0.f, 0.f, 0.f); }
__device__ __forceinline__ uint4 vzero(uint4) { return make_uint4(0u, 0u, 0u, 0u); }

// ------------------------------------------------------------------------------------------ GEMV tiles
// A stage's matrix W is (N, K), row-major, rows = outputs, in format WT. Row groups of R rows; block b owns the
// contiguous groups [RG*b/G, RG*(b+1)/G). A warp takes one (row group, segment) item per wave; a segment is
// 32*U of the format's 16-byte vectors (fp32: float4 columns; bf16 and int8: 2 or 4 times as many weights).
template <int K, int WT = W_F32> struct Geo {
    static constexpr int K4 = K / 4;                                // float4s of the input row
    static constexpr int GP = Fmt<WT>::PER / 4;                     // input float4s per weight vector
    static constexpr int KV = K / Fmt<WT>::PER;                     // weight vectors per row
    static constexpr int SEG = 32 * U;                              // weight vectors per segment
    static constexpr int NSEG = (KV + SEG - 1) / SEG;
    static constexpr int WPRG = NSEG < NWARPS ? NSEG : NWARPS;     // warps per row group
    static constexpr int RGPW = NWARPS / WPRG;                      // row groups per wave
    static constexpr bool FULL = KV % SEG == 0;
};
static_assert(Geo<C, MK_WT>::RGPW * R * NB <= MK_THREADS && Geo<C, MK_WT_HEAD>::RGPW * R * NB <= MK_THREADS,
              "one reduction per thread");

// QKV rows are visited head-major (all of head 0's q, k and v rows, then head 1's, ...), so a block's
// contiguous range finishes a few heads, and attention on a head can start as soon as its rows are done.
template <int EPI>
__device__ __forceinline__ int row_of(int v) {
    if (EPI != EPI_QKV) return v;
    const int h = v / (3 * HD), rem = v - h * 3 * HD, part = rem / HD, d = rem - part * HD;
    return part * C + h * HD + d;
}

template <int N>
__device__ __forceinline__ void tile_range(int& rg0, int& rg1) {
    constexpr int RG = (N + R - 1) / R;
    rg0 = (int)((long long)RG * blockIdx.x / gridDim.x);
    rg1 = (int)((long long)RG * (blockIdx.x + 1) / gridDim.x);
}

template <int K, int N, int EPI, int WT = W_F32, typename V = typename Fmt<WT>::V>
__device__ __forceinline__ void gemv_load(V (&w)[R][U], const void* __restrict__ W, int rg, int seg, bool act) {
    using G = Geo<K, WT>;
    const int lane = threadIdx.x % 32;
    const V* Wv = reinterpret_cast<const V*>(W);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int v = rg * R + r;
        const V* row = Wv + (long long)row_of<EPI>(v < N ? v : N - 1) * G::KV;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = seg * G::SEG + lane + 32 * u;
            w[r][u] = (act && (G::FULL || k < G::KV)) ? ld_weight<EPI != EPI_LOGITS>(row + k) : vzero(V());
        }
    }
}

// Ask L2 for rows [v0, v1) of W (one prefetch per 128-byte line), spread over the block's threads.
// Not inlined: its address arithmetic would otherwise hold registers across the whole kernel (spills).
// K weights of BYTES bytes per row (the row length in bytes: K * BYTES).
template <int K, int N, int EPI, int BYTES = 4>
__device__ __noinline__ void prefetch_rows(const void* W, int v0, int v1) {
    constexpr int LPR = (K * BYTES + 127) / 128;
    v1 = v1 < N ? v1 : N;
    for (int i = threadIdx.x; i < (v1 - v0) * LPR; i += MK_THREADS) {
        const int v = v0 + i / LPR;
        prefetch_l2<EPI != EPI_LOGITS>(reinterpret_cast<const char*>(W) + (long long)row_of<EPI>(v) * K * BYTES
                                       + (i % LPR) * 128);
    }
}

// The first waves of this block's tile of a stage: what v2 prefetches one stage ahead.
template <int K, int N, int EPI, int WT = W_F32>
__device__ __forceinline__ void prefetch_tile(const void* W) {
    int rg0, rg1;
    tile_range<N>(rg0, rg1);
    const int end = min(rg1, rg0 + MK_PF_WAVES * Geo<K, WT>::RGPW);
    prefetch_rows<K, N, EPI, Fmt<WT>::BYTES>(W, rg0 * R, end * R);
}

// The register loads of the block's first wave (v2 issues them before waiting for the stage's inputs).
template <int K, int N, int EPI, int WT = W_F32, typename V = typename Fmt<WT>::V>
__device__ __forceinline__ void gemv_preload(V (&w)[R][U], const void* W) {
    using G = Geo<K, WT>;
    int rg0, rg1;
    tile_range<N>(rg0, rg1);
    const int warp = threadIdx.x / 32, slot = warp / G::WPRG, wi = warp % G::WPRG;
    gemv_load<K, N, EPI, WT>(w, W, rg0 + slot, wi, slot < G::RGPW && rg0 + slot < rg1);
}

struct Epi {
    const float* bias;
    float* out;          // q (QKV), x (RESID), h (GELU: shared, NB x MK_HCAP from row row0), logits (LOGITS)
    float* kc;           // QKV: this layer's caches (NB, NH, L, HD)
    float* vc;
    const int* spos;     // shared: each row's position
    int L;
    unsigned long long* best;   // LOGITS: shared, packed (value, index) per row
    float* acc;          // RESID: the last MLP's sums, folded into x when `fold` (not at layer 0), then zeroed
    int fold;
    int row0;            // GELU: the first row held in `out`
    bool pre_ok;         // RESID: `pre` holds this thread's first-wave x + bias (+ acc), read before the wait
    float pre;
    const float* scale;  // int8 weights: the matrix's row scales (N,), applied to each row's sum; else unused
};

__device__ __forceinline__ unsigned long long pack_best(float v, int n) {
    unsigned bits = __float_as_uint(v);
    bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);        // order-preserving for non-NaN floats
    return ((unsigned long long)bits << 32) | (unsigned)(0xffffffffu - (unsigned)n);   // ties: smaller index
}

template <int EPI, int N>
__device__ __forceinline__ void epilogue(int v, int b, float s, const Epi& e, bool first) {
    const int n = row_of<EPI>(v);
    if (EPI == EPI_QKV) {
        s += e.bias[n];
        const int part = n / C, c = n - part * C, h = c / HD, d = c - h * HD;
        if (part == 0) e.out[b * C + c] = s;
        else (part == 1 ? e.kc : e.vc)[(((long long)b * NH + h) * e.L + e.spos[b]) * HD + d] = s;
    } else if (EPI == EPI_RESID) {
        float* p = e.out + (long long)b * N + n;
        float* a = e.acc + (long long)b * N + n;
        *p = first && e.pre_ok ? s + e.pre : __ldcg(p) + s + e.bias[n] + (e.fold ? __ldcg(a) : 0.0f);
        *a = 0.0f;                              // ready for this layer's MLP (which waits for this stage)
    } else if (EPI == EPI_GELU) {
        e.out[b * MK_HCAP + n - e.row0] = gelu_tanh(s + e.bias[n]);
    } else {
        e.out[(long long)b * N + n] = s;
    }
}

// Row groups [rg0, rg1) of one GEMV stage (the block's tile, or a part of it): xs (shared, NB x K) times
// rows of W (format WT). w holds the first wave's weights on entry when `preloaded`. Every wave: compute
// (each weight vector widened once, used for every batch row), issue the next wave's loads (and, v2, an L2
// prefetch MK_PF_WAVES waves ahead), reduce across warps in shared memory, scale (int8), epilogue.
template <int K, int N, int EPI, int WT = W_F32, typename V = typename Fmt<WT>::V>
__device__ void gemv_tile(V (&w)[R][U], bool preloaded, const void* __restrict__ W, const float* xs,
                          float* part, const Epi& e, int rg0, int rg1) {
    using G = Geo<K, WT>;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int slot = warp / G::WPRG, wi = warp % G::WPRG;
    if (!preloaded) gemv_load<K, N, EPI, WT>(w, W, rg0 + slot, wi, slot < G::RGPW && rg0 + slot < rg1);
    const float4* xs4 = reinterpret_cast<const float4*>(xs);
    // the reduction: thread t sums (slot t / (R NB), row (t / NB) % R, batch row t % NB) over the WPRG warps
    const int red_slot = threadIdx.x / (R * NB), red_r = (threadIdx.x / NB) % R, red_b = threadIdx.x % NB;
    float best_v = __int_as_float(0xff800000);
    int best_n = 0x7fffffff;
    int buf = 0;
    for (int base = rg0; base < rg1; base += G::RGPW, buf ^= 1) {
        const int rg = base + slot;
        const bool act = slot < G::RGPW && rg < rg1;
        float acc[R][NB];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int b = 0; b < NB; ++b) acc[r][b] = 0.0f;
        if (act) {
            for (int seg = wi;;) {
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int k = seg * G::SEG + lane + 32 * u;
                    if (!G::FULL && k >= G::KV) break;
#pragma unroll
                    for (int j = 0; j < G::GP; ++j) {              // fp32: one float4, w itself
                        float4 wf[R];
#pragma unroll
                        for (int r = 0; r < R; ++r) wf[r] = Fmt<WT>::unpack4(w[r][u], j);
#pragma unroll
                        for (int b = 0; b < NB; ++b) {
                            const float4 xv = xs4[b * G::K4 + k * G::GP + j];
#pragma unroll
                            for (int r = 0; r < R; ++r) acc[r][b] += dot4(wf[r], xv);
                        }
                    }
                }
                seg += G::WPRG;
                if (seg >= G::NSEG) break;
                gemv_load<K, N, EPI, WT>(w, W, rg, seg, true);
            }
        }
        const int nrg = rg + G::RGPW;                         // the next wave's first segment: in flight now
        if (slot < G::RGPW && nrg < rg1) gemv_load<K, N, EPI, WT>(w, W, nrg, wi, true);
#if MK_VERSION == 2
        if (base + MK_PF_WAVES * G::RGPW < rg1)
            prefetch_rows<K, N, EPI, Fmt<WT>::BYTES>(W, (base + MK_PF_WAVES * G::RGPW) * R,
                                                     min(rg1, base + (MK_PF_WAVES + 1) * G::RGPW) * R);
#endif
        float* pb = part + buf * NWARPS * R * NB;
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                const float s = warp_sum(acc[r][b]);
                if (lane == 0 && act) pb[(warp * R + r) * NB + b] = s;
            }
        __syncthreads();
        if (red_slot < G::RGPW) {
            const int rgx = base + red_slot, v = rgx * R + red_r;
            if (rgx < rg1 && v < N) {
                float s = 0.0f;
#pragma unroll 4
                for (int j = 0; j < G::WPRG; ++j) s += pb[((red_slot * G::WPRG + j) * R + red_r) * NB + red_b];
                if (WT == W_I8) s *= e.scale[row_of<EPI>(v)];     // the row's scale, once per output
                epilogue<EPI, N>(v, red_b, s, e, base == rg0);
                if (EPI == EPI_LOGITS && (s > best_v || (s == best_v && v < best_n))) { best_v = s; best_n = v; }
            }
        }
    }
    if (EPI == EPI_LOGITS) {
        if (best_n != 0x7fffffff) atomicMax(&e.best[red_b], pack_best(best_v, best_n));
        __syncthreads();
    }
}

// v2: what the projection's epilogue adds to its sum for this thread's first-wave output (x + bias, + acc
// after layer 0), read before the stage waits, so no dependent load is left after the attention arrives.
// Safe to read early: x's rows here are written only by this block's own projections (at layer 0 x is the
// embedding, made here from the inputs), and acc was complete when this block's QKV stage began.
__device__ __forceinline__ float resid_preload(const float* x, const float* acc, const float* __restrict__ bias,
                                               int layer, const float* __restrict__ wte,
                                               const float* __restrict__ wpe, const int* stok, const int* spos) {
    int rg0, rg1;
    tile_range<C>(rg0, rg1);
    const int red_slot = threadIdx.x / (R * NB), red_r = (threadIdx.x / NB) % R, b = threadIdx.x % NB;
    const int v = (rg0 + red_slot) * R + red_r;
    if (red_slot >= Geo<C, MK_WT>::RGPW || rg0 + red_slot >= rg1 || v >= C) return 0.0f;
    const float r = layer == 0 ? __ldg(wte + (long long)stok[b] * C + v) + __ldg(wpe + (long long)spos[b] * C + v)
                               : __ldcg(x + b * C + v) + __ldcg(acc + b * C + v);
    return r + bias[v];
}
