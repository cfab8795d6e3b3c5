"""Lesson 4b's exercises: a backward kernel checked alone against the float64 reference, then swapped into a
short training run of your own, whose losses must follow the course's.

The swap goes through step4_gpt2.train.ops, which the trainer's model (model.py) calls at run time
(`ops.layernorm_backward`, `ops.gelu_bias_backward`): replacing that module attribute for the duration of the
run puts the learner's kernel in every layer's backward pass. `SWAPS` declares each replacement
(common.exercises.Swap: the op, and a function with its signature that launches the learner's kernel), which
the capstone installs too; `swap(exercise_id, kern)` makes one.

The training run: a 2-layer, 2-head, C = 64 GPT (shakespeare_char's shape, smaller) on the course's Shakespeare,
batch 8 x 64 characters, 20 AdamW steps without a CUDA graph, once with the course's kernels and once with
yours, from the same initial weights and batches. Two comparisons:
- the first step's gradients, tensor by tensor: max |yours - course| <= 1e-4 * max |course|. Both are fp32
  sums in different orders; each is within about 1e-5 of float64 (lesson 4b, section 3), so two correct
  kernels differ by a few 1e-5 at most;
- the loss of each of the 20 steps: |yours - course| <= 1e-3 * the course's. The first loss is the same
  forward pass; after that the updates differ by what the gradients' rounding differs, which AdamW can blow
  up to a whole learning-rate step on a parameter whose gradient is near zero (its sign is noise): a
  parameter that hardly moves the loss. A wrong kernel shows at once in the first step's gradients; the
  losses show whether its error matters to the training (AdamW divides each update by the gradient's own
  scale, so a gradient wrong by a constant factor can still train alike).
"""
from __future__ import annotations

import functools
from unittest import mock

import numpy as np

from common import launch_grid, rand
from common.exercises import CaseResult, Exercise, Out, Speed, Swap
from common.reference import train_gpt2 as R

HERE = "step4_gpt2/train/exercises"
LN_WARPS = 4                     # layernorm_backward: warps per block (the stub's LN_WARPS)
LN_ROWS = 32                     # layernorm_backward: rows per block
RUN_STEPS, RUN_BATCH, RUN_T = 20, 8, 64
GRAD_ATOL, LOSS_RTOL = 1e-4, 1e-3   # the run's tolerances (the module docstring says why)


