// conv_bias_relu.cu - Exercise 3c.1: convolution + bias + ReLU in one kernel.
//
// x is (N, Cin, H, W), w is (Cout, Cin, KSIZE, KSIZE), bias (Cout,), y (N, Cout, H, W), all NCHW float32.
// Write, for every output element:
//
//   y[n, co, oy, ox] = max(0, bias[co] + sum over ci, ky, kx of x[n, ci, iy, ix] * w[co, ci, ky, kx])
//   with iy = oy + ky - KSIZE / 2,  ix = ox + kx - KSIZE / 2
//
// Stride 1 and zero "same" padding: a tap whose (iy, ix) falls outside the H x W image adds nothing
// (skip it; never read it). Launch: a fixed grid of 256-thread blocks; loop over the
// N * Cout * H * W outputs with a grid-stride loop, one output at a time (i = ((n * Cout + co) * H
// + oy) * W + ox). The sizes are small and odd (H = 7, W = 5, Cin = 3 ...), edges everywhere.
// Napkin math: each output costs 2 * Cin * KSIZE^2 FLOPs and writes 4 bytes: compute-bound, so the bias
// and ReLU are free when applied to the accumulator before the store.
//
// Hint 1 (where to look): Undo the flat index first: ox = i % W, oy = (i / W) % H, co = (i / (W * H)) % Cout, n = i /
//   (W * H * Cout). Then three nested loops, ci, ky, kx, and one accumulator.
// Hint 2 (the shape of the code): acc = bias[co]; for ci, ky, kx: iy = oy + ky - KSIZE / 2, ix = ...; if (iy < 0 || iy
//   >= H || ix < 0 || ix >= W) continue; acc += x[...] * w[...]; finally y[i] = fmaxf(acc, 0.f).
// The solution: solution("step3/conv_bias_relu") gives its path (read it after trying).
// Check it with: from common.exercises import check; check("step3/conv_bias_relu")
#ifndef KSIZE
#define KSIZE 3
#endif

extern "C" __global__ void conv_bias_relu(const float* __restrict__ x, const float* __restrict__ w,
                                          const float* __restrict__ bias, float* __restrict__ y,
                                          int N, int Cin, int H, int W, int Cout) {
    // TODO: your code here
}
