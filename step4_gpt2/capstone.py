"""The capstone: GPT-2 on your own kernels.

    from step4_gpt2.capstone import build
    gpt = build(mine=True)                 # re-checks your exercise files, prints which kernels are yours
    gpt.generate("Hello, I'm a language model,", max_new_tokens=32)
    gpt.train(steps=20)                    # a short 4b training run, yours against the course's kernels

    python -m step4_gpt2 --mine "Hello, I'm a language model,"        the same from the command line

Every exercise whose kernel does the job of one of GPT-2's ops declares a swap (common.exercises.Swap; the
list is common.exercises.swaps()). build() looks for your file of each such exercise (your working copy,
made by start()), runs check() on it again, and uses it only when every case passes: a file that is
missing, still the stub as shipped, or failing falls back to the course's kernel, and the table says which
and why. While GPT-2 runs, each of your kernels replaces the course's op (the model calls every op through
its module, so replacing the module's attribute swaps it in every block); the decode step then runs its
kernels one by one (no CUDA graph: a graph would replay the kernels it recorded) with the "split" plan,
where every matrix product but the QKV one (whose epilogue appends to the KV cache) is a plain GEMV and every
LayerNorm a kernel of its own, so that yours are used. The first run of each of your kernels at each shape is
waited for, at most WATCH_S: a kernel that hangs there raises GPUUnusable rather than stalling the decode.

build(mine="solutions") does the same with the shipped solutions copied into a temporary exercises folder
(COURSE_EXERCISES_DIR): it must choose the same greedy tokens as the course's own kernels.
"""
from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.exercises import SWAP_USES, Swap

SOURCES = ("mine", "solutions", "course")      # whose kernels: your files, the shipped solutions, none
COURSE_ONLY = "embedding, the QKV GEMV + KV-cache append, decode attention, argmax, cuBLAS's GEMMs in the prefill"
WATCH_S = 30.0           # the longest wait for your kernel's first run at each shape inside GPT-2 (as check's)


class GPUUnusable(RuntimeError):
    """A kernel of yours left the GPU unusable in this process: it never ended (it keeps the GPU busy until the
    process ends) or it hit a sticky CUDA error. Restart Python, then check() that exercise."""


# ----------------------------------------------------------------------------- the swaps of steps 2 to 4
# Each make(kern, original) returns a function with the op's signature: the learner's kernel where the
# exercise covers the call, the course's op (`original`) for what it does not.

def _flash_attention(kern, original):
    """step2/flash_rescale (one head of causal attention, HEAD_DIM 64) as the prefill's flash_attention_qkv."""
    import cupy as cp
    from step2_attention.exercises import HEAD_DIM, _flash_launch

    def flash_attention_qkv(qkv, n_head, causal=True, bias=None, out=None, scale=None, lse=None, **kw):
        B, T, C3 = qkv.shape
        C = C3 // 3
        D = C // n_head
        if D != HEAD_DIM or not causal or lse is not None or kw or (scale is not None and scale != 1 / math.sqrt(D)):
            return original(qkv, n_head, causal=causal, bias=bias, out=out, scale=scale, lse=lse, **kw)
        t = qkv if bias is None else qkv + bias
        t = t.reshape(B, T, 3, n_head, D).transpose(2, 0, 3, 1, 4)            # (3, B, H, T, D)
        q, k, v = (cp.ascontiguousarray(t[i]).reshape(B * n_head, T, D) for i in range(3))
        o = cp.empty_like(q)
        lse_tmp = cp.empty((B * n_head, T), cp.float32)
        _flash_launch(kern, {"q": q, "k": k, "v": v, "o": o, "lse": lse_tmp, "causal": 1})
        merged = o.reshape(B, n_head, T, D).transpose(0, 2, 1, 3).reshape(B, T, C)
        if out is None:
            return cp.ascontiguousarray(merged)
        out[...] = merged
        return out

    return flash_attention_qkv


