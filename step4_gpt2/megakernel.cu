// megakernel.cu - the limit of fusion: one persistent kernel runs a whole GPT-2 decode step (all layers).
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
//   v1  a grid-wide barrier before every stage (an atomic counter + a bounded spin), 4 per layer: simple,
//       but after each barrier every block starts its loads from scratch: the DRAM idles for the barrier
//       and for one round trip per stage.
//   v2  no barriers. Each stage announces its progress on counters in global memory, and a consumer waits
//       only for what it reads: attention on head h waits for head h's q/k/v rows only. Release: a block
//       (or warp) barrier, then one thread's red.release; acquire: one thread's ld.acquire, then a barrier.
//       No full fence (__threadfence) on either side: each hop between blocks would wait for one (only the
//       LM head's last block and the attention's last unit per head keep a fenced atomic). Before
//       waiting, a block issues the register loads of its first weight tile and asks L2 to prefetch the
//       next stage's weights (prefetch.global.L2), so the DRAM keeps streaming weights while blocks wait,
//       normalise or do attention.
//
// Both versions can run several greedy decode steps in one launch (nsteps): the chosen token feeds the next
// step on the device. Nothing here can hang: every wait is bounded by %globaltimer (timeout_ns); on a
// timeout a block records (code 1, block, stage, layer, step) in err[] and every block leaves at its next
// wait; the host turns err[] into an exception (code 2: launched with less dynamic shared memory than the
// layout needs). All blocks must be resident at once (the host sizes the
// grid with the occupancy API and refuses a launch that cannot fit). stall_block >= 0 makes that block never
// signal (the test of the timeout path). With -DMK_TIMELINE=1 thread 0 of each block stamps %globaltimer at
// the start of each stage, when its inputs are ready, and at its end (the measurement; the normal build
// compiles the stamps out).
//
// Compile-time constants (defaults: GPT-2 124M, batch 1): NB (batch rows), C, NH, NL, VOCAB, MK_THREADS,
// MK_ROWS, MK_UNROLL, MK_VERSION (1|2), MK_PF_WAVES (waves of weight rows prefetched ahead, v2),
// ATT_MAXCL (most positions per attention unit), MK_ATT_PF_MAX (bytes of KV cache v2 prefetches),
// MK_MERGE_MAX (most NB x chunks the projection merges itself), MK_HCAP (most h rows a block keeps in shared
// memory at once), MK_EPS (LayerNorm epsilon), MK_TIMELINE, MK_KEEP_WEIGHTS (a measurement, sm_80+: L2 is asked
// to keep the layers' weights (evict-last), so it keeps what fits of them; with every layer = layer 0 that is
// all of them, and the step is what is left when the layer weights cost no DRAM traffic; l2_evict_normal
// undoes it).
#include "course.cuh"

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
#define MK_VERSION 2
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
#ifndef MK_TIMELINE
#define MK_TIMELINE 0
#endif
#ifndef MK_KEEP_WEIGHTS
#define MK_KEEP_WEIGHTS 0
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
#if MK_KEEP_WEIGHTS && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "MK_KEEP_WEIGHTS needs sm_80 or newer (L2 eviction-priority hints)"
#endif
static_assert(ATT_MAXCL % 32 == 0, "ATT_MAXCL must be a multiple of 32");
static_assert(MK_MERGE_MAX >= 1, "MK_MERGE_MAX: at least 1");
static_assert(MK_HCAP % R == 0 && MK_HCAP % 4 == 0, "MK_HCAP: a multiple of MK_ROWS and of 4 (float4 after it)");

// One layer's pointers in the table the host passes (NL x LW_COUNT, as 64-bit integers).
enum { LW_LN1W, LW_LN1B, LW_ATTNW, LW_ATTNB, LW_PROJW, LW_PROJB, LW_LN2W, LW_LN2B, LW_FCW, LW_FCB,
       LW_MPROJWT, LW_MPROJB, LW_KCACHE, LW_VCACHE, LW_COUNT };
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
// KEEP (with MK_KEEP_WEIGHTS, a layer's weights): ask L2 to keep the line (evict-last).
template <bool KEEP = false>
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if MK_KEEP_WEIGHTS
    if (KEEP) {
        asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(p));
        return;
    }
#endif
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
}

// Where a stage is: for the error record and the timeline.
struct Where { int stage, layer, step; };

struct Ctl {
    unsigned* sync;
    int* err;
    long long timeout_ns;
    int stall_block;
    unsigned long long* timeline;   // (grid, nsteps * STAGES_PER_STEP, 3) with MK_TIMELINE
    int stamps_per_block;
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
// Release: everything this block wrote before is visible to whoever sees the counter move.
__device__ __forceinline__ void block_signal(unsigned* ctr, unsigned add, const Ctl& ctl) {
    __syncthreads();
    if (threadIdx.x == 0 && (int)blockIdx.x != ctl.stall_block && add) red_release(ctr, add);
}

// v1: every block arrives, then waits for all gridDim.x arrivals; bar is the counter's value before it.
__device__ __forceinline__ bool grid_barrier(unsigned* ctr, unsigned& bar, const Ctl& ctl, Where w) {
    block_signal(ctr, 1, ctl);
    const bool ok = block_wait(ctr, bar + gridDim.x, ctl, w);
    bar += gridDim.x;
    return ok;
}

__device__ __forceinline__ void stamp(const Ctl& ctl, int idx, int which) {
#if MK_TIMELINE
    if (threadIdx.x == 0) ctl.timeline[((long long)blockIdx.x * ctl.stamps_per_block + idx) * 3 + which] = globaltimer();
#endif
}

// ------------------------------------------------------------------------------------------ weight loads
// Every weight is read once per step: streamed, evict-first in L2 (ld.global.cs). With MK_KEEP_WEIGHTS the
// layers' weights (KEEP) are asked for evict-last by the L2 prefetches (prefetch_l2) and loaded with the normal
// priority (ld.global.cg); the LM head always streams. (An evict-last policy on the loads themselves costs
// registers that the batch-1 build does not have.)
template <bool KEEP>
__device__ __forceinline__ float4 ld_weight(const float4* p) {
    return MK_KEEP_WEIGHTS && KEEP ? __ldcg(p) : __ldcs(p);
}

// Back to evict-normal: the lines of n floats at p that MK_KEEP_WEIGHTS kept (one thread per 128-byte line).
extern "C" __global__ void l2_evict_normal(const float* p, long long n) {
    const long long lines = (n * 4 + 127) / 128;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < lines; i += (long long)gridDim.x * blockDim.x) {
#if __CUDA_ARCH__ >= 800
        asm volatile("applypriority.global.L2::evict_normal [%0], 128;" :: "l"(p + i * 32) : "memory");
#endif
    }
}

