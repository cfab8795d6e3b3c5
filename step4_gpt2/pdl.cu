// pdl.cu - two kernels in a row with programmatic dependent launch: the next one starts while this one drains.
//
// A decode step is a chain of small kernels, each reading what the one before wrote. Each has a prologue
// that needs nothing from its predecessor: it computes its indices and loads its weights. With programmatic
// dependent launch (common/include/pdl.cuh says how) that prologue overlaps the tail of the kernel before,
// and only the reads of its output wait. This file is the smallest such chain, y = w * x + b, where w plays
// the weights (no kernel writes it) and x the activations (the previous kernel's output):
//
//   chain_v1   plain: read w and x, write y. Launched with the attribute it would read x too early.
//   chain_v2   v1 with the PDL contract: w is loaded before pdl_wait(), x after it; the block then lets the
//              next kernel start (pdl_launch_dependents) while it computes and stores.
//
// Launch v2 with step4_gpt2/pdl.py: launch_pdl(kernel, grid, block, args, stream); in a CUDA graph captured
// from such launches, the edge between the two kernels keeps the overlap (a programmatic edge).
#include "pdl.cuh"

extern "C" __global__ void chain_v1(const float* __restrict__ w, const float* __restrict__ x,
                                    float* __restrict__ y, float b, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = w[i] * x[i] + b;
}

extern "C" __global__ void chain_v2(const float* __restrict__ w, const float* __restrict__ x,
                                    float* __restrict__ y, float b, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const float wi = i < n ? w[i] : 0.0f;      // the prologue: weights are never written by a kernel
    pdl_wait();                                // every thread, even past n: see pdl.cuh's rules
    pdl_launch_dependents();
    if (i < n) y[i] = wi * x[i] + b;
}
