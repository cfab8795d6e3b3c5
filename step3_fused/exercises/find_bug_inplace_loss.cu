// find_bug_inplace_loss.cu - Exercise 3b.3, find the bug: one row of the fused classifier, in place.
//
// TODO: this kernel compiles and looks right, but it has ONE bug. Find it and fix it (a small change).
//
// What it should do: for row r = blockIdx.x of the logits z (rows, V) and its target t = targets[r],
//   loss[r] = logsumexp(z[r, :]) - z[r, t]                   (cross-entropy of softmax(z[r, :]))
//   z[r, i] <- (softmax(z[r, :])_i - [i == t]) * scale       (d loss / d logits, written over the logits)
// One block of 256 threads per row. Pass 1: an online max and sum of exp (block_max / block_sum from
// course.cuh combine the threads); pass 2: the gradient, written over the row, and the loss.
//
// Symptom: check("step3/find_bug_inplace_loss") fails every case on `loss`, even B = 1, V = 1, while
// the gradient written into z is right (fix the loss alone and every case passes).
//
// Hint 1 (where to look): only `loss` is wrong, so look at the one line that writes it. Which value of
//   zr[t] does it read: the logit, or something written a moment earlier? (With V = 1: the loss should be
//   0; it prints the logit itself.)
// Hint 2 (the class of bug): read-after-overwrite in an in-place kernel. When a kernel writes its output
//   over its input, every read of the input must come before the write that replaces it.
// The solution: solution("step3/find_bug_inplace_loss") gives its path; it names the bug and why it bit.
//
// Check it with: from common.exercises import check; check("step3/find_bug_inplace_loss")
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
        zr[i] = (expf(zr[i] - lse) - (i == t ? 1.0f : 0.0f)) * scale;
        if (i == t) loss[blockIdx.x] = lse - zr[i];  // the thread that owns the target writes the loss
    }
}
