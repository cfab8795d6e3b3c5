// train_backward.cu - the backward pass around the GEMMs, and where atomics are (and are not) needed.
//
// Given dz = dlogits (B, V) from the fused classifier (train_forward.cu):
//     dW2 = h^T dz   (cuBLAS)          db2 = sum_b dz[b, :]
//     dh  = dz W2^T  (cuBLAS)          dhpre = dh * [h > 0]          db1 = sum_b dhpre[b, :]
//     dW1 = x^T dhpre (cuBLAS)         dx = dhpre W1^T (cuBLAS)
//     demb[ctx[b, j], :] += dx[b, :] / K   for every sample b and context slot j
//
// Atomics. A bias gradient is a sum over the batch. Written per sample ("for each b: db += dz[b]") it
// needs an atomicAdd per element per sample - B-way contention on every address. Instead each block owns
// a strip of 32 columns and reduces over the batch itself (threads split the rows, then a shared-memory
// tree): no atomics, deterministic. The GEMMs do the same for dW1/dW2. The embedding gradient is the one
// place where atomics are natural: sample b writes rows chosen by the DATA (its context ids), and two
// samples - or two slots of one sample - may name the same token. The alternative is to sort the
// (token, sample) pairs and let one block own each distinct token; with B*K << V collisions are rare, so
// atomics on distinct addresses cost almost nothing here.
//
//   v1  unfused pieces: column_sum (one bias gradient per launch), relu_backward (its own pass).
//   v2  fused: bias_grads_relu_backward - ONE launch computes db2 (column sums of dz), and, in other
//       blocks of the same grid, dhpre = dh * [h > 0] in place plus db1 (column sums of dhpre); the
//       masked gradient is summed from registers, so dhpre is never re-read for db1.
//   embedding_backward: dense demb (must be zeroed) by atomic scatter; needed for AdamW, which updates
//       every row. embedding_sgd: for SGD the update IS the scattered gradient, so the fused step applies
//       -lr * dx / K straight into the embedding table and never materialises the V*E gradient.
// Compile-time knobs, passed by training.py (which sizes the grids with them): COLS columns per block strip
// (32 = one warp wide, so row reads are 128-byte coalesced) and ROWS warps per block, splitting the batch.
#ifndef COLS
#error "COLS is passed by training.py"
#endif
#ifndef ROWS
#error "ROWS is passed by training.py"
#endif

// Sum over the rows of a strip: thread (lane, warp) owns column col, rows warp, warp+ROWS, ...
// `acc` is the thread's partial; returns the column total in warp 0 (other warps get garbage).
__device__ __forceinline__ float strip_reduce(float acc, float (*s)[COLS + 1]) {
    const int lane = threadIdx.x % COLS, w = threadIdx.x / COLS;
    s[w][lane] = acc;
    __syncthreads();
    if (w == 0) {
        for (int r = 1; r < ROWS; ++r) acc += s[r][lane];
    }
    __syncthreads();
    return acc;
}

// ---------------------------------------------------------------- v1: one kernel per operation
// out[c] = sum_r a[r, c]; grid = ceil(cols / COLS), block = COLS * ROWS.
extern "C" __global__ void column_sum(const float* __restrict__ a, float* __restrict__ out, int rows, int cols) {
    __shared__ float s[ROWS][COLS + 1];
    const int lane = threadIdx.x % COLS, w = threadIdx.x / COLS;
    const int c = blockIdx.x * COLS + lane;
    float acc = 0.0f;
    if (c < cols)
        for (int r = w; r < rows; r += ROWS) acc += a[(long long)r * cols + c];
    acc = strip_reduce(acc, s);
    if (w == 0 && c < cols) out[c] = acc;
}

// dhpre = dh where h > 0, else 0 (h is the post-ReLU activation: h > 0 exactly where the input was > 0).
extern "C" __global__ void relu_backward(const float* __restrict__ dh, const float* __restrict__ h,
                                         float* __restrict__ dhpre, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dhpre[i] = h[i] > 0.0f ? dh[i] : 0.0f;
}

// ---------------------------------------------------------------- v2: fused
// Blocks [0, vblocks) : db2 = column sums of dz (B, V).
// Blocks [vblocks, ..): dh (B, H) <- dh * [h > 0] in place, and db1 = its column sums.
extern "C" __global__ void bias_grads_relu_backward(const float* __restrict__ dz, float* __restrict__ db2,
                                                    float* __restrict__ dh, const float* __restrict__ h,
                                                    float* __restrict__ db1, int B, int V, int H, int vblocks) {
    __shared__ float s[ROWS][COLS + 1];
    const int lane = threadIdx.x % COLS, w = threadIdx.x / COLS;
    float acc = 0.0f;
    if (blockIdx.x < vblocks) {
        const int c = blockIdx.x * COLS + lane;
        if (c < V)
            for (int r = w; r < B; r += ROWS) acc += dz[(long long)r * V + c];
        acc = strip_reduce(acc, s);
        if (w == 0 && c < V) db2[c] = acc;
    } else {
        const int c = (blockIdx.x - vblocks) * COLS + lane;
        if (c < H)
            for (int r = w; r < B; r += ROWS) {
                const long long i = (long long)r * H + c;
                const float g = h[i] > 0.0f ? dh[i] : 0.0f;
                dh[i] = g;
                acc += g;
            }
        acc = strip_reduce(acc, s);
        if (w == 0 && c < H) db1[c] = acc;
    }
}

// demb[ctx[b, j], :] += dx[b, :] / K with atomics (demb zeroed by the caller). One block per sample.
// Out-of-range ids are skipped (the wrappers reject them before launching).
extern "C" __global__ void embedding_backward(const float* __restrict__ dx, const int* __restrict__ ctx,
                                              float* __restrict__ demb, int K, int E, int V) {
    const int b = blockIdx.x;
    const float inv = 1.0f / (float)K;
    for (int j = 0; j < K; ++j) {
        const int t = ctx[(long long)b * K + j];
        if (t < 0 || t >= V) continue;
        for (int e = threadIdx.x; e < E; e += blockDim.x)
            atomicAdd(demb + (long long)t * E + e, dx[(long long)b * E + e] * inv);
    }
}

// SGD on the embedding straight from dx: emb[ctx[b, j], :] -= lr * dx[b, :] / K. Only touched rows move.
extern "C" __global__ void embedding_sgd(float* __restrict__ emb, const float* __restrict__ dx,
                                         const int* __restrict__ ctx, float lr, int K, int E, int V) {
    const int b = blockIdx.x;
    const float step = -lr / (float)K;
    for (int j = 0; j < K; ++j) {
        const int t = ctx[(long long)b * K + j];
        if (t < 0 || t >= V) continue;
        for (int e = threadIdx.x; e < E; e += blockDim.x)
            atomicAdd(emb + (long long)t * E + e, dx[(long long)b * E + e] * step);
    }
}
