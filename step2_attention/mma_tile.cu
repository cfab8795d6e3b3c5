// mma_tile.cu - one tensor-core instruction, by hand: C (16x8, fp32) = A (16x16) * B (16x8), fp16 or bf16 in.
//
// A tensor core is driven by one warp at a time. `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32` takes A, B
// and C spread over the registers of all 32 lanes, in a fixed "fragment" layout, and returns D = A*B + C in the
// same layout as C. Nothing else is new: the whole lesson is which lane holds which element. With
//     g = lane >> 2   (groupID, 0..7)          t = lane % 4   (threadID_in_group, 0..3)
// the PTX ISA's fragment tables for m16n8k16 say (a 32-bit register holds two 16-bit values, the first one in
// its low half):
//     A, 4 registers:  a[0] = A[g][2t, 2t+1]   a[1] = A[g+8][2t, 2t+1]   a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
//     B, 2 registers:  b[0] = B[2t, 2t+1][g]   b[1] = B[2t+8, 2t+9][g]   (".col": two k of one column)
//     C, 4 floats:     c[0], c[1] = C[g][2t, 2t+1]                        c[2], c[3] = C[g+8][2t, 2t+1]
// step2_attention/ops.py computes the same map in Python (mma_fragment_map), and the tests check it on the GPU.
//
// v1: the fragments loaded straight from global memory, the index arithmetic written out;
// v2: the same tile through shared memory and ldmatrix, the load flash_attention_tc.cu uses;
// v3: one 16x8 tile of a larger C = A B per warp, the accumulator kept in registers over K (the GEMM inner loop).
// mma_fragments: the bare instruction, each lane passing in the registers it holds (the ownership test).
// v2, v3 and mma_fragments call v1's instruction as a function, mma16816, which lives with smem_addr in
// common/include/mma.cuh: flash_attention_tc.cu uses the same two.
//
// Architectures: m16n8k16 with fp16 or bf16 inputs needs sm_80. On sm_75 (T4) fp16 runs as two m16n8k8
// (the same registers, split in k); bf16 needs sm_80 and ops.py refuses older GPUs. sm_70 has neither shape
// nor ldmatrix: the kernels trap there, and ops.py refuses before launching.
// Layout: row-major A (M, K) and B (K, N), fp16 or bf16 (bit patterns as uint16); C (M, N) float32.
// v1/v2 take exactly one 16x16 A and 16x8 B; v3 any M, N, K (zero padding at the edges).

#include "mma.cuh"

#ifndef V3_WARPS
#define V3_WARPS 4      // v3: warps per block, each one 16x8 tile of C, stacked along M
#endif

typedef unsigned short u16;

// two 16-bit values in one register: lo in bits 0..15 (the lower row or column index), hi in bits 16..31
__device__ __forceinline__ unsigned pack(unsigned lo, unsigned hi) { return lo | (hi << 16); }

// ------------------------------------------------------------------------------------------------- v1
// One warp, one tile. Each lane fetches its own 8 values of A and 4 of B, following the table above.
template <bool BF16> __global__ void __launch_bounds__(32) mma_tile_v1(const u16* __restrict__ a, const u16* __restrict__ b, float* __restrict__ c) {
#if __CUDA_ARCH__ >= 750
    const int lane = threadIdx.x, g = lane >> 2, t = lane % 4;
    // A is 16x16 row-major: A[r][k] = a[r * 16 + k]
    const unsigned a0 = pack(a[g * 16 + 2 * t], a[g * 16 + 2 * t + 1]);
    const unsigned a1 = pack(a[(g + 8) * 16 + 2 * t], a[(g + 8) * 16 + 2 * t + 1]);
    const unsigned a2 = pack(a[g * 16 + 2 * t + 8], a[g * 16 + 2 * t + 9]);
    const unsigned a3 = pack(a[(g + 8) * 16 + 2 * t + 8], a[(g + 8) * 16 + 2 * t + 9]);
    // B is 16x8 row-major: B[k][n] = b[k * 8 + n]; a B register holds two neighbouring k of column n = g
    const unsigned b0 = pack(b[(2 * t) * 8 + g], b[(2 * t + 1) * 8 + g]);
    const unsigned b1 = pack(b[(2 * t + 8) * 8 + g], b[(2 * t + 9) * 8 + g]);
    float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;     // C = 0, so D = A * B
#if __CUDA_ARCH__ >= 800
    if (BF16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    if (BF16) __trap();   // bf16 mma needs sm_80; ops.py refuses before launching
    // sm_75 has m16n8k8 only: k = 0..7 lives in (a0, a1, b0), k = 8..15 in (a2, a3, b1)
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
                 : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3) : "r"(a0), "r"(a1), "r"(b0));
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
                 : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3) : "r"(a2), "r"(a3), "r"(b1));
#endif
    // C is 16x8 row-major: lane (g, t) writes C[g][2t, 2t+1] and C[g+8][2t, 2t+1]
    c[g * 8 + 2 * t] = d0;
    c[g * 8 + 2 * t + 1] = d1;
    c[(g + 8) * 8 + 2 * t] = d2;
    c[(g + 8) * 8 + 2 * t + 1] = d3;
#else
    __trap();   // no mma.sync for fp16/bf16 before sm_75; ops.py refuses before launching
#endif
}