def _layernorm(kern, original):
    """step3/layernorm_welford (one warp per row) as ops.layernorm, in the prefill and the decode step."""
    import cupy as cp
    from common import expect_array, out_array
    from step3_fused.exercises import BLOCK, _rows_grid

    def layernorm(x, weight, bias, eps=1e-5, version=None, out=None):
        x = expect_array(x, "x", dtype=np.float32, ndim=2)
        N, C = x.shape
        y = out_array(out, (N, C))
        if N == 0:
            return y
        xc = cp.ascontiguousarray(x)
        kern("layernorm_welford")(_rows_grid(N), (BLOCK,), (xc, weight, bias, y, np.int32(N), np.int32(C),
                                                            np.float32(eps)))
        return y

    return layernorm


def _residual_layernorm(kern, original):
    """step3/residual_layernorm as ops.residual_layernorm: r = x + proj + bias, y = LayerNorm(r)."""
    import cupy as cp
    from common import expect_array, out_array
    from step3_fused.exercises import BLOCK, _rows_grid

    def residual_layernorm(x, proj, proj_bias, weight, bias, eps=1e-5, out_residual=None, out_ln=None):
        x = expect_array(x, "x", dtype=np.float32, ndim=2)
        N, C = x.shape
        r = out_array(out_residual, (N, C), name="out_residual")
        y = out_array(out_ln, (N, C), name="out_ln")
        if N == 0:
            return r, y
        pb = proj_bias if proj_bias is not None else cp.zeros(C, cp.float32)
        # the model updates the residual stream in place (out_residual is x): your kernel gets a buffer of
        # its own, so it may read x again after writing r
        aliased = r.data.ptr in (x.data.ptr, proj.data.ptr)
        r_k = cp.empty_like(r) if aliased else r
        kern("bias_residual_layernorm")(_rows_grid(N), (BLOCK,), (x, proj, pb, weight, bias, r_k, y, np.int32(N),
                                                                  np.int32(C), np.float32(eps)))
        if aliased:
            r[...] = r_k
        return r, y

    return residual_layernorm


def _classifier(kern, original):
    """step3/classifier_row as 4b's ops.classifier (losses and dlogits in place, in the training step)."""
    from common import expect_array, out_array

    def classifier(logits, targets, losses=None, scale=None, grad=True):
        if not grad:                          # evaluation: the logits must stay as they are
            return original(logits, targets, losses=losses, scale=scale, grad=grad)
        logits = expect_array(logits, "logits", dtype=np.float32, ndim=2)
        N, V = logits.shape
        targets = expect_array(targets, "targets", dtype=np.int32, shape=(N,))    # read as int* by your kernel
        loss = out_array(losses, (N,), name="losses")
        if N and V:
            kern("classifier_row")((N,), (256,), (logits, targets, loss, np.int32(V),
                                                  np.float32(1.0 / N if scale is None else scale)))
        return loss

    return classifier


def _bias_gelu(kern, original):
    """step4/bias_gelu as ops.bias_gelu (the prefill's MLP epilogue; the decode's GELU after your GEMV)."""
    from step4_gpt2.exercises import _gelu_launch

    def bias_gelu(h, b):
        _gelu_launch(kern, {"h": h, "b": b})
        return h

    return bias_gelu


def _gemv(kern, original):
    """step4/gemv as ops.gemv: every plain matrix product of the decode step and the prefill's LM head; the
    fused variants (ln=, residual=) stay the course's, and gelu=True runs ops.bias_gelu after your GEMV."""
    import cupy as cp
    from step4_gpt2 import ops
    from step4_gpt2.exercises import _gemv_launch
    zeros = {}

    def gemv(x, W, bias=None, out=None, gelu=False, version=None, ln=None, eps=1e-5, residual=False, **kw):
        if ln is not None or residual or kw:
            return original(x, W, bias, out, gelu, version, ln, eps, residual, **kw)
        y = out if out is not None else cp.empty((x.shape[0], W.shape[0]), cp.float32)
        _gemv_launch(kern, {"x": cp.ascontiguousarray(x), "W": W, "bias": bias, "y": y})
        if gelu:                   # looked up now: your bias_gelu when it is swapped in too
            n = y.shape[1]
            if n not in zeros:
                zeros[n] = cp.zeros(n, cp.float32)
            ops.bias_gelu(y, zeros[n])
        return y

    return gemv


