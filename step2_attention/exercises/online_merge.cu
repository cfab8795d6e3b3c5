// online_merge.cu - Exercise 2b.1: merging two online-softmax partial states.
//
// The keys of each query row r were split in two parts, and each part was reduced on its own:
//   m_i[r]    = the largest score s_j in part i
//   l_i[r]    = sum over part i of exp(s_j - m_i[r])
//   o_i[r, :] = sum over part i of exp(s_j - m_i[r]) * v_j[:]  /  l_i[r]     (D floats, normalised)
// A part with no keys has m_i = -inf, l_i = 0, o_i = 0.
// Write the state of the whole row, as if all keys had been reduced at once: m[r], l[r] and o[r, :].
// The two sums are relative to different maxima: rescale each to the common max m = max(m1, m2)
// with exp(m_i - m) before adding them. Never compute exp(m_i) itself (the checker uses scores in the
// hundreds), and mind the row whose two parts are both empty: -inf - (-inf) is NaN; its merged state
// is m = -inf, l = 0, o = 0.
// Launch: one thread per element of o, i = blockIdx.x * blockDim.x + threadIdx.x over rows * D
// (blocks of 256, the last one partly idle); the thread with d == 0 also writes m[r] and l[r].
//
// Hint 1 (where to look): Lesson 2b's online softmax section has the rule for one new key; two parts merge the same
//   way. Write it for one row on paper first: m, then the two weights exp(m1 - m) and exp(m2 - m), then l.
// Hint 2 (the shape of the code): m = fmaxf(m1, m2); if m is -inf (both parts empty) write m, l = 0, o = 0; else a1 =
//   l1 * expf(m1 - m), a2 = l2 * expf(m2 - m), l = a1 + a2, o = (a1 * o1 + a2 * o2) / l (o1 and o2 are
//   normalised, so each is weighted by its part's share of l).
// The solution: solution("step2/online_merge") gives its path (read it after trying).
// Check it with: from common.exercises import check; check("step2/online_merge")
#define NEG_INF __int_as_float(0xff800000)

extern "C" __global__ void merge_states(const float* __restrict__ m1, const float* __restrict__ l1,
                                        const float* __restrict__ o1, const float* __restrict__ m2,
                                        const float* __restrict__ l2, const float* __restrict__ o2,
                                        float* __restrict__ m, float* __restrict__ l, float* __restrict__ o,
                                        int rows, int D) {
    // TODO: your code here
}
