// matmul_tiles.cu (solution) - exercise 7 of step 2: the tile loads of a shared-memory tiled matmul.
//
//   C (M, N) = A (M, K) @ B (K, N), float32, row-major
//
// A TILE x TILE block computes a TILE x TILE tile of C. For each step k0 of the K loop, every thread
// loads ONE element of A's tile and ONE of B's into shared memory, and then reads 2 * TILE of them:
// each element fetched from global memory is used TILE times. Elements past M, N or K load as 0, so
// the padding adds nothing to the dot products and any M, N, K works.
// Two barriers per step: the tile is complete before anyone reads it, and everyone has finished
// reading it before the next step's loads overwrite it.
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
        Bs[ty][tx] = k0 + ty < K && col < N ? B[(long long)(k0 + ty) * N + col] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < TILE; k++) acc += As[ty][k] * Bs[k][tx];
        __syncthreads();
    }
    if (row < M && col < N) C[(long long)row * N + col] = acc;
}
