// adamw.cu - Exercise 3b.2: an AdamW update over a flat parameter buffer.
//
// p (parameters), g (gradients), m and v (the optimiser's two moments) are float32 arrays of n
// elements. Update every element i < n in place, PyTorch's torch.optim.AdamW formula:
//
//   m[i] = b1 * m[i] + (1 - b1) * g[i]
//   v[i] = b2 * v[i] + (1 - b2) * g[i]^2
//   p[i] = p[i] - lr * (wd * p[i] + (m[i] / bc1) / (sqrt(v[i] / bc2) + eps))
//
// bc1 = 1 - b1^t and bc2 = 1 - b2^t (the bias corrections of step t) are passed in, computed once on
// the host. Launch: a fixed grid of 256-thread blocks: write a grid-stride loop.
// Napkin math: each element reads 16 bytes and writes 12, and nothing is reused: the best possible
// time is 28 * n bytes at the copy bandwidth.
//
// Hint 1 (where to look): The formula is written above; the launch is Exercise 1a.2's grid-stride loop. Load p, g, m
//   and v once into registers, update them, store three of them.
// Hint 2 (the shape of the code): for (i = global index; i < n; i += grid size) { mi = b1 * m[i] + (1 - b1) * gi; vi =
//   ...; p[i] = pi - lr * (wd * pi + (mi / bc1) / (sqrtf(vi / bc2) + eps)); m[i] = mi; v[i] = vi; } The weight decay
//   uses p before the update.
// The solution: solution("step3/adamw") gives its path (read it after trying).
// Check it with: from common.exercises import check; check("step3/adamw")
extern "C" __global__ void adamw_step(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                                      float* __restrict__ v, long long n, float lr, float b1, float b2,
                                      float eps, float wd, float bc1, float bc2) {
    // TODO: your code here
}
