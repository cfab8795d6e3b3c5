// find_bug_last_block.cu - Exercise 1d.1, find the bug: a sum in ONE launch, the last block adds the partials.
//
// TODO: this kernel compiles and looks right, but it has ONE bug. Find it and fix it (a small change).
//
// What it should do: *out = x[0] + ... + x[n-1], in one launch, again and again. Each block sums a
// grid-stride slice with a shared-memory tree, writes its partial to partials[blockIdx.x], fences (release)
// and takes a ticket with atomicAdd(tickets, 1); the block that draws the last ticket (gridDim.x - 1) fences
// (acquire), adds all the partials and writes *out: the pattern of lesson 1d. The caller zeroes `tickets` once,
// before the first launch; after that the kernel must be reusable as it is, like a loss reduction that a
// training loop launches every step. The checker launches it twice with the same tickets and partials (on
// the same x) and compares the SECOND launch's *out.
//
// Symptom: check("step1/find_bug_last_block") fails every case, and *out is nan: nobody wrote it. Yet
// the first launch's result is right (try it: launch it once yourself on a fresh tickets = cp.zeros(1,
// cp.uint32) and print *out).
//
// Hint 1 (where to look): not the sum, not the fences. Print tickets after each launch: what value does the
//   second launch start from, and which ticket does its last block draw?
// Hint 2 (the class of bug): state that a launch leaves behind for the next one. A counter that decides
//   "I am the last block" must be back at its starting value when the launch ends.
// The solution: solution("step1/find_bug_last_block") gives its path; it names the bug and why it bit.
//
// Check it with: from common.exercises import check; check("step1/find_bug_last_block")
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
    if (threadIdx.x == 0) *out = s[0];
}
