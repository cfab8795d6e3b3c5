// attention_tc.cu - attention forward and backward on tensor cores, at fp32 accuracy (3xTF32): version 3
// of the training step's attention (attention.cu: v1 materialises P, v2 is flash-style on the FMA units).
//
// The fp32 flash kernels (step 2's flash_attention.cu forward, train_gpt2.cu's backward v2) run on the FMA
// units. Tensor cores multiply TF32: fp32 with a 10-bit mantissa, so one TF32 product is off by about 1e-3
// relative, too coarse for gradients checked against fp32 autograd at 1e-4. The 3xTF32 trick splits every
// operand into a TF32 "big" part and a TF32 "small" part (what the rounding dropped), x = xb + xs, and uses
//
//     a * b  ~=  ab * bb  +  ab * bs  +  as * bb          (as * bs, about 2^-22 relative, is dropped)
//
// three tensor-core products for one: fp32-class accuracy at tensor-core speed. It is what CUTLASS calls
// OpMultiplyAddFastF32, and what PyTorch's float32 scaled_dot_product_attention runs.
//
// The instruction: mma.sync.m16n8k8 with TF32 inputs, D (16x8) += A (16x8) B (8x8), for one warp. Fragments,
// with g = lane / 4, t = lane % 4 (row, column):
//     A: a0 (g, t)   a1 (g+8, t)   a2 (g, t+4)   a3 (g+8, t+4)        B: b0 (k=t, n=g)   b1 (k=t+4, n=g)
//     C: c0 (g, 2t)  c1 (g, 2t+1)  c2 (g+8, 2t)  c3 (g+8, 2t+1)
// The accumulator of S = Q K^T holds keys 2t and 2t+1 of each 8 in a thread, but the A fragment of P V wants
// keys t and t+4. Rather than shuffle, the kernels number the keys of each group of 8 differently for the
// second product: A's k = t is key 2t, k = t+4 is key 2t+1, and V's B fragment is read from those same rows.
// A sum does not care about order, so S's accumulator *is* P V's A fragment: {c0, c2, c1, c3}. The same
// holds for dS in dQ = dS K, and for P^T, dS^T in dV = P^T dO, dK = dS^T Q.
//
//   attention_forward_tc   a block (4 warps) owns 64 queries, a warp 16: Q in registers; K and V tiles of 32
//                          keys stream into shared memory with cp.async, the next tile while this one
//                          computes; the online softmax in registers (4 lanes share a row: two shuffles);
//                          writes out and lse.
//   attention_dkv_tc       a warp owns 16 keys (K, V in registers); walks the query tiles from its first key:
//                          S^T = K Q^T, P^T = exp2(S^T - lse), dV += P^T dO, dP^T = V dO^T,
//                          dS^T = P^T (dP^T - delta), dK += dS^T Q; and writes dS to memory.
//   attention_dq_tc        a warp owns 16 queries: dQ += dS K over the key tiles, dS read back from memory.
// Recompute or store? dQ needs dS with the queries as rows, and dkv holds it with the keys as rows. Version 2
// recomputes S and dP for dQ, two of its seven products; here dkv writes dS once (the causal half of T x T
// floats) and dQ reads it back: per score, 8 bytes of DRAM traffic instead of 2 x 3 x 64 x 2 tensor-core FLOPs,
// a trade that paid at T = 256 and at T = 1024 (benchmarks.py times both; docs/training.md has the numbers).
// dS is kept as 16 x 16 tiles of the lower triangle only: tile (qt, kt), kt <= qt, at qt (qt + 1) / 2 + kt,
// each [key][query], the order dkv's accumulator holds it in, so its float2 stores fill 32-byte sectors.
// As in v2 there are no atomics: each output row has one owner, so the results are the same bits every run.
// delta (dO . O per row) comes from train_gpt2.cu's attention_delta, launched first. Exponentials are in the exp2
// domain: Q (or K) is scaled by scale * log2(e) as it is loaded.
//
// Operands are split where they are read: the A fragments from registers, the B fragments from the fp32 tiles in
// shared memory. The splits are most of what these kernels execute, so each is two integer instructions and a
// subtraction (TF32_SPLIT below). The tiles hold q, k, v, dO as they are in memory: the qkv bias is added once
// per row instead (bias_dot, rowsum_times), not to every element a warp reads.
//
// Layouts as in train_gpt2.cu: qkv (B, T, 3C) without its bias (see above), out and dout (B, T, C),
// lse and delta (B, H, T), dqkv (B, T, 3C). Shared rows are D + 4 floats long, which makes both fragment
// reads below conflict-free: rows g, columns t (bank 4g + t) and rows 2t, columns g (bank 8t + g).
//
// Architectures: TF32 mma needs sm_80. Compiled for older GPUs the kernels trap; ops.py does not launch
// them there (the default attention version is 2 below sm_80). Compile-time knobs: HEAD_DIM (32 or 64), TF32_SPLIT.
#include "course.cuh"
#include "mma.cuh"            // smem_addr, copy16 / copy_commit / copy_wait (cp.async), shared with step 2

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#define D HEAD_DIM
#define KD (D / 8)            // 8-wide steps across the head dims
#define WARPS 4
#define ROWS (16 * WARPS)     // queries (or keys) a block owns
#define KEY_TILE 32           // keys per shared-memory tile in the forward
#define QUERY_TILE 16         // queries per tile in dK, dV: that kernel holds K, V, dK, dV in registers
#define DQ_TILE 32            // keys per tile in dQ (two 16 x 16 tiles of dS)
#define TS (D + 4)            // shared row stride in floats
#define NEG_INF __int_as_float(0xff800000)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

