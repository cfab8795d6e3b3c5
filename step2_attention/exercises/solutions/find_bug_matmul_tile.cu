// find_bug_matmul_tile.cu (solution) - find the bug, step 2: a shared-memory tiled matmul.
//
//   C (M, N) = A (M, K) @ B (K, N), float32, row-major; TILE x TILE threads per TILE x TILE tile of C
//
// The bug: B's tile was stored as Bs[tx][ty] = B[k0 + ty, col] but read as Bs[k][tx], which needs
// Bs[k][tx] = B[k0 + k, col0 + tx]. Stored transposed, Bs[k][tx] held B[k0 + tx, col0 + k]: each thread
// multiplied A's row by the wrong elements of B, and C got plausible numbers, all wrong. Why it bit: the
// global load was right (coalesced, bounds-checked), only the shared-memory index was swapped, and with
// M = N = K = 1 (tx = ty = 0) the two orders agree. The fix: Bs[ty][tx], the same [row][col] order as As
// and as the read. Rule: name the tile's indices after B's own (row k, column n) and use that order in
// both the store and the read.
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
        Bs[ty][tx] = k0 + ty < K && col < N ? B[(long long)(k0 + ty) * N + col] : 0.0f;   // FIX: [row][col]
        __syncthreads();
#pragma unroll
        for (int k = 0; k < TILE; k++) acc += As[ty][k] * Bs[k][tx];
        __syncthreads();
    }
    if (row < M && col < N) C[(long long)row * N + col] = acc;
}
