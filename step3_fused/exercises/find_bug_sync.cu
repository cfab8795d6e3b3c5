// find_bug_sync.cu - Exercise 3a.4, find the bug: LayerNorm with one BLOCK per row. A compute-sanitizer one.
//
// TODO: this kernel compiles and looks right, but it has ONE bug. Find it and fix it (a small change).
//
// What it should do: for every row r = blockIdx.x of x (N, C),
//   y[r, :] = (x[r, :] - mean) / sqrt(var + eps) * w + b        mean, var (biased: divide by C) of the row
// One block of BLOCK (256) threads = 8 warps per row (rows can be long: C up to thousands). Each thread
// sums its elements c = threadIdx.x, + BLOCK, ...; block_total() adds the 256 partial sums: each warp adds
// its lanes (warp_sum, course.cuh), lane 0 of each warp puts its warp's total in red[], warp 0 adds those
// and leaves the block's total in red[0] for every thread. Twice: once for the mean, once for the variance.
//
// Symptom: check("step3/find_bug_sync") passes the rows of C <= 32 and fails the longer ones, badly from
// column 32 on (columns 0-31 at most slightly off, through the variance). Run it twice: the small failing
// cases may change, even pass: results that change from run to run are the mark of a race.
//
// Find it with compute-sanitizer's racecheck (GPU; the pip wheel requirements-dev.txt installs, no CUDA
// toolkit needed: docs/debugging.md, section 2). From the notebook or any Python:
//   from common.sanitize import sanitize; sanitize("step3/find_bug_sync", tool="racecheck")
// which runs check('step3/find_bug_sync', timing=False) on your copy under the sanitizer.
// It names the shared-memory address, the two lines of this file that race and the kind of hazard.
//
// Hint 1 (where to look): columns 0-31 belong to warp 0, whose mean is right; the other warps are not.
//   What do warps 1-7 read in `return red[0]`, and has warp 0 written its total there yet?
// Hint 2 (the class of bug): a missing barrier. A value that one warp writes to shared memory and other
//   warps read needs a __syncthreads() between the write and the reads; nothing orders the warps otherwise.
// The solution: solution("step3/find_bug_sync") gives its path; it names the bug and why it bit.
//
// Check it with: from common.exercises import check; check("step3/find_bug_sync")
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