SWAPS = [
    Swap("step2/flash_rescale", "step4_gpt2.ops.flash_attention_qkv", ("prefill",), _flash_attention,
         "prefill attention, per head (head_dim 64)"),
    Swap("step3/layernorm_welford", "step4_gpt2.ops.layernorm", ("prefill", "decode"), _layernorm,
         "the first LayerNorm"),
    Swap("step3/residual_layernorm", "step4_gpt2.ops.residual_layernorm", ("prefill", "decode"),
         _residual_layernorm, "bias + residual + LayerNorm after each projection"),
    Swap("step3/classifier_row", "step4_gpt2.train.ops.classifier", ("train",), _classifier,
         "loss and dlogits of the training step"),
    Swap("step4/bias_gelu", "step4_gpt2.ops.bias_gelu", ("prefill", "decode"), _bias_gelu, "the MLP's GELU"),
    Swap("step4/gemv", "step4_gpt2.ops.gemv", ("prefill", "decode"), _gemv,
         "the decode step's matrix products, the LM head"),
]


# ----------------------------------------------------------------------------- choosing the kernels
@dataclass
class Row:
    """One swap of the table: whose kernel runs, why, and how fast each is (check's timing, ms)."""
    swap: Swap
    yours: bool
    why: str
    path: str | None = None
    mine_ms: float | None = None
    course_ms: float | None = None
    kernels: dict = field(default_factory=dict, repr=False)     # kernel name -> compiled kernel (yours)

    def kern(self, name: str):
        return self.kernels[name]


def _source(mine) -> str:
    from common import expect_choice
    if mine is True or mine is None:
        mine = "mine"
    elif mine is False:
        mine = "course"
    return expect_choice(mine, "mine", SOURCES)


def _quiet_check(exercise_id: str, path, timing: bool):
    """check() with its printing kept (returned) rather than shown: the capstone prints one table."""
    from common.exercises import check
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        result = check(exercise_id, path=path, timing=timing)
    return result, buf.getvalue()


def choose(mine=True, checker=None, timing: bool = True, verbose: bool = False) -> list:
    """One Row per swap (common.exercises.swaps()): yours when your working copy passes check(), else the
    course's, with the reason. checker(exercise_id, path) -> (CheckResult, printed text) replaces the check
    (tests); verbose prints each check's own output too. Raises RuntimeError when a check leaves the GPU
    unusable (GPUUnusable: a kernel that never ends, a sticky CUDA error): restart Python, then check that
    exercise. An exercise that needs a newer GPU (its min_sm) is the course's, and not checked, on an older one."""
    from common.exercises import exercise, registry, swaps, too_old, working_copy
    from common.kernels import ROOT
    source = _source(mine)
    checker = checker or (lambda i, p: _quiet_check(i, p, timing))
    rows, order = [], list(registry())
    for ex_id, sw in sorted(swaps().items(), key=lambda kv: order.index(kv[0])):
        if source == "course":
            rows.append(Row(sw, False, "the course's kernel (asked for)"))
            continue
        ex = exercise(ex_id)
        path = working_copy(ex_id)
        if not path.is_file():
            rows.append(Row(sw, False, f"no file yet: start({ex_id!r})"))
            continue
        if path.read_bytes() == (ROOT / ex.stub).read_bytes():
            rows.append(Row(sw, False, "your file is still the stub as shipped"))
            continue
        old = too_old(ex)
        if old:
            rows.append(Row(sw, False, old, str(path)))
            continue
        result, text = checker(ex_id, path)
        if verbose:
            print(text, end="")
        if not result.passed:
            n = sum(c.passed for c in result.cases)
            why = (f"{n} of {len(result.cases)} cases pass" if result.cases else
                   "does not compile" if not result.compiled else (result.message or "not run"))
            rows.append(Row(sw, False, f"check({ex_id!r}) FAILs: {why}", str(path)))
            if result.ran and result.message:          # a hang or a sticky CUDA error: nothing more can run
                raise GPUUnusable(f"{ex_id}: {result.message}")
            continue
        t = result.timings
        ms = lambda k: t[k].median_ms if k in t else None            # noqa: E731
        rows.append(Row(sw, True, "passes check()", str(path), ms("yours"), ms("course")))
    return rows


