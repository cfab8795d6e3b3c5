// sublayer_glue.cu - the small kernels an UNFUSED attention sublayer needs between its big ones.
//
// A framework without fusion runs each of these as its own launch, and each one is a full round trip
// of an activation tensor through DRAM:
//
//   bias_add_rows   y[n, c] = x[n, c] + bias[c]        (after each GEMM)       read 1, write 1
//   split_heads     (B, T, 3C) -> q, k, v (B, H, T, D)  (the permute)          read 1, write 1
//   merge_heads     (B, H, T, D) -> (B, T, C)           (undo the permute)     read 1, write 1
//   add             y = a + b                           (the residual)         read 2, write 1
//
// The fused pipeline (ops.attention_sublayer_fused) does all of them inside other kernels: the bias and
// the permute in flash attention's loads and stores, the bias and the residual in residual_layernorm.
// All are grid-stride loops over elements, one thread per element per iteration.
//
// bias_add_rows and add may run in place (y == x, or y == a / y == b): each thread reads element i and
// then writes element i, so aliasing is harmless - as long as the compiler is not told otherwise. Their
// x/y (a/b/y) pointers are therefore NOT __restrict__: promising no aliasing and then passing the same
// buffer twice is undefined behaviour, even when it happens to work.
// Compile-time knob: BLOCK (threads per block), passed by ops.py (GLUE_BLOCK), which launches with it.
#ifndef BLOCK
#error "BLOCK is passed by ops.py"
#endif

extern "C" __global__ void bias_add_rows(const float* x, const float* __restrict__ bias,
                                         float* y, long long n, int C) {
    for (long long i = (long long)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (long long)gridDim.x * BLOCK)
        y[i] = x[i] + bias[i % C];
}

extern "C" __global__ void add(const float* a, const float* b, float* y, long long n) {
    for (long long i = (long long)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (long long)gridDim.x * BLOCK)
        y[i] = a[i] + b[i];
}

// One thread per element of q/k/v, indexed in the OUTPUT order (b, h, t, d) so the writes coalesce;
// the reads are coalesced too (d is the fastest index on both sides).
extern "C" __global__ void split_heads(const float* __restrict__ qkv, float* __restrict__ q,
                                       float* __restrict__ k, float* __restrict__ v,
                                       int B, int T, int H, int D) {
    const long long n = (long long)B * H * T * D;
    const int C = H * D;
    for (long long i = (long long)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (long long)gridDim.x * BLOCK) {
        const int d = (int)(i % D);
        const int t = (int)((i / D) % T);
        const int h = (int)((i / ((long long)D * T)) % H);
        const long long b = i / ((long long)D * T * H);
        const long long src = (b * T + t) * 3LL * C + (long long)h * D + d;
        q[i] = qkv[src];
        k[i] = qkv[src + C];
        v[i] = qkv[src + 2 * C];
    }
}

extern "C" __global__ void merge_heads(const float* __restrict__ o, float* __restrict__ y,
                                       int B, int T, int H, int D) {
    const long long n = (long long)B * H * T * D;
    for (long long i = (long long)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (long long)gridDim.x * BLOCK) {
        // i indexes y (b, t, h, d): coalesced writes; reads walk o (b, h, t, d) in runs of D.
        const int d = (int)(i % D);
        const int h = (int)((i / D) % H);
        const int t = (int)((i / ((long long)D * H)) % T);
        const long long b = i / ((long long)D * H * T);
        y[i] = o[((b * H + h) * T + t) * D + d];
    }
}
