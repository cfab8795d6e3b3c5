// matmul.cu - C = A @ B in float32, A (M, K), B (K, N), C (M, N), all row-major.
//
// A matmul does 2*M*N*K FLOPs on 4*(M*K + K*N + M*N) bytes: at 4096^3 that is 137 GFLOP on 201 MB,
// ~680 FLOPs per byte, far above any GPU's FLOP/byte balance. So it is compute-bound IF every byte
// loaded from DRAM is reused enough times on chip. The versions add reuse, one level at a time.
//
//   v1  naive: one thread per C element, K-loop over global memory. threadIdx.x walks columns, so a
//       warp reads one A element (broadcast) and 32 consecutive B elements (coalesced), but nothing is
//       reused on purpose: 2 loads per FMA, capped by L1/L2 bandwidth.
//   v2  shared-memory tiling: a TILE x TILE block stages TILE x TILE tiles of A and B in shared memory
//       and every element is used TILE times from there. Now 2 shared loads per FMA: capped by
//       shared-memory bandwidth.
//   v3  register tiling: a block computes a BM x BN tile (128 x 128), each thread a TM x TN (8 x 8)
//       sub-tile held in 64 registers. Per k a thread loads TM + TN values from shared memory (as
//       float4) and does TM*TN FMAs: 16 loads for 64 FMAs. A is stored transposed in shared memory
//       (As[k][m]) so a thread's 4 consecutive rows are one float4; its row gets +4 padding so the
//       transposing stores hit 32 different banks. The next K-tile is fetched from global into
//       registers while the current one is multiplied, and shared memory is double-buffered, so one
//       __syncthreads per K-tile suffices. A thread's 8 rows (and 8 columns) are two groups of 4,
//       BM/2 apart, so a warp's float4 reads of B cover 64 consecutive floats (no bank conflicts).
//
// Edges: every version handles M, N, K that are not multiples of the tile (out-of-range loads read 0,
// out-of-range stores are skipped). v3 has a float4 global-load path (matmul_v3: K % 4 == 0,
// N % 4 == 0, 16-byte-aligned pointers; the Python side checks) and a scalar one (matmul_v3_scalar).
//
// Compile-time knobs: TILE (v2, default 32: TILE*TILE threads), BM, BN, BK, TM, TN (v3; defaults
// 128, 128, 8, 8, 8: (BM/TM)*(BN/TN) = 256 threads), MIN_BLOCKS (v3 blocks per SM to budget
// registers for, default 2).
#ifndef TILE
#define TILE 32
#endif
#ifndef BM
#define BM 128
#endif
#ifndef BN
#define BN 128
#endif
#ifndef BK
#define BK 8
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2     // v3: ask ptxas for <= 128 registers so two 256-thread blocks share an SM
#endif
#ifndef TM
#define TM 8
#endif
#ifndef TN
#define TN 8
#endif

// ------------------------------------------------------------------ v1: naive
extern "C" __global__ void matmul_v1(const float* __restrict__ A, const float* __restrict__ B,
                                     float* __restrict__ C, int M, int N, int K) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    const int row = blockIdx.y * blockDim.y + threadIdx.y;
    if (row >= M || col >= N) return;
    const float* a = A + (long long)row * K;
    float acc = 0.0f;
    for (int k = 0; k < K; k++) acc += a[k] * B[(long long)k * N + col];
    C[(long long)row * N + col] = acc;
}

// ------------------------------------------------------------------ v2: shared-memory tiles
extern "C" __global__ void __launch_bounds__(TILE * TILE)
matmul_v2(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, int K) {
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int row = blockIdx.y * TILE + ty, col = blockIdx.x * TILE + tx;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        // Both loads are coalesced: consecutive tx read consecutive addresses.
        As[ty][tx] = row < M && k0 + tx < K ? A[(long long)row * K + k0 + tx] : 0.0f;
        Bs[ty][tx] = k0 + ty < K && col < N ? B[(long long)(k0 + ty) * N + col] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < TILE; k++) acc += As[ty][k] * Bs[k][tx];   // As: broadcast, Bs: 32 banks
        __syncthreads();
    }
    if (row < M && col < N) C[(long long)row * N + col] = acc;
}

// ------------------------------------------------------------------ v3: register tiles
#define NT ((BM / TM) * (BN / TN))     // threads per block
#define APAD 4                         // As row padding (floats): keeps float4 alignment, spreads banks
static_assert(TM % 4 == 0 && TN % 4 == 0, "TM and TN must be multiples of 4 (float4 fragments)");
static_assert((BM * BK) % (4 * NT) == 0 && (BN * BK) % (4 * NT) == 0, "tiles must split into float4 per thread");
static_assert(BK % 4 == 0, "BK must be a multiple of 4");

struct Stage {                         // one K-tile in flight through registers
    float4 a[BM * BK / (4 * NT)];
    float4 b[BN * BK / (4 * NT)];
};

// p[0..3] as a float4; only the first n of them exist, the others read as 0 (n <= 0: all 0). VEC: one
// 16-byte load (p is then 16-byte aligned and n >= 4 whenever n > 0: K % 4 == 0 and N % 4 == 0).
template <bool VEC>
__device__ __forceinline__ float4 load4(const float* p, int n) {
    if (VEC) return n > 0 ? *reinterpret_cast<const float4*>(p) : make_float4(0.f, 0.f, 0.f, 0.f);
    return make_float4(n > 0 ? p[0] : 0.f, n > 1 ? p[1] : 0.f, n > 2 ? p[2] : 0.f, n > 3 ? p[3] : 0.f);
}