# ------------------------------------------------------------------------------ LayerNorm backward
def _ln_make(p, rng):
    N, C = p["N"], p["C"]
    x = rand(N, C, low=-2.0, high=2.0, rng=rng) + np.float32(p.get("offset_x", 0.0))
    w = rand(C, low=0.5, high=1.5, rng=rng)
    _, mean, rstd = R.layernorm_forward(x, w, np.zeros(C, np.float32))
    out = {"dy": rand(N, C, rng=rng), "x": x, "w": w, "mean": mean.astype(np.float32),
           "rstd": rstd.astype(np.float32), "partial": Out((-(-N // LN_ROWS), 2 * C)),
           "accumulate": int(bool(p.get("accumulate", False)))}
    out["dx"] = rand(N, C, rng=rng) if out["accumulate"] else Out((N, C))
    return out


def _ln_ref(h):
    dx, _, _ = R.layernorm_backward(h["dy"], h["x"], h["w"], h["mean"], h["rstd"])
    if h["accumulate"]:
        dx = dx + h["dx"]
    N, C = h["dy"].shape
    xhat = (h["x"].astype(np.float64) - h["mean"][:, None]) * h["rstd"][:, None].astype(np.float64)
    dy = h["dy"].astype(np.float64)
    blocks = -(-N // LN_ROWS)
    partial = np.zeros((blocks, 2 * C))
    for b in range(blocks):
        rows = slice(b * LN_ROWS, (b + 1) * LN_ROWS)
        partial[b, :C], partial[b, C:] = (dy[rows] * xhat[rows]).sum(0), dy[rows].sum(0)
    return {"dx": dx, "partial": partial}


def _ln_launch(kern, a):
    from common import allow_dynamic_smem
    N, C = a["dy"].shape
    k = kern("layernorm_backward")
    smem = LN_WARPS * 2 * C * 4
    allow_dynamic_smem(k, smem, f"layernorm_backward with C={C}")
    k((-(-N // LN_ROWS),), (LN_WARPS * 32,), (a["dy"], a["x"], a["w"], a["mean"], a["rstd"], a["dx"], a["partial"],
                                              np.int32(N), np.int32(C), np.int32(LN_ROWS), np.int32(a["accumulate"])),
      shared_mem=smem)


def _layernorm_backward_with(kern):
    """ops.layernorm_backward's signature, on the learner's kernel; the partial rows are added by the
    course's column_finish (the same fixed order as the course's op). A bf16 copy of dx (dx16, which only the
    bf16 model asks for) is the course's cast of the learner's dx."""
    import cupy as cp
    from common import expect_array, out_array
    from step4_gpt2.train import ops
    from step4_gpt2.train.ops_bf16 import to_bf16

    def layernorm_backward(dy, x, weight, mean, rstd, dx=None, dweight=None, dbias=None, accumulate=False,
                           dx16=None):
        dy = expect_array(dy, "dy", dtype=np.float32, ndim=2)
        N, C = dy.shape
        dx = out_array(dx, (N, C), name="dx")
        dweight, dbias = out_array(dweight, (C,), name="dweight"), out_array(dbias, (C,), name="dbias")
        blocks = max(1, -(-N // LN_ROWS))
        partial = cp.zeros((blocks, 2 * C), cp.float32)
        if N and C:
            _ln_launch(kern, {"dy": dy, "x": x, "w": weight, "mean": mean, "rstd": rstd, "dx": dx,
                              "partial": partial, "accumulate": int(bool(accumulate))})
        if C:
            ops._finish(partial, blocks, 2 * C, dweight, dbias, split=C)
        if dx16 is not None:
            to_bf16(dx, out=dx16)
        return dx, dweight, dbias
    return layernorm_backward


def _course_ln(a):
    from step4_gpt2.train import ops
    dx = a["dx"].copy()
    return lambda: ops.layernorm_backward(a["dy"], a["x"], a["w"], a["mean"], a["rstd"], dx=dx)


# ------------------------------------------------------------------------------ bias + GELU backward
def _gelu_make(p, rng):
    rows, C = p["rows"], p["C"]
    s = p.get("scale", 3.0)
    out = {"h": rand(rows, C, low=-s, high=s, rng=rng), "bias": rand(C, rng=rng), "dout": rand(rows, C, rng=rng)}
    if p.get("in_place"):                  # dpre is dout: the kernel gets the same array twice
        out["dpre"] = out.pop("dout")
    else:
        out["dpre"] = Out((rows, C))
    return out


def _gelu_ref(h):
    dout = h["dout"] if "dout" in h else h["dpre"]
    return {"dpre": R.gelu_bias_backward(dout, R.gelu_bias_forward(h["h"], h["bias"])[0])[0]}


def _gelu_launch(kern, a):
    total, C = a["h"].size, a["h"].shape[1]
    dout = a.get("dout", a["dpre"])
    kern("gelu_backward")(launch_grid(total, 256, per_sm=8), (256,),
                          (dout, a["h"], a["bias"], a["dpre"], np.int64(total), np.int32(C)))


def _gelu_bias_backward_with(kern):
    """ops.gelu_bias_backward's signature, on the learner's kernel; dbias is the course's column_sum of dpre.
    The bf16 model passes h in bf16 and asks for dpre16: h widened for the learner's fp32 kernel, then the
    learner's fp32 dpre cast into dpre16 by the course."""
    from common import expect_array, out_array
    from step2_attention.flash import bf16_to_float32
    from step4_gpt2.train import ops
    from step4_gpt2.train.ops_bf16 import to_bf16

    def gelu_bias_backward(dout, h, bias, dpre=None, dbias=None, dpre16=None):
        dout = expect_array(dout, "dout", dtype=np.float32, ndim=2)
        rows, cols = dout.shape
        if h.dtype == np.uint16:
            h = bf16_to_float32(h)
        dpre = out_array(dpre, (rows, cols), name="dpre")
        if dout.size:
            _gelu_launch(kern, {"dout": dout, "h": h, "bias": bias, "dpre": dpre})
        dbias = ops.column_sum(dpre, out=dbias)
        return (dpre if dpre16 is None else to_bf16(dpre, out=dpre16)), dbias
    return gelu_bias_backward


def _course_gelu(a):
    from step4_gpt2.train import ops
    dpre = a["dpre"].copy()
    return lambda: ops.gelu_bias_backward(a["dout"], a["h"], a["bias"], dpre=dpre)


# ------------------------------------------------------------------------------ the training run
def _course_ops() -> dict:
    from step4_gpt2.train import ops
    return {"layernorm_backward": ops.layernorm_backward, "gelu_bias_backward": ops.gelu_bias_backward}


_COURSE_OPS = _course_ops()      # as the module defines them, before anyone swaps them
# The ops these exercises stand in for (common.exercises.swaps() collects them for the capstone): used in the
# training step; make(kern, original) -> the replacement, with the op's signature.
SWAPS = [
    Swap("step4/layernorm_backward", "step4_gpt2.train.ops.layernorm_backward", ("train",),
         lambda kern, original: _layernorm_backward_with(kern),
         note="dx and each block's dweight, dbias partials (the course's column_finish adds the partials)"),
    Swap("step4/gelu_backward", "step4_gpt2.train.ops.gelu_bias_backward", ("train",),
         lambda kern, original: _gelu_bias_backward_with(kern),
         note="dpre (the course's column_sum gives dbias)"),
]


def swap(exercise_id: str, kern):
    """(name of the op in step4_gpt2.train.ops, the replacement running the learner's kernel): kern(name) gives
    a compiled kernel of the learner's file, as check() passes it. Install it with
    mock.patch.object(step4_gpt2.train.ops, name, replacement) or setattr."""
    sw = next(sw for sw in SWAPS if sw.exercise == exercise_id)
    return sw.attribute, sw.make(kern, _COURSE_OPS[sw.attribute])


@functools.lru_cache(maxsize=1)
def _data():
    from step4_gpt2.train.train import Data
    return Data.shakespeare("char")


def _config(vocab_size: int):
    from step4_gpt2.weights import GPTConfig
    return GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=vocab_size, block_size=RUN_T)


def train_run(steps: int = RUN_STEPS, batch: int = RUN_BATCH) -> dict:
    """A short training run on the ops as they are now (swapped or not): the first step's gradients
    {name: NumPy copy}, the loss of every step (NumPy), and how many times each op was called per backward."""
    import cupy as cp
    from step4_gpt2.train import ops
    from step4_gpt2.train.train import Trainer, TrainConfig, TrainGPT
    data = _data()
    model = TrainGPT(_config(data.vocab_size), seed=0)
    calls = {sw.attribute: 0 for sw in SWAPS}
    originals = {name: getattr(ops, name) for name in calls}

    def counted(name):
        def run(*args, **kw):
            calls[name] += 1
            return originals[name](*args, **kw)
        return run

    x0, y0 = (cp.asarray(a) for a in data.batch("train", batch, RUN_T, step=0))
    with mock.patch.multiple(ops, **{name: counted(name) for name in calls}):
        model.loss_and_grads(x0, y0)
    grads = {k: v.get() for k, v in model.grads.items()}
    trainer = Trainer(model, TrainConfig(batch_size=batch, lr=1e-3, min_lr=1e-4, warmup=2, max_steps=steps,
                                         eval_every=steps, eval_batches=1), graph=False)
    losses = []
    for k in range(steps):
        x, y = data.batch("train", batch, RUN_T, step=k)
        trainer.step(cp.asarray(x), cp.asarray(y), check=False)
        losses.append(trainer.last_loss)
    return {"grads": grads, "losses": np.array([float(v) for v in losses]), "calls": calls}


@functools.lru_cache(maxsize=4)
def _course_run(key) -> dict:
    """The course's own run (cached per device, attention version and TF32 setting: the same every time), on
    the course's ops even while a caller has swapped some of them."""
    from step4_gpt2.train import ops
    with mock.patch.multiple(ops, **_COURSE_OPS):
        return train_run()


def _run_key():
    import cupy as cp
    from common.cublas import tf32_enabled
    from step4_gpt2.train import ops
    return (cp.cuda.Device().id, ops.default_attention_version(), tf32_enabled())


def _in_training(exercise_id: str):
    def model_check(kern) -> list:
        from step4_gpt2.train import ops
        want = _course_run(_run_key())
        name, replacement = swap(exercise_id, kern)
        with mock.patch.object(ops, name, replacement):
            got = train_run()
        label = f"training run ({RUN_STEPS} steps, 2 layers, C = 64)"
        if got["calls"][name] != want["calls"][name] or got["calls"][name] == 0:
            return [CaseResult(label, False, f"ops.{name} was called {got['calls'][name]} times: the swap did not "
                                             f"take effect")]
        worst, where = 0.0, None
        for k, ref in want["grads"].items():
            scale = max(float(np.abs(ref).max()), 1e-30)
            err = float(np.abs(got["grads"][k] - ref).max()) / scale if np.isfinite(got["grads"][k]).all() else np.inf
            if err > worst or where is None:
                worst, where = err, k
        ok = worst <= GRAD_ATOL
        out = [CaseResult(f"{label}: first step's gradients", ok,
                          f"worst tensor {where}: max |yours - course's| = {worst:.1e} of its largest value"
                          + ("" if ok else f" (more than {GRAD_ATOL:g})"))]
        dl = np.abs(got["losses"] - want["losses"])
        bad = ~(dl <= LOSS_RTOL * np.abs(want["losses"]))
        if bad.any():
            s = int(np.argmax(bad))
            out.append(CaseResult(f"{label}: loss curve", False, f"step {s}: loss {got['losses'][s]:.5f}, the course's "
                                                                  f"{want['losses'][s]:.5f}", (s,),
                                  float(got["losses"][s]), float(want["losses"][s])))
        else:
            out.append(CaseResult(f"{label}: loss curve", True,
                                  f"every step within {float((dl / np.abs(want['losses'])).max()):.1e} of the course's "
                                  f"(loss {want['losses'][0]:.3f} -> {want['losses'][-1]:.3f}; {got['calls'][name]} "
                                  f"calls per backward pass were yours)"))
        return out
    return model_check


EXERCISES = [
    Exercise(
        id="step4/layernorm_backward", title="LayerNorm's backward pass: dx and the dweight, dbias partials, "
                                             "then swapped into a training run",
        teaches="two reductions in two directions: a warp per row for the means, per-warp shared-memory rows "
                "for the column sums (no atomics, a fixed order)",
        stub=f"{HERE}/layernorm_backward.cu", kernels=("layernorm_backward",), defines={"LN_WARPS": LN_WARPS},
        make=_ln_make, launch=_ln_launch, reference=_ln_ref, outputs=("dx", "partial"),
        # One row of C = 1 (or 2) is degenerate: LayerNorm's output is constant there, so dx is exactly 0 in
        # float64 and a correct float32 kernel returns only rounding (x rstd = 316) that no tolerance relative to
        # a zero reference can accept (an FMA of d * w - mean(g) leaves it). The smallest row is C = 4.
        cases=(("1 x 4", {"N": 1, "C": 4}), ("5 x 37", {"N": 5, "C": 37}),
               ("33 x 384 (a second, nearly empty block)", {"N": 33, "C": 384}),
               ("70 x 45, x around 300", {"N": 70, "C": 45, "offset_x": 300.0}),
               ("100 x 1000, dx +=", {"N": 100, "C": 1000, "accumulate": True}),
               ("300 x 768", {"N": 300, "C": 768})),
        model=_in_training("step4/layernorm_backward"),
        speed=Speed({"N": 16384, "C": 384}, bytes=lambda a: 12 * a["dy"].size,
                    course=("the course's layernorm_backward", _course_ln))),
    Exercise(
        id="step4/gelu_backward", title="the backward pass of bias + GELU, dpre = dout * gelu'(h + b), then "
                                        "swapped into a training run",
        teaches="differentiating GPT-2's tanh GELU; a kernel that may run in place",
        stub=f"{HERE}/gelu_backward.cu", kernels=("gelu_backward",), make=_gelu_make, launch=_gelu_launch,
        reference=_gelu_ref, outputs=("dpre",),
        cases=(("1 x 1", {"rows": 1, "C": 1}), ("3 x 37", {"rows": 3, "C": 37}),
               ("64 x 1536, in place (dpre is dout)", {"rows": 64, "C": 1536, "in_place": True}),
               ("257 x 3073", {"rows": 257, "C": 3073}),
               ("40 x 100, |h + b| up to 20", {"rows": 40, "C": 100, "scale": 20.0})),
        model=_in_training("step4/gelu_backward"),
        speed=Speed({"rows": 16384, "C": 1536}, bytes=lambda a: 12 * a["h"].size,
                    course=("the course's gelu_bias_backward (with dbias)", _course_gelu))),
]
