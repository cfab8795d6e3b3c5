// find_bug_sync.cu (solution) - find the bug, step 3: LayerNorm with one block per row.
//
//   y[r, :] = (x[r, :] - mean) / sqrt(var + eps) * w + b        one block of BLOCK threads per row
//
// The bug: block_total() had no barrier between warp 0 writing the block's total to red[0] and every
// thread reading it. Warp 0 still has a shared load and five shuffles to do before it writes; warps 1-7 go
// straight to `return red[0]` and, on almost every run, read what was there: warp 0's OWN partial sum from
// the step before. So the threads of warps 1-7 normalised their columns (32 and up) with a wrong mean and
// variance, while warp 0 (columns 0-31) had the right mean; its variance sums the other warps' wrongly
// centred terms, so even its columns can be slightly off. A race: it depends on how the warps are
// scheduled, so small cases can pass on one run and fail on the next. racecheck reports it on every run: a hazard on
// red[0] between warp 0's write and the other warps' read, whichever came first.
// Why it bit: the first version of this helper let every warp reduce red[] itself (as course.cuh's
// block_sum does, no broadcast needed); the "only warp 0 reduces" edit moved the result into shared
// memory and added a write that other warps read, without the barrier that such a write needs.
// The fix: __syncthreads() before the read. (__syncwarp() would not do: it orders the lanes of one warp.)
#include "course.cuh"

#ifndef BLOCK
#define BLOCK 256
#endif

// The sum of v over the whole block, returned to every thread; red holds BLOCK / 32 floats in shared memory.
__device__ __forceinline__ float block_total(float v, float* red) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = warp_sum(v);
    __syncthreads();                           // red may still be read by the previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();                           // every warp's total is in red
    if (warp == 0) {
        v = warp_sum(lane < BLOCK / 32 ? red[lane] : 0.0f);
        if (lane == 0) red[0] = v;             // the block's total, for everyone
    }
    __syncthreads();                           // FIX: warp 0 has written red[0] before anyone reads it
    return red[0];
}

extern "C" __global__ void layernorm_rows(const float* __restrict__ x, const float* __restrict__ w,
                                          const float* __restrict__ b, float* __restrict__ y, int C, float eps) {
    __shared__ float red[BLOCK / 32];
    const float* xr = x + (long long)blockIdx.x * C;
    float* yr = y + (long long)blockIdx.x * C;
    float s = 0.0f;
    for (int c = threadIdx.x; c < C; c += BLOCK) s += xr[c];
    const float mean = block_total(s, red) / C;
    float q = 0.0f;
    for (int c = threadIdx.x; c < C; c += BLOCK) { const float d = xr[c] - mean; q += d * d; }
    const float rstd = rsqrtf(block_total(q, red) / C + eps);
    for (int c = threadIdx.x; c < C; c += BLOCK) yr[c] = (xr[c] - mean) * rstd * w[c] + b[c];
}
