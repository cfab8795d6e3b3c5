// mma_tile.cu - Exercise 2c.1: one tensor-core tile per warp, C (16x8, fp32) = A (16xK) * B (Kx8), fp16 in.
//
// TODO: write the fragment loads, the mma and the stores of one 16x8 tile, from the fragment table below.
//
// Each warp owns one independent tile (the checker gives several, with K = 16, 32, ... 128). Walk K 16 at a
// time: load this lane's share of A and B straight from global memory into registers, in the fragment layout
// of mma.sync.m16n8k16 (g = lane >> 2, t = lane % 4; a register holds two 16-bit values, the lower index in
// its low half: pack(lo, hi) below):
//     A, 4 registers:  a[0] = A[g][2t, 2t+1]   a[1] = A[g+8][2t, 2t+1]   a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
//     B, 2 registers:  b[0] = B[2t, 2t+1][g]   b[1] = B[2t+8, 2t+9][g]   (".col": two k of one column)
//     C, 4 floats:     d[0], d[1] = C[g][2t, 2t+1]                          d[2], d[3] = C[g+8][2t, 2t+1]
// (k counts from the current k-step k0). Then mma16816<false>(d, a, b0, b1) from common/include/mma.cuh
// (fp16 in, fp32 accumulate: d += A_k * B_k) once per k-step, and write d[0..3] to C where the C row says.
// Launch: blocks of WARPS warps, warp w of block x takes tile x * WARPS + w; the lines below already give each
// warp its tile, and send a warp past the last tile home as a whole (mma.sync needs all 32 lanes).
// Architectures: fp16 mma.sync needs sm_75 or newer (a T4 or later); on sm_70 the body is compiled out and the
// checker says so instead of running it.
//
// Hint 1 (where to look): the fragment tables of lesson 2c (`ops.mma_fragment_map("a")`, "b", "c" print which
//   lane holds which element), and mma_tile.cu's mma_tile_v1, which does the same for one 16x16 A.
// Hint 2 (the idea): with A row-major (16 x K), A[r][k] is A[r * K + k]; with B row-major (K x 8), B[k][n] is
//   B[k * 8 + n]. Keep d in registers across the k-steps: the instruction adds to it.
// The solution: solution("step2/mma_tile") gives its path.
//
// Check it with: from common.exercises import check; check("step2/mma_tile")
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
    const long long tile = (long long)blockIdx.x * WARPS + threadIdx.x / 32;
    if (tile >= tiles) return;                  // the whole warp leaves together
    // TODO: your code here. This warp's tile: A at a + tile * 16 * K (16 x K, row-major), B at b + tile * K * 8
    //   (K x 8, row-major), C at c + tile * 16 * 8 (16 x 8, row-major); this thread is lane threadIdx.x % 32.
    //   The k-steps (fragments, mma16816 into float d[4] = {0, 0, 0, 0}), then the four stores of d.
#endif
}
