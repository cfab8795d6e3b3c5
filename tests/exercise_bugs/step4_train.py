"""Planted bugs of lesson 4b's exercises (step4_gpt2/train/exercises/), in the form of
tests/exercise_bugs/__init__.py: exercise id -> [(bug name, what the learner did wrong, old, new)], each an
edit of the solution whose old text occurs exactly once. Each one fails at least one case of the check on
every run (no races)."""

BUGS = {
    "step4/layernorm_backward": [
        ("no_mean_g", "dx leaves out mean(g): only the xhat * mean(g * xhat) term is subtracted",
         "const float v = r * (d * w[c] - sg - xh * sgx);", "const float v = r * (d * w[c] - xh * sgx);"),
        ("dweight_from_x", "d weight sums dy * x instead of dy * xhat",
         "            dw[c] += d * xh;", "            dw[c] += d * x[off + c];"),
        ("no_accumulate", "dx = v even when accumulate asks for dx += v (the residual's gradient is lost)",
         "dx[off + c] = accumulate ? dx[off + c] + v : v;", "dx[off + c] = v;"),
        ("warp_zero_only", "the block's partial is warp 0's row: the other warps' rows are never added",
         "        for (int k = 0; k < LN_WARPS; ++k) s += sm[k * 2 * C + c];", "        s = sm[c];"),
    ],
    "step4/gelu_backward": [
        ("no_product_rule", "gelu'(x) = 0.5 (1 + t): the derivative of the tanh factor is forgotten",
         "return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * a * x * x);",
         "return 0.5f * (1.0f + t);"),
        ("tanh_through_exp", "tanh written as (e^2u - 1) / (e^2u + 1): inf / inf = NaN for large positive x",
         "const float t = tanhf(k * (x + a * x * x * x));",
         "const float e = expf(2.0f * k * (x + a * x * x * x));\n    const float t = (e - 1.0f) / (e + 1.0f);"),
        ("no_bias", "gelu' of h instead of h + bias",
         "gelu_grad(h[i] + bias[i % C])", "gelu_grad(h[i])"),
    ],
}
