// memory_model.cu - when one block waits for another: a flag, a payload, and the order in which they arrive.
//
// Blocks of one launch normally never wait for each other. When they must, one block (the producer) writes a
// payload and then sets a flag; another (the consumer) spins until it sees the flag, then reads the payload.
// Each pair of blocks hands over `rounds` payloads in turn: the producer waits for the consumer's `ack` of
// round r-1, writes round r's payload, sets `flag = r`; the consumer waits for `flag == r`, checks the
// payload, sets `ack = r`. Every spin gives up after `cap` tries, so no version can hang.
//
//   handoff_v1  plain loads and stores. Nothing tells the compiler another block writes the flag, so it may
//               load it once and spin on the copy in a register: the wait never sees the store.
//   handoff_v2  `volatile` flag and ack: every spin iteration loads the flag from memory. But volatile
//               orders nothing else: the payload may still be read from a stale copy (the consumer SM's L1
//               cache keeps the last round's payload) or become visible after the flag.
//   handoff_v3  v2 + fences: __threadfence() between the payload and the flag (release), and after seeing
//               the flag, before reading the payload (acquire). Always correct.
//   handoff_v4  the same order with one-sided PTX instructions (sm_70+): st.release.gpu sets the flag,
//               ld.acquire.gpu reads it - no full fence needed.
//
//   sum_last_block  the pattern step 3 uses: each block writes its partial sum, fences, then takes a ticket
//                   with atomicAdd; the block that draws the last ticket sums every partial, in the same launch.
//
// Both blocks of a pair must be resident at once (a block that spins holds its SM until it is done): the
// wrapper launches no more blocks than the GPU can hold. Compile-time knob: PAYLOAD (ints per handoff).
#ifndef PAYLOAD
#define PAYLOAD 1024
#endif
#ifndef BLOCK
#define BLOCK 256
#endif

enum { GAVE_UP = 0, STALE = 1, CORRECT = 2 };    // the counters of counts[]: one per handoff or give-up

// The payload of round r: element k holds r * PAYLOAD + k, so a stale read finds another round's number.
__device__ void write_payload(int* payload, int r) {
    for (int k = threadIdx.x; k < PAYLOAD; k += blockDim.x) payload[k] = r * PAYLOAD + k;
}

// True in every thread when the whole block read round r's payload (__syncthreads_or: a barrier that also
// tells every thread whether any thread passed true).
__device__ bool payload_ok(const int* payload, int r) {
    int bad = 0;
    for (int k = threadIdx.x; k < PAYLOAD; k += blockDim.x) bad |= payload[k] != r * PAYLOAD + k;
    return !__syncthreads_or(bad);
}

// The waits, one per version, each in a function of its own (__noinline__) so that its compiled code can be read
// on its own (memory_model.ptx_of). Each returns false if it gave up after `cap` tries.
__device__ __noinline__ bool wait_plain(const int* word, int want, int cap) {
    int tries = 0;
    while (*word != want && ++tries < cap) {}
    return tries < cap;
}
__device__ __noinline__ bool wait_volatile(const volatile int* word, int want, int cap) {
    int tries = 0;
    while (*word != want && ++tries < cap) {}
    return tries < cap;
}

extern "C" __global__ void handoff_v1(int* flags, int* acks, int* payloads, int* counts, int rounds, int cap) {
    int *flag = flags + blockIdx.x / 2, *ack = acks + blockIdx.x / 2, *payload = payloads + blockIdx.x / 2 * PAYLOAD;
    const bool producer = blockIdx.x % 2 == 0;
    __shared__ bool ok;
    for (int r = 1; r <= rounds; ++r) {
        if (threadIdx.x == 0) ok = producer ? wait_plain(ack, r - 1, cap) : wait_plain(flag, r, cap);
        __syncthreads();
        if (!ok) break;
        if (producer) {
            write_payload(payload, r);
            __syncthreads();                                  // the whole block has written its part
            if (threadIdx.x == 0) *flag = r;
        } else {
            bool fresh = payload_ok(payload, r);
            if (threadIdx.x == 0) { atomicAdd(&counts[fresh ? CORRECT : STALE], 1); *ack = r; }
        }
    }
    if (threadIdx.x == 0 && !ok) atomicAdd(&counts[GAVE_UP], 1);
}

