// find_bug_tail.cu - Exercise 1a.4, find the bug: y = clamp(a*x + b, lo, hi), four elements per thread.
//
// TODO: this kernel compiles and looks right, but it has ONE bug. Find it and fix it (a small change).
//
// What it should do: for every i < n,
//   y[i] = min(max(a * x[i] + b, lo), hi)
// Each thread handles four neighbouring elements, 4t .. 4t + 3 (t its global index); the checker launches
// ceil(ceil(n / 4) / 256) blocks of 256 threads. n can be anything from 1 up.
//
// Symptom: check("step1/find_bug_tail") FAILs some cases and PASSes others. Read the table: which sizes
// pass, which fail, at which index, and what value is there (nan: nobody wrote that element).
//
// Hint 1 (where to look): the cases that pass have n = 4 and n = 4,096; the first mismatch of the others is
//   at index n - n % 4. Which thread owns the last n % 4 elements, and does it write them?
// Hint 2 (the class of bug): a tail bug. A bounds check that tests a whole group of four at once drops the
//   last, partial group: each element needs its own check.
// The solution: solution("step1/find_bug_tail") gives its path; it names the bug and why it bit.
//
// Check it with: from common.exercises import check; check("step1/find_bug_tail")
extern "C" __global__ void scale_clamp4(const float* __restrict__ x, float* __restrict__ y,
                                        float a, float b, float lo, float hi, long long n) {
    const long long i = 4 * ((long long)blockIdx.x * blockDim.x + threadIdx.x);   // this thread's first element
    if (i + 3 < n) {                                   // all four elements of the group are in range
#pragma unroll
        for (int k = 0; k < 4; ++k) y[i + k] = fminf(fmaxf(a * x[i + k] + b, lo), hi);
    }
}
