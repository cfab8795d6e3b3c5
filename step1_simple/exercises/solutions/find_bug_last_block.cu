// find_bug_last_block.cu (solution) - find the bug, step 1: a sum in one launch, the last block adds the partials.
//
//   *out = x[0] + ... + x[n-1]; tickets zeroed once by the caller, the kernel relaunched as it is
//
// The bug: the last block never set `tickets` back to 0. The first launch was right and left tickets =
// gridDim.x; in the second, atomicAdd returned gridDim.x, ..., 2 * gridDim.x - 1, never gridDim.x - 1, so
// no block was "last" and nobody wrote *out (the checker's NaN stayed). Why it bit: a kernel tested once
// from a fresh buffer always passes; the state it leaves behind only matters at the second launch.
// The fix: the last block resets the counter when it is done (no other block of this launch touches it
// any more: every one has already drawn its ticket). 01d's sum_last_block does the same.
#ifndef BLOCK
#define BLOCK 256
#endif

extern "C" __global__ void sum_last_block(const float* __restrict__ x, float* partials, unsigned int* tickets,
                                          float* out, long long n) {
    __shared__ float s[BLOCK];
    __shared__ bool last;
    float v = 0.0f;
    for (long long i = (long long)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (long long)gridDim.x * BLOCK)
        v += x[i];
    s[threadIdx.x] = v;
    __syncthreads();
    for (int half = BLOCK / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) s[threadIdx.x] += s[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = s[0];
        __threadfence();                             // release: the partial is visible before we are counted
        last = atomicAdd(tickets, 1) == gridDim.x - 1;
        if (last) __threadfence();                   // acquire: we see every partial counted before ours
    }
    __syncthreads();
    if (!last) return;
    v = 0.0f;
    for (int b = threadIdx.x; b < gridDim.x; b += BLOCK)
        v += __ldcg(partials + b);                   // from L2, never a stale L1 copy
    s[threadIdx.x] = v;
    __syncthreads();
    for (int half = BLOCK / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) s[threadIdx.x] += s[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        *out = s[0];
        *tickets = 0;                                // FIX: back to 0, ready for the next launch
    }
}
