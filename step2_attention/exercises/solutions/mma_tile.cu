// mma_tile.cu - Exercise 2c.1: one tensor-core tile per warp, C (16x8, fp32) = A (16xK) * B (Kx8), fp16 in.
//
// The solution. Each warp owns one independent tile: it walks K 16 at a time, loads its lane's share of A and
// B straight from global memory in the m16n8k16 fragment layout (g = lane >> 2, t = lane % 4):
//     A, 4 registers:  a[0] = A[g][2t, 2t+1]   a[1] = A[g+8][2t, 2t+1]   a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
//     B, 2 registers:  b[0] = B[2t, 2t+1][g]   b[1] = B[2t+8, 2t+9][g]
//     C, 4 floats:     d[0], d[1] = C[g][2t, 2t+1]                          d[2], d[3] = C[g+8][2t, 2t+1]
// (two 16-bit values per register, the lower index in the low half), issues one mma16816 per k-step into the
// same accumulators, and stores the four floats where the C row of the table says.
// Launch: blocks of WARPS warps, warp w of block x takes tile x * WARPS + w; a warp past the last tile leaves
// as a whole (mma.sync needs all 32 lanes of the warp).
// Architectures: fp16 mma.sync needs sm_75 (on sm_75 mma16816 runs it as two m16n8k8); sm_70 compiles an
// empty kernel, which the checker does not launch.
#include "mma.cuh"

#ifndef WARPS
#define WARPS 4
#endif

typedef unsigned short u16;

// two 16-bit values in one register: lo in bits 0..15 (the lower index), hi in bits 16..31
__device__ __forceinline__ unsigned pack(unsigned lo, unsigned hi) { return lo | (hi << 16); }

extern "C" __global__ void __launch_bounds__(32 * WARPS) mma_tiles(const u16* __restrict__ a, const u16* __restrict__ b,
                                                                   float* __restrict__ c, int tiles, int K) {
#if __CUDA_ARCH__ >= 750
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane % 4;
    const long long tile = (long long)blockIdx.x * WARPS + threadIdx.x / 32;
    if (tile >= tiles) return;                  // the whole warp leaves together
    const u16* A = a + tile * 16 * K;           // this tile's A: 16 x K, row-major, A[r][k] = A[r * K + k]
    const u16* B = b + tile * K * 8;            // this tile's B: K x 8, row-major, B[k][n] = B[k * 8 + n]
    float* C = c + tile * 16 * 8;               // this tile's C: 16 x 8, row-major
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k0 = 0; k0 < K; k0 += 16) {
        const int k = k0 + 2 * t;
        const unsigned fa[4] = {pack(A[g * K + k], A[g * K + k + 1]),
                                pack(A[(g + 8) * K + k], A[(g + 8) * K + k + 1]),
                                pack(A[g * K + k + 8], A[g * K + k + 9]),
                                pack(A[(g + 8) * K + k + 8], A[(g + 8) * K + k + 9])};
        const unsigned b0 = pack(B[k * 8 + g], B[(k + 1) * 8 + g]);          // two k of column g
        const unsigned b1 = pack(B[(k + 8) * 8 + g], B[(k + 9) * 8 + g]);
        mma16816<false>(d, fa, b0, b1);         // d += A_k * B_k: the accumulators carry over the k-steps
    }
    C[g * 8 + 2 * t] = d[0];
    C[g * 8 + 2 * t + 1] = d[1];
    C[(g + 8) * 8 + 2 * t] = d[2];
    C[(g + 8) * 8 + 2 * t + 1] = d[3];
#endif
}
