// megakernel_keep_l2.cu - the lab's keep-in-L2 build of the decode megakernel v2 (a measurement, sm_80+).
//
// The mainline streams every weight evict-first: each is read once per step, so L2 should not keep it. Here
// the layers' weights (KEEP) are asked for evict-last by the L2 prefetches and loaded with the normal priority
// (ld.global.cg), so L2 keeps what fits of them; the LM head still streams. On a model whose every layer is
// layer 0 that is all of them, and the step is what is left when the layer weights cost no DRAM traffic (the
// floor). l2_evict_normal undoes it afterwards. (An evict-last policy on the loads themselves costs registers
// that the batch-1 build does not have.) Before sm_80 there are no eviction-priority hints: the build is the
// mainline's (the host refuses to use it there).
#define MK_WEIGHT_LOADS
template <bool KEEP>
__device__ __forceinline__ float4 ld_weight(const float4* p) {
#if __CUDA_ARCH__ >= 800
    return KEEP ? __ldcg(p) : __ldcs(p);
#else
    return __ldcs(p);
#endif
}

template <bool KEEP = false>
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if __CUDA_ARCH__ >= 800
    if (KEEP) {
        asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(p));
        return;
    }
#endif
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
}

#include "../megakernel_v2.cu"

// Back to evict-normal: the lines of n floats at p that this build kept (one thread per 128-byte line).
extern "C" __global__ void l2_evict_normal(const float* p, long long n) {
    const long long lines = (n * 4 + 127) / 128;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < lines; i += (long long)gridDim.x * blockDim.x) {
#if __CUDA_ARCH__ >= 800
        asm volatile("applypriority.global.L2::evict_normal [%0], 128;" :: "l"(p + i * 32) : "memory");
#endif
    }
}
