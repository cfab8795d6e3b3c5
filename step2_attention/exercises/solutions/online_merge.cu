// online_merge.cu (solution) - exercise 6 of step 2: merging two partial softmax states.
//
// A query's keys are split in two parts (two blocks of split-K decode attention, or two K/V tiles of
// flash attention). Part i produced
//   m_i = max score,  l_i = sum_j exp(s_j - m_i),  o_i = sum_j exp(s_j - m_i) v_j / l_i   (row r, dims d)
// and an empty part has m_i = -inf, l_i = 0, o_i = 0. The merged state is that of all keys at once:
//   m = max(m1, m2),  w_i = l_i * exp(m_i - m)  (each part's weight, rescaled to the common max)
//   l = w1 + w2,      o = (w1 * o1 + w2 * o2) / l
// exp(m_i - m) <= 1, so nothing overflows however large the scores are. w_i is taken as 0 for an
// empty part explicitly: when both parts are empty, -inf - (-inf) would be NaN.
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float part_weight(float l, float mi, float m) {
    return mi == NEG_INF ? 0.0f : l * expf(mi - m);
}

extern "C" __global__ void merge_states(const float* __restrict__ m1, const float* __restrict__ l1,
                                        const float* __restrict__ o1, const float* __restrict__ m2,
                                        const float* __restrict__ l2, const float* __restrict__ o2,
                                        float* __restrict__ m, float* __restrict__ l, float* __restrict__ o,
                                        int rows, int D) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * D) return;
    const int r = (int)(i / D), d = (int)(i % D);
    const float mm = fmaxf(m1[r], m2[r]);
    const float w1 = part_weight(l1[r], m1[r], mm), w2 = part_weight(l2[r], m2[r], mm);
    const float ll = w1 + w2;
    o[i] = ll > 0.0f ? (w1 * o1[i] + w2 * o2[i]) / ll : 0.0f;
    if (d == 0) { m[r] = mm; l[r] = ll; }      // one thread per row writes the row's state
}
