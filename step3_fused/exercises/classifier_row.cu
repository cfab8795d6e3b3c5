// classifier_row.cu - Exercise 3b.1: softmax, cross-entropy loss and the logits' gradient of
// one row, in one kernel.
//
// z is (rows, V) logits, targets (rows,) the right class of each row, in 0 .. V-1. For each row r:
//   loss[r] = logsumexp(z[r, :]) - z[r, t]       t = targets[r]; logsumexp = m + log(sum_i exp(z_i - m))
//   z[r, i] <- (softmax(z[r, :])_i - (i == t ? 1 : 0)) * scale       IN PLACE, every i < V
// Launch: one block of 256 threads per row; V can be 1, 37 or 50257, and the logits can be in the
// hundreds (so exp(z) alone overflows: work relative to the row's max m).
// Aim for two passes over the row: one that finds the max and the sum of exp together (online softmax:
// keep a running max m and a sum s of exp(z - m); when a larger value arrives, multiply s by
// exp(m_old - m_new) first), and one that writes the gradient. block_max / block_sum from course.cuh
// combine the threads' values (they need a __shared__ float scratch[32]; their barriers also order
// what happened before them). Mind the race: the thread that writes z[r, t] may run before the
// thread that reads z[r, t] for the loss, unless the read comes first.
//
// Hint 1 (where to look): Lesson 3b's fused classifier (step3_fused/train_forward.cu) does this row by row. Before any
//   write: the max and the sum of exp, combined over the block, and z[r, t] read into a register.
// Hint 2 (the shape of the code): thread 0 first copies z[r, t] to a __shared__ float; each thread keeps an
//   online (m, s) over i = tid, tid + 256, ...; M = block_max(m); S = block_sum(m == -inf ? 0 : s * expf(m - M));
//   thread 0 writes loss = M + logf(S) - z_t; then a loop writes (expf(z - M) / S - (i == t)) * scale.
// The solution: solution("step3/classifier_row") gives its path (read it after trying).
// Check it with: from common.exercises import check; check("step3/classifier_row")
#include "course.cuh"

#define NEG_INF __int_as_float(0xff800000)

extern "C" __global__ void classifier_row(float* __restrict__ z, const int* __restrict__ targets,
                                          float* __restrict__ loss, int V, float scale) {
    // TODO: your code here
}