def table(rows: list) -> str:
    """The table build() prints: each op, whose kernel runs it and why, and the check's timing."""
    from common.timing import faster
    cells = []
    for r in rows:
        speed = ""
        if r.mine_ms is not None:
            speed = f"{r.mine_ms * 1e3:.1f} us"
            if r.course_ms is not None:
                speed += f" vs {r.course_ms * 1e3:.1f} us: {faster(r.mine_ms, r.course_ms)}"
        cells.append((r.swap.exercise, f"{r.swap.attribute} ({', '.join(r.swap.uses)})",
                      "yours" if r.yours else "course", speed, r.why))
    head = ("exercise", "op (where GPT-2 runs it)", "runs", "yours vs the course's (check)", "why")
    w = [max(len(c[i]) for c in cells + [head]) for i in range(4)]
    lines = ["  " + "  ".join(f"{c[i]:{w[i]}s}" for i in range(4)) + "  " + c[4] for c in [head] + cells]
    n = sum(r.yours for r in rows)
    lines.append(f"{n} of {len(rows)} swappable ops run your kernels; always the course's: {COURSE_ONLY}")
    return "\n".join(lines)


@contextlib.contextmanager
def solutions_dir():
    """A temporary exercises folder holding every shipped solution as the learner's file
    (COURSE_EXERCISES_DIR points at it while the block runs)."""
    from common.exercises import registry, working_copy
    from common.kernels import ROOT
    before = os.environ.get("COURSE_EXERCISES_DIR")
    with tempfile.TemporaryDirectory(prefix="course_solutions_") as tmp:
        os.environ["COURSE_EXERCISES_DIR"] = tmp
        try:
            for ex in registry().values():
                dest = working_copy(ex.id)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(ROOT / ex.solution, dest)
            yield Path(tmp)
        finally:
            if before is None:
                os.environ.pop("COURSE_EXERCISES_DIR", None)
            else:
                os.environ["COURSE_EXERCISES_DIR"] = before


def _compile(rows: list) -> None:
    """Load your kernels of each row that uses them (cached by common.get_kernel: check compiled them)."""
    from common.exercises import exercise, load_kernels
    for r in rows:
        if r.yours:
            r.kernels = load_kernels(exercise(r.swap.exercise), r.path)


# ----------------------------------------------------------------------------- GPT-2 on them
def _capturing() -> bool:
    """Whether the current stream is being captured into a CUDA graph (where no wait may happen)."""
    import cupy as cp
    try:
        return bool(cp.cuda.get_current_stream().is_capturing())
    except Exception:
        return False


def _shape_key(args, kw) -> tuple:
    """What makes one call of an op differ from another for a kernel: array shapes and dtypes, plain values."""
    def one(v):
        if hasattr(v, "shape") and hasattr(v, "dtype"):
            return ("array", tuple(v.shape), str(v.dtype))
        return v if isinstance(v, (bool, int, float, str, type(None))) else type(v).__name__
    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kw.items()))


