"""Planted bugs: for every exercise, mistakes a careless learner would make, written as edits of the
solution (old text -> new text, each old text found exactly once). tests/test_exercises.py applies each
edit to a copy of the solution and requires common.exercises.check to report FAIL on it, which proves
that the checker's cases can catch that mistake. Not shipped to learners (the solutions folder is).

    exercise id -> [(bug name, what the learner did wrong, old, new), ...]
"""

BUGS = {
    "step1/scale_clamp": [
        ("off_by_one", "bounds check i <= n: the thread at i == n writes past the end",
         "    if (i < n) y[i]", "    if (i <= n) y[i]"),
    ],
    "step1/scale_clamp_grid_stride": [
        ("no_block_offset", "the loop starts at threadIdx.x: every block does the first block's elements",
         "for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)",
         "for (long long i = threadIdx.x; i < n; i += stride)"),
    ],
    "step1/scale_clamp_float4": [
        ("missing_tail", "no scalar tail: the last (n - head) % 4 elements are never written",
         "    if (t < n) y[t] = clamp_axpb(x[t], a, b, lo, hi);\n", ""),
    ],
    "step1/block_max": [
        ("max_starts_at_zero", "the running max starts at 0 instead of -inf (wrong for negative inputs)",
         "    float m = NEG_INF;\n    for (long long i", "    float m = 0.0f;\n    for (long long i"),
    ],
    "step2/softmax_warp": [
        ("no_max_subtraction", "exp(x) without subtracting the row max: overflows for large inputs",
         "    m = warp_max(m);", "    m = 0.0f * warp_max(m);"),
    ],
    "step2/online_merge": [
        ("no_rescale", "each part's sum is not rescaled to the common max: exp(m_i - m) forgotten",
         "    return mi == NEG_INF ? 0.0f : l * expf(mi - m);", "    return mi == NEG_INF ? 0.0f : l;"),
    ],
    "step2/matmul_tiles": [
        ("no_k_bound_on_a", "A's tile load checks the row but not k: reads past the end of each row",
         "        As[ty][tx] = row < M && k0 + tx < K ?", "        As[ty][tx] = row < M ?"),
    ],
    "step2/attention_scores": [
        ("mask_hides_diagonal", "j >= i + offset: a query cannot see its own key",
         "const bool masked = causal && j > i + (Tk - Tq);", "const bool masked = causal && j >= i + (Tk - Tq);"),
    ],
    "step2/flash_rescale": [
        ("acc_not_rescaled", "l is rescaled when the max grows, the output accumulator is not",
         "        for (int i = 0; i < D / 32; ++i) acc[i] *= alpha;\n", ""),
    ],
    "step3/layernorm_welford": [
        ("sum_of_squares", "each lane sums x and x^2 and takes M2 = sum(x^2) - n mean^2: cancels for rows around 1000",
         "        mean += d / n;\n        m2 += d * (v - mean);                // old deviation times new deviation: exact update of M2\n    }\n",
         "        mean += v;\n        m2 += v * v;\n    }\n    if (n > 0.0f) { mean /= n; m2 -= n * mean * mean; }\n"),
    ],
    "step3/residual_layernorm": [
        ("unbiased_variance", "divides the variance by C - 1 (torch.var's default), LayerNorm divides by C",
         "    const float rstd = rsqrtf(warp_sum(q) / C + eps);", "    const float rstd = rsqrtf(warp_sum(q) / (C - 1) + eps);"),
    ],
    "step3/classifier_row": [
        ("no_max_subtraction", "sums exp(z) without a running max: overflows for logits in the hundreds",
         "        if (v > m) { s *= expf(m - v); m = v; }      // a new max: rescale what was summed so far\n"
         "        s += expf(v - m);",
         "        m = 0.0f;\n        s += expf(v);"),
    ],
    "step3/adamw": [
        ("no_bias_correction", "uses m and v without dividing by bc1 and bc2",
         "(mi / bc1) / (sqrtf(vi / bc2) + eps)", "mi / (sqrtf(vi) + eps)"),
    ],
    "step3/conv_bias_relu": [
        ("off_by_one_edge", "iy > H instead of iy >= H: the bottom row reads one image row too far",
         "if (iy < 0 || iy >= H) continue;", "if (iy < 0 || iy > H) continue;"),
    ],
    "step4/bias_gelu": [
        ("erf_gelu", "the erf GELU (PyTorch's default) instead of GPT-2's tanh approximation",
         "        h[i] = gelu_tanh(h[i] + b[i % C]);",
         "        h[i] = 0.5f * (h[i] + b[i % C]) * (1.0f + erff((h[i] + b[i % C]) * 0.70710678f));"),
    ],
    "step4/gemv": [
        ("no_warp_sum", "lane 0 writes its own partial sum: the warp reduction is missing",
         "        const float total = warp_sum(acc[b]);", "        const float total = acc[b];"),
    ],
}

from tests.exercise_bugs.find_bug import BUGS as _FIND_THE_BUG   # noqa: E402  (docs/exercises.md, "Find the bug")
BUGS.update(_FIND_THE_BUG)
from tests.exercise_bugs.x2 import BUGS as _X2   # noqa: E402  (Exercises 2c.1 and 4c.1)
BUGS.update(_X2)
from tests.exercise_bugs.step4_train import BUGS as _STEP4_TRAIN   # noqa: E402  (Exercises 4b.1 and 4b.2)
BUGS.update(_STEP4_TRAIN)


def bugged_copy(tmp_path, ex_id: str, bug: str):
    """A copy of exercise ex_id's solution with the planted bug `bug` applied, in tmp_path: the file that
    common.exercises.check(ex_id, path=...) must report FAIL on."""
    from common import exercises as E
    from common.kernels import ROOT
    name, _, old, new = next(b for b in BUGS[ex_id] if b[0] == bug)
    src = (ROOT / E.exercise(ex_id).solution).read_text()
    assert src.count(old) == 1, f"{ex_id} bug {name}: the text to replace must occur once in the solution"
    path = tmp_path / f"{ex_id.replace('/', '__')}__{name}.cu"
    path.write_text(src.replace(old, new))
    return path