static_assert(D == 32 || D == 64, "HEAD_DIM must be 32 or 64");

template <int R> struct Tile {   // R rows of D floats, two buffers: one computes while the next streams in
    float v[2][R][TS];
};

#ifndef TF32_SPLIT
#define TF32_SPLIT 0
#endif
// How each operand is split into its TF32 parts (0, the default; 1 and 2 are lab/tf32_split.py's, which times the
// three and checks 1 against 2):
//   0  big = x rounded to TF32; small = x - big, handed to the tensor core as it is: the tensor core reads only
//      a TF32 operand's top 19 bits, so small is truncated there. Two integer instructions and a subtraction;
//      CUTLASS's OpMultiplyAddFastF32 (PyTorch's float32 attention) splits the same way. The default.
//   1  as 0, and small rounded to TF32 too (to nearest): two more integer instructions, half the error in small.
//   2  as 1 with PTX's cvt.rna.tf32.f32 for both roundings: the same bits as 1, but on sm_80 .. sm_90 ptxas
//      expands each cvt into about five instructions (a compare and a select for NaN among them), and the
//      splits are most of what these kernels execute.
// Rounding to nearest, ties away from zero, for a finite x: add half a TF32 ulp to the bits and clear the 13 low
// ones (sign and magnitude: the add rounds the magnitude up from the half; a carry into the exponent is the
// right result). The inputs here are finite. volatile: not hoisted out of loops, where its result would hold
// registers.
__device__ __forceinline__ unsigned tf32(float x) {
    unsigned r;
#if TF32_SPLIT == 2
    asm volatile("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
#else
    asm volatile("{\n\tadd.u32 %0, %1, 0x1000;\n\tand.b32 %0, %0, 0xffffe000;\n}\n" : "=r"(r) : "r"(__float_as_uint(x)));
#endif
    return r;
}

__device__ __forceinline__ void split(float x, unsigned& big, unsigned& small) {
    big = tf32(x);
#if TF32_SPLIT == 0
    small = __float_as_uint(x - __uint_as_float(big));
#else
    small = tf32(x - __uint_as_float(big));
#endif
}

__device__ __forceinline__ void split4(float a0, float a1, float a2, float a3, unsigned (&ab)[4], unsigned (&as)[4]) {
    split(a0, ab[0], as[0]);
    split(a1, ab[1], as[1]);
    split(a2, ab[2], as[2]);
    split(a3, ab[3], as[3]);
}

__device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a b, the small terms into ds (which may be d): a tensor core rounds each accumulation toward zero, not
// to nearest, so every mma may lose up to an ulp of what its accumulator holds, always in the same direction;
// thousands of them in one accumulator add up to errors of 1e-5 (measured). So the products of each tile go
// to accumulators that start at zero, and the long sums (O, dQ, dK, dV over many tiles) are added up on the FMA
// units, rounded to nearest; in S the small terms have an accumulator of their own, which stays about 2^-11 of
// the big one, so its rounding costs nothing.
__device__ __forceinline__ void mma3(float (&d)[4], float (&ds)[4], const unsigned (&ab)[4], const unsigned (&as)[4],
                                     float x0, float x1) {
    unsigned bb0, bs0, bb1, bs1;
    split(x0, bb0, bs0);
    split(x1, bb1, bs1);
    mma(ds, as, bb0, bb1);
    mma(ds, ab, bs0, bs1);
    mma(d, ab, bb0, bb1);
}

__device__ __forceinline__ void zero(float (&d)[4]) { d[0] = d[1] = d[2] = d[3] = 0.0f; }

// s (16 x R) = A tile^T, A (16 x D) held as fp32 fragments, split here for each tile (keeping the split parts
// would double the registers A takes). The tile's rows are n, its columns k (S = Q K^T: n = key, k = head dim).
// The tiles hold q, k, v and dO as they are in memory, without the qkv bias: cp.async copies bytes and cannot add
// it, and adding it to every element a warp reads cost an instruction per element and product. The kernels add
// what the bias contributes once per row instead (bias_dot, rowsum_times below).
template <int R>
__device__ __forceinline__ void product_t(float (&s)[R / 8][4], const float (&a)[KD][4], const float (*tl)[TS], int g,
                                          int t) {
    float ss[R / 8][4];
#pragma unroll
    for (int nt = 0; nt < R / 8; ++nt) zero(s[nt]), zero(ss[nt]);
#pragma unroll
    for (int ks = 0; ks < KD; ++ks) {
        unsigned ab[4], as[4];
        split4(a[ks][0], a[ks][1], a[ks][2], a[ks][3], ab, as);
        const int k = ks * 8 + t;
#pragma unroll
        for (int nt = 0; nt < R / 8; ++nt) {
            const int n = nt * 8 + g;
            mma3(s[nt], ss[nt], ab, as, tl[n][k], tl[n][k + 4]);
        }
    }
#pragma unroll
    for (int nt = 0; nt < R / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] += ss[nt][e];
}

// acc += C tile, C (16 x R) an accumulator used as the A operand: the tile's rows are k, renumbered (k = t is
// row 2t, k = t+4 is row 2t+1), its columns n (O += P V: k = key, n = head dim). The tile's sum is made in an
// accumulator that starts at zero (the small terms share it: a second one would not fit in the registers of the
// backward kernels), then added to acc on the FMA units.
template <int R>
__device__ __forceinline__ void product_acc(float (&acc)[KD][4], const float (&c)[R / 8][4], const float (*tl)[TS],
                                            int g, int t) {
    float d[KD][4];
#pragma unroll
    for (int nt = 0; nt < KD; ++nt) zero(d[nt]);
#pragma unroll
    for (int kk = 0; kk < R / 8; ++kk) {
        unsigned ab[4], as[4];
        split4(c[kk][0], c[kk][2], c[kk][1], c[kk][3], ab, as);
        const int k = kk * 8 + 2 * t;
#pragma unroll
        for (int nt = 0; nt < KD; ++nt) {
            const int n = nt * 8 + g;
            mma3(d[nt], d[nt], ab, as, tl[k][n], tl[k + 1][n]);
        }
    }
#pragma unroll
    for (int nt = 0; nt < KD; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] += d[nt][e];
}

// The warp's A fragments of rows r0 .. r0+15 of a (.., stride) buffer, from column 0 of src (+ bias), times
// mul; rows past T are zero.
__device__ __forceinline__ void load_a(float (&a)[KD][4], const float* __restrict__ src, long long stride,
                                       const float* __restrict__ bias, int r0, int T, float mul, int g, int t) {
#pragma unroll
    for (int ks = 0; ks < KD; ++ks)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = r0 + g + (i & 1) * 8, c = ks * 8 + t + (i >> 1) * 4;
            a[ks][i] = r < T ? (src[(long long)r * stride + c] + (bias ? bias[c] : 0.0f)) * mul : 0.0f;
        }
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800     // cp.async: the kernels below trap on older GPUs
// Start copying rows r0 .. r0+R-1 of a (.., stride) buffer, D floats from src, into tl; rows past T are zeros.
template <int R>
__device__ __forceinline__ void fetch(float (*tl)[TS], const float* __restrict__ src, long long stride, int r0, int T) {
    for (int e = threadIdx.x; e < R * D / 4; e += blockDim.x) {
        const int r = e / (D / 4), c = (e % (D / 4)) * 4;
        const bool valid = r0 + r < T;
        copy16(&tl[r][c], src + (long long)(valid ? r0 + r : 0) * stride + c, valid);
    }
}

// Start copying rows r0 .. r0+R-1 of two tiles (K and V, or Q and dO) into buffer buf of each, if r0 < end, as
// one cp.async group; an empty group otherwise, so that copy_wait<1> always means "all but the newest have landed".
template <int R>
__device__ __forceinline__ void fetch2(Tile<R>& a, const float* __restrict__ a_src, long long a_stride, Tile<R>& b,
                                       const float* __restrict__ b_src, long long b_stride, int buf, int r0, int end,
                                       int T) {
    if (r0 < end) {
        fetch<R>(a.v[buf], a_src, a_stride, r0, T);
        fetch<R>(b.v[buf], b_src, b_stride, r0, T);
    }
    copy_commit();
}

// Wait until the tiles fetched before the newest group have landed, every thread's copies of them.
__device__ __forceinline__ void wait_tiles() {
    copy_wait<1>();
    __syncthreads();
}
#endif

// Rows r0 + g and r0 + g + 8 of a warp's 16 x D accumulator, times mul, into rows of dst (`stride` floats apart,
// the accumulator's column 0 at dst); rows at or past T are not written.
__device__ __forceinline__ void store_rows(float* dst, long long stride, const float (&acc)[KD][4], float mul, int r0,
                                           int T, int g, int t) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = r0 + g + i * 8;
        if (r >= T) continue;
        float* p = dst + r * stride + 2 * t;
#pragma unroll
        for (int nt = 0; nt < KD; ++nt)
            *reinterpret_cast<float2*>(p + nt * 8) = make_float2(acc[nt][2 * i] * mul, acc[nt][2 * i + 1] * mul);
    }
}