// ------------------------------------------------------------------------------------------ GEMV tiles
// A stage's matrix W is (N, K), row-major, rows = outputs. Row groups of R rows; block b owns the
// contiguous groups [RG*b/G, RG*(b+1)/G). A warp takes one (row group, segment) item per wave.
template <int K> struct Geo {
    static constexpr int K4 = K / 4;
    static constexpr int SEG = 32 * U;                              // float4 columns per segment
    static constexpr int NSEG = (K4 + SEG - 1) / SEG;
    static constexpr int WPRG = NSEG < NWARPS ? NSEG : NWARPS;     // warps per row group
    static constexpr int RGPW = NWARPS / WPRG;                      // row groups per wave
    static constexpr bool FULL = K4 % SEG == 0;
};
static_assert(Geo<C>::RGPW * R * NB <= MK_THREADS, "one reduction per thread");

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

template <int K, int N, int EPI>
__device__ __forceinline__ void gemv_load(float4 (&w)[R][U], const float* __restrict__ W, int rg, int seg, bool act) {
    using G = Geo<K>;
    const int lane = threadIdx.x % 32;
    const float4* W4 = reinterpret_cast<const float4*>(W);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int v = rg * R + r;
        const float4* row = W4 + (long long)row_of<EPI>(v < N ? v : N - 1) * G::K4;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = seg * G::SEG + lane + 32 * u;
            w[r][u] = (act && (G::FULL || k < G::K4)) ? ld_weight<EPI != EPI_LOGITS>(row + k) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
}

// Ask L2 for rows [v0, v1) of W (one prefetch per 128-byte line), spread over the block's threads.
// Not inlined: its address arithmetic would otherwise hold registers across the whole kernel (spills).
template <int K, int N, int EPI>
__device__ __noinline__ void prefetch_rows(const float* W, int v0, int v1) {
    constexpr int LPR = (K * 4 + 127) / 128;
    v1 = v1 < N ? v1 : N;
    for (int i = threadIdx.x; i < (v1 - v0) * LPR; i += MK_THREADS) {
        const int v = v0 + i / LPR;
        prefetch_l2<EPI != EPI_LOGITS>(W + (long long)row_of<EPI>(v) * K + (i % LPR) * 32);
    }
}

// The first waves of this block's tile of a stage: what v2 prefetches one stage ahead.
template <int K, int N, int EPI>
__device__ __forceinline__ void prefetch_tile(const float* W) {
    int rg0, rg1;
    tile_range<N>(rg0, rg1);
    const int end = min(rg1, rg0 + MK_PF_WAVES * Geo<K>::RGPW);
    prefetch_rows<K, N, EPI>(W, rg0 * R, end * R);
}

// The register loads of the block's first wave (v2 issues them before waiting for the stage's inputs).
template <int K, int N, int EPI>
__device__ __forceinline__ void gemv_preload(float4 (&w)[R][U], const float* W) {
    using G = Geo<K>;
    int rg0, rg1;
    tile_range<N>(rg0, rg1);
    const int warp = threadIdx.x / 32, slot = warp / G::WPRG, wi = warp % G::WPRG;
    gemv_load<K, N, EPI>(w, W, rg0 + slot, wi, slot < G::RGPW && rg0 + slot < rg1);
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
// rows of W. w holds the first wave's weights on entry when `preloaded`. Every wave: compute, issue the next
// wave's loads (and, v2, an L2 prefetch MK_PF_WAVES waves ahead), reduce across warps in shared memory,
// epilogue.
template <int K, int N, int EPI>
__device__ void gemv_tile(float4 (&w)[R][U], bool preloaded, const float* __restrict__ W, const float* xs,
                          float* part, const Epi& e, int rg0, int rg1) {
    using G = Geo<K>;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int slot = warp / G::WPRG, wi = warp % G::WPRG;
    if (!preloaded) gemv_load<K, N, EPI>(w, W, rg0 + slot, wi, slot < G::RGPW && rg0 + slot < rg1);
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
                    if (!G::FULL && k >= G::K4) break;
#pragma unroll
                    for (int b = 0; b < NB; ++b) {
                        const float4 xv = xs4[b * G::K4 + k];
#pragma unroll
                        for (int r = 0; r < R; ++r) acc[r][b] += dot4(w[r][u], xv);
                    }
                }
                seg += G::WPRG;
                if (seg >= G::NSEG) break;
                gemv_load<K, N, EPI>(w, W, rg, seg, true);
            }
        }
        const int nrg = rg + G::RGPW;                         // the next wave's first segment: in flight now
        if (slot < G::RGPW && nrg < rg1) gemv_load<K, N, EPI>(w, W, nrg, wi, true);
