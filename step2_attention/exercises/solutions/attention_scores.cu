// attention_scores.cu (solution) - exercise 8 of step 2: the scale and the causal mask of the naive
// attention's scores kernel.
//
//   s[h, i, j] = scale * sum_d q[h, i, d] * k[h, j, d]     if key j is visible to query i
//              = -inf                                       otherwise (causal and j > i + (Tk - Tq))
//
// The dot products are a tiled matmul with K read transposed (as attention_naive.cu's attn_scores).
// The causal rule counts queries from the end when Tq < Tk (decoding against a longer cache): query i
// is the token at position i + (Tk - Tq), and sees keys up to and including that position. Writing
// -inf (not 0) makes the following softmax give the masked keys exactly zero weight.
#ifndef TILE
#define TILE 32
#endif
#define NEG_INF __int_as_float(0xff800000)

extern "C" __global__ void __launch_bounds__(TILE * TILE)
attn_scores_masked(const float* __restrict__ q, const float* __restrict__ k, float* __restrict__ s,
                   int Tq, int Tk, int D, float scale, int causal) {
    __shared__ float Qs[TILE][TILE];
    __shared__ float Ks[TILE][TILE + 1];     // read down a column: +1 puts each row in another bank
    const int tx = threadIdx.x, ty = threadIdx.y;
    const long long h = blockIdx.z;
    const float* qh = q + h * Tq * D;
    const float* kh = k + h * Tk * D;
    const int i = blockIdx.y * TILE + ty;    // this thread's query
    const int j0 = blockIdx.x * TILE, j = j0 + tx;   // ... and key
    float acc = 0.0f;
    for (int d0 = 0; d0 < D; d0 += TILE) {
        Qs[ty][tx] = i < Tq && d0 + tx < D ? qh[(long long)i * D + d0 + tx] : 0.0f;
        Ks[ty][tx] = j0 + ty < Tk && d0 + tx < D ? kh[(long long)(j0 + ty) * D + d0 + tx] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int d = 0; d < TILE; d++) acc += Qs[ty][d] * Ks[tx][d];
        __syncthreads();
    }
    if (i < Tq && j < Tk) {
        const bool masked = causal && j > i + (Tk - Tq);
        s[(h * Tq + i) * Tk + j] = masked ? NEG_INF : acc * scale;
    }
}
