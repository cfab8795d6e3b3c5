// handoff.cu - Exercise 4c.1: a release/acquire handoff between two blocks, with a bounded spin and an error flag.
//
// TODO: write the producer's release and the consumer's bounded acquire spin (the two TODOs below).
//
// Blocks 0 .. pairs-1 are consumers, blocks pairs .. 2*pairs-1 producers: block pairs + p hands one payload of
// PAYLOAD ints to block p, the way the megakernel's stages hand activations to the next stage. The flag counts
// up: launch number `seq` (1, 2, ...) hands over its payload when flag == seq.
//   producer: every thread writes its part of the payload (given), then the flag is set to seq so that a
//             consumer that sees the flag also sees the whole payload.
//   consumer: one thread reads the flag until it is seq, but at most max_tries times; then EVERY thread of the
//             block must know whether it arrived. If it did, the block copies the payload to received (given);
//             if not, it copies nothing. status[p] is the error flag the host reads: 0 received, 1 gave up.
// The checker launches it many times (seq = 1, 2, ...) with up to one pair per SM (every block resident at
// once) and compares every received payload and status; in its last case no producer is launched at all: every
// consumer must give up and report 1 (within max_tries reads), not hang.
//
// Hint 1 (where to look): lesson 1d, handoff_v4 in step1_simple/memory_model.cu (and load_acquire,
//   store_release below); the megakernel's wait in megakernel.cuh (wait_geq) for the bounded spin.
// Hint 2 (the idea): producer: payload, __syncthreads(), then one thread store_release(flag, seq). Consumer:
//   thread 0 spins with load_acquire and a try counter, writes the verdict to shared memory and status[p];
//   __syncthreads() before anyone reads the verdict (and the payload).
// The solution: solution("step4/handoff") gives its path.
//
// Check it with: from common.exercises import check; check("step4/handoff")
#ifndef PAYLOAD
#define PAYLOAD 1024
#endif

// The value of element k of pair p's payload in launch `seq`: each launch and pair writes other numbers, so a
// stale read (another launch's payload) or a copy from the wrong pair cannot match.
__device__ __forceinline__ int payload_value(int seq, int p, int k) { return seq * 1000003 + p * PAYLOAD + k; }

// One-sided orderings in PTX (lesson 1d): nothing after the acquire load may overtake it; nothing before the
// release store may fall behind it. ".gpu": the order holds for every block of the GPU.
__device__ __forceinline__ int load_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void store_release(int* p, int v) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

extern "C" __global__ void handoff(int* flags, int* payloads, int* received, int* status, int pairs, int seq,
                                   int max_tries) {
    const bool producer = blockIdx.x >= pairs;
    const int p = producer ? blockIdx.x - pairs : blockIdx.x;
    int* payload = payloads + (long long)p * PAYLOAD;
    if (producer) {
        for (int k = threadIdx.x; k < PAYLOAD; k += blockDim.x) payload[k] = payload_value(seq, p, k);
        // TODO: your code here (make the payload visible, then set this pair's flag, flags[p], to seq)
        return;
    }
    __shared__ int ok;
    // TODO: your code here (thread 0: the bounded acquire spin on flags[p], then ok and status[p]; then the block)
    if (!ok) return;                                       // gave up: the payload may not be there
    for (int k = threadIdx.x; k < PAYLOAD; k += blockDim.x) received[(long long)p * PAYLOAD + k] = payload[k];
}