__device__ __forceinline__ void load_bias(float* dst, const float* __restrict__ bias) {
    for (int c = threadIdx.x; c < D; c += blockDim.x) dst[c] = bias ? bias[c] : 0.0f;
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, 1));
    return fmaxf(x, __shfl_xor_sync(FULL_MASK, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(FULL_MASK, x, 1);
    return x + __shfl_xor_sync(FULL_MASK, x, 2);
}

// What a bias b on the tile's side adds, per row of the warp's A fragments: (a + ...) . b for rows g and g+8 (the
// quad's four lanes hold a row's columns between them). S = A (X + b)^T = A X^T + (A b) 1^T: a constant per row of S.
__device__ __forceinline__ void bias_dot(float (&c)[2], const float (&a)[KD][4], const float* b, int t) {
    c[0] = c[1] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KD; ++ks)
#pragma unroll
        for (int i = 0; i < 4; ++i) c[i & 1] = fmaf(a[ks][i], b[ks * 8 + t + (i >> 1) * 4], c[i & 1]);
    c[0] = quad_sum(c[0]);
    c[1] = quad_sum(c[1]);
}

// acc += rs b^T, rs[r] this lane's part of the sum of row g + 8r of C over all tiles: C (X + b) = C X + (C 1) b^T.
__device__ __forceinline__ void rowsum_times(float (&acc)[KD][4], float (&rs)[2], const float* b, int t) {
    rs[0] = quad_sum(rs[0]);
    rs[1] = quad_sum(rs[1]);
#pragma unroll
    for (int nt = 0; nt < KD; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = fmaf(rs[e >> 1], b[nt * 8 + 2 * t + (e & 1)], acc[nt][e]);
}

#define QKV_OFFSETS                                                                                             \
    const int C = H * D, bh = blockIdx.y, b = bh / H, h = bh % H;                                               \
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;                     \
    const float* q_src = qkv + (long long)b * T * 3 * C + h * D;                                                \
    const float* k_src = q_src + C;                                                                             \
    const float* v_src = q_src + 2 * C;                                                                         \
    const float* q_bias = bias ? bias + h * D : nullptr;                                                        \
    const float* k_bias = bias ? bias + C + h * D : nullptr;                                                    \
    const float* v_bias = bias ? bias + 2 * C + h * D : nullptr;

// ----------------------------------------------------------------------------------------------- forward
extern "C" __global__ void __launch_bounds__(WARPS * 32, 2) attention_forward_tc(
        const float* __restrict__ qkv, const float* __restrict__ bias, float* __restrict__ out,
        float* __restrict__ lse, int T, int H, float scale) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) Tile<KEY_TILE> ks, vs;
    __shared__ float kb[D], vb[D];
    QKV_OFFSETS
    const int row0 = (gridDim.x - 1 - blockIdx.x) * ROWS;      // the blocks with the most keys start first
    const int r0 = row0 + warp * 16;
    const int last = min(T, row0 + ROWS);
    fetch2<KEY_TILE>(ks, k_src, 3 * C, vs, v_src, 3 * C, 0, 0, last, T);
    load_bias(kb, k_bias);
    load_bias(vb, v_bias);
    float q[KD][4], o[KD][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    load_a(q, q_src, 3 * C, q_bias, r0, T, scale * LOG2E, g, t);
#pragma unroll
    for (int nt = 0; nt < KD; ++nt) zero(o[nt]);
    for (int j0 = 0, it = 0; j0 < last; j0 += KEY_TILE, ++it) {
        const int cur = it & 1;
        fetch2<KEY_TILE>(ks, k_src, 3 * C, vs, v_src, 3 * C, cur ^ 1, j0 + KEY_TILE, last, T);
        wait_tiles();                                          // this tile has landed; the next may still stream
        if (j0 <= r0 + 15) {                                   // else every key of the tile is after this warp's rows
            float s[KEY_TILE / 8][4];
            product_t<KEY_TILE>(s, q, ks.v[cur], g, t);         // S = Q K^T (log2 domain; the k bias: in lse)
            float mx[2] = {m[0], m[1]};
#pragma unroll
            for (int nt = 0; nt < KEY_TILE / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = j0 + nt * 8 + 2 * t + (e & 1), row = r0 + g + (e >> 1) * 8;
                    if (key > row || key >= T) s[nt][e] = NEG_INF;
                    mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
                }
            float corr[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {                      // key 0 is in every row's first tile: m is finite
                mx[i] = quad_max(mx[i]);
                corr[i] = exp2f(m[i] - mx[i]);
                m[i] = mx[i];
                l[i] *= corr[i];
            }
#pragma unroll
            for (int nt = 0; nt < KEY_TILE / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[nt][e] = exp2f(s[nt][e] - m[e >> 1]);
                    l[e >> 1] += s[nt][e];                     // this thread's share; the quad adds them at the end
                }
#pragma unroll
            for (int nt = 0; nt < KD; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[nt][e] *= corr[e >> 1];
            product_acc<KEY_TILE>(o, s, vs.v[cur], g, t);        // O += P V (the v bias: at the end)
        }
        __syncthreads();                                       // before the next fetch overwrites this buffer
    }
    // The scores lacked q . k_bias, the same for every key of a row: softmax does not see it, lse does. And a row
    // of P sums to 1, so P (V + v_bias) = P V + v_bias.
    float cq[2];
    bias_dot(cq, q, kb, t);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int row = r0 + g + i * 8;
        const float sum = quad_sum(l[i]);
        if (row >= T) continue;
        float* dst = out + ((long long)b * T + row) * C + h * D + 2 * t;
#pragma unroll
        for (int nt = 0; nt < KD; ++nt)
            *reinterpret_cast<float2*>(dst + nt * 8) = make_float2(o[nt][2 * i] / sum + vb[nt * 8 + 2 * t],
                                                                   o[nt][2 * i + 1] / sum + vb[nt * 8 + 2 * t + 1]);
        if (t == 0) lse[(long long)bh * T + row] = (m[i] + log2f(sum) + cq[i]) * LN2;
    }
#else
    __trap();
#endif
}

// ----------------------------------------------------------------------------------------------- backward
// dK, dV and dS: a warp owns 16 keys; block 0 (the first keys, the most queries) starts first.
extern "C" __global__ void __launch_bounds__(WARPS * 32, 2) attention_dkv_tc(
        const float* __restrict__ qkv, const float* __restrict__ bias, const float* __restrict__ dout,
        const float* __restrict__ lse, const float* __restrict__ delta, float* __restrict__ dqkv,
        float* __restrict__ ds, int T, int H, float scale) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) Tile<QUERY_TILE> qs, dos;
    __shared__ float qb[D];
    QKV_OFFSETS
    const int j0 = blockIdx.x * ROWS, k0 = j0 + warp * 16;
    const float* do_src = dout + (long long)b * T * C + h * D;
    fetch2<QUERY_TILE>(qs, q_src, 3 * C, dos, do_src, C, 0, j0, T, T);
    load_bias(qb, q_bias);
    float k[KD][4], v[KD][4], dk[KD][4], dv[KD][4];
    load_a(k, k_src, 3 * C, k_bias, k0, T, scale * LOG2E, g, t);
    load_a(v, v_src, 3 * C, v_bias, k0, T, 1.0f, g, t);
    __syncthreads();                                           // qb
    float ck[2], rs[2] = {0.0f, 0.0f};                          // k . q_bias per key; the rows of dS^T, summed
    bias_dot(ck, k, qb, t);
