// train_forward.cu - the forward pass and loss of a next-token MLP: from one kernel per operation to a
// fused classifier that never writes the logits back as probabilities.
//
// Model (B samples, context of K token ids each, vocabulary V, embedding E, hidden H):
//     x = mean_j emb[ctx[b, j]]          (B, E)
//     h = relu(x W1 + b1)                (B, H)
//     z = h W2 + b2                      (B, V)   <- the big tensor: B*V floats
//     loss_b = logsumexp(z_b) - z_b[target_b]
// The two GEMMs are cuBLAS (cupy.matmul). Everything around them is here.
//
//   v1  unfused pieces, one kernel per operation, as array code would run them:
//       bias_add, relu, softmax_rows, ce_loss, ce_grad. Each one reads (and most write) the whole B*V
//       logits tensor again: bias (r+w), softmax (r twice + w), loss (gather), grad (r+w) = ~7 passes.
//   v2  fused: embed_mean (gather + average), bias_relu (hidden epilogue) and classifier_fused:
//       one block per row adds the bias, finds max and sum(exp) in ONE online pass (the running max
//       rescales the running sum), writes the loss, and in a second pass over the same row (now in L1/L2,
//       not DRAM) overwrites the logits in place with dlogits = (softmax - onehot) * scale - llm.c's
//       "fused classifier". DRAM traffic on the logits: one read + one write instead of ~7 passes.
//
// Out-of-range token ids never read out of bounds: the affected output is NaN (the Python wrappers
// raise a clear error before launching, this is the second line of defence).
// Compile-time knob: none (block size comes from the launch; it must be a multiple of 32, <= 1024).
#include "course.cuh"

#define NAN_F __int_as_float(0x7fffffff)

// ---------------------------------------------------------------- shared by both: the embedding average
// One block per sample; threads walk the E features, so each gathered row is read coalesced.
extern "C" __global__ void embed_mean(const float* __restrict__ emb, const int* __restrict__ ctx,
                                      float* __restrict__ x, int B, int K, int E, int V) {
    const int b = blockIdx.x;
    const int* c = ctx + (long long)b * K;
    const float inv = 1.0f / (float)K;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float s = 0.0f;
        bool bad = false;
        for (int j = 0; j < K; ++j) {
            const int t = c[j];
            if (t < 0 || t >= V) bad = true;
            else s += emb[(long long)t * E + e];
        }
        x[(long long)b * E + e] = bad ? NAN_F : s * inv;
    }
}

// ---------------------------------------------------------------- v1: one kernel per operation
// y[r, c] += bias[c] for a (rows, cols) row-major matrix, in place.
extern "C" __global__ void bias_add(float* __restrict__ y, const float* __restrict__ bias, long long n, int cols) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] += bias[i % cols];
}

extern "C" __global__ void relu(float* __restrict__ y, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = fmaxf(y[i], 0.0f);
}

// p = softmax(z) row by row, one block per row: a max pass, a sum pass, a write pass.
extern "C" __global__ void softmax_rows(const float* __restrict__ z, float* __restrict__ p, int cols) {
    __shared__ float scratch[32];
    const float* zr = z + (long long)blockIdx.x * cols;
    float* pr = p + (long long)blockIdx.x * cols;
    float m = __int_as_float(0xff800000);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) m = fmaxf(m, zr[i]);
    m = block_max(m, scratch);
    float s = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) s += expf(zr[i] - m);
    s = block_sum(s, scratch);
    const float inv = 1.0f / s;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) pr[i] = expf(zr[i] - m) * inv;
}

// loss[b] = -log p[b, target[b]], one thread per row (a gather: only B floats are read, but it is a launch).
extern "C" __global__ void ce_loss(const float* __restrict__ p, const int* __restrict__ targets,
                                   float* __restrict__ loss, int rows, int cols) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= rows) return;
    const int t = targets[b];
    loss[b] = (t < 0 || t >= cols) ? NAN_F : -logf(p[(long long)b * cols + t]);
}

// d[b, i] = (p[b, i] - [i == target[b]]) * scale. d may alias p.
extern "C" __global__ void ce_grad(const float* p, const int* __restrict__ targets, float* d,
                                   long long n, int cols, float scale) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const int c = (int)(i % cols);
        const int t = targets[i / cols];
        d[i] = (p[i] - (c == t ? 1.0f : 0.0f)) * scale;
    }
}

// ---------------------------------------------------------------- v2: fused
// h = relu(h + b1) in place: the hidden layer's bias and activation as one pass (the GEMM's epilogue).
extern "C" __global__ void bias_relu(float* __restrict__ h, const float* __restrict__ bias, long long n, int cols) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        h[i] = fmaxf(h[i] + bias[i % cols], 0.0f);
}

// One block per row of z (B rows, V cols), in place.
//   mode 0: loss only (evaluation): z is read once and left as it was.
//   mode 1: loss and z <- dlogits = (softmax(z + bias) - onehot(target)) * scale (training).
//   mode 2: z <- softmax(z + bias) (prediction); targets may be null, then no loss is written.
// bias may be null (no bias: GPT's LM head).
extern "C" __global__ void classifier_fused(float* z, const float* __restrict__ bias, const int* __restrict__ targets,
                                            float* __restrict__ loss, int cols, float scale, int mode) {
    __shared__ float scratch[32];
    __shared__ float z_target;
    float* zr = z + (long long)blockIdx.x * cols;
    const int t = targets ? targets[blockIdx.x] : -1;
    const bool valid = t >= 0 && t < cols;
    // Read the target's logit before anyone may overwrite the row (block_sum below has the barriers).
    if (threadIdx.x == 0) z_target = valid ? zr[t] + (bias ? bias[t] : 0.0f) : NAN_F;
    // Online softmax: one pass keeps a running max m and a sum s of exp(z - m), rescaled when m grows.
    float m = __int_as_float(0xff800000), s = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float v = zr[i] + (bias ? bias[i] : 0.0f);
        if (v > m) { s *= expf(m - v); m = v; }
        s += expf(v - m);
    }
    const float mb = block_max(m, scratch);
    s = block_sum(m == __int_as_float(0xff800000) ? 0.0f : s * expf(m - mb), scratch);
    const float lse = mb + logf(s);
    if (threadIdx.x == 0 && targets) loss[blockIdx.x] = valid ? lse - z_target : NAN_F;
    if (mode == 0) return;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float p = expf(zr[i] + (bias ? bias[i] : 0.0f) - lse);
        zr[i] = mode == 1 ? (valid ? (p - (i == t ? 1.0f : 0.0f)) * scale : NAN_F) : p;
    }
}
