// megakernel_v1.cu - the whole GPT-2 decode step in one persistent kernel, version 1: a grid-wide barrier
// before every stage.
//
// Every block takes a tile of every stage of every layer (megakernel.cuh describes the stages and their
// tiles). Between two stages all blocks meet at a grid-wide barrier: each adds one to a counter in global
// memory and waits (a bounded spin) until all gridDim.x have arrived; 4 barriers per layer, 49 per step of the
// 124M model. Simple and obviously correct, but after each barrier every block starts its loads from scratch:
// the DRAM idles for the barrier and for one round trip per stage. megakernel_v2.cu removes the barriers.
//
// One launch runs nsteps greedy decode steps: the chosen token feeds the next step on the device.
#define MK_VERSION 1
#include "megakernel.cuh"           // constants, the bounded wait, weight loads, GEMV tiles
#include "megakernel_stages.cuh"    // LayerNorm, the MLP's down projection, attention
static_assert(MK_WT == W_F32, "MK_WT: v1 reads fp32 weights; the bf16 and int8 builds are v2's (megakernel_v2.cu)");

// ------------------------------------------------------------------------------------------ the kernel
struct Work {              // float workspace (the host allocates it as one buffer)
    float *x, *q, *att, *acc, *partial;
};


extern "C" __global__ void __launch_bounds__(MK_THREADS, 1)
megakernel_decode(const unsigned long long* __restrict__ lw, const float* __restrict__ wte,
                  const float* __restrict__ wpe, const float* __restrict__ lnf_w, const float* __restrict__ lnf_b,
                  const void* __restrict__ head, const float* __restrict__ head_s, int* tokens, int* pos, int* lens,
                  float* ws, unsigned* sync, unsigned long long* amax,
                  float* logits, int* out_tokens, int L, int nch, int nsteps, unsigned epoch, unsigned bar_base,
                  long long timeout_ns, int* err) {
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

    const Ctl ctl{sync, err, timeout_ns};
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
    unsigned bar = bar_base;                 // v1: barriers passed so far on this sync buffer
    float4 w[R][U];
    if (threadIdx.x == 0) s_abort = 0;

    for (int step = 0; step < nsteps; ++step) {
        const unsigned gs = epoch + step;
        // the step's inputs (tokens, positions, lengths) were written by the last step's finisher: the
        // barrier before the first QKV stage waits for it
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
            MK_STAMP(sidx, 0);
            if (step > 0 || layer > 0) {
                if (!grid_barrier(sync + S_BAR, bar, ctl, Where{ST_QKV, layer, step})) return;
            }
            MK_STAMP(sidx, 1);
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
                gemv_tile<C, 3 * C, EPI_QKV>(w, false, Wattn, xs, part, e, rg0, rg1);
            }
            MK_STAMP(sidx, 2);

            // ================= ATT
            ++sidx;
            MK_STAMP(sidx, 0);
            const int CL = att_chunk_len(slens, nch);
            if (!grid_barrier(sync + S_BAR, bar, ctl, Where{ST_ATT, layer, step})) return;
            MK_STAMP(sidx, 1);
            for (int u = att_unit(warp); u < NB * NH * nch; u += G * NWARPS) {
                attention_unit(u, nch, CL, wk.q, kc, vc, wk.partial, wk.att, sync + S_ATTC0, gl, slens, L,
                               sq + warp * HD, sp + warp * ATT_MAXCL, ctl);
            }
            __syncthreads();
            if (s_abort) return;
            MK_STAMP(sidx, 2);

            // ================= PROJ: x += att W^T + b (+ the last layer's MLP sums, acc, which it zeroes)
            ++sidx;
            MK_STAMP(sidx, 0);
            float pre = 0.0f;
            if (!grid_barrier(sync + S_BAR, bar, ctl, Where{ST_PROJ, layer, step})) return;
            MK_STAMP(sidx, 1);
            if (proj_merges(nch)) merge_rows(wk.partial, xs, nch);
            else copy_rows(wk.att, xs, NB * C / 4);
            {
                const Epi e{(const float*)P[LW_PROJB], wk.x, nullptr, nullptr, spos, L, nullptr, wk.acc, layer > 0, 0,
                            MK_PRE_RESID, pre};
                int rg0, rg1;
                tile_range<C>(rg0, rg1);
                gemv_tile<C, C, EPI_RESID>(w, false, Wproj, xs, part, e, rg0, rg1);
            }
            MK_STAMP(sidx, 2);

            // ================= MLP: acc += gelu(LayerNorm(x) Wfc^T + bfc) Wmproj^T (+ bmproj), split over h
            ++sidx;
            MK_STAMP(sidx, 0);
            if (!grid_barrier(sync + S_BAR, bar, ctl, Where{ST_MLP, layer, step})) return;
            MK_STAMP(sidx, 1);
            ln_rows(wk.x, nullptr, (const float*)P[LW_LN2W], (const float*)P[LW_LN2B], xs, false, wte, wpe, stok,
                    spos, wk.x);
            {
                int rg0, rg1;
                tile_range<4 * C>(rg0, rg1);
                for (int c0 = rg0; c0 < rg1; c0 += MK_HCAP / R) {         // one pass unless the grid is small
                    const int c1 = min(rg1, c0 + MK_HCAP / R);
                    const Epi e{(const float*)P[LW_FCB], hs, nullptr, nullptr, spos, L, nullptr, nullptr, 0, c0 * R, false, 0.0f};
                    if (c0 == rg0) {
                        gemv_tile<C, 4 * C, EPI_GELU>(w, false, Wfc, xs, part, e, c0, c1);
                    } else {                                        // w is dead from here: no registers held
                        float4 w2[R][U];
                        gemv_tile<C, 4 * C, EPI_GELU>(w2, false, Wfc, xs, part, e, c0, c1);
                    }
                    __syncthreads();
                    // the bias once: by the block with row 0 (block 0 has no rows when the grid is wider than 4C/R)
                    mlp_down(hs, WmprojT, c0 == 0 ? (const float*)P[LW_MPROJB] : nullptr, nullptr, c0 * R,
                             min(c1 * R, 4 * C), dn, wk.acc);
                }
            }
            MK_STAMP(sidx, 2);
        }

        // ================= LM head: logits = LayerNorm_f(x + acc) head^T (head: wte, tied), greedy choice
        const int sidx = step * STAGES_PER_STEP + STAGES_PER_LAYER * NL;
        MK_STAMP(sidx, 0);
        if (threadIdx.x < NB) sbest[threadIdx.x] = 0ull;
        if (!grid_barrier(sync + S_BAR, bar, ctl, Where{ST_LM, NL, step})) return;
        MK_STAMP(sidx, 1);
        ln_rows(wk.x, wk.acc, lnf_w, lnf_b, xs, false, wte, wpe, stok, spos, wk.x);
        {
            const Epi e{nullptr, logits, nullptr, nullptr, spos, L, sbest, nullptr, 0, 0, false, 0.0f};
            int rg0, rg1;
            tile_range<VOCAB>(rg0, rg1);
            gemv_tile<C, VOCAB, EPI_LOGITS>(w, false, head, xs, part, e, rg0, rg1);
        }
        if (threadIdx.x < NB && sbest[threadIdx.x]) atomicMax(amax + threadIdx.x, sbest[threadIdx.x]);
        __syncthreads();
        // the last block to finish the LM head writes the tokens and advances the positions
        if (threadIdx.x == 0 && MK_SIGNALS()) {
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
            }
        }
        MK_STAMP(sidx, 2);
        (void)lane;
    }
}
