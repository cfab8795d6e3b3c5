// scale_clamp_float4.cu (solution) - exercise 3 of step 1: float4 loads and stores, with a scalar head
// and tail.
//
//   y[i] = min(max(a * x[i] + b, lo), hi)        for every i < n
//
// A float4 load moves 16 bytes in one instruction (4x fewer load instructions than floats), but it
// must start on a 16-byte boundary. x may be a view that starts 4, 8 or 12 bytes past one, so:
//   head   the first `head` (0..3) elements, one float each (the caller computes head from x's address;
//          y has the same alignment),
//   body   (n - head) / 4 float4s starting at x + head, in a grid-stride loop,
//   tail   the last (n - head) % 4 elements, one float each.
__device__ __forceinline__ float clamp_axpb(float v, float a, float b, float lo, float hi) {
    return fminf(fmaxf(a * v + b, lo), hi);
}

extern "C" __global__ void scale_clamp_float4(const float* __restrict__ x, float* __restrict__ y,
                                              float a, float b, float lo, float hi, long long n, int head) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    if (tid < head && tid < n) y[tid] = clamp_axpb(x[tid], a, b, lo, hi);
    const long long body = n > head ? n - head : 0;
    const long long nvec = body / 4;
    const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x + head);
    float4* __restrict__ y4 = reinterpret_cast<float4*>(y + head);
    for (long long i = tid; i < nvec; i += stride) {
        const float4 v = x4[i];
        y4[i] = make_float4(clamp_axpb(v.x, a, b, lo, hi), clamp_axpb(v.y, a, b, lo, hi),
                            clamp_axpb(v.z, a, b, lo, hi), clamp_axpb(v.w, a, b, lo, hi));
    }
    const long long t = head + nvec * 4 + tid;          // at most 3 elements are left
    if (t < n) y[t] = clamp_axpb(x[t], a, b, lo, hi);
}
