// train_update.cu - optimiser steps: one launch per tensor, then one launch for ALL tensors.
//
// An update is pure bandwidth: AdamW reads p, g, m, v and writes p, m, v (28 bytes per parameter, no
// reuse), SGD reads p, g and writes p (12 bytes). Its floor is bytes / copy bandwidth; what a naive
// optimiser adds is launches: one (or, written as array expressions, several) per tensor, each too short
// to fill the GPU for small tensors such as biases.
//
//   v1  sgd_v1 / adamw_v1: one launch per tensor, the whole update of an element in registers.
//   v2  sgd_multi / adamw_multi: one launch for every tensor. A small table in device memory holds each
//       tensor's pointers, size, weight decay and its first block; block i finds its tensor (a scan over a
//       handful of entries) and updates a CHUNK-element slice of it. The tensors can live anywhere in
//       memory - the same idea as PyTorch's multi_tensor_apply ("foreach" optimisers).
//
// AdamW (Loshchilov & Hutter; PyTorch's formula): m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//   p -= lr * (wd * p + (m / bc1) / (sqrt(v / bc2) + eps)), with bc1 = 1 - b1^t, bc2 = 1 - b2^t.
// 1-b1 and 1-b2 arrive precomputed in double on the host (omb1, omb2): 1 - 0.999f in float32 is off by
// 1.3e-5 relative, which shows up in the first step as a 6e-6 error in every update.
// Compile-time knob: CHUNK (elements per block in the multi-tensor kernels), passed by training.py, which
// lays out the block table with it.
#ifndef CHUNK
#error "CHUNK is passed by training.py"
#endif

__device__ __forceinline__ void adamw_element(float* p, const float* g, float* m, float* v, long long i,
                                              float lr, float b1, float b2, float omb1, float omb2,
                                              float eps, float wd, float bc1, float bc2, float gs = 1.0f) {
    const float gi = g[i] * gs;                // gs: gradient clipping's factor (1: none; x * 1.0f == x)
    const float mi = b1 * m[i] + omb1 * gi;
    const float vi = b2 * v[i] + omb2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float pi = p[i];
    p[i] = pi - lr * (wd * pi + (mi / bc1) / (sqrtf(vi / bc2) + eps));
}

// ---------------------------------------------------------------- v1: one launch per tensor
extern "C" __global__ void sgd_v1(float* __restrict__ p, const float* __restrict__ g, long long n, float lr, float wd) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        p[i] -= lr * (g[i] + wd * p[i]);
}

extern "C" __global__ void adamw_v1(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                                    float* __restrict__ v, long long n, float lr, float b1, float b2, float omb1,
                                    float omb2, float eps, float wd, float bc1, float bc2) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        adamw_element(p, g, m, v, i, lr, b1, b2, omb1, omb2, eps, wd, bc1, bc2);
}

// ---------------------------------------------------------------- v2: one launch for all tensors
// Which tensor does this block work on? first_block has n_tensors + 1 entries (a prefix sum of blocks).
__device__ __forceinline__ int find_tensor(const int* __restrict__ first_block, int n_tensors) {
    int t = 0;
    while (t + 1 < n_tensors && (int)blockIdx.x >= first_block[t + 1]) ++t;
    return t;
}

// ptrs: 2 per tensor (p, g) as 64-bit addresses.
extern "C" __global__ void sgd_multi(const unsigned long long* __restrict__ ptrs, const long long* __restrict__ sizes,
                                     const float* __restrict__ wds, const int* __restrict__ first_block,
                                     int n_tensors, float lr) {
    const int t = find_tensor(first_block, n_tensors);
    float* p = reinterpret_cast<float*>(ptrs[2 * t]);
    const float* g = reinterpret_cast<const float*>(ptrs[2 * t + 1]);
    const long long n = sizes[t], start = (long long)(blockIdx.x - first_block[t]) * CHUNK;
    const long long end = min(n, start + CHUNK);
    const float wd = wds[t];
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) p[i] -= lr * (g[i] + wd * p[i]);
}

// ptrs: 4 per tensor (p, g, m, v).
extern "C" __global__ void adamw_multi(const unsigned long long* __restrict__ ptrs, const long long* __restrict__ sizes,
                                       const float* __restrict__ wds, const int* __restrict__ first_block,
                                       int n_tensors, float lr, float b1, float b2, float omb1, float omb2, float eps,
                                       float bc1, float bc2, const float* __restrict__ sched) {
    // sched, when given, is (lr, bc1, bc2, gs) in device memory and replaces the three arguments: a CUDA graph
    // replays the arguments it captured, so what changes from step to step must live on the GPU (step 4b).
    // gs multiplies every gradient as it is read: global-norm clipping without a pass of its own.
    float gs = 1.0f;
    if (sched != nullptr) {
        lr = sched[0];
        bc1 = sched[1];
        bc2 = sched[2];
        gs = sched[3];
    }
    const int t = find_tensor(first_block, n_tensors);
    float* p = reinterpret_cast<float*>(ptrs[4 * t]);
    const float* g = reinterpret_cast<const float*>(ptrs[4 * t + 1]);
    float* m = reinterpret_cast<float*>(ptrs[4 * t + 2]);
    float* v = reinterpret_cast<float*>(ptrs[4 * t + 3]);
    const long long n = sizes[t], start = (long long)(blockIdx.x - first_block[t]) * CHUNK;
    const long long end = min(n, start + CHUNK);
    const float wd = wds[t];
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x)
        adamw_element(p, g, m, v, i, lr, b1, b2, omb1, omb2, eps, wd, bc1, bc2, gs);
}