def _watched(exercise_id: str, op: str, fn, on_unusable=None, timeout_s: float = WATCH_S):
    """fn (a replacement running your kernel) that, the first time it is called with each shape, waits for the
    GPU at most timeout_s (common.exercises' bounded wait): a kernel of yours that never ends, or ends in a
    CUDA error, on one of GPT-2's shapes raises GPUUnusable there instead of hanging the decode loop. Later
    calls with a shape already seen run without waiting. on_unusable(message), if given, is called first
    (the command line leaves the process there: a decoder's clean-up would wait for the GPU forever)."""
    import sys
    from common import exercises as E
    seen = set()

    @functools.wraps(fn)
    def run(*args, **kw):
        out = fn(*args, **kw)
        key = _shape_key(args, kw)
        if key in seen or _capturing():
            return out
        try:
            E._wait(timeout_s)
        except E._Hang:
            msg = (f"{exercise_id}: your kernel, as {op} inside GPT-2, did not finish within {timeout_s:g} s (an "
                   f"endless loop at these shapes?); the GPU stays busy until this Python process ends: restart "
                   f"it (Jupyter: Kernel > Restart), then check({exercise_id!r})")
            if on_unusable is not None:
                on_unusable(msg)
            print(msg, file=sys.stderr, flush=True)    # shown now: the decoder's clean-up may wait for the GPU
            raise GPUUnusable(msg) from None
        except Exception as e:         # the CUDA error of a kernel queued so far: sticky
            msg = (f"{exercise_id}: the GPU reported an error after your kernel ran as {op} inside GPT-2 "
                   f"({type(e).__name__}: {e}); a CUDA error is sticky: restart Python, then check({exercise_id!r})")
            if on_unusable is not None:
                on_unusable(msg)
            raise GPUUnusable(msg) from e
        seen.add(key)
        return out

    return run