// ------------------------------------------------------------------------------------------------- v2
// ldmatrix loads whole 8x8 tiles of 16-bit values from shared memory straight into fragment layout: each of
// lanes 0..7 (then 8..15, ...) passes the address of one 16-byte row of a tile, and every lane receives
// row lane/4, columns 2(lane%4), +1 of each tile: the (g, 2t) pattern of the table above.
//   A (x4): lanes 0-15 point at rows 0-15, column 0; lanes 16-31 at rows 0-15, column 8. The four tiles are
//           rows 0-7|8-15 x columns 0-7|8-15 in the order a[0], a[1], a[2], a[3].
//   B (x2.trans): B is stored row-major (k, n), but its register wants two k of one column: .trans hands
//           each lane the transposed tile, B[2t, 2t+1][g]. Lanes 0-15 point at rows k = 0..15 (tiles b[0], b[1]).
// (A's 32-byte rows make this ldmatrix a 2-way bank conflict; flash_attention_tc.cu pads rows by 16 bytes.)
template <bool BF16> __global__ void __launch_bounds__(32) mma_tile_v2(const u16* __restrict__ a, const u16* __restrict__ b, float* __restrict__ c) {
#if __CUDA_ARCH__ >= 750
    __shared__ __align__(16) u16 as[16 * 16];
    __shared__ __align__(16) u16 bs[16 * 8];
    const int lane = threadIdx.x, g = lane >> 2, t = lane % 4;
    for (int i = lane; i < 16 * 16; i += 32) as[i] = a[i];
    for (int i = lane; i < 16 * 8; i += 32) bs[i] = b[i];
    __syncwarp();
    unsigned fa[4], fb[2];
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(fa[0]), "=r"(fa[1]), "=r"(fa[2]), "=r"(fa[3]) : "r"(smem_addr(as + (lane % 16) * 16 + (lane / 16) * 8)));
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(fb[0]), "=r"(fb[1]) : "r"(smem_addr(bs + (lane % 16) * 8)));
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    mma16816<BF16>(d, fa, fb[0], fb[1]);
    c[g * 8 + 2 * t] = d[0];
    c[g * 8 + 2 * t + 1] = d[1];
    c[(g + 8) * 8 + 2 * t] = d[2];
    c[(g + 8) * 8 + 2 * t + 1] = d[3];
#else
    __trap();   // ldmatrix and mma.sync need sm_75
#endif
}

// ------------------------------------------------------------------------------------------------- v3
// element (r, col) of a row-major rows x cols matrix, 0 outside it: the zero padding lets any M, N, K work
__device__ __forceinline__ unsigned at(const u16* p, int r, int col, int rows, int cols) {
    return (r < rows && col < cols) ? p[(long long)r * cols + col] : 0u;
}

// A GEMM from v1: warp w of block (x, y) owns C's rows 16 (V3_WARPS y + w) .. +15 and columns 8x .. 8x+7,
// and walks K 16 at a time, the accumulator d staying in registers: C = sum over k-steps of A_k B_k.
// (Fragments still come straight from global memory, as in v1; a fast GEMM stages tiles through shared
// memory with ldmatrix (v2) and gives each warp several tiles to reuse every fragment it loads.)
template <bool BF16> __global__ void __launch_bounds__(32 * V3_WARPS) mma_tile_v3(const u16* __restrict__ a, const u16* __restrict__ b, float* __restrict__ c, int M, int N, int K) {
#if __CUDA_ARCH__ >= 750
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane % 4;
    const int m0 = (blockIdx.y * V3_WARPS + threadIdx.x / 32) * 16, n0 = blockIdx.x * 8;
    if (m0 >= M) return;    // the whole warp leaves together: mma.sync needs all 32 lanes
    const int r0 = m0 + g, r1 = m0 + g + 8, n = n0 + g;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k0 = 0; k0 < K; k0 += 16) {
        const int k = k0 + 2 * t;
        const unsigned fa[4] = {pack(at(a, r0, k, M, K), at(a, r0, k + 1, M, K)),
                                pack(at(a, r1, k, M, K), at(a, r1, k + 1, M, K)),
                                pack(at(a, r0, k + 8, M, K), at(a, r0, k + 9, M, K)),
                                pack(at(a, r1, k + 8, M, K), at(a, r1, k + 9, M, K))};
        const unsigned fb[2] = {pack(at(b, k, n, K, N), at(b, k + 1, n, K, N)),
                                pack(at(b, k + 8, n, K, N), at(b, k + 9, n, K, N))};
        mma16816<BF16>(d, fa, fb[0], fb[1]);
    }
    const int col = n0 + 2 * t;
    if (r0 < M && col < N) c[(long long)r0 * N + col] = d[0];
    if (r0 < M && col + 1 < N) c[(long long)r0 * N + col + 1] = d[1];
    if (r1 < M && col < N) c[(long long)r1 * N + col] = d[2];
    if (r1 < M && col + 1 < N) c[(long long)r1 * N + col + 1] = d[3];
#else
    __trap();
#endif
}

// ---------------------------------------------------------------------------------------- the bare mma
// No layout arithmetic at all: lane L passes in a_frag[L][0..7] (its A registers as 8 values, a0..a7),
// b_frag[L][0..3] and gets back c_frag[L][0..3]. Python places the matrices into these arrays with
// mma_fragment_map, so comparing the result with A @ B checks that map against the hardware.
template <bool BF16> __global__ void __launch_bounds__(32) mma_fragments(const u16* __restrict__ a_frag, const u16* __restrict__ b_frag, float* __restrict__ c_frag) {
#if __CUDA_ARCH__ >= 750
    const int lane = threadIdx.x;
    const u16* pa = a_frag + lane * 8;
    const u16* pb = b_frag + lane * 4;
    const unsigned fa[4] = {pack(pa[0], pa[1]), pack(pa[2], pa[3]), pack(pa[4], pa[5]), pack(pa[6], pa[7])};
    const unsigned fb[2] = {pack(pb[0], pb[1]), pack(pb[2], pb[3])};
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    mma16816<BF16>(d, fa, fb[0], fb[1]);
    for (int i = 0; i < 4; ++i) c_frag[lane * 4 + i] = d[i];
#else
    __trap();
#endif
}
