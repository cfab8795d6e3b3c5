// conv_bias_relu.cu (solution) - exercise 14 of step 3: a direct convolution with bias and ReLU fused.
//
//   y[n, co, oy, ox] = relu(bias[co] + sum_{ci, ky, kx} x[n, ci, oy + ky - P, ox + kx - P] * w[co, ci, ky, kx])
//
// NCHW, KSIZE x KSIZE filter, stride 1, zero "same" padding P = KSIZE / 2 (a tap outside the image adds
// nothing). One thread per output element in a grid-stride loop. Each output costs Cin * K * K
// multiply-adds: compute-bound, so the fused bias and ReLU (two elementwise passes over y unfused) are
// nearly free here - they are applied to the accumulator before the single store.
#ifndef KSIZE
#define KSIZE 3
#endif

extern "C" __global__ void conv_bias_relu(const float* __restrict__ x, const float* __restrict__ w,
                                          const float* __restrict__ bias, float* __restrict__ y,
                                          int N, int Cin, int H, int W, int Cout) {
    const long long total = (long long)N * Cout * H * W;
    const int pad = KSIZE / 2;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        const int ox = (int)(i % W), oy = (int)((i / W) % H);
        const int co = (int)((i / ((long long)W * H)) % Cout);
        const long long n = i / ((long long)W * H * Cout);
        float acc = bias[co];
        for (int ci = 0; ci < Cin; ci++) {
            const float* xp = x + (n * Cin + ci) * H * W;
            const float* wp = w + ((long long)co * Cin + ci) * KSIZE * KSIZE;
#pragma unroll
            for (int ky = 0; ky < KSIZE; ky++) {
                const int iy = oy + ky - pad;
                if (iy < 0 || iy >= H) continue;             // zero padding: the tap adds nothing
#pragma unroll
                for (int kx = 0; kx < KSIZE; kx++) {
                    const int ix = ox + kx - pad;
                    if (ix >= 0 && ix < W) acc += xp[iy * W + ix] * wp[ky * KSIZE + kx];
                }
            }
        }
        y[i] = fmaxf(acc, 0.0f);
    }
}
