// scale_clamp_grid_stride.cu - Exercise 1a.2: a grid-stride loop.
//
// Compute, for every i < n:
//
//   y[i] = min(max(a * x[i] + b, lo), hi)
//
// How it is launched: a FIXED grid, far fewer threads than n (the checker uses a tiny grid on purpose,
// and a few blocks per SM for timing). So one thread has to handle many elements: start at the
// thread's global index and step by the number of threads in the whole grid (gridDim.x * blockDim.x),
// so that neighbouring threads keep reading neighbouring floats on every trip (coalesced).
//
// Hint 1 (where to look): Exercise 1a.1's kernel handles one element per thread; here there are fewer threads than
//   elements. How many threads does the whole grid have (gridDim.x, blockDim.x)?
// Hint 2 (the shape of the code): for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i +=
//   (long long)gridDim.x * blockDim.x) { the body of exercise 1a.1 }.
// The solution: solution("step1/scale_clamp_grid_stride") gives its path (read it after trying).
// Check it with: from common.exercises import check; check("step1/scale_clamp_grid_stride")
extern "C" __global__ void scale_clamp_grid_stride(const float* __restrict__ x, float* __restrict__ y,
                                                   float a, float b, float lo, float hi, long long n) {
    // TODO: your code here
}
