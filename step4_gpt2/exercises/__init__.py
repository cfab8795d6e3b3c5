"""Step 4's exercises: a kernel checked alone, then swapped into the GPT-2 model (see step1's for the shape).

The swap goes through step4_gpt2.ops, which model.py calls at run time (`ops.bias_gelu`, `ops.gemv`): for
the duration of the model check the learner's kernel replaces the course's in every block. The model is a
small GPT-2 with random weights (no download): 2 layers, 2 heads, 64 channels, 512 tokens.
"""
from __future__ import annotations

from unittest import mock

import numpy as np

from common import launch_grid, null_or, rand, reference
from common.exercises import CaseResult, Exercise, Out, Speed, compare
from common.reference import gpt2 as ref_gpt2

HERE = "step4_gpt2/exercises"
MAXB = 8              # gemv: batch rows per launch (the stub's MAXB)


def _config():
    from step4_gpt2.weights import GPTConfig
    return GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=512, block_size=64)


def _model():
    """A small GPT-2 (random weights, seeded) and its weight dict."""
    from step4_gpt2.model import GPT
    from step4_gpt2.weights import random_weights
    cfg = _config()
    params = random_weights(cfg, seed=0, notice=False)
    return GPT(cfg, params), params


# ------------------------------------------------------------------------------ (15) bias + GELU in the model
def _gelu_make(p, rng):
    rows, C = p["rows"], p["C"]
    return {"h": rand(rows, C, low=-3.0, high=3.0, rng=rng), "b": rand(C, rng=rng)}


def _gelu_launch(kern, a):
    total, C = a["h"].size, a["h"].shape[1]
    kern("bias_gelu")(launch_grid(total, 256, per_sm=8), (256,), (a["h"], a["b"], np.int64(total), np.int32(C)))


def _gelu_in_model(kern) -> list:
    """The model's prefill with the learner's bias_gelu in every MLP, against the float64 reference model."""
    from step4_gpt2 import ops
    model, params = _model()
    cfg = model.config
    idx = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 13))
    calls = []

    def mine(h, b):
        calls.append(h.shape)
        _gelu_launch(kern, {"h": h, "b": b})
        return h

    with mock.patch.object(ops, "bias_gelu", mine):         # model.py calls ops.bias_gelu through the module
        got = model.forward(idx).get()
    name = f"GPT-2 (2 layers, random weights) logits, prompts {idx.shape}"
    if len(calls) != cfg.n_layer:
        return [CaseResult(name, False, f"the model called bias_gelu {len(calls)} times, not once per layer "
                                        f"({cfg.n_layer}): the swap did not take effect")]
    want = ref_gpt2.forward(params, idx, cfg.n_layer, cfg.n_head, cfg.eps)
    r = compare(name, got, want, rtol=0.0, atol=1e-4)       # max abs error / max |logit| <= 1e-4
    r.detail = "vs the float64 reference model: " + r.detail
    return [r]


def _course_gelu(a):
    from step4_gpt2 import ops
    h = a["h"].copy()
    return lambda: ops.bias_gelu(h, a["b"])


# ------------------------------------------------------------------------------ (16) the decode GEMV
def _gemv_make(p, rng):
    B, N, K = p["B"], p["N"], p["K"]
    return {"x": rand(B, K, rng=rng), "W": 0.05 * rand(N, K, rng=rng), "bias": rand(N, rng=rng) if p.get("bias", True) else None,
            "y": Out((B, N))}


def _gemv_ref(h):
    y = reference.matmul(h["x"], h["W"].T)
    return {"y": y if h["bias"] is None else y + h["bias"].astype(np.float64)}


