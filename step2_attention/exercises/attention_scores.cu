// attention_scores.cu - Exercise 2a.3: scale and causal mask in the attention scores kernel.
//
// q (H, Tq, D) and k (H, Tk, D) hold H heads (batch and heads flattened). Write, for every head h,
// query i < Tq and key j < Tk:
//
//   s[h, i, j] = scale * dot(q[h, i, :], k[h, j, :])      if key j is visible to query i
//              = -infinity (NEG_INF)                      otherwise
//
// Visible: always when causal == 0. When causal != 0, query i is the token at position i + (Tk - Tq)
// (Tq < Tk when new queries attend to a longer cache) and sees the keys at positions 0 .. i + (Tk - Tq),
// itself included. A masked score is -inf, not 0: softmax then gives that key exactly zero weight.
// The tiled dot product is written for you: after the loop, acc holds dot(q[h, i, :], k[h, j, :])
// for this thread's (i, j). What is left is the store, including its bounds: the blocks at the edges
// have threads with i >= Tq or j >= Tk. Grid (ceil(Tk / TILE), ceil(Tq / TILE), H), TILE x TILE threads.
//
// Hint 1 (where to look): Only the store after the loop is yours. First the bounds (i < Tq and j < Tk), then the rule:
//   with Tq < Tk, query i sits at position i + (Tk - Tq); which keys j does it see?
// Hint 2 (the shape of the code): if (i < Tq && j < Tk) s[(h * Tq + i) * Tk + j] = (causal && j > i + (Tk - Tq)) ?
//   NEG_INF : scale * acc; (check the output's index against the layout at the top of the file).
// The solution: solution("step2/attention_scores") gives its path (read it after trying).
// Check it with: from common.exercises import check; check("step2/attention_scores")
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
    const int j0 = blockIdx.x * TILE;        // ... and its key is j = j0 + tx
    float acc = 0.0f;
    for (int d0 = 0; d0 < D; d0 += TILE) {
        Qs[ty][tx] = i < Tq && d0 + tx < D ? qh[(long long)i * D + d0 + tx] : 0.0f;
        Ks[ty][tx] = j0 + ty < Tk && d0 + tx < D ? kh[(long long)(j0 + ty) * D + d0 + tx] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int d = 0; d < TILE; d++) acc += Qs[ty][d] * Ks[tx][d];
        __syncthreads();
    }
    // TODO: write s[h, i, j] (scaled, or NEG_INF where masked) for this thread's i and j, if they exist
}
