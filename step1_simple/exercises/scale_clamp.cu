// scale_clamp.cu - Exercise 1a.1: your first kernel, one thread per element.
//
// Compute, for every i < n:
//
//   y[i] = min(max(a * x[i] + b, lo), hi)         (clamp a*x + b to the range [lo, hi])
//
// How it is launched: blocks of 256 threads and ceil(n / 256) blocks. n is rarely a multiple of 256,
// so the last block has threads with no element: they must not write (y has exactly n elements).
//
// Hint 1 (where to look): Each thread computes its global index i = blockIdx.x * blockDim.x + threadIdx.x, as a long
//   long (a product of two ints overflows past 2^31). Which threads of the last block have no element?
// Hint 2 (the shape of the code): Three lines: the index; `if (i < n)`; y[i] = fminf(fmaxf(a * x[i] + b, lo), hi).
//   fminf / fmaxf clamp without a branch.
// The solution: solution("step1/scale_clamp") gives its path (read it after trying).
// Check it with: from common.exercises import check; check("step1/scale_clamp")
extern "C" __global__ void scale_clamp(const float* __restrict__ x, float* __restrict__ y,
                                       float a, float b, float lo, float hi, long long n) {
    // TODO: your code here
}