// Global -> registers: this thread's share of the BM x BK tile of A and the BK x BN tile of B at k0.
template <bool VEC>
__device__ __forceinline__ void fetch(Stage& st, const float* A, const float* B, int M, int N, int K,
                                      int bm, int bn, int k0, int tid) {
#pragma unroll
    for (int i = 0; i < BM * BK / (4 * NT); i++) {
        const int f = tid + i * NT;
        const int r = bm + f / (BK / 4), k = k0 + (f % (BK / 4)) * 4;      // row r, columns k .. k+3 of A
        st.a[i] = load4<VEC>(A + (long long)r * K + k, r < M ? K - k : 0);
    }
#pragma unroll
    for (int i = 0; i < BN * BK / (4 * NT); i++) {
        const int f = tid + i * NT;
        const int k = k0 + f / (BN / 4), c = bn + (f % (BN / 4)) * 4;      // row k, columns c .. c+3 of B
        st.b[i] = load4<VEC>(B + (long long)k * N + c, k < K ? N - c : 0);
    }
}

// Registers -> shared memory, A transposed (As[k][m]) so that the compute loop reads 4 rows as one float4.
__device__ __forceinline__ void stash(const Stage& st, float (*As)[BM + APAD], float (*Bs)[BN], int tid) {
#pragma unroll
    for (int i = 0; i < BM * BK / (4 * NT); i++) {
        const int f = tid + i * NT;
        const int r = f / (BK / 4), k = (f % (BK / 4)) * 4;
        As[k + 0][r] = st.a[i].x;      // transposed: As[k][m], so the compute loop reads rows as float4
        As[k + 1][r] = st.a[i].y;
        As[k + 2][r] = st.a[i].z;
        As[k + 3][r] = st.a[i].w;
    }
#pragma unroll
    for (int i = 0; i < BN * BK / (4 * NT); i++) {
        const int f = tid + i * NT;
        *reinterpret_cast<float4*>(&Bs[f / (BN / 4)][(f % (BN / 4)) * 4]) = st.b[i];
    }
}

template <bool VEC>
__device__ __forceinline__ void matmul_regtile(const float* __restrict__ A, const float* __restrict__ B,
                                               float* __restrict__ C, int M, int N, int K) {
    __shared__ __align__(16) float As[2][BK][BM + APAD];
    __shared__ __align__(16) float Bs[2][BK][BN];
    constexpr int GM = BM * 4 / TM, GN = BN * 4 / TN;    // distance between a thread's groups of 4
    const int tid = threadIdx.x;
    const int tx = tid % (BN / TN), ty = tid / (BN / TN);
    const int bm = blockIdx.y * BM, bn = blockIdx.x * BN;

    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TN; j++) acc[i][j] = 0.0f;

    Stage st;
    fetch<VEC>(st, A, B, M, N, K, bm, bn, 0, tid);
    stash(st, As[0], Bs[0], tid);
    __syncthreads();
    const int tiles = (K + BK - 1) / BK;
    for (int t = 0; t < tiles; t++) {
        const int cur = t & 1;
        if (t + 1 < tiles) fetch<VEC>(st, A, B, M, N, K, bm, bn, (t + 1) * BK, tid);   // in flight during the FMAs
#pragma unroll
        for (int k = 0; k < BK; k++) {
            float a[TM], b[TN];
#pragma unroll
            for (int g = 0; g < TM / 4; g++) {
                const float4 v = *reinterpret_cast<const float4*>(&As[cur][k][g * GM + ty * 4]);
                a[g * 4 + 0] = v.x; a[g * 4 + 1] = v.y; a[g * 4 + 2] = v.z; a[g * 4 + 3] = v.w;
            }
#pragma unroll
            for (int g = 0; g < TN / 4; g++) {
                const float4 v = *reinterpret_cast<const float4*>(&Bs[cur][k][g * GN + tx * 4]);
                b[g * 4 + 0] = v.x; b[g * 4 + 1] = v.y; b[g * 4 + 2] = v.z; b[g * 4 + 3] = v.w;
            }
#pragma unroll
            for (int i = 0; i < TM; i++)
#pragma unroll
                for (int j = 0; j < TN; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        // The other buffer was last read in iteration t-1, which every thread finished before the
        // barrier that ended it: writing it now is safe, and one barrier per K-tile is enough.
        if (t + 1 < tiles) stash(st, As[cur ^ 1], Bs[cur ^ 1], tid);
        __syncthreads();                        // tile t+1 is in shared memory for everyone
    }

#pragma unroll
    for (int i = 0; i < TM; i++) {
        const int r = bm + (i / 4) * GM + ty * 4 + (i % 4);
        if (r >= M) continue;
#pragma unroll
        for (int g = 0; g < TN / 4; g++) {
            const int c = bn + g * GN + tx * 4;
            float* p = C + (long long)r * N + c;
            if (VEC && c < N) {
                *reinterpret_cast<float4*>(p) = make_float4(acc[i][g * 4], acc[i][g * 4 + 1],
                                                            acc[i][g * 4 + 2], acc[i][g * 4 + 3]);
            } else if (!VEC) {
#pragma unroll
                for (int e = 0; e < 4; e++)
                    if (c + e < N) p[e] = acc[i][g * 4 + e];
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(NT, MIN_BLOCKS)
matmul_v3(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, int K) {
    matmul_regtile<true>(A, B, C, M, N, K);
}

extern "C" __global__ void __launch_bounds__(NT, MIN_BLOCKS)
matmul_v3_scalar(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, int K) {
    matmul_regtile<false>(A, B, C, M, N, K);
}
