// classifier_row.cu (solution) - exercise 12 of step 3: one row of the fused classifier.
//
// For row r of the logits z (rows, V) and its target t:
//   loss[r] = logsumexp(z[r, :]) - z[r, t]                   (cross-entropy of softmax(z[r, :]))
//   z[r, i] <- (softmax(z[r, :])_i - [i == t]) * scale       (d loss / d logits, in place)
// The logits are the biggest tensor of a language model's step (rows x 50257 for GPT-2): the unfused
// version reads and writes them ~7 times (softmax, loss, gradient), this one reads them twice and
// writes them once. Pass 1 is an online softmax: each thread keeps a running max m and a sum s of
// exp(z - m), rescaling s when m grows, so max and sum take one pass; block_max / block_sum combine
// the threads. Pass 2 writes the gradient over the row, which is still in L1/L2.
// The target's logit is read BEFORE pass 2 overwrites it (by thread 0, into shared memory; the barriers
// inside block_max / block_sum order that read before every thread's writes).
#include "course.cuh"

#define NEG_INF __int_as_float(0xff800000)

extern "C" __global__ void classifier_row(float* __restrict__ z, const int* __restrict__ targets,
                                          float* __restrict__ loss, int V, float scale) {
    __shared__ float scratch[32];
    __shared__ float z_target;
    float* zr = z + (long long)blockIdx.x * V;
    const int t = targets[blockIdx.x];
    if (threadIdx.x == 0) z_target = zr[t];
    float m = NEG_INF, s = 0.0f;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = zr[i];
        if (v > m) { s *= expf(m - v); m = v; }      // a new max: rescale what was summed so far
        s += expf(v - m);
    }
    const float mb = block_max(m, scratch);
    s = block_sum(m == NEG_INF ? 0.0f : s * expf(m - mb), scratch);   // a thread with no element adds 0
    const float lse = mb + logf(s);
    if (threadIdx.x == 0) loss[blockIdx.x] = lse - z_target;
    for (int i = threadIdx.x; i < V; i += blockDim.x)
        zr[i] = (expf(zr[i] - lse) - (i == t ? 1.0f : 0.0f)) * scale;
}
