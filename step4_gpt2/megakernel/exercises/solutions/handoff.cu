// handoff.cu - Exercise 4c.1: a release/acquire handoff between two blocks, with a bounded spin and an error flag.
//
// The solution. Blocks 0 .. pairs-1 are consumers, blocks pairs .. 2*pairs-1 producers: block pairs + p hands one
// payload of PAYLOAD ints to block p, the way the megakernel's stages hand activations to the next stage.
//   producer: every thread writes its part of the payload; a barrier (the whole block has written); then ONE
//             thread releases the flag: st.release.gpu makes every write the block ordered before it (through
//             the barrier) visible to a block that acquires the flag before the flag itself.
//   consumer: ONE thread spins on ld.acquire.gpu of the flag until it reads `seq`, at most max_tries times; it
//             tells the block through shared memory; a barrier; then every thread copies the payload (ordered
//             after the acquire by the barrier) or, after a give-up, copies nothing. Thread 0 writes the status
//             the host reads: 0 received, 1 gave up.
// A flag counts up, one `seq` per launch, so it never needs resetting, and a flag left from the launch before
// (seq - 1) is not mistaken for this one's.
// Nothing can hang: the spin gives up. A consumer whose producer never runs (it is not resident, or was never
// launched) reports 1 after max_tries reads instead of waiting forever.
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
    int* flag = flags + p;
    int* payload = payloads + (long long)p * PAYLOAD;
    if (producer) {
        for (int k = threadIdx.x; k < PAYLOAD; k += blockDim.x) payload[k] = payload_value(seq, p, k);
        __syncthreads();                                   // every thread of the block has written its part
        if (threadIdx.x == 0) store_release(flag, seq);    // release: the payload is visible before the flag
        return;
    }
    __shared__ int ok;
    if (threadIdx.x == 0) {
        int tries = 0;
        while (load_acquire(flag) != seq && ++tries < max_tries) {}    // acquire; bounded
        ok = tries < max_tries;
        status[p] = ok ? 0 : 1;                            // the error flag the host reads
    }
    __syncthreads();                                       // the block waits for thread 0's verdict
    if (!ok) return;                                       // gave up: the payload may not be there
    for (int k = threadIdx.x; k < PAYLOAD; k += blockDim.x) received[(long long)p * PAYLOAD + k] = payload[k];
}