#pragma unroll
    for (int nt = 0; nt < KD; ++nt) zero(dk[nt]), zero(dv[nt]);
    const float* lse_bh = lse + (long long)bh * T;
    const float* delta_bh = delta + (long long)bh * T;
    // This thread's place in dS tile (qt, k0 / 16) is ds_k + qt (qt + 1) / 2 * 256. ops.py always passes ds;
    // the null test costs nothing and, measured, keeps ptxas from spilling 28 bytes (sm_90) in this 255-register kernel.
    const int nt16 = (T + 15) / 16;
    float* ds_k = !ds ? nullptr : ds + ((long long)bh * (nt16 * (nt16 + 1) / 2) + k0 / 16) * 256 + g * 16 + 2 * t;
    for (int i0 = j0, it = 0; i0 < T; i0 += QUERY_TILE, ++it) {
        const int cur = it & 1;
        fetch2<QUERY_TILE>(qs, q_src, 3 * C, dos, do_src, C, cur ^ 1, i0 + QUERY_TILE, T, T);
        wait_tiles();
        if (i0 + QUERY_TILE > k0) {                            // else every query of the tile is before these keys
            float ls[QUERY_TILE / 8][2], dl[QUERY_TILE / 8][2];
#pragma unroll
            for (int nt = 0; nt < QUERY_TILE / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int i = i0 + nt * 8 + 2 * t + e;
                    ls[nt][e] = i < T ? lse_bh[i] * LOG2E : 0.0f;
                    dl[nt][e] = i < T ? delta_bh[i] : 0.0f;
                }
            float s[QUERY_TILE / 8][4], dp[QUERY_TILE / 8][4];
            product_t<QUERY_TILE>(s, k, qs.v[cur], g, t);         // S^T = K Q^T (log2 domain), + ck below
            product_t<QUERY_TILE>(dp, v, dos.v[cur], g, t);       // dP^T = V dO^T
#pragma unroll
            for (int nt = 0; nt < QUERY_TILE / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = i0 + nt * 8 + 2 * t + (e & 1), key = k0 + g + (e >> 1) * 8;
                    // keys past T hold zeros; their rows of dK, dV are never written
                    const float p = (key <= i && i < T) ? exp2f(s[nt][e] + ck[e >> 1] - ls[nt][e & 1]) : 0.0f;
                    s[nt][e] = p;
                    dp[nt][e] = p * (dp[nt][e] - dl[nt][e & 1]);
                    rs[e >> 1] += dp[nt][e];
                }
            product_acc<QUERY_TILE>(dv, s, dos.v[cur], g, t);     // dV += P^T dO
            if (ds_k) {
                float* tile = ds_k + (i0 / 16) * (i0 / 16 + 1) / 2 * 256;        // dS for attention_dq_tc
#pragma unroll
                for (int nt = 0; nt < QUERY_TILE / 8; ++nt)
#pragma unroll
                    for (int i = 0; i < 2; ++i)
                        *reinterpret_cast<float2*>(tile + i * 128 + nt * 8) = make_float2(dp[nt][2 * i], dp[nt][2 * i + 1]);
            }
            product_acc<QUERY_TILE>(dk, dp, qs.v[cur], g, t);     // dK += dS^T Q (+ rowsum(dS^T) q_bias below)
        }
        __syncthreads();
    }
    rowsum_times(dk, rs, qb, t);
    float* dst = dqkv + (long long)b * T * 3 * C + h * D;
    store_rows(dst + C, 3 * C, dk, scale, k0, T, g, t);
    store_rows(dst + 2 * C, 3 * C, dv, 1.0f, k0, T, g, t);
