// scale_clamp.cu (solution) - exercise 1 of step 1: one thread per element, with a bounds check.
//
//   y[i] = min(max(a * x[i] + b, lo), hi)        for i < n
//
// Launch: blocks of 256 threads, ceil(n / 256) blocks, so the last block usually has threads past n.
// Each element is read once and written once (8 bytes), so the kernel's ceiling is the copy bandwidth.
extern "C" __global__ void scale_clamp(const float* __restrict__ x, float* __restrict__ y,
                                       float a, float b, float lo, float hi, long long n) {
    // 64-bit index: blockIdx.x * blockDim.x overflows int past 2^31 elements
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = fminf(fmaxf(a * x[i] + b, lo), hi);   // threads past the end must not write
}
