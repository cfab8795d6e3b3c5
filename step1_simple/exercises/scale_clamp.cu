// scale_clamp.cu - exercise 1 of step 1: your first kernel, one thread per element.
//
// Compute, for every i < n:
//
//   y[i] = min(max(a * x[i] + b, lo), hi)         (clamp a*x + b to the range [lo, hi])
//
// How it is launched: blocks of 256 threads and ceil(n / 256) blocks. n is rarely a multiple of 256,
// so the last block has threads with no element: they must not write (y has exactly n elements).
// Hints: the global index is blockIdx.x * blockDim.x + threadIdx.x (make it a long long);
// fminf / fmaxf clamp without branches.
// Check it with: from common.exercises import check; check("step1/scale_clamp")
extern "C" __global__ void scale_clamp(const float* __restrict__ x, float* __restrict__ y,
                                       float a, float b, float lo, float hi, long long n) {
    // TODO: your code here
}
