// mma.cuh - the tensor-core helpers of step 2c, shared by step2_attention/mma_tile.cu (whose v1 writes the
// instruction out), step2_attention/flash_attention_tc.cu and step4_gpt2/train/attention_tc.cu (which use them).
// Included with #include "mma.cuh" (common/include is on the include path).
//
// Architectures: everything here needs sm_75 (ldmatrix, mma.sync m16n8k8), so it is compiled only there and
// above (and in the host pass); a kernel that includes it traps on older GPUs. bf16 needs sm_80.
#pragma once

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 750
// The 32-bit shared-memory address that ldmatrix and cp.async take, from a generic pointer into shared memory.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; rows past the end are zero-filled (src-size 0 reads nothing).
__device__ __forceinline__ void copy16(void* dst, const void* src, bool valid) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
#else
    *reinterpret_cast<uint4*>(dst) = valid ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
#endif
}
__device__ __forceinline__ void copy_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void copy_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// d += A * B: A a 16x16 tile in row-major fragments a[0..3], B a 16x8 tile in column-major fragments b0, b1
// (mma_tile.cu's header has the fragment tables), fp32 accumulators d[0..3] in C's layout. fp16 inputs, or
// bf16 with BF16 = true. B comes as two registers rather than an array because flash_attention_tc.cu feeds
// it the two halves of one ldmatrix.x4.
template <bool BF16>
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    if (BF16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    if (BF16) __trap();   // bf16 mma needs sm_80; the wrappers refuse older GPUs before launching
    // sm_75 has m16n8k8 only: k = 0..7 lives in (a0, a1, b0), k = 8..15 in (a2, a3, b1): two make one m16n8k16.
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(b0));
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[2]), "r"(a[3]), "r"(b1));
#endif
}
#endif
