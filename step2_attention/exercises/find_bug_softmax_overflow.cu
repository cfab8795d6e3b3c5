// find_bug_softmax_overflow.cu - Exercise 2a.4, find the bug: row softmax, one warp per row.
//
// TODO: this kernel compiles and looks right, but it has ONE bug. Find it and fix it (a small change).
//
// What it should do: for every row r < rows and column j < cols,
//   y[r, j] = exp(x[r, j]) / sum_k exp(x[r, k])
// for ANY float32 inputs (attention scores and logits can be in the hundreds). One warp per row, WARPS (4)
// rows per block: the 32 lanes stride across the row, warp_sum (course.cuh) adds their partial sums.
//
// Symptom: check("step2/find_bug_softmax_overflow") passes the rows of values in [-1, 1) and even those up
// to +-80, then fails the rows with values up to +-100 and +-500: nan (or 0) where a probability should be.
//
// Hint 1 (where to look): the failing cases differ from the passing ones only in the size of the values.
//   What is expf(89.0f) in float32? And inf / inf? (Try it in NumPy: np.exp(np.float32(89)).)
// Hint 2 (the class of bug): an overflow that the mathematically equal, numerically stable form avoids.
//   softmax(x) = softmax(x - c) for any constant c; which c keeps every exponent <= 0?
// The solution: solution("step2/find_bug_softmax_overflow") gives its path; it names the bug and why it bit.
//
// Check it with: from common.exercises import check; check("step2/find_bug_softmax_overflow")
#include "course.cuh"

#ifndef WARPS
#define WARPS 4
#endif

extern "C" __global__ void softmax_rows(const float* __restrict__ x, float* __restrict__ y, int rows, int cols) {
    const int lane = threadIdx.x % 32;
    const int r = blockIdx.x * WARPS + threadIdx.x / 32;
    if (r >= rows) return;                  // a whole warp leaves together: the shuffles stay full-mask
    const float* xr = x + (long long)r * cols;
    float* yr = y + (long long)r * cols;
    float s = 0.0f;
    for (int j = lane; j < cols; j += 32) s += expf(xr[j]);
    const float inv = 1.0f / warp_sum(s);
    for (int j = lane; j < cols; j += 32) yr[j] = expf(xr[j]) * inv;
}
