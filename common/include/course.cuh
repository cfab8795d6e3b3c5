// course.cuh - small device helpers shared by the course's kernels.
// Included with #include "course.cuh" (common/include is on the include path).
#pragma once

#ifndef FULL_MASK
#define FULL_MASK 0xffffffffu
#endif

// Sum over the 32 lanes of a warp with butterfly shuffles: every lane ends with the total.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
    return v;
}

// Maximum over the 32 lanes of a warp; every lane ends with the result.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
    return v;
}

// Sum over a whole block (blockDim.x a multiple of 32, at most 1024). `scratch` holds 32 floats in
// shared memory. Every thread gets the total. Safe to call repeatedly (it syncs before reusing scratch).
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    v = warp_sum(v);
    __syncthreads();                       // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

// Maximum over a whole block; same contract as block_sum.
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : __int_as_float(0xff800000);
    return warp_max(v);
}

// LayerNorm of B rows of K floats (x4: K/4 float4s a row, K a multiple of 4) into shared memory (xs4,
// B x K/4), two passes over each row as in step 3. A warp takes a row; a lone row (decode at batch 1) is
// shared by the whole block instead, or one warp would queue its K/128 loads a pass while the others wait.
__device__ __forceinline__ void layernorm_to_shared(float4* xs4, const float4* __restrict__ x4,
                                                    const float4* __restrict__ g4, const float4* __restrict__ b4,
                                                    int B, int K, float eps) {
    __shared__ float scratch[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32, K4 = K / 4;
    const bool whole = B == 1;                                // the same for every thread: block_sum is safe
    const int first = whole ? threadIdx.x : lane, step = whole ? blockDim.x : 32;
    for (int b = whole ? 0 : warp; b < B; b += nwarps) {
        float4* sr = xs4 + (long long)b * K4;
        float sum = 0.0f;
        for (int k = first; k < K4; k += step) {
            const float4 v = x4[(long long)b * K4 + k];
            sr[k] = v;
            sum += (v.x + v.y) + (v.z + v.w);
        }
        const float mean = (whole ? block_sum(sum, scratch) : warp_sum(sum)) / K;
        float ss = 0.0f;
#pragma unroll 1   // shared memory only; unrolled, ptxas spilled a register in gemv_v6 at UNROLL 1 (sm_90)
        for (int k = first; k < K4; k += step) {              // a thread re-reads only what it wrote
            const float4 v = sr[k];
            const float a = v.x - mean, c = v.y - mean, d = v.z - mean, e = v.w - mean;
            ss += (a * a + c * c) + (d * d + e * e);
        }
        const float rstd = rsqrtf((whole ? block_sum(ss, scratch) : warp_sum(ss)) / K + eps);
        for (int k = first; k < K4; k += step) {
            const float4 v = sr[k], g = __ldg(g4 + k), o = __ldg(b4 + k);
            sr[k] = make_float4((v.x - mean) * rstd * g.x + o.x, (v.y - mean) * rstd * g.y + o.y,
                                (v.z - mean) * rstd * g.z + o.z, (v.w - mean) * rstd * g.w + o.w);
        }
    }
    __syncthreads();
}

// Elementwise sum of two float4s (four neighbouring columns at once).
__device__ __forceinline__ float4 operator+(float4 a, float4 b) {
    return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// Dot product of two float4s (a float4 load of a row against one of a vector).
__device__ __forceinline__ float dot4(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }

// GELU, tanh approximation (GPT-2's "gelu_new").
__device__ __forceinline__ float gelu_tanh(float x) {
    const float k = 0.7978845608028654f;   // sqrt(2/pi)
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

// ---- signalling between blocks (the decode megakernel, and hops.cu, which measures what one costs)
// Nanoseconds since some epoch, the same clock on every SM (stamps from different blocks compare).
__device__ __forceinline__ unsigned long long globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// Acquire: this thread's later loads see everything the releasing side wrote before its release.
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// Release: this thread's earlier writes, and those of the threads it has met at a barrier (bar.sync,
// bar.warp.sync), are visible to whoever acquires the counter after this add. Lighter than __threadfence()
// (fence.sc) + atomicAdd.
__device__ __forceinline__ void red_release(unsigned* p, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
