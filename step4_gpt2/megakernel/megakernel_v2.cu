// megakernel_v2.cu - the whole GPT-2 decode step in one persistent kernel, version 2: counters instead of
// barriers, and the next weights streaming while a block waits.
//
// The stages and their tiles are v1's (megakernel_v1.cu, megakernel.cuh); what changes is how blocks wait:
//   - no barriers. Each stage announces its progress on counters in global memory, and a consumer waits only
//     for what it reads: attention on head h waits for head h's q/k/v rows only. Release: a block (or warp)
//     barrier, then one thread's red.release; acquire: one thread's ld.acquire, then a barrier. No full fence
//     (__threadfence) on either side: each hop between blocks would wait for one (only the LM head's last
//     block and the attention's last unit per head keep a fenced atomic).
//   - before waiting, a block issues the register loads of its first weight tile and asks L2 to prefetch the
//     next stage's weights (prefetch.global.L2), so the DRAM keeps streaming weights while blocks wait,
//     normalise or do attention.
//
// The weights may be fp32, bf16 or int8 (MK_WT for the layers, MK_WT_HEAD for the LM head: megakernel.cuh's
// weight formats): the stages are the same; each GEMV tile and the MLP's down projection are instantiated for
// the format, and the host picks the build from the model's weights (megakernel.py).
//
// One launch runs nsteps greedy decode steps: the chosen token feeds the next step on the device.
#define MK_VERSION 2
#include "megakernel.cuh"           // constants, the bounded wait, weight loads, GEMV tiles
#include "megakernel_stages.cuh"    // LayerNorm, the MLP's down projection, attention

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
    (void)bar_base;
    typename Fmt<MK_WT>::V w[R][U];          // a wave's weights (float4, or 16 bytes of bf16/int8 bits)
    if (threadIdx.x == 0) s_abort = 0;

    for (int step = 0; step < nsteps; ++step) {
        const unsigned gs = epoch + step;
        // ---- the step's inputs: tokens, positions, lengths (written by the last step's finisher)
        if (step > 0 && !block_wait(sync + S_TOK_DONE, gs, ctl, Where{ST_QKV, 0, step})) return;
        for (int layer = 0; layer < NL; ++layer) {
            const unsigned long long* P = lw + layer * LW_COUNT;
            const void* Wattn = (const void*)P[LW_ATTNW];          // format MK_WT
            const void* Wproj = (const void*)P[LW_PROJW];
            const void* Wfc = (const void*)P[LW_FCW];
            const void* WmprojT = (const void*)P[LW_MPROJWT];
            float* kc = (float*)P[LW_KCACHE];
            float* vc = (float*)P[LW_VCACHE];
            const unsigned gl = gs * NL + layer;
            int sidx = step * STAGES_PER_STEP + layer * STAGES_PER_LAYER;

            // ================= QKV: x -> LayerNorm -> q, k/v appended
            MK_STAMP(sidx, 0);
            prefetch_tile<C, C, EPI_RESID, MK_WT>(Wproj);     // two stages ahead: attention reads no weights
            gemv_preload<C, 3 * C, EPI_QKV, MK_WT>(w, Wattn);
            if (layer > 0 && !block_wait(sync + S_X2_DONE, gl * G, ctl, Where{ST_QKV, layer, step})) return;
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
                const Epi e{(const float*)P[LW_ATTNB], wk.q, kc, vc, spos, L, nullptr, nullptr, 0, 0, false, 0.0f,
                            (const float*)P[LW_ATTNS]};
                int rg0, rg1;
                tile_range<3 * C>(rg0, rg1);
                gemv_tile<C, 3 * C, EPI_QKV, MK_WT>(w, true, Wattn, xs, part, e, rg0, rg1);
            }
            {   // announce the finished rows of each head
                int rg0, rg1;
                tile_range<3 * C>(rg0, rg1);
                const int v0 = rg0 * R, v1 = min(rg1 * R, 3 * C);
                __syncthreads();
                if (threadIdx.x == 0 && MK_SIGNALS() && v1 > v0) {
                    for (int hh = v0 / (3 * HD); hh <= (v1 - 1) / (3 * HD); ++hh) {
                        const int a = max(v0, hh * 3 * HD), z = min(v1, (hh + 1) * 3 * HD);
                        red_release(sync + S_HEAD0 + hh, (unsigned)(z - a));
                    }
                }
            }
            MK_STAMP(sidx, 2);

            // ================= ATT
            ++sidx;
            MK_STAMP(sidx, 0);
            const int CL = att_chunk_len(slens, nch);
            prefetch_attention(kc, vc, nch, CL, slens, L);
            bool stamped = false;
            for (int u = att_unit(warp); u < NB * NH * nch; u += G * NWARPS) {
                const int hh = u / (NB * nch);
                int ok = 1;
                if (lane == 0) ok = wait_geq(sync + S_HEAD0 + hh, (gl + 1) * 3 * HD, ctl, Where{ST_ATT, layer, step});
                ok = __shfl_sync(FULL_MASK, ok, 0);
                __syncwarp();                           // lane 0's acquire, passed on to the warp
                if (!ok) { s_abort = 1; break; }
                if (!stamped) { MK_STAMP(sidx, 1); stamped = true; }
                attention_unit(u, nch, CL, wk.q, kc, vc, wk.partial, wk.att, sync + S_ATTC0, gl, slens, L,
                               sq + warp * HD, sp + warp * ATT_MAXCL, ctl);
            }
            __syncthreads();
            if (s_abort) return;
            prefetch_tile<C, 4 * C, EPI_GELU, MK_WT>(Wfc);  // two stages ahead, once this block's units are done
            MK_STAMP(sidx, 2);

            // ================= PROJ: x += att W^T + b (+ the last layer's MLP sums, acc, which it zeroes)
            ++sidx;
            MK_STAMP(sidx, 0);
            float pre = 0.0f;
            {   // the MLP's down-projection rows of this block (all of them: it loads them at once)
                int rg0, rg1;
                tile_range<4 * C>(rg0, rg1);
                prefetch_rows<C, 4 * C, EPI_GELU, Fmt<MK_WT>::BYTES>(WmprojT, rg0 * R, rg1 * R);
            }
            gemv_preload<C, C, EPI_RESID, MK_WT>(w, Wproj);   // its rows are in L2 (two stages ahead): into registers
            if (MK_PRE_RESID) pre = resid_preload(wk.x, wk.acc, (const float*)P[LW_PROJB], layer, wte, wpe, stok, spos);
            if (!block_wait(sync + S_ATT_DONE, (gl + 1) * NB * NH * (proj_merges(nch) ? nch : 1), ctl,
                            Where{ST_PROJ, layer, step})) return;
            MK_STAMP(sidx, 1);
            if (proj_merges(nch)) merge_rows(wk.partial, xs, nch);
            else copy_rows(wk.att, xs, NB * C / 4);
            {
                const Epi e{(const float*)P[LW_PROJB], wk.x, nullptr, nullptr, spos, L, nullptr, wk.acc, layer > 0, 0,
                            MK_PRE_RESID, pre, (const float*)P[LW_PROJS]};
                int rg0, rg1;
                tile_range<C>(rg0, rg1);
                gemv_tile<C, C, EPI_RESID, MK_WT>(w, true, Wproj, xs, part, e, rg0, rg1);
            }
            block_signal(sync + S_X_DONE, 1, ctl);
            MK_STAMP(sidx, 2);

            // ================= MLP: acc += gelu(LayerNorm(x) Wfc^T + bfc) Wmproj^T (+ bmproj), split over h
            ++sidx;
            MK_STAMP(sidx, 0);
            {   // the stage after this one: the next layer's QKV rows, or the LM head's first waves
                const unsigned long long* Pn = lw + (layer + 1 < NL ? layer + 1 : layer) * LW_COUNT;
                if (layer + 1 < NL) prefetch_tile<C, 3 * C, EPI_QKV, MK_WT>((const void*)Pn[LW_ATTNW]);
                else prefetch_tile<C, VOCAB, EPI_LOGITS, MK_WT_HEAD>(head);
            }
            gemv_preload<C, 4 * C, EPI_GELU, MK_WT>(w, Wfc);
            if (!block_wait(sync + S_X_DONE, (gl + 1) * G, ctl, Where{ST_MLP, layer, step})) return;
            MK_STAMP(sidx, 1);
            ln_rows(wk.x, nullptr, (const float*)P[LW_LN2W], (const float*)P[LW_LN2B], xs, false, wte, wpe, stok,
                    spos, wk.x);
            {
                int rg0, rg1;
                tile_range<4 * C>(rg0, rg1);
                for (int c0 = rg0; c0 < rg1; c0 += MK_HCAP / R) {         // one pass unless the grid is small
                    const int c1 = min(rg1, c0 + MK_HCAP / R);
                    const Epi e{(const float*)P[LW_FCB], hs, nullptr, nullptr, spos, L, nullptr, nullptr, 0, c0 * R,
                                false, 0.0f, (const float*)P[LW_FCS]};
                    if (c0 == rg0) {
                        gemv_tile<C, 4 * C, EPI_GELU, MK_WT>(w, true, Wfc, xs, part, e, c0, c1);
                    } else {                                        // w is dead from here: no registers held
                        typename Fmt<MK_WT>::V w2[R][U];
                        gemv_tile<C, 4 * C, EPI_GELU, MK_WT>(w2, false, Wfc, xs, part, e, c0, c1);
                    }
                    __syncthreads();
                    // the bias once: by the block with row 0 (block 0 has no rows when the grid is wider than 4C/R)
                    mlp_down(hs, WmprojT, c0 == 0 ? (const float*)P[LW_MPROJB] : nullptr, (const float*)P[LW_MPROJS],
                             c0 * R, min(c1 * R, 4 * C), dn, wk.acc);
                }
            }
            block_signal(sync + S_X2_DONE, 1, ctl);
            MK_STAMP(sidx, 2);
        }

        // ================= LM head: logits = LayerNorm_f(x + acc) head^T (fp32: wte, tied), greedy choice
        const int sidx = step * STAGES_PER_STEP + STAGES_PER_LAYER * NL;
        MK_STAMP(sidx, 0);
        if (threadIdx.x < NB) sbest[threadIdx.x] = 0ull;
        gemv_preload<C, VOCAB, EPI_LOGITS, MK_WT_HEAD>(w, head);
        if (!block_wait(sync + S_X2_DONE, (gs * NL + NL) * G, ctl, Where{ST_LM, NL, step})) return;
        MK_STAMP(sidx, 1);
        ln_rows(wk.x, wk.acc, lnf_w, lnf_b, xs, false, wte, wpe, stok, spos, wk.x);
        {
            const Epi e{nullptr, logits, nullptr, nullptr, spos, L, sbest, nullptr, 0, 0, false, 0.0f, head_s};
            int rg0, rg1;
            tile_range<VOCAB>(rg0, rg1);
            gemv_tile<C, VOCAB, EPI_LOGITS, MK_WT_HEAD>(w, true, head, xs, part, e, rg0, rg1);
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
                atomicAdd(sync + S_TOK_DONE, 1u);
            }
        }
        MK_STAMP(sidx, 2);
        (void)lane;
    }
}