#if MK_VERSION == 2
        if (base + MK_PF_WAVES * G::RGPW < rg1)
            prefetch_rows<K, N, EPI>(W, (base + MK_PF_WAVES * G::RGPW) * R,
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
    if (red_slot >= Geo<C>::RGPW || rg0 + red_slot >= rg1 || v >= C) return 0.0f;
    const float r = layer == 0 ? __ldg(wte + (long long)stok[b] * C + v) + __ldg(wpe + (long long)spos[b] * C + v)
                               : __ldcg(x + b * C + v) + __ldcg(acc + b * C + v);
    return r + bias[v];
}

// ------------------------------------------------------------------------------------------ prologues
// Inlined, ln_rows and mlp_down leave the kernel a few registers past its 168 on sm_70/75 (NVRTC 12.9), so
// there they are calls. Elsewhere they stay inline: a call must wait for every load in flight, and the
// LayerNorm runs while the first wave's weight loads are in flight (on the H100 a call costs about 10%).
// For the same register budget, v2's early read of the projection's residual (resid_preload) is sm_80+ only.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define MK_OUTLINE __noinline__
#define MK_PRE_RESID 0
#else
#define MK_OUTLINE
#define MK_PRE_RESID (MK_VERSION == 2)      // resid_preload: one more register across the wait
#endif
// xs (NB x C) = LayerNorm(x (+ add, when not null)) rows, a warp per row (the row stays in registers: one
// round trip). With `embed`, x is first made from the token and position embeddings, and block 0 stores it
// as the residual.
__device__ MK_OUTLINE void ln_rows(const float* x, const float* add, const float* __restrict__ g,
                        const float* __restrict__ bt, float* xs, bool embed, const float* __restrict__ wte,
                        const float* __restrict__ wpe, const int* stok, const int* spos, float* xout) {
    constexpr int C4 = C / 4, PER = (C4 + 31) / 32;            // float4 per lane: all loads issued at once
    const int lane = threadIdx.x % 32, b = threadIdx.x / 32;
    if (b < NB) {
        float4* sr = reinterpret_cast<float4*>(xs) + b * C4;
        const float4* x4 = reinterpret_cast<const float4*>(x) + b * C4;
        const float4* g4 = reinterpret_cast<const float4*>(g);
        const float4* b4 = reinterpret_cast<const float4*>(bt);
        float4 v[PER];
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int k = lane + 32 * i;
            if (k < C4) {
                if (embed) {
                    const float4 a = __ldg(reinterpret_cast<const float4*>(wte) + (long long)stok[b] * C4 + k);
                    const float4 p = __ldg(reinterpret_cast<const float4*>(wpe) + (long long)spos[b] * C4 + k);
                    v[i] = make_float4(a.x + p.x, a.y + p.y, a.z + p.z, a.w + p.w);
                } else {
                    v[i] = __ldcg(x4 + k);
                    if (add) {
                        const float4 a = __ldcg(reinterpret_cast<const float4*>(add) + b * C4 + k);
                        v[i] = make_float4(v[i].x + a.x, v[i].y + a.y, v[i].z + a.z, v[i].w + a.w);
                    }
                }
            }
        }
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int k = lane + 32 * i;
            if (k < C4) {
                if (embed && blockIdx.x == 0) reinterpret_cast<float4*>(xout)[b * C4 + k] = v[i];
                sum += (v[i].x + v[i].y) + (v[i].z + v[i].w);
            }
        }
        const float mean = warp_sum(sum) / C;
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            if (lane + 32 * i < C4) {
                const float a = v[i].x - mean, c = v[i].y - mean, d = v[i].z - mean, f = v[i].w - mean;
                ss += (a * a + c * c) + (d * d + f * f);
            }
        }
        const float rstd = rsqrtf(warp_sum(ss) / C + MK_EPS);
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int k = lane + 32 * i;
            if (k < C4) {
                const float4 gg = __ldg(g4 + k), bb = __ldg(b4 + k);
                sr[k] = make_float4((v[i].x - mean) * rstd * gg.x + bb.x, (v[i].y - mean) * rstd * gg.y + bb.y,
                                    (v[i].z - mean) * rstd * gg.z + bb.z, (v[i].w - mean) * rstd * gg.w + bb.w);
            }
        }
    }
    __syncthreads();
}

// xs = src (NB x K), written by other blocks in this launch: read through L2 (ld.cg), never ld.global.nc.
__device__ void copy_rows(const float* src, float* xs, int n4) {
    const float4* s4 = reinterpret_cast<const float4*>(src);
    float4* d4 = reinterpret_cast<float4*>(xs);
    for (int i = threadIdx.x; i < n4; i += MK_THREADS) d4[i] = __ldcg(s4 + i);
    __syncthreads();
}

// ------------------------------------------------------------------------------------------ MLP down projection
#define MLP_KG (C / 4 > MK_THREADS ? 1 : MK_THREADS / (C / 4))     // groups of threads that split its rows
__device__ __forceinline__ void red_add4(float* p, float4 v) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
                 : "memory");
#else
    atomicAdd(p, v.x); atomicAdd(p + 1, v.y); atomicAdd(p + 2, v.z); atomicAdd(p + 3, v.w);
#endif
}

