// megakernel_stages.cuh - the stages of the decode megakernel that are not plain GEMV tiles: LayerNorm of the
// <= 8 rows (each block recomputes it), the MLP's down projection split over its inputs (split-K, atomics into
// acc), and attention over the KV cache, one warp per (sequence, head, chunk) unit. Included by
// megakernel_v1.cu and megakernel_v2.cu after megakernel.cuh.
#pragma once
#include "megakernel.cuh"

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

// s[b] += sum over rows r0 + g, r0 + g + KG, ... < r1 of h[b][r] Wt[r][float4 column c] (four weights of
// format WT, widened in registers), DU rows' loads in flight at once.
template <int KG, int WT = W_F32>
__device__ __forceinline__ void mlp_column(float4 (&s)[NB], const float* hs, const void* __restrict__ Wt, int c,
                                           int g, int r0, int r1) {
    using V4 = typename Fmt<WT>::V4;
    constexpr int C4 = C / 4, DU = NB > 4 ? 8 : 16;
    const V4* W4 = reinterpret_cast<const V4*>(Wt);
    for (int r = r0 + g; r < r1; r += KG * DU) {
        V4 wq[DU];
#pragma unroll
        for (int i = 0; i < DU; ++i) {
            const int rr = r + i * KG;
            wq[i] = rr < r1 ? ld_weight<true>(W4 + (long long)rr * C4 + c) : V4();     // V4(): zero bits
        }
#pragma unroll
        for (int i = 0; i < DU; ++i) {
            const float4 wv = Fmt<WT>::widen4(wq[i]);
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                const float hv = hs[b * MK_HCAP + min(r + i * KG, r1 - 1) - r0];     // wv is 0 past r1
                s[b].x += hv * wv.x; s[b].y += hv * wv.y; s[b].z += hv * wv.z; s[b].w += hv * wv.w;
            }
        }
    }
}

// acc (NB x C) += h rows [r0, r1) (shared: hs[b * MK_HCAP + r - r0]) times the same rows of Wt (4C x C, mlp
// c_proj transposed, format MK_WT): the block's share of the down projection, split over its inputs. KG groups
// of threads take every KG-th row, a thread per float4 column (WIDE: a thread takes columns in turns); with
// KG > 1 their sums meet in shared memory (dn, KG x NB x C). One atomic per float4 adds a column's sum to acc
// (red.global.add.v4.f32 on sm_90, four scalar ones before). `bias`: added once (the caller passes it in one
// block only). int8: column c of Wt is output row c of mlp c_proj, so its scale (scale[c], C of them)
// multiplies the column's sum, before the bias.
__device__ MK_OUTLINE void mlp_down(const float* hs, const void* __restrict__ Wt, const float* __restrict__ bias,
                                    const float* __restrict__ scale, int r0, int r1, float* dn, float* acc) {
    constexpr int C4 = C / 4;
    constexpr bool WIDE = C4 > MK_THREADS;
    constexpr int KG = WIDE ? 1 : MK_THREADS / C4;
    const float4* bias4 = reinterpret_cast<const float4*>(bias);
    const int g = WIDE ? 0 : threadIdx.x / C4;
    float4* dn4 = reinterpret_cast<float4*>(dn);
    for (int c = WIDE ? threadIdx.x : threadIdx.x % C4; c < C4 && g < KG; c += WIDE ? MK_THREADS : C4) {
        float4 s[NB];
        const bool add_bias = bias && g == 0;
#pragma unroll
        for (int b = 0; b < NB; ++b)
            s[b] = add_bias && MK_WT != W_I8 ? __ldg(bias4 + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        mlp_column<KG, MK_WT>(s, hs, Wt, c, g, r0, r1);
        if (MK_WT == W_I8) {     // this group's partial sum of the codes, scaled (the scale is per column, so
                                 // scaling each partial sum before the atomic add equals scaling the total), then the bias
            const float4 sc = __ldg(reinterpret_cast<const float4*>(scale) + c);
            const float4 bb = add_bias ? __ldg(bias4 + c) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int b = 0; b < NB; ++b)
                s[b] = make_float4(s[b].x * sc.x + bb.x, s[b].y * sc.y + bb.y, s[b].z * sc.z + bb.z,
                                   s[b].w * sc.w + bb.w);
        }
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
        if (lane == 0 && MK_SIGNALS()) red_release(ctl.sync + S_ATT_DONE, 1u);
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
    if (lane == 0 && MK_SIGNALS()) red_release(ctl.sync + S_ATT_DONE, 1u);
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
