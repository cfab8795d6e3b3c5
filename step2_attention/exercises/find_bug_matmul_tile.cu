// find_bug_matmul_tile.cu - Exercise 2a.5, find the bug: a shared-memory tiled matmul.
//
// TODO: this kernel compiles and looks right, but it has ONE bug. Find it and fix it (a small change).
//
// What it should do: C (M, N) = A (M, K) @ B (K, N), float32, row-major, any M, N, K >= 1. A block of
// TILE x TILE (32 x 32) threads computes one TILE x TILE tile of C: for each step k0 of the K loop, each
// thread loads one element of A's tile and one of B's into shared memory (0 outside the matrices), a
// barrier, TILE multiply-adds from shared memory, a barrier. Grid: (ceil(N / TILE), ceil(M / TILE)).
//
// Symptom: check("step2/find_bug_matmul_tile") passes M = N = K = 1 and fails every other case, with
// plausible-looking wrong numbers (no nan: every element of C is written).
//
// Hint 1 (where to look): every global address is right (bounds, coalescing); the shared tiles are not.
//   Write out, for one thread (tx, ty), which element of B sits in Bs[k][tx] after the load, and which
//   one the multiply-add needs there.
// Hint 2 (the class of bug): a shared-memory tile indexed [col][row] in one place and [row][col] in another:
//   the tile is stored transposed. With 1 x 1 matrices, row and column are both 0, so it cannot show.
// The solution: solution("step2/find_bug_matmul_tile") gives its path; it names the bug and why it bit.
//
// Check it with: from common.exercises import check; check("step2/find_bug_matmul_tile")
#ifndef TILE
#define TILE 32
#endif

extern "C" __global__ void __launch_bounds__(TILE * TILE)
matmul_tiled(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, int K) {
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int row = blockIdx.y * TILE + ty, col = blockIdx.x * TILE + tx;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        // consecutive tx read consecutive addresses in both loads: coalesced
        As[ty][tx] = row < M && k0 + tx < K ? A[(long long)row * K + k0 + tx] : 0.0f;
        Bs[tx][ty] = k0 + ty < K && col < N ? B[(long long)(k0 + ty) * N + col] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < TILE; k++) acc += As[ty][k] * Bs[k][tx];
        __syncthreads();
    }
    if (row < M && col < N) C[(long long)row * N + col] = acc;
}
