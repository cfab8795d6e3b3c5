// matmul_tiles.cu - Exercise 2a.2: the tile loads of a shared-memory tiled matmul.
//
//   C (M, N) = A (M, K) @ B (K, N), float32, row-major; M, N and K are NOT multiples of TILE.
//
// Everything is written except the loads. A block of TILE x TILE threads (threadIdx.x = tx is the
// column, threadIdx.y = ty the row) computes one TILE x TILE tile of C. For each k0 of the K loop:
//   As[ty][tx] must hold A[row][k0 + tx]   and   Bs[ty][tx] must hold B[k0 + ty][col],
//   or 0.0f where that element does not exist (row >= M, col >= N, or the k index >= K): a 0 adds
//   nothing to the dot product, so the last, partial tiles need no other special case.
// Then make sure the whole tile is in shared memory before any thread reads it (__syncthreads()),
// and that every thread has finished with it before the next iteration overwrites it.
// Grid: (ceil(N / TILE), ceil(M / TILE)) blocks.
//
// Hint 1 (where to look): Lesson 2a's matmul v2 (step2_attention/matmul.cu) loads its tiles the same way. For thread
//   (ty, tx): which element of A and which of B does it copy, and when does that element not exist?
// Hint 2 (the shape of the code): As[ty][tx] = (row < M && k0 + tx < K) ? A[row * K + k0 + tx] : 0.0f; Bs[ty][tx] =
//   (k0 + ty < K && col < N) ? B[(k0 + ty) * N + col] : 0.0f; __syncthreads() before the inner product loop and
//   another after it.
// The solution: solution("step2/matmul_tiles") gives its path (read it after trying).
// Check it with: from common.exercises import check; check("step2/matmul_tiles")
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
        // TODO: load this thread's element of A's tile into As[ty][tx] and of B's tile into Bs[ty][tx]
        // TODO: wait for the whole tile

#pragma unroll
        for (int k = 0; k < TILE; k++) acc += As[ty][k] * Bs[k][tx];
        // TODO: wait until every thread is done with this tile
    }
    if (row < M && col < N) C[(long long)row * N + col] = acc;
}