class Capstone:
    """GPT-2 (a step4_gpt2.model.GPT) and the kernels chosen for each swappable op (rows). on_unusable:
    None, or a function(message) called when a kernel of yours leaves the GPU unusable (see _watched)."""

    def __init__(self, model, rows: list, tokenizer=None):
        self.model, self.rows, self.tokenizer = model, rows, tokenizer
        self.on_unusable = None

    @property
    def yours(self) -> list:
        return [r for r in self.rows if r.yours]

    def uses(self, where: str) -> list:
        return [r for r in self.yours if where in r.swap.uses]

    @contextlib.contextmanager
    def swapped(self, where=SWAP_USES):
        """Your kernels in place of the course's ops (those used in `where`) while the block runs; the first
        call of each op at each shape waits for the GPU, at most WATCH_S (GPUUnusable if your kernel hangs)."""
        import importlib
        from unittest import mock
        with contextlib.ExitStack() as stack:
            for r in self.yours:
                if not set(r.swap.uses) & set(where):
                    continue
                mod = importlib.import_module(r.swap.module)
                original = getattr(mod, r.swap.attribute)
                fn = _watched(r.swap.exercise, r.swap.op, r.swap.make(r.kern, original), self.on_unusable)
                stack.enter_context(mock.patch.object(mod, r.swap.attribute, fn))
            yield self

    def decoder_options(self) -> dict:
        """Eager launches and the "split" plan when any decode op is yours; the course's defaults otherwise."""
        return {"cuda_graph": False, "plan": "split"} if self.uses("decode") else {}

    def generate(self, prompts, max_new_tokens: int = 32, temperature: float = 0.0, **kw):
        """generate() (step4_gpt2.generate) with your kernels swapped in: a string (printed as it is made,
        with the tokenizer) or a list of prompts (token id lists or strings). Returns the Generation."""
        kw = {**self.decoder_options(), **kw}
        if self.uses("decode") and kw.get("cuda_graph", True):
            # a graph would record your kernels (and the buffers they allocate) and replay them after the swap
            raise ValueError("cuda_graph: decode ops of yours are swapped in, so the decode step runs eagerly; "
                             "leave cuda_graph out (or False)")
        from step4_gpt2.generate import generate, generate_streamed
        with self.swapped(("prefill", "decode")):
            if isinstance(prompts, str):
                return generate_streamed(self.model, prompts, max_new_tokens, tokenizer=self.tokenizer,
                                         temperature=temperature, **kw)
            return generate(self.model, prompts, max_new_tokens, temperature=temperature, **kw)

    def train(self, steps: int = 20, batch: int = 8, T: int = 64, seed: int = 0, quiet: bool = False) -> dict:
        """A short 4b training run (a small GPT, synthetic text), twice from the same start: the course's
        kernels, then with yours swapped in. Prints both loss curves; returns {"course": [...], "yours": [...]}."""
        from step4_gpt2.train.model import TrainGPT
        from step4_gpt2.train.train import TrainConfig, Trainer
        from step4_gpt2.weights import GPTConfig
        if not isinstance(steps, (int, np.integer)) or steps < 1:
            raise ValueError(f"steps: expected an integer >= 1, got {steps!r}")
        cfg = GPTConfig(n_layer=2, n_head=2, n_embd=128, vocab_size=96, block_size=T)
        rng = np.random.default_rng(seed)
        text = np.tile(rng.integers(0, cfg.vocab_size, 997), 8).astype(np.int32)   # repeats: learnable
        starts = rng.integers(0, text.size - T - 1, (steps, batch))
        import cupy as cp
        batches = [(cp.asarray(np.stack([text[s:s + T] for s in st])),
                    cp.asarray(np.stack([text[s + 1:s + T + 1] for s in st]))) for st in starts]

        def run(swapped: bool) -> list:
            tc = TrainConfig(batch_size=batch, warmup=min(2, steps), max_steps=steps)
            trainer = Trainer(TrainGPT(cfg, seed=seed), tc)
            losses = []
            with self.swapped(("train",)) if swapped else contextlib.nullcontext():
                for idx, tgt in batches:
                    trainer.step(idx, tgt)
                    losses.append(float(trainer.last_loss))
            return losses

        out = {"course": run(False), "yours": run(True)}
        if not quiet:
            mine = ", ".join(r.swap.exercise for r in self.uses("train")) or "none (every op is the course's)"
            print(f"training step, {steps} steps of {batch} x {T} tokens; your kernels: {mine}")
            print(f"  {'step':>4s}  {'course':>8s}  {'yours':>8s}")
            for i in sorted({0, steps // 2, steps - 1}):
                print(f"  {i:4d}  {out['course'][i]:8.4f}  {out['yours'][i]:8.4f}")
            diff = max(abs(a - b) for a, b in zip(out["course"], out["yours"]))
            print(f"  largest difference between the two curves: {diff:.2e}")
        return out


def build(mine=True, model=None, weights=None, name: str = "gpt2", timing: bool = True, verbose: bool = False,
          quiet: bool = False, tokenizer=None) -> Capstone:
    """GPT-2 on your kernels. mine: True / "mine" (your files in the exercises folder, each re-checked),
    "solutions" (the shipped solutions, through a temporary exercises folder), False / "course" (none).
    model: a step4_gpt2.model.GPT to use (with its `tokenizer`, for text prompts), e.g. the one a notebook has
    loaded already; else GPT-2 `name` from weights.load (weights: a folder or file).
    Prints the table of kernels (unless quiet) and returns a Capstone (its .generate, .train)."""
    from common.device import require_gpu
    source = _source(mine)
    require_gpu()
    if source == "solutions":
        with solutions_dir():
            rows = choose("mine", timing=timing, verbose=verbose)
            _compile(rows)                    # while the files exist
    else:
        rows = choose(source, timing=timing, verbose=verbose)
        _compile(rows)
    tok = tokenizer
    if model is None:
        from step4_gpt2 import tokenizer, weights as W
        from step4_gpt2.model import GPT
        cfg, params, _ = W.load(name, path=weights, notice="stderr")
        model = GPT(cfg, params)
        tok = tokenizer.for_checkpoint(weights) if weights else tokenizer.BPETokenizer()
    if not quiet:
        print({"mine": "GPT-2 on your kernels", "solutions": "GPT-2 on the shipped solutions",
               "course": "GPT-2 on the course's kernels"}[source])
        print(table(rows))
    return Capstone(model, rows, tok)


__all__ = ["build", "choose", "table", "solutions_dir", "Capstone", "Row", "SWAPS", "SOURCES", "GPUUnusable"]
