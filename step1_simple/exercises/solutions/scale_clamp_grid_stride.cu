// scale_clamp_grid_stride.cu (solution) - exercise 2 of step 1: the same kernel as a grid-stride loop.
//
//   y[i] = min(max(a * x[i] + b, lo), hi)        for every i < n, whatever the grid size
//
// The grid is fixed (a few blocks per SM), not sized to n: each thread starts at its global index and
// steps by the total number of threads in the grid. On every trip the 32 threads of a warp still touch
// 32 consecutive floats, so the loads stay coalesced.
extern "C" __global__ void scale_clamp_grid_stride(const float* __restrict__ x, float* __restrict__ y,
                                                   float a, float b, float lo, float hi, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = fminf(fmaxf(a * x[i] + b, lo), hi);
}
