// find_bug_inplace_loss.cu (solution) - find the bug, step 3: one row of the fused classifier, in place.
//
//   loss[r] = logsumexp(z[r, :]) - z[r, t]
//   z[r, i] <- (softmax(z[r, :])_i - [i == t]) * scale       (d loss / d logits, over the logits)
//
// The bug: the loss was computed as lse - zr[t] on the line AFTER zr[t] had been overwritten with its
// gradient, so it subtracted (p_t - 1) * scale instead of the logit z[r, t]. The gradient was right and
// the loss wrong in every row (V = 1: loss = z instead of 0). It is deterministic, no race: the thread
// that owns i == t writes zr[i] and then reads it back itself, in program order.
// Why it bit: in place, "zr[i]" names two different values before and after the write, and the line looks
// like the formula. The fix: read the logit once into a register, use it for both the gradient and the
// loss. (Moving the loss after the loop with a barrier would not help: the logit is gone by then.)
#include "course.cuh"

#define NEG_INF __int_as_float(0xff800000)

extern "C" __global__ void classifier_row(float* __restrict__ z, const int* __restrict__ targets,
                                          float* __restrict__ loss, int V, float scale) {
    __shared__ float scratch[32];
    float* zr = z + (long long)blockIdx.x * V;
    const int t = targets[blockIdx.x];
    float m = NEG_INF, s = 0.0f;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = zr[i];
        if (v > m) { s *= expf(m - v); m = v; }      // a new max: rescale what was summed so far
        s += expf(v - m);
    }
    const float mb = block_max(m, scratch);
    s = block_sum(m == NEG_INF ? 0.0f : s * expf(m - mb), scratch);   // a thread with no element adds 0
    const float lse = mb + logf(s);
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = zr[i];                       // FIX: the logit, read before it is overwritten
        zr[i] = (expf(v - lse) - (i == t ? 1.0f : 0.0f)) * scale;
        if (i == t) loss[blockIdx.x] = lse - v;      // the thread that owns the target writes the loss
    }
}
