// when_fusion_hurts.cu - two experiments on the limits of fusion.
//
// (a) conv2d + bias + ReLU. A direct 2-D convolution (NCHW, KSIZE x KSIZE, stride 1, "same" padding)
//     does Cin*K*K multiply-adds per output element, so it is compute-bound; bias and ReLU add two
//     elementwise passes over the output. Fusing them into the convolution's epilogue saves two
//     round trips of the output tensor and two launches - real, but small next to the convolution.
//       conv2d            y = conv(x, w)                  (one thread per output element)
//       bias_add_nchw     y[n, c, :, :] += bias[c]
//       relu_inplace      y = max(y, 0)
//       conv2d_bias_relu  all three, the bias and ReLU applied to the accumulator before the store
//
// (b) Over-fusion: LayerNorm fused into the GEMM that follows it, y = LN(x) @ W + bias, written the
//     obvious way. A block normalises OVERFUSE_ROWS rows into shared memory, then each thread computes
//     OVERFUSE_COLS output columns for all of those rows: OVERFUSE_ROWS * OVERFUSE_COLS accumulators in
//     registers. Small tiles re-read W from L2 for every group of rows (little reuse); big tiles need
//     more registers than a thread has (fewer resident warps, then spills to local memory). Either
//     way it cannot match LayerNorm + a cuBLAS GEMM, whose tiling, tensor-core-free FMA pipelines and
//     double buffering this naive fused loop gives up. The notebook compiles it with several tile
//     sizes (-DOVERFUSE_ROWS=.. -DOVERFUSE_COLS=..) and reads registers, spills and occupancy.
//       ln_linear_overfused
//
// Knobs: KSIZE (odd), OVERFUSE_ROWS, OVERFUSE_COLS, OVERFUSE_THREADS, all passed by ops.py.
#include "course.cuh"

#ifndef KSIZE
#error "KSIZE is passed by ops.py"
#endif
#ifndef OVERFUSE_ROWS
#error "OVERFUSE_ROWS is passed by ops.py"
#endif
#ifndef OVERFUSE_COLS
#error "OVERFUSE_COLS is passed by ops.py"
#endif
#ifndef OVERFUSE_THREADS
#error "OVERFUSE_THREADS is passed by ops.py"
#endif

// ------------------------------------------------------------------ (a) conv2d + bias + ReLU
__device__ __forceinline__ float conv_at(const float* __restrict__ x, const float* __restrict__ w,
                                         long long i, int Cin, int H, int W, int Cout) {
    const int ox = (int)(i % W), oy = (int)((i / W) % H);
    const int co = (int)((i / ((long long)W * H)) % Cout);
    const long long n = i / ((long long)W * H * Cout);
    const int pad = KSIZE / 2;
    float acc = 0.0f;
    for (int ci = 0; ci < Cin; ci++) {
        const float* xp = x + (n * Cin + ci) * H * W;
        const float* wp = w + ((long long)co * Cin + ci) * KSIZE * KSIZE;
#pragma unroll
        for (int ky = 0; ky < KSIZE; ky++) {
            const int iy = oy + ky - pad;
            if (iy < 0 || iy >= H) continue;
#pragma unroll
            for (int kx = 0; kx < KSIZE; kx++) {
                const int ix = ox + kx - pad;
                if (ix >= 0 && ix < W) acc += xp[iy * W + ix] * wp[ky * KSIZE + kx];
            }
        }
    }
    return acc;
}

extern "C" __global__ void conv2d(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                                  int N, int Cin, int H, int W, int Cout) {
    const long long n = (long long)N * Cout * H * W;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = conv_at(x, w, i, Cin, H, W, Cout);
}

extern "C" __global__ void bias_add_nchw(float* __restrict__ y, const float* __restrict__ bias,
                                         long long n, int Cout, int HW) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] += bias[(i / HW) % Cout];
}

extern "C" __global__ void relu_inplace(float* __restrict__ y, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = fmaxf(y[i], 0.0f);
}

extern "C" __global__ void conv2d_bias_relu(const float* __restrict__ x, const float* __restrict__ w,
                                            const float* __restrict__ bias, float* __restrict__ y,
                                            int N, int Cin, int H, int W, int Cout) {
    const long long n = (long long)N * Cout * H * W;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const int co = (int)((i / ((long long)W * H)) % Cout);
        y[i] = fmaxf(conv_at(x, w, i, Cin, H, W, Cout) + bias[co], 0.0f);
    }
}

// ------------------------------------------------------------------ (b) the over-fused LayerNorm + GEMM
// grid (ceil(N / ROWS), ceil(M / (THREADS * COLS))), block THREADS, dynamic shared memory ROWS * C floats.
extern "C" __global__ void __launch_bounds__(OVERFUSE_THREADS) ln_linear_overfused(
        const float* __restrict__ x, const float* __restrict__ ln_w, const float* __restrict__ ln_b,
        const float* __restrict__ wt, const float* __restrict__ bias, float* __restrict__ y,
        int N, int C, int M, float eps) {
    extern __shared__ float xs[];                    // the block's rows, normalised
    const int row0 = blockIdx.x * OVERFUSE_ROWS, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int rr = warp; rr < OVERFUSE_ROWS; rr += OVERFUSE_THREADS / 32) {
        float* xr = xs + rr * C;
        if (row0 + rr >= N) {
            for (int i = lane; i < C; i += 32) xr[i] = 0.0f;
            continue;
        }
        const float* src = x + (long long)(row0 + rr) * C;
        float s = 0.0f;
        for (int i = lane; i < C; i += 32) { xr[i] = src[i]; s += xr[i]; }
        const float mean = warp_sum(s) / C;
        float q = 0.0f;
        for (int i = lane; i < C; i += 32) { const float d = xr[i] - mean; q += d * d; }
        const float rstd = rsqrtf(warp_sum(q) / C + eps);
        for (int i = lane; i < C; i += 32) xr[i] = (xr[i] - mean) * rstd * ln_w[i] + ln_b[i];
    }
    __syncthreads();
    const int col0 = blockIdx.y * OVERFUSE_THREADS * OVERFUSE_COLS + threadIdx.x;
    float acc[OVERFUSE_ROWS][OVERFUSE_COLS];
#pragma unroll
    for (int rr = 0; rr < OVERFUSE_ROWS; rr++)
#pragma unroll
        for (int j = 0; j < OVERFUSE_COLS; j++) acc[rr][j] = 0.0f;
    for (int k = 0; k < C; k++) {
        float wv[OVERFUSE_COLS];
#pragma unroll
        for (int j = 0; j < OVERFUSE_COLS; j++) {
            const int c = col0 + j * OVERFUSE_THREADS;
            wv[j] = c < M ? wt[(long long)k * M + c] : 0.0f;
        }
#pragma unroll
        for (int rr = 0; rr < OVERFUSE_ROWS; rr++) {
            const float xv = xs[rr * C + k];
#pragma unroll
            for (int j = 0; j < OVERFUSE_COLS; j++) acc[rr][j] += xv * wv[j];
        }
    }
#pragma unroll
    for (int rr = 0; rr < OVERFUSE_ROWS; rr++) {
        if (row0 + rr >= N) break;
#pragma unroll
        for (int j = 0; j < OVERFUSE_COLS; j++) {
            const int c = col0 + j * OVERFUSE_THREADS;
            if (c < M) y[(long long)(row0 + rr) * M + c] = acc[rr][j] + bias[c];
        }
    }
}
