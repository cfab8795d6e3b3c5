// find_bug_tail.cu (solution) - find the bug, step 1: y = clamp(a*x + b, lo, hi), four elements per thread.
//
//   y[i] = min(max(a * x[i] + b, lo), hi)      for every i < n; thread t handles 4t .. 4t + 3
//
// The bug: the shipped kernel wrote its group only `if (i + 3 < n)`, i.e. when all four elements exist. When
// n is not a multiple of 4, the last thread owns 1 to 3 elements, fails that test and writes none of them:
// y[n - n % 4 .. n - 1] kept the checker's NaN (n = 1 wrote nothing at all). Why it bit: the test is right for
// every thread but the last, and the sizes we try first (powers of two) are multiples of 4.
// The fix: check each element on its own, so the last thread writes exactly the elements that exist.
extern "C" __global__ void scale_clamp4(const float* __restrict__ x, float* __restrict__ y,
                                        float a, float b, float lo, float hi, long long n) {
    const long long i = 4 * ((long long)blockIdx.x * blockDim.x + threadIdx.x);   // this thread's first element
#pragma unroll
    for (int k = 0; k < 4; ++k)
        if (i + k < n) y[i + k] = fminf(fmaxf(a * x[i + k] + b, lo), hi);        // FIX: one check per element
}