// s[b] += sum over rows r0 + g, r0 + g + KG, ... < r1 of h[b][r] Wt[r][float4 column c], DU rows' loads in
// flight at once.
template <int KG>
__device__ __forceinline__ void mlp_column(float4 (&s)[NB], const float* hs, const float4* __restrict__ W4, int c,
                                           int g, int r0, int r1) {
    constexpr int C4 = C / 4, DU = NB > 4 ? 8 : 16;
    for (int r = r0 + g; r < r1; r += KG * DU) {
        float4 wv[DU];
#pragma unroll
        for (int i = 0; i < DU; ++i) {
            const int rr = r + i * KG;
            wv[i] = rr < r1 ? ld_weight<true>(W4 + (long long)rr * C4 + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int i = 0; i < DU; ++i) {
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                const float hv = hs[b * MK_HCAP + min(r + i * KG, r1 - 1) - r0];     // wv is 0 past r1
                s[b].x += hv * wv[i].x; s[b].y += hv * wv[i].y; s[b].z += hv * wv[i].z; s[b].w += hv * wv[i].w;
            }
        }
    }
}

// acc (NB x C) += h rows [r0, r1) (shared: hs[b * MK_HCAP + r - r0]) times the same rows of Wt (4C x C, mlp
// c_proj transposed): the block's share of the down projection, split over its inputs. KG groups of threads
// take every KG-th row, a thread per float4 column (WIDE: a thread takes columns in turns); with KG > 1 their
// sums meet in shared memory (dn, KG x NB x C). One atomic per float4 adds a column's sum to acc
// (red.global.add.v4.f32 on sm_90, four scalar ones before). `bias`: added once (the caller passes it in one
// block only).
__device__ MK_OUTLINE void mlp_down(const float* hs, const float* __restrict__ Wt, const float* __restrict__ bias,
                                    int r0, int r1, float* dn, float* acc) {
    constexpr int C4 = C / 4;
    constexpr bool WIDE = C4 > MK_THREADS;
    constexpr int KG = WIDE ? 1 : MK_THREADS / C4;
    const float4* W4 = reinterpret_cast<const float4*>(Wt);
    const float4* bias4 = reinterpret_cast<const float4*>(bias);
    const int g = WIDE ? 0 : threadIdx.x / C4;
    float4* dn4 = reinterpret_cast<float4*>(dn);
    for (int c = WIDE ? threadIdx.x : threadIdx.x % C4; c < C4 && g < KG; c += WIDE ? MK_THREADS : C4) {
        float4 s[NB];
#pragma unroll
        for (int b = 0; b < NB; ++b) s[b] = bias && g == 0 ? __ldg(bias4 + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        mlp_column<KG>(s, hs, W4, c, g, r0, r1);
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            if (KG == 1) red_add4(acc + b * C + 4 * c, s[b]);
            else dn4[(g * NB + b) * C4 + c] = s[b];               // not held across the barrier below
        }
    }
    if (KG > 1) {                                                 // the KG groups' sums, one atomic per float4
        __syncthreads();
        for (int i = threadIdx.x; i < NB * C4; i += MK_THREADS) {
            float4 t = dn4[i];
            for (int j = 1; j < KG; ++j) {
                const float4 u = dn4[j * NB * C4 + i];
                t.x += u.x; t.y += u.y; t.z += u.z; t.w += u.w;
            }
            red_add4(acc + 4 * i, t);
        }
    }
    __syncthreads();
}

// ------------------------------------------------------------------------------------------ attention
// Unit u = (head h, row b, chunk c): positions [c*CL, min(len, (c+1)*CL)) of sequence b, head h, one warp.
// Scores: a lane per position (a whole key row per lane, q broadcast from shared memory); softmax over the
// chunk; output: lanes split the head dimension and walk the positions. The partial (max, sum, o[HD]) goes
// to global memory; the warp whose arrival completes (b, h) merges the chunks into att.
// Units are dealt round-robin over the blocks: warp j of block k takes units k + j*grid, k + (j + NWARPS)*grid,
// ... so a few dozen units land on as many SMs, one each, instead of filling the warps of two or three blocks
// whose load paths would then carry every cache row (and whose own next tiles would start last).
__device__ __forceinline__ int att_unit(int j) { return blockIdx.x + j * gridDim.x; }

__device__ __forceinline__ int att_chunk_len(const int* slens, int nch) {
    int mx = 1;
#pragma unroll
    for (int b = 0; b < NB; ++b) mx = max(mx, slens[b]);
    return ((mx + nch - 1) / nch + 31) / 32 * 32;
}

// Few chunks (NB x nch <= MK_MERGE_MAX): every unit just publishes its partial, and each block of the
// projection merges the partials as it reads att, two round trips (the merging warp's loads, its att writes)
// fewer on the way to the projection. With more chunks every block would read all of them: the last unit of a
// (sequence, head) merges instead.
__device__ __forceinline__ bool proj_merges(int nch) { return NB * nch <= MK_MERGE_MAX; }

// The weight of a chunk whose scores peak at m in a row whose overall peak is M: exp(m - M), and 0 for an
// empty chunk (m = -inf), whose sum and output are 0 anyway.
__device__ __forceinline__ float chunk_weight(float m, float M) {
    return m == __int_as_float(0xff800000) ? 0.0f : expf(m - M);
}

// xs (NB x C) = att merged from the partials (max, sum, o) of each (sequence, head)'s nch chunks.
__device__ void merge_rows(const float* partial, float* xs, int nch) {
    for (int i = threadIdx.x; i < NB * C; i += MK_THREADS) {
        const int b = i / C, c = i - b * C, h = c / HD, d = c - h * HD;
        const float* P0 = partial + (long long)(b * NH + h) * nch * (HD + 2);
        float mc[MK_MERGE_MAX], lc[MK_MERGE_MAX], oc[MK_MERGE_MAX];
        float M = __int_as_float(0xff800000);
#pragma unroll
        for (int k = 0; k < MK_MERGE_MAX; ++k) {                // every load in flight at once
            if (k < nch) {
                mc[k] = __ldcg(P0 + k * (HD + 2));
                lc[k] = __ldcg(P0 + k * (HD + 2) + 1);
                oc[k] = __ldcg(P0 + k * (HD + 2) + 2 + d);
                M = fmaxf(M, mc[k]);
            }
        }
        float Ls = 0.0f, acc = 0.0f;
#pragma unroll
        for (int k = 0; k < MK_MERGE_MAX; ++k) {
            if (k < nch) {
                const float wgt = chunk_weight(mc[k], M);
                Ls += wgt * lc[k];
                acc += wgt * oc[k];
            }
        }
        xs[i] = acc / Ls;
    }
    __syncthreads();
}

