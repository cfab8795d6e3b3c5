"""Planted bugs of the find-the-bug exercises (docs/exercises.md, "Find the bug"), in the form of
tests/exercise_bugs/__init__.py: exercise id -> [(bug name, what is wrong, old text of the solution, new text)].

The first entry of each, "as_shipped", is the bug the learner is given: tests/test_exercises_find_bug.py
checks that the solution with this one edit IS the shipped file (comments and white space aside), so the
shipped file and the solution differ by exactly that bug. The others are wrong fixes a learner might try;
tests/test_exercises.py requires FAIL for every entry, like any planted bug. Every one fails the same way on
every run (no races), except find_bug_sync's "as_shipped", whose large case fails on practically every run
and which racecheck reports on every run (tests/test_exercises_find_bug.py).
"""

BUGS = {
    "step1/find_bug_tail": [
        ("as_shipped", "the bounds check tests the whole group of four: the last 1-3 elements are never written",
         "#pragma unroll\n    for (int k = 0; k < 4; ++k)\n"
         "        if (i + k < n) y[i + k] = fminf(fmaxf(a * x[i + k] + b, lo), hi);",
         "if (i + 3 < n) {\n#pragma unroll\n"
         "        for (int k = 0; k < 4; ++k) y[i + k] = fminf(fmaxf(a * x[i + k] + b, lo), hi);\n    }"),
        ("off_by_one_fix", "i + k <= n: the last thread writes one element past the end",
         "if (i + k < n) y[i + k]", "if (i + k <= n) y[i + k]"),
    ],
    "step1/find_bug_warp_sum": [
        ("as_shipped", "offsets 16, 8, 4, 2 and never 1: lane 0 sums the even lanes only",
         "offset > 0; offset >>= 1) v +=", "offset > 1; offset >>= 1) v +="),
        ("no_second_stage", "warp 0 does not reduce the warps' totals: only warp 0's total is written",
         "        s = warp_sum_xor(s);\n        if (lane == 0) out", "        if (lane == 0) out"),
    ],
    "step1/find_bug_last_block": [
        ("as_shipped", "the last block never resets tickets: the next launch has no last block",
         "    if (threadIdx.x == 0) {\n        *out = s[0];\n        *tickets = 0;"
         "                                // FIX: back to 0, ready for the next launch\n    }",
         "    if (threadIdx.x == 0) *out = s[0];"),
        ("last_ticket_off_by_one", "the last ticket taken as gridDim.x: no block is ever the last",
         "atomicAdd(tickets, 1) == gridDim.x - 1;", "atomicAdd(tickets, 1) == gridDim.x;"),
    ],
    "step2/find_bug_softmax_overflow": [
        ("as_shipped", "exp(x) / sum exp(x) without the row max: expf overflows above 88.7",
         "    float m = __int_as_float(0xff800000);                                  // FIX: the row max, from -inf\n"
         "    for (int j = lane; j < cols; j += 32) m = fmaxf(m, xr[j]);\n"
         "    m = warp_max(m);\n"
         "    float s = 0.0f;\n"
         "    for (int j = lane; j < cols; j += 32) s += expf(xr[j] - m);            // FIX: exponents <= 0\n"
         "    const float inv = 1.0f / warp_sum(s);\n"
         "    for (int j = lane; j < cols; j += 32) yr[j] = expf(xr[j] - m) * inv;",
         "    float s = 0.0f;\n"
         "    for (int j = lane; j < cols; j += 32) s += expf(xr[j]);\n"
         "    const float inv = 1.0f / warp_sum(s);\n"
         "    for (int j = lane; j < cols; j += 32) yr[j] = expf(xr[j]) * inv;"),
        ("lane_max", "each lane subtracts its own max (no warp_max): the lanes' terms no longer share one scale",
         "    m = warp_max(m);\n", ""),
    ],
    "step2/find_bug_matmul_tile": [
        ("as_shipped", "B's tile stored as Bs[tx][ty] but read as Bs[k][tx]: transposed",
         "Bs[ty][tx] = k0 + ty < K", "Bs[tx][ty] = k0 + ty < K"),
        ("a_transposed", "A's tile stored transposed instead (As[tx][ty], read As[ty][k])",
         "As[ty][tx] = row < M", "As[tx][ty] = row < M"),
    ],
    "step3/find_bug_sync": [
        ("as_shipped", "no barrier between warp 0 writing red[0] and the other warps reading it (a race)",
         "    __syncthreads();                           // FIX: warp 0 has written red[0] before anyone reads it\n",
         ""),
        ("unbiased_variance", "the variance divided by C - 1 instead of C",
         "rsqrtf(block_total(q, red) / C + eps)", "rsqrtf(block_total(q, red) / (C - 1) + eps)"),
    ],
    "step3/find_bug_inplace_loss": [
        ("as_shipped", "the loss reads zr[t] after the same thread overwrote it with the gradient",
         "        const float v = zr[i];                       // FIX: the logit, read before it is overwritten\n"
         "        zr[i] = (expf(v - lse) - (i == t ? 1.0f : 0.0f)) * scale;\n"
         "        if (i == t) loss[blockIdx.x] = lse - v;",
         "        zr[i] = (expf(zr[i] - lse) - (i == t ? 1.0f : 0.0f)) * scale;\n"
         "        if (i == t) loss[blockIdx.x] = lse - zr[i];"),
        ("loss_after_a_barrier", "the loss moved after the loop behind a barrier: the logit is already overwritten",
         "        if (i == t) loss[blockIdx.x] = lse - v;      // the thread that owns the target writes the loss\n"
         "    }\n",
         "    }\n    __syncthreads();\n    if (threadIdx.x == 0) loss[blockIdx.x] = lse - zr[t];\n"),
    ],
    "step4/find_bug_gemv_batch": [
        ("as_shipped", "every batch row reads row 0 of x: the b * K4 offset is missing",
         "__ldg(x4 + (long long)b * K4 + k)", "__ldg(x4 + k)"),
        ("bias_row_0_only", "the bias added to batch row 0 only",
         "total + (bias ? bias[n] : 0.0f)", "total + (b == 0 && bias ? bias[n] : 0.0f)"),
    ],
}
