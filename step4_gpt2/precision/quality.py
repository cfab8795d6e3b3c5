"""What fewer bytes per weight cost in quality: perplexity on held-out text, and how often two models choose the
same next token.

    ppl = perplexity(model, ids, T=256)                # exp(mean NLL) over windows of T tokens, float64
    agree = greedy_agreement(fp32_model, int8_model, prompts, n=64)
    agree.same_prefix, agree.top1                      # tokens before the first difference; top-1 agreement

Perplexity: the held-out tokens are cut into non-overlapping windows of T + 1; the model reads the first T of a
window and is scored on predicting each next one, so a token's context is what precedes it inside its window
(the first token of a window is predicted from nothing before it). The per-token negative log-likelihood,
logsumexp(logits) - logits[target], is computed in float64 from the model's float32 logits, then summed on the
host in float64: comparing a perplexity change of a fraction of a percent needs the sum to be exact well below
that.
Greedy agreement: both models continue the same prompts greedily; free-running, one different choice changes
everything after it (same_prefix counts the tokens before that); teacher-forced (top1), both read the reference's
continuation and we count the positions where their next-token argmax agrees.

The models: any object with `forward(idx (B, T) int32) -> logits (B, T, V)` (NumPy or CuPy) and, for
perplexity's check of T, a `config.block_size` (step4_gpt2.model.GPT has both). Two sources of weights:
`shakespeare_model` (lesson 4b's model, trained here for about a minute on the character-level plays) and
`gpt2_cached` (GPT-2 124M, only when the Hugging Face cache holds it: nothing here downloads).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from step4_gpt2.quantize import PRECISIONS, _xp

LOGITS_BUDGET = 256 * 2**20         # bytes of float32 logits per forward call, and
TOKENS_PER_CALL = 16384             # tokens per forward call: the windows per call follow from both


def token_nll(logits, targets):
    """Negative log-likelihood of each target, float64, in the logits' array module: logits (..., V) float32 or
    float64, targets (...) integers in [0, V)."""
    xp = _xp(logits)
    if logits.ndim < 1 or tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"targets: expected shape {tuple(logits.shape[:-1])} (the logits' without V), "
                         f"got {tuple(targets.shape)}")
    z = logits.astype(xp.float64)
    m = z.max(axis=-1, keepdims=True)
    lse = m[..., 0] + xp.log(xp.exp(z - m).sum(axis=-1))
    picked = xp.take_along_axis(z, xp.asarray(targets).astype(xp.int64)[..., None], axis=-1)[..., 0]
    return lse - picked


def windows(ids, T: int, max_windows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), each (n, T) int32: the non-overlapping windows of T + 1 tokens of ids (the last
    incomplete one dropped); with max_windows, that many spread evenly over the text."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise ValueError(f"ids: expected a 1-D array of token ids, got {ids.dtype} of shape {ids.shape}")
    if isinstance(T, bool) or not isinstance(T, (int, np.integer)) or T < 1:
        raise ValueError(f"T: expected a window length >= 1, got {T!r}")
    n = (len(ids) - 1) // T
    if n < 1:
        raise ValueError(f"ids: {len(ids)} tokens hold no window of T + 1 = {T + 1}; give more text or a smaller T")
    if max_windows is not None:
        if isinstance(max_windows, bool) or not isinstance(max_windows, (int, np.integer)) or max_windows < 1:
            raise ValueError(f"max_windows: expected an integer >= 1 or None, got {max_windows!r}")
    starts = np.arange(n) * T
    if max_windows is not None and max_windows < n:
        starts = starts[np.linspace(0, n - 1, max_windows).round().astype(np.int64)]
    x = np.stack([ids[s:s + T] for s in starts]).astype(np.int32)
    y = np.stack([ids[s + 1:s + T + 1] for s in starts]).astype(np.int32)
    return x, y


def mean_nll(model, ids, T: int, max_windows: int | None = None, batch: int | None = None) -> tuple[float, int]:
    """(mean negative log-likelihood per token in nats, tokens scored) of model on ids (see the module
    docstring). batch: windows per forward call (default: as many as TOKENS_PER_CALL tokens and LOGITS_BUDGET
    bytes of logits allow)."""
    block = getattr(getattr(model, "config", None), "block_size", None)
    if block is not None and T > block:
        raise ValueError(f"T: {T} tokens exceed the model's context, block_size={block}")
    x, y = windows(ids, T, max_windows)
    if batch is None:
        V = getattr(getattr(model, "config", None), "vocab_size", None) or 65536
        batch = max(1, min(LOGITS_BUDGET // (T * V * 4), TOKENS_PER_CALL // T))
    elif isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch: expected an integer >= 1 or None, got {batch!r}")
    total, count = 0.0, 0
    for b0 in range(0, len(x), batch):
        logits = model.forward(x[b0:b0 + batch])
        xp = _xp(logits)
        nll = token_nll(logits, xp.asarray(y[b0:b0 + batch]))
        total += float(nll.sum())                      # float64, on the host
        count += nll.size
    return total / count, count


def perplexity(model, ids, T: int, max_windows: int | None = None, batch: int | None = None) -> float:
    """exp(mean NLL) of model on held-out ids, windows of T tokens (mean_nll)."""
    return float(np.exp(mean_nll(model, ids, T, max_windows, batch)[0]))


def top1_agreement(ref, other, seqs, starts) -> float:
    """Teacher-forced top-1 agreement: both models read each sequence of seqs (1-D id lists), and at every
    position from starts[i] - 1 on (where seqs[i][starts[i]:] are being predicted) we count whether their
    argmax agrees. Returns the fraction of those positions."""
    if len(seqs) != len(starts):
        raise ValueError(f"starts: expected one start per sequence ({len(seqs)}), got {len(starts)}")
    same = total = 0
    for seq, start in zip(seqs, starts):
        seq = np.asarray(seq, np.int32)
        if not 1 <= start < len(seq):
            raise ValueError(f"starts: {start} is not inside a sequence of {len(seq)} tokens (1 .. {len(seq) - 1})")
        picks = []
        for m in (ref, other):
            logits = m.forward(seq[None])[0, start - 1:len(seq) - 1]
            xp = _xp(logits)
            picks.append(np.asarray(xp.argmax(logits, axis=-1).get() if xp is not np else logits.argmax(axis=-1)))
        same += int((picks[0] == picks[1]).sum())
        total += len(picks[0])
    return same / total


@dataclass
class Agreement:
    same_prefix: list          # per prompt: tokens the two free-running greedy continuations share before they differ
    n: int                     # tokens generated per prompt
    top1: float                # teacher-forced top-1 agreement on the reference's continuations

    def __str__(self) -> str:
        shared = ", ".join(str(k) for k in self.same_prefix)
        return (f"greedy continuations identical for the first {shared} of {self.n} tokens; "
                f"next-token choices agree at {self.top1:.1%} of positions (teacher-forced)")


def greedy_agreement(ref, other, prompts, n: int = 64) -> Agreement:
    """How two GPTs (e.g. fp32 and int8) differ in what they generate: both continue each prompt (lists of ids)
    greedily for n tokens (step4_gpt2.generate, no stop at end-of-text)."""
    from step4_gpt2.generate import generate
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n: expected an integer >= 1, got {n!r}")
    prompts = [list(map(int, p)) for p in prompts]
    a = generate(ref, prompts, n, stop_at_eos=False, eos=None).tokens
    b = generate(other, prompts, n, stop_at_eos=False, eos=None).tokens
    prefix = [next((k for k, (s, t) in enumerate(zip(x, y)) if s != t), n) for x, y in zip(a, b)]
    top1 = top1_agreement(ref, other, [p + t for p, t in zip(prompts, a)], [len(p) for p in prompts])
    return Agreement(prefix, n, top1)


# ----------------------------------------------------------------------------- the models measured
def shakespeare_model(seconds: float = 60.0, steps: int = 1000, seed: int = 0):
    """Lesson 4b's model (shakespeare_char: 6 layers, C=384, 65 characters) trained on the course's
    Shakespeare for `steps` steps or `seconds` of training, whichever ends first, each step one CUDA graph.
    Returns (config, params as NumPy in the HF layout, data): data.val are the held-out plays' character ids."""
    from step4_gpt2.train.train import Data, Trainer, TrainConfig, TrainGPT, batch_that_fits, shakespeare_char
    data = Data.shakespeare("char")
    model = TrainGPT(shakespeare_char(data.vocab_size), seed=seed)
    tc = TrainConfig(batch_size=batch_that_fits(model.config), max_steps=steps, warmup=min(100, steps // 10),
                     eval_every=steps, seed=seed)
    Trainer(model, tc, graph=True).fit(data, steps, time_budget_s=seconds, progress=False)
    config, params = model.config, model.host_params()
    del model
    _give_back()                                 # the trainer's activations and graph, before the models come
    return config, params, data


def _give_back() -> None:
    import gc

    import cupy as cp
    gc.collect()                                 # (a trainer and its CUDA graph refer to each other)
    cp.get_default_memory_pool().free_all_blocks()


def gpt2_cached():
    """(config, params, "") of GPT-2 124M from the local Hugging Face cache, or (None, None, why) when it is not
    there. Never downloads."""
    from step4_gpt2 import weights as W
    path = W.cached()
    if path is None:
        return None, None, f"GPT-2 124M ({W.HF_REPO}) is not in the Hugging Face cache (nothing is downloaded here)"
    return (*W.load_file(path), "")


def quality_table(config, params, ids, T: int, precisions=PRECISIONS, max_windows: int | None = None,
                  prompts=None, n: int = 64, lm_head: str | None = None) -> dict:
    """{precision: {"ppl": perplexity, "change": relative change vs fp32, "agreement": Agreement vs fp32 (None
    for fp32 or without prompts)}} of GPT(config, params, precision) on ids, one model on the GPU at a time."""
    from step4_gpt2.generate import release
    from step4_gpt2.model import GPT
    if "fp32" not in precisions:
        raise ValueError(f"precisions: the changes are measured against fp32; include it, got {precisions!r}")
    ref = GPT(config, params)
    out = {"fp32": {"ppl": perplexity(ref, ids, T, max_windows), "change": 0.0, "agreement": None}}
    for p in precisions:
        if p == "fp32":
            continue
        m = GPT(config, params, precision=p, lm_head=lm_head if p == "int8" else None)
        ppl = perplexity(m, ids, T, max_windows)
        agree = greedy_agreement(ref, m, prompts, n) if prompts else None
        out[p] = {"ppl": ppl, "change": ppl / out["fp32"]["ppl"] - 1, "agreement": agree}
        release(m)
        del m
        _give_back()
    release(ref)
    return out


__all__ = ["token_nll", "windows", "mean_nll", "perplexity", "top1_agreement", "Agreement", "greedy_agreement",
           "shakespeare_model", "gpt2_cached", "quality_table"]