def _gemv_launch(kern, a):
    B, K = a["x"].shape
    N = a["W"].shape[0]
    bias = null_or(a["bias"])
    k = kern("gemv")
    for b0 in range(0, B, MAXB):
        nb = min(MAXB, B - b0)
        k((-(-N // 4),), (128,), (a["x"][b0:b0 + nb], a["W"], bias, a["y"][b0:b0 + nb], np.int32(nb), np.int32(N),
                                 np.int32(K)))


def _greedy(model, ids, lens, steps: int):
    """Greedy tokens of a fresh eager decoder (no CUDA graph: a graph would replay the kernels it captured),
    "split" plan (every plain GEMV goes through ops.gemv), and the last step's logits."""
    from step4_gpt2.generate import Decoder
    dec = Decoder(model, ids.shape[0], int(max(lens)) + steps + 1, greedy=True, cuda_graph=False, plan="split")
    first = dec.prefill(ids, lens)
    tokens = [first] + list(dec.decode(steps))
    return np.stack(tokens, axis=1), dec.state.logits.get()


def _gemv_in_model(kern) -> list:
    """The decode step with the learner's GEMV for every plain matrix product, against the course's own."""
    import cupy as cp
    model, _ = _model()
    lens = np.array([7, 4])
    from step4_gpt2.benchmarks import random_ids
    ids = random_ids(model.config, 2, 7, seed=2)
    steps = 12
    want_tokens, want_logits = _greedy(model, ids, lens, steps)
    calls = []
    from step4_gpt2 import ops
    original, course_gelu = ops.gemv, ops.bias_gelu

    def mine(x, W, bias=None, out=None, gelu=False, version=None, ln=None, eps=1e-5, residual=False, **kw):
        if ln is not None or residual:           # the fused variants are not this exercise: the course's
            return original(x, W, bias, out, gelu, version, ln, eps, residual, **kw)
        calls.append(W.shape)
        y = out if out is not None else cp.empty((x.shape[0], W.shape[0]), cp.float32)
        _gemv_launch(kern, {"x": x, "W": W, "bias": bias, "y": y})
        if gelu:                                 # the course's GELU (zero bias) after your GEMV + bias
            course_gelu(y, cp.zeros(y.shape[1], cp.float32))
        return y

    with mock.patch.object(ops, "gemv", mine):
        got_tokens, got_logits = _greedy(model, ids, lens, steps)
    name = f"decode, 2 prompts (lengths {lens.tolist()}), {steps} greedy steps"
    if not calls:
        return [CaseResult(name, False, "the decode step never called ops.gemv: the swap did not take effect")]
    out = []
    same = got_tokens == want_tokens
    if same.all():
        out.append(CaseResult(name + ": tokens", True, f"all {same.size} tokens equal the course's "
                                                       f"({len(calls)} GEMV calls were yours)"))
    else:
        b, t = (int(i) for i in np.argwhere(~same)[0])
        out.append(CaseResult(name + ": tokens", False, f"sequence {b}, token {t}: got {got_tokens[b, t]}, the "
                                                        f"course's model chose {want_tokens[b, t]}", (b, t)))
    r = compare(name + ": last logits", got_logits, want_logits, rtol=0.0, atol=1e-4)
    r.detail = "vs the course's decode step: " + r.detail
    return out + [r]


def _course_gemv(a):
    from step4_gpt2 import ops
    y = a["y"].copy()
    return lambda: ops.gemv(a["x"], a["W"], out=y)


EXERCISES = [
    Exercise(
        id="step4/bias_gelu", title="GPT-2's MLP epilogue h = gelu(h + b), then swapped into the model",
        teaches="an elementwise epilogue fused after a GEMM; GPT-2's tanh GELU; checking a kernel inside a model",
        stub=f"{HERE}/bias_gelu.cu", kernels=("bias_gelu",), make=_gelu_make, launch=_gelu_launch,
        reference=lambda h: {"h": reference.gelu(h["h"].astype(np.float64) + h["b"])}, outputs=("h",),
        cases=tuple((f"{r} x {C}", {"rows": r, "C": C}) for r, C in ((1, 1), (3, 37), (64, 3072), (257, 3073))),
        model=_gelu_in_model,
        speed=Speed({"rows": 8192, "C": 3072}, bytes=lambda a: 8 * a["h"].size,
                    course=("the course's bias_gelu", _course_gelu))),
    Exercise(
        id="step4/gemv", title="the decode step's GEMV y = x W^T + b, then swapped into the decode step",
        teaches="a weight-bandwidth-bound kernel: one warp per output row, float4 loads, batch rows share loads",
        stub=f"{HERE}/gemv.cu", kernels=("gemv",), defines={"MAXB": MAXB}, make=_gemv_make, launch=_gemv_launch,
        reference=_gemv_ref, outputs=("y",),
        cases=(("B=1, N=1, K=4", {"B": 1, "N": 1, "K": 4}), ("B=1, N=37, K=100", {"B": 1, "N": 37, "K": 100}),
               ("B=3, N=768, K=768, no bias", {"B": 3, "N": 768, "K": 768, "bias": False}),
               ("B=8, N=3072, K=768", {"B": 8, "N": 3072, "K": 768}),
               ("B=11 (two launches), N=5003, K=768", {"B": 11, "N": 5003, "K": 768})),
        model=_gemv_in_model,
        speed=Speed({"B": 1, "N": 50257, "K": 768}, bytes=lambda a: 4 * a["W"].size,
                    course=("the course's gemv (v5)", _course_gemv))),
    # find the bug: the stub is a complete kernel with one bug (docs/exercises.md, "Find the bug")
    Exercise(
        id="step4/find_bug_gemv_batch", title="find the bug: the decode GEMV for a batch of rows, then the decode step",
        teaches="batched kernels: row b of a 2-D array is b * row_length in",
        stub=f"{HERE}/find_bug_gemv_batch.cu", kernels=("gemv",), defines={"MAXB": MAXB}, make=_gemv_make,
        launch=_gemv_launch, reference=_gemv_ref, outputs=("y",),
        cases=(("B=1, N=1, K=4", {"B": 1, "N": 1, "K": 4}), ("B=1, N=37, K=100", {"B": 1, "N": 37, "K": 100}),
               ("B=2, N=37, K=100", {"B": 2, "N": 37, "K": 100}),
               ("B=3, N=768, K=768, no bias", {"B": 3, "N": 768, "K": 768, "bias": False}),
               ("B=11 (two launches), N=5003, K=768", {"B": 11, "N": 5003, "K": 768})),
        model=_gemv_in_model),
]