__device__ void attention_unit(int u, int nch, int CL, const float* q, const float* kc, const float* vc,
                               float* partial, float* att, unsigned* attc, unsigned gl, const int* slens,
                               int L, float* sq, float* sp, const Ctl& ctl) {
    constexpr int HD4 = HD / 4, OPL = HD / 32;                 // head-dim values per lane in the output
    const int lane = threadIdx.x % 32;
    const int h = u / (NB * nch), b = (u / nch) % NB, c = u % nch;
    const int len = slens[b], t0 = c * CL, t1 = min(len, t0 + CL);
    const float scale = rsqrtf((float)HD);
    const float4* K4 = reinterpret_cast<const float4*>(kc + ((long long)b * NH + h) * L * HD);
    const float* Vh = vc + ((long long)b * NH + h) * L * HD;
    const float4* q4 = reinterpret_cast<const float4*>(sq);
    // The unit is a chain of dependent L2 round trips (a few hundred ns each), and the next stage waits for
    // its end: so every load that does not depend on another is issued at once. q and this lane's whole
    // key row go out together; then the next row is in flight while this one is scored.
    float qv[OPL];
#pragma unroll
    for (int j = 0; j < OPL; ++j) qv[j] = __ldcg(q + b * C + h * HD + lane + 32 * j);
    float4 kr[HD4];
    int t = t0 + lane;
#pragma unroll
    for (int d4 = 0; d4 < HD4; ++d4) kr[d4] = t < t1 ? __ldcg(K4 + (long long)t * HD4 + d4) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int j = 0; j < OPL; ++j) sq[lane + 32 * j] = qv[j] * scale;
    __syncwarp();
    float m = __int_as_float(0xff800000);
    for (; t < t1; t += 32) {
        float s = 0.0f;
#pragma unroll
        for (int d4 = 0; d4 < HD4; ++d4) s += dot4(kr[d4], q4[d4]);
        if (t + 32 < t1) {
#pragma unroll
            for (int d4 = 0; d4 < HD4; ++d4) kr[d4] = __ldcg(K4 + (long long)(t + 32) * HD4 + d4);
        }
        sp[t - t0] = s;
        m = fmaxf(m, s);
    }
    m = warp_max(m);
    float l = 0.0f;
    for (int i = lane; i < t1 - t0; i += 32) {
        const float p = expf(sp[i] - m);
        sp[i] = p;
        l += p;
    }
    l = warp_sum(l);
    __syncwarp();
    float o[OPL];
#pragma unroll
    for (int j = 0; j < OPL; ++j) o[j] = 0.0f;
    constexpr int VB = 16;                                      // value rows in flight per lane
    int i = 0;
    for (; i + VB <= t1 - t0; i += VB) {
        float vv[VB][OPL];
#pragma unroll
        for (int a = 0; a < VB; ++a)
#pragma unroll
            for (int j = 0; j < OPL; ++j) vv[a][j] = __ldcg(Vh + (long long)(t0 + i + a) * HD + lane + 32 * j);
#pragma unroll
        for (int a = 0; a < VB; ++a)
#pragma unroll
            for (int j = 0; j < OPL; ++j) o[j] += sp[i + a] * vv[a][j];
    }
    if (i < t1 - t0) {                                          // the tail, also all at once (zeros past it)
        float vv[VB][OPL];
#pragma unroll
        for (int a = 0; a < VB; ++a)
#pragma unroll
            for (int j = 0; j < OPL; ++j) vv[a][j] = i + a < t1 - t0 ? __ldcg(Vh + (long long)(t0 + i + a) * HD + lane + 32 * j) : 0.0f;
#pragma unroll
        for (int a = 0; a < VB; ++a)
            if (i + a < t1 - t0) {
#pragma unroll
                for (int j = 0; j < OPL; ++j) o[j] += sp[i + a] * vv[a][j];
            }
    }
    float* P = partial + ((long long)(b * NH + h) * nch + c) * (HD + 2);
    if (lane == 0) { P[0] = m; P[1] = l; }                      // an empty chunk: m = -inf, l = 0, o = 0
#pragma unroll
    for (int j = 0; j < OPL; ++j) P[2 + lane + 32 * j] = o[j];
    __syncwarp();
    if (proj_merges(nch)) {                                     // the projection merges the chunks as it reads them
#if MK_VERSION == 2
        if (lane == 0 && (int)blockIdx.x != ctl.stall_block) red_release(ctl.sync + S_ATT_DONE, 1u);
#endif
        return;
    }
    unsigned last = 0;
    if (lane == 0) {
        __threadfence();
        const unsigned target = (gl + 1) * (unsigned)nch;
        last = atomicAdd(&attc[b * NH + h], 1u) == target - 1;
        if (last) __threadfence();
    }
    last = __shfl_sync(FULL_MASK, last, 0);
    __syncwarp();                                               // lane 0's fenced arrival, passed on to the warp
    if (!last) return;
    // merge the nch chunks of (b, h): softmax-weighted by exp(m_c - M)
    const float* P0 = partial + (long long)(b * NH + h) * nch * (HD + 2);
    float M = __int_as_float(0xff800000);
    for (int cc = lane; cc < nch; cc += 32) M = fmaxf(M, __ldcg(P0 + cc * (HD + 2)));
    M = warp_max(M);
    float Ls = 0.0f, acc[OPL];
