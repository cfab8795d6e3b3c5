"""Step 4's exercises answered with numbers (common.hints.Question): the expected values live here, so the
notebook's check cell holds no answer; `common.hints.answer(id, ...)` compares them."""
from __future__ import annotations

from common.hints import Question

MODEL = "gpt2-medium"


def _bound() -> dict:
    from common.timing import copy_bandwidth
    from step4_gpt2.weights import GPTConfig
    cfg = GPTConfig.from_name(MODEL)
    nbytes = cfg.weight_bytes_per_token()
    return {"bytes_per_token": nbytes, "bound_tokens_per_s": copy_bandwidth() * 1e9 / nbytes}


QUESTIONS = [
    Question(
        id="step4/decode_bound", number="4a.1", title="the weight-bandwidth bound of gpt2-medium",
        hints=("A decode step at batch 1 reads every weight once. Count the float32 parameters of gpt2-medium "
               "(n_layer = 24, n_embd = C = 1024, vocab 50257, context 1024) from the shapes of its tensors: "
               "W.expected_shapes(cfg_m) lists them. Then tokens/s = bytes per second / bytes per token.",
               "Per layer: two LayerNorms (2C each), c_attn (C x 3C + 3C), attn c_proj (C x C + C), c_fc (C x 4C "
               "+ 4C), mlp c_proj (4C x C + C). Plus wte (vocab x C, read once as the LM head), ln_f (2C) and ONE "
               "row of wpe (C), not the whole wpe. Times 4 bytes. The bandwidth is copy_bandwidth() * 1e9 B/s."),
        worked="bytes_per_token = 4 * (n_params - 1024 * C + C) = cfg_m.weight_bytes_per_token() "
               "(about 1.42 GB for gpt2-medium); bound_tokens_per_s = copy_bandwidth() * 1e9 / bytes_per_token.",
        expected=_bound, rtol={"bytes_per_token": 0.0, "bound_tokens_per_s": 0.05},
        wrong={"bytes_per_token": "every weight once, wte once, one row of wpe (not all of it), 4 bytes each",
               "bound_tokens_per_s": "bytes per second (copy_bandwidth() is in GB/s) over bytes per token"}),
]
