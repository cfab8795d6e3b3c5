// streams.cu - kernels whose running time we know in advance, to see what a timer measures and when two
// kernels run at once.
//
//   busy_wait    every thread spins until `ns` nanoseconds have passed on the GPU's own clock: a kernel that
//                takes a known time however fast the GPU is. Launched with a few blocks, it occupies a few SMs
//                and leaves the rest free - a stand-in for a small kernel.
//   late_fill    waits `ns` nanoseconds, then writes y[i] = value: a slow producer, to show what a second
//                stream reads when it does not wait for it.

// The GPU's nanosecond clock, read with one line of PTX (docs/cuda_cpp.md#inline-ptx): CUDA C++ has no name for it.
__device__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

extern "C" __global__ void busy_wait(unsigned long long ns) {
    unsigned long long t0 = global_ns();
    while (global_ns() - t0 < ns) {}
}

extern "C" __global__ void late_fill(float* __restrict__ y, float value, long long n, unsigned long long ns) {
    unsigned long long t0 = global_ns();
    while (global_ns() - t0 < ns) {}
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = value;
}