#pragma unroll
    for (int j = 0; j < OPL; ++j) acc[j] = 0.0f;
#pragma unroll 4                                           // four chunks' loads in flight
    for (int cc = 0; cc < nch; ++cc) {
        const float* Pc = P0 + cc * (HD + 2);
        const float mc = __ldcg(Pc);
        const float wgt = chunk_weight(mc, M);
        Ls += wgt * __ldcg(Pc + 1);
#pragma unroll
        for (int j = 0; j < OPL; ++j) acc[j] += wgt * __ldcg(Pc + 2 + lane + 32 * j);
    }
#pragma unroll
    for (int j = 0; j < OPL; ++j) att[b * C + h * HD + lane + 32 * j] = acc[j] / Ls;
#if MK_VERSION == 2
    __syncwarp();
    if (lane == 0 && (int)blockIdx.x != ctl.stall_block) red_release(ctl.sync + S_ATT_DONE, 1u);
#endif
}

#if MK_VERSION == 2
// v2: L2-prefetch the cache rows this block's attention units will read (they do not depend on this step).
__device__ __noinline__ void prefetch_attention(const float* kc, const float* vc, int nch, int CL, const int* slens, int L) {
    const int total = NB * NH * nch;
    int mx = 0;
#pragma unroll
    for (int b = 0; b < NB; ++b) mx = max(mx, slens[b]);
    if ((long long)NB * NH * mx * HD * 8 > MK_ATT_PF_MAX) return;   // more than L2 should hold: stream it instead
    constexpr int LPR = HD * 4 / 128 > 0 ? HD * 4 / 128 : 1;
    for (int u = 0; u < total; u += gridDim.x * NWARPS) {
        for (int j = 0; j < NWARPS; ++j) {
            const int uu = u + att_unit(j);
            if (uu >= total) break;
            const int h = uu / (NB * nch), b = (uu / nch) % NB, c = uu % nch;
            const int t0 = c * CL, t1 = min(slens[b] - 1, t0 + CL);       // the newest row is written this step
            const long long off = ((long long)b * NH + h) * L * HD;
            for (int i = threadIdx.x; i < (t1 - t0) * LPR * 2; i += MK_THREADS) {
                const int row = t0 + i / (2 * LPR), part = (i / LPR) & 1, line = i % LPR;
                prefetch_l2((part ? vc : kc) + off + (long long)row * HD + line * 32);
            }
        }
    }
}
#endif

// ------------------------------------------------------------------------------------------ the kernel
struct Work {              // float workspace (the host allocates it as one buffer)
    float *x, *q, *att, *acc, *partial;
};


extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
megakernel_decode(const unsigned long long* __restrict__ lw, const float* __restrict__ wte,
                  const float* __restrict__ wpe, const float* __restrict__ lnf_w, const float* __restrict__ lnf_b,
                  int* tokens, int* pos, int* lens, float* ws, unsigned* sync, unsigned long long* amax,
                  float* logits, int* out_tokens, int L, int nch, int nsteps, unsigned epoch, unsigned bar_base,
                  long long timeout_ns, int stall_block, int* err, unsigned long long* timeline) {
    extern __shared__ float4 smem4[];
    float* xs = reinterpret_cast<float*>(smem4);                            // NB x C
    float* dn = xs + NB * C;                                                // MLP_KG x NB x C
    float* hs = dn + MLP_KG * NB * C;                                       // NB x MK_HCAP
    float* part = hs + NB * MK_HCAP;                                        // 2 x NWARPS x R x NB
    float* sq = part + 2 * NWARPS * R * NB;                                 // NWARPS x HD
    float* sp = sq + NWARPS * HD;                                           // NWARPS x ATT_MAXCL
    __shared__ int stok[NB], spos[NB], slens[NB];
    __shared__ unsigned long long sbest[NB];
    __shared__ int s_abort;

    const Ctl ctl{sync, err, timeout_ns, stall_block, timeline, nsteps * STAGES_PER_STEP};
    Work wk;
    wk.x = ws;
    wk.q = wk.x + NB * C;
    wk.att = wk.q + NB * C;
    wk.acc = wk.att + NB * C;
    wk.partial = wk.acc + NB * C;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned G = gridDim.x;
    {   // the layout above against what the host gave (megakernel.py's smem_bytes): an error, not a stray write
        constexpr unsigned need = 4u * (NB * C * (1 + MLP_KG) + NB * MK_HCAP + 2 * NWARPS * R * NB + NWARPS * HD
                                        + NWARPS * ATT_MAXCL);
        unsigned have;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
        if (have < need) {
            if (threadIdx.x == 0 && atomicCAS(err, 0, 2) == 0) { err[5] = (int)have; err[6] = (int)need; }
            return;
        }
    }
#if MK_VERSION == 1
    unsigned bar = bar_base;                 // v1: barriers passed so far on this sync buffer
#else
    (void)bar_base;
#endif
    float4 w[R][U];
    if (threadIdx.x == 0) s_abort = 0;

    for (int step = 0; step < nsteps; ++step) {
        const unsigned gs = epoch + step;
        // ---- the step's inputs: tokens, positions, lengths (written by the last step's finisher)
#if MK_VERSION == 2
        if (step > 0 && !block_wait(sync + S_TOK_DONE, gs, ctl, Where{ST_QKV, 0, step})) return;
#endif
        for (int layer = 0; layer < NL; ++layer) {
            const unsigned long long* P = lw + layer * LW_COUNT;
            const float* Wattn = (const float*)P[LW_ATTNW];
            const float* Wproj = (const float*)P[LW_PROJW];
            const float* Wfc = (const float*)P[LW_FCW];
            const float* WmprojT = (const float*)P[LW_MPROJWT];
            float* kc = (float*)P[LW_KCACHE];
            float* vc = (float*)P[LW_VCACHE];
            const unsigned gl = gs * NL + layer;
            int sidx = step * STAGES_PER_STEP + layer * STAGES_PER_LAYER;

            // ================= QKV: x -> LayerNorm -> q, k/v appended
            stamp(ctl, sidx, 0);
#if MK_VERSION == 1
            if (step > 0 || layer > 0) {
                if (!grid_barrier(sync + S_BAR, bar, ctl, Where{ST_QKV, layer, step})) return;
            }
#else
            prefetch_tile<C, C, EPI_RESID>(Wproj);     // two stages ahead: attention reads no weights
            gemv_preload<C, 3 * C, EPI_QKV>(w, Wattn);
            if (layer > 0 && !block_wait(sync + S_X2_DONE, gl * G, ctl, Where{ST_QKV, layer, step})) return;
#endif
            stamp(ctl, sidx, 1);
            if (threadIdx.x < NB) {
                stok[threadIdx.x] = __ldcg(tokens + threadIdx.x);
                spos[threadIdx.x] = __ldcg(pos + threadIdx.x);
                slens[threadIdx.x] = __ldcg(lens + threadIdx.x);
            }
            __syncthreads();
            ln_rows(wk.x, layer > 0 ? wk.acc : nullptr, (const float*)P[LW_LN1W], (const float*)P[LW_LN1B], xs,
                    layer == 0, wte, wpe, stok, spos, wk.x);
            {
                const Epi e{(const float*)P[LW_ATTNB], wk.q, kc, vc, spos, L, nullptr, nullptr, 0, 0, false, 0.0f};
                int rg0, rg1;
                tile_range<3 * C>(rg0, rg1);
                gemv_tile<C, 3 * C, EPI_QKV>(w, MK_VERSION == 2, Wattn, xs, part, e, rg0, rg1);
            }
#if MK_VERSION == 2
            {   // announce the finished rows of each head
                int rg0, rg1;
                tile_range<3 * C>(rg0, rg1);
                const int v0 = rg0 * R, v1 = min(rg1 * R, 3 * C);
                __syncthreads();
                if (threadIdx.x == 0 && (int)blockIdx.x != stall_block && v1 > v0) {
                    for (int hh = v0 / (3 * HD); hh <= (v1 - 1) / (3 * HD); ++hh) {
                        const int a = max(v0, hh * 3 * HD), z = min(v1, (hh + 1) * 3 * HD);
                        red_release(sync + S_HEAD0 + hh, (unsigned)(z - a));
                    }
                }
            }
#endif
            stamp(ctl, sidx, 2);

            // ================= ATT
            ++sidx;
            stamp(ctl, sidx, 0);
            const int CL = att_chunk_len(slens, nch);
#if MK_VERSION == 1
            if (!grid_barrier(sync + S_BAR, bar, ctl, Where{ST_ATT, layer, step})) return;
            stamp(ctl, sidx, 1);
#else
            prefetch_attention(kc, vc, nch, CL, slens, L);
            bool stamped = false;
#endif
            for (int u = att_unit(warp); u < NB * NH * nch; u += G * NWARPS) {
#if MK_VERSION == 2
                const int hh = u / (NB * nch);
                int ok = 1;
                if (lane == 0) ok = wait_geq(sync + S_HEAD0 + hh, (gl + 1) * 3 * HD, ctl, Where{ST_ATT, layer, step});
                ok = __shfl_sync(FULL_MASK, ok, 0);
                __syncwarp();                           // lane 0's acquire, passed on to the warp
                if (!ok) { s_abort = 1; break; }
                if (!stamped) { stamp(ctl, sidx, 1); stamped = true; }
#endif
                attention_unit(u, nch, CL, wk.q, kc, vc, wk.partial, wk.att, sync + S_ATTC0, gl, slens, L,
                               sq + warp * HD, sp + warp * ATT_MAXCL, ctl);
            }
            __syncthreads();
            if (s_abort) return;
#if MK_VERSION == 2
            prefetch_tile<C, 4 * C, EPI_GELU>(Wfc);        // two stages ahead, once this block's units are done
#endif
            stamp(ctl, sidx, 2);

            // ================= PROJ: x += att W^T + b (+ the last layer's MLP sums, acc, which it zeroes)
            ++sidx;
            stamp(ctl, sidx, 0);
            float pre = 0.0f;
#if MK_VERSION == 1
            if (!grid_barrier(sync + S_BAR, bar, ctl, Where{ST_PROJ, layer, step})) return;
#else
            {   // the MLP's down-projection rows of this block (all of them: it loads them at once)
                int rg0, rg1;
                tile_range<4 * C>(rg0, rg1);
                prefetch_rows<C, 4 * C, EPI_GELU>(WmprojT, rg0 * R, rg1 * R);
            }
            gemv_preload<C, C, EPI_RESID>(w, Wproj);      // its rows are in L2 (two stages ahead): into registers
            if (MK_PRE_RESID) pre = resid_preload(wk.x, wk.acc, (const float*)P[LW_PROJB], layer, wte, wpe, stok, spos);
            if (!block_wait(sync + S_ATT_DONE, (gl + 1) * NB * NH * (proj_merges(nch) ? nch : 1), ctl,
                            Where{ST_PROJ, layer, step})) return;
#endif
            stamp(ctl, sidx, 1);
            if (proj_merges(nch)) merge_rows(wk.partial, xs, nch);
            else copy_rows(wk.att, xs, NB * C / 4);
            {
                const Epi e{(const float*)P[LW_PROJB], wk.x, nullptr, nullptr, spos, L, nullptr, wk.acc, layer > 0, 0,
                            MK_PRE_RESID, pre};
                int rg0, rg1;
                tile_range<C>(rg0, rg1);
                gemv_tile<C, C, EPI_RESID>(w, MK_VERSION == 2, Wproj, xs, part, e, rg0, rg1);
            }
#if MK_VERSION == 2
            block_signal(sync + S_X_DONE, 1, ctl);
#endif
            stamp(ctl, sidx, 2);

            // ================= MLP: acc += gelu(LayerNorm(x) Wfc^T + bfc) Wmproj^T (+ bmproj), split over h
            ++sidx;
            stamp(ctl, sidx, 0);
#if MK_VERSION == 1
            if (!grid_barrier(sync + S_BAR, bar, ctl, Where{ST_MLP, layer, step})) return;
#else
            {   // the stage after this one: the next layer's QKV rows, or the LM head's first waves
                const unsigned long long* Pn = lw + (layer + 1 < NL ? layer + 1 : layer) * LW_COUNT;
                if (layer + 1 < NL) prefetch_tile<C, 3 * C, EPI_QKV>((const float*)Pn[LW_ATTNW]);
                else prefetch_tile<C, VOCAB, EPI_LOGITS>(wte);
            }
            gemv_preload<C, 4 * C, EPI_GELU>(w, Wfc);
            if (!block_wait(sync + S_X_DONE, (gl + 1) * G, ctl, Where{ST_MLP, layer, step})) return;
#endif
            stamp(ctl, sidx, 1);
            ln_rows(wk.x, nullptr, (const float*)P[LW_LN2W], (const float*)P[LW_LN2B], xs, false, wte, wpe, stok,
                    spos, wk.x);
            {
                int rg0, rg1;
                tile_range<4 * C>(rg0, rg1);
                for (int c0 = rg0; c0 < rg1; c0 += MK_HCAP / R) {         // one pass unless the grid is small
                    const int c1 = min(rg1, c0 + MK_HCAP / R);
                    const Epi e{(const float*)P[LW_FCB], hs, nullptr, nullptr, spos, L, nullptr, nullptr, 0, c0 * R, false, 0.0f};
                    if (c0 == rg0) {
                        gemv_tile<C, 4 * C, EPI_GELU>(w, MK_VERSION == 2, Wfc, xs, part, e, c0, c1);
                    } else {                                        // w is dead from here: no registers held
                        float4 w2[R][U];
                        gemv_tile<C, 4 * C, EPI_GELU>(w2, false, Wfc, xs, part, e, c0, c1);
                    }
                    __syncthreads();
                    // the bias once: by the block with row 0 (block 0 has no rows when the grid is wider than 4C/R)
                    mlp_down(hs, WmprojT, c0 == 0 ? (const float*)P[LW_MPROJB] : nullptr, c0 * R,
                             min(c1 * R, 4 * C), dn, wk.acc);
                }
            }
#if MK_VERSION == 2
            block_signal(sync + S_X2_DONE, 1, ctl);
#endif
            stamp(ctl, sidx, 2);
        }

        // ================= LM head: logits = LayerNorm_f(x + acc) wte^T, greedy choice
        const int sidx = step * STAGES_PER_STEP + STAGES_PER_LAYER * NL;
        stamp(ctl, sidx, 0);
        if (threadIdx.x < NB) sbest[threadIdx.x] = 0ull;
#if MK_VERSION == 1
        if (!grid_barrier(sync + S_BAR, bar, ctl, Where{ST_LM, NL, step})) return;
#else
        gemv_preload<C, VOCAB, EPI_LOGITS>(w, wte);
        if (!block_wait(sync + S_X2_DONE, (gs * NL + NL) * G, ctl, Where{ST_LM, NL, step})) return;
#endif
        stamp(ctl, sidx, 1);
        ln_rows(wk.x, wk.acc, lnf_w, lnf_b, xs, false, wte, wpe, stok, spos, wk.x);
        {
            const Epi e{nullptr, logits, nullptr, nullptr, spos, L, sbest, nullptr, 0, 0, false, 0.0f};
            int rg0, rg1;
            tile_range<VOCAB>(rg0, rg1);
            gemv_tile<C, VOCAB, EPI_LOGITS>(w, MK_VERSION == 2, wte, xs, part, e, rg0, rg1);
        }
        if (threadIdx.x < NB && sbest[threadIdx.x]) atomicMax(amax + threadIdx.x, sbest[threadIdx.x]);
        __syncthreads();
        // the last block to finish the LM head writes the tokens and advances the positions
        if (threadIdx.x == 0 && (int)blockIdx.x != stall_block) {
            __threadfence();
            const unsigned done = atomicAdd(sync + S_LM_DONE, 1u);
            if (done == (gs + 1) * G - 1) {
                __threadfence();
                for (int b = 0; b < NB; ++b) {
                    const unsigned long long p = atomicExch(amax + b, 0ull);     // read and reset for the next step
                    const int tok = (int)(0xffffffffu - (unsigned)(p & 0xffffffffu));
                    const int t = (p != 0ull && tok >= 0 && tok < VOCAB) ? tok : 0;   // all-NaN row: token 0
                    tokens[b] = t;
                    pos[b] += 1;
                    lens[b] += 1;
                    if (out_tokens) out_tokens[step * NB + b] = t;
                }
                __threadfence();
#if MK_VERSION == 2
                atomicAdd(sync + S_TOK_DONE, 1u);
#endif
            }
        }
        stamp(ctl, sidx, 2);
        (void)lane;
    }
}