extern "C" __global__ void handoff_v2(int* flags, int* acks, int* payloads, int* counts, int rounds, int cap) {
    volatile int *flag = flags + blockIdx.x / 2, *ack = acks + blockIdx.x / 2;
    int* payload = payloads + blockIdx.x / 2 * PAYLOAD;
    const bool producer = blockIdx.x % 2 == 0;
    __shared__ bool ok;
    for (int r = 1; r <= rounds; ++r) {
        if (threadIdx.x == 0) ok = producer ? wait_volatile(ack, r - 1, cap) : wait_volatile(flag, r, cap);
        __syncthreads();
        if (!ok) break;
        if (producer) {
            write_payload(payload, r);
            __syncthreads();                                  // the whole block has written its part
            if (threadIdx.x == 0) *flag = r;
        } else {
            bool fresh = payload_ok(payload, r);
            if (threadIdx.x == 0) { atomicAdd(&counts[fresh ? CORRECT : STALE], 1); *ack = r; }
        }
    }
    if (threadIdx.x == 0 && !ok) atomicAdd(&counts[GAVE_UP], 1);
}

extern "C" __global__ void handoff_v3(int* flags, int* acks, int* payloads, int* counts, int rounds, int cap) {
    volatile int *flag = flags + blockIdx.x / 2, *ack = acks + blockIdx.x / 2;
    int* payload = payloads + blockIdx.x / 2 * PAYLOAD;
    const bool producer = blockIdx.x % 2 == 0;
    __shared__ bool ok;
    for (int r = 1; r <= rounds; ++r) {
        if (threadIdx.x == 0) {
            ok = producer ? wait_volatile(ack, r - 1, cap) : wait_volatile(flag, r, cap);
            __threadfence();            // acquire: what the block reads or writes next comes after what we saw
        }
        __syncthreads();
        if (!ok) break;
        if (producer) {
            write_payload(payload, r);
            __syncthreads();                                  // the whole block has written its part
            if (threadIdx.x == 0) { __threadfence(); *flag = r; }   // release: payload visible before the flag
        } else {
            bool fresh = payload_ok(payload, r);
            if (threadIdx.x == 0) { atomicAdd(&counts[fresh ? CORRECT : STALE], 1); __threadfence(); *ack = r; }
        }
    }
    if (threadIdx.x == 0 && !ok) atomicAdd(&counts[GAVE_UP], 1);
}

// One-sided orderings in PTX (docs/cuda_cpp.md#inline-ptx): a load that nothing after it may overtake, a store
// that nothing before it may fall behind; ".gpu" makes the order hold for every block of the GPU.
__device__ int load_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ void store_release(int* p, int v) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __noinline__ bool wait_acquire(const int* word, int want, int cap) {
    int tries = 0;
    while (load_acquire(word) != want && ++tries < cap) {}
    return tries < cap;
}

extern "C" __global__ void handoff_v4(int* flags, int* acks, int* payloads, int* counts, int rounds, int cap) {
    int *flag = flags + blockIdx.x / 2, *ack = acks + blockIdx.x / 2, *payload = payloads + blockIdx.x / 2 * PAYLOAD;
    const bool producer = blockIdx.x % 2 == 0;
    __shared__ bool ok;
    for (int r = 1; r <= rounds; ++r) {
        if (threadIdx.x == 0) ok = producer ? wait_acquire(ack, r - 1, cap) : wait_acquire(flag, r, cap);
        __syncthreads();
        if (!ok) break;
        if (producer) {
            write_payload(payload, r);
            __syncthreads();                                  // the whole block has written its part
            if (threadIdx.x == 0) store_release(flag, r);
        } else {
            bool fresh = payload_ok(payload, r);
            if (threadIdx.x == 0) { atomicAdd(&counts[fresh ? CORRECT : STALE], 1); store_release(ack, r); }
        }
    }
    if (threadIdx.x == 0 && !ok) atomicAdd(&counts[GAVE_UP], 1);
}

// Sum of n floats in one launch. Each block sums a grid-stride slice with 01b's shared-memory tree (sum_v1) and
// writes its partial; the last block to finish adds the partials. `tickets` must be 0 before the first launch;
// the last block sets it back to 0, so the kernel can be launched again.
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
        v += __ldcg(partials + b);                   // from L2, never a stale L1 copy (docs/cuda_cpp.md#ldg)
    s[threadIdx.x] = v;
    __syncthreads();
    for (int half = BLOCK / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) s[threadIdx.x] += s[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        *out = s[0];
        *tickets = 0;                                // ready for the next launch
    }
}