#else
    __trap();
#endif
}

// dQ = dS K from the dS attention_dkv_tc stored: one product, not three. A warp owns 16 queries, one row of dS
// tiles, and reads the A fragments of the next key tile from memory while it multiplies this one; K tiles stream
// through shared memory. Keys past the warp's last query are zeros (tiles above the diagonal were never written).
__device__ __forceinline__ void load_ds(float (&c)[DQ_TILE / 8][4], const float* __restrict__ row, int kt0, int qt,
                                        int g, int t) {
#pragma unroll
    for (int kk = 0; kk < DQ_TILE / 8; ++kk) {
        const int ktile = kt0 + kk / 2;
        const float* p = row + (long long)ktile * 256 + ((kk % 2) * 8 + 2 * t) * 16 + g;
#pragma unroll
        for (int e = 0; e < 4; ++e) c[kk][e] = ktile <= qt ? __ldg(p + (e & 1) * 16 + (e >> 1) * 8) : 0.0f;
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 2) attention_dq_tc(
        const float* __restrict__ qkv, const float* __restrict__ bias, const float* __restrict__ ds,
        float* __restrict__ dqkv, int T, int H, float scale) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) Tile<DQ_TILE> ks;
    __shared__ float kb[D];
    const int C = H * D, bh = blockIdx.y, b = bh / H, h = bh % H;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const float* k_src = qkv + (long long)b * T * 3 * C + C + h * D;
    const float* k_bias = bias ? bias + C + h * D : nullptr;
    const int row0 = (gridDim.x - 1 - blockIdx.x) * ROWS, r0 = row0 + warp * 16;
    const int last = min(T, row0 + ROWS), qt = r0 / 16, nt16 = (T + 15) / 16;
    const float* row = ds + ((long long)bh * (nt16 * (nt16 + 1) / 2) + qt * (qt + 1) / 2) * 256;
    const bool active = r0 < T;
    fetch<DQ_TILE>(ks.v[0], k_src, 3 * C, 0, T);
    copy_commit();
    load_bias(kb, k_bias);
    float dq[KD][4], c[DQ_TILE / 8][4], nx[DQ_TILE / 8][4], rs[2] = {0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < KD; ++nt) zero(dq[nt]);
    if (active) load_ds(nx, row, 0, qt, g, t);
    for (int j0 = 0, it = 0; j0 < last; j0 += DQ_TILE, ++it) {
        const int cur = it & 1;
        if (j0 + DQ_TILE < last) fetch<DQ_TILE>(ks.v[cur ^ 1], k_src, 3 * C, j0 + DQ_TILE, T);
        copy_commit();
        wait_tiles();
        if (active && j0 <= r0 + 15) {
#pragma unroll
            for (int kk = 0; kk < DQ_TILE / 8; ++kk)
#pragma unroll
                for (int e = 0; e < 4; ++e) c[kk][e] = nx[kk][e];
            if (j0 + DQ_TILE <= r0 + 15) load_ds(nx, row, (j0 + DQ_TILE) / 16, qt, g, t);
            product_acc<DQ_TILE>(dq, c, ks.v[cur], g, t);       // dQ += dS K (+ rowsum(dS) k_bias below)
#pragma unroll
            for (int kk = 0; kk < DQ_TILE / 8; ++kk)
#pragma unroll
                for (int e = 0; e < 4; ++e) rs[e >> 1] += c[kk][e];
        }
        __syncthreads();
    }
    rowsum_times(dq, rs, kb, t);
    store_rows(dqkv + (long long)b * T * 3 * C + h * D, 3 * C, dq, scale, r0, T, g, t);
#else
    __trap();
#endif
}
