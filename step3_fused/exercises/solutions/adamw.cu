// adamw.cu (solution) - exercise 13 of step 3: an AdamW update over a flat parameter buffer.
//
//   m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g^2
//   p = p - lr * (wd * p + (m / bc1) / (sqrt(v / bc2) + eps))      bc1 = 1 - b1^t, bc2 = 1 - b2^t
//
// PyTorch's torch.optim.AdamW formula (decoupled weight decay). Pure bandwidth: 16 bytes read (p, g, m,
// v) and 12 written per parameter, no reuse, so the floor is 28 bytes / copy bandwidth. A grid-stride
// loop with the whole update of an element in registers: each array is touched exactly once.
extern "C" __global__ void adamw_step(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                                      float* __restrict__ v, long long n, float lr, float b1, float b2,
                                      float eps, float wd, float bc1, float bc2) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float gi = g[i];
        const float mi = b1 * m[i] + (1.0f - b1) * gi;
        const float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        const float pi = p[i];
        p[i] = pi - lr * (wd * pi + (mi / bc1) / (sqrtf(vi / bc2) + eps));
    }
}
