"""Step 3's exercises: what common.exercises.check runs for each stub in this folder (see step1's for the shape)."""
from __future__ import annotations

import numpy as np

from common import launch_grid, rand, reference
from common.exercises import Exercise, Out, Speed
from common.reference import fusion, mlp

HERE = "step3_fused/exercises"
BLOCK = 256          # layernorm_welford, bias_residual_layernorm: 8 warps = 8 rows per block
EPS = 1e-5
ADAMW = {"lr": 1e-2, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "wd": 0.1, "t": 3}



def _rows_grid(N):
    return (-(-N // (BLOCK // 32)),)


# ------------------------------------------------------------------------------ (10) LayerNorm, Welford
def _ln_make(p, rng):
    N, C = p["N"], p["C"]
    return {"x": rand(N, C, rng=rng) + np.float32(p.get("mean", 0.0)), "w": 1 + 0.1 * rand(C, rng=rng), "b": 0.1 * rand(C, rng=rng),
            "y": Out((N, C))}


def _ln_launch(kern, a):
    N, C = a["x"].shape
    kern("layernorm_welford")(_rows_grid(N), (BLOCK,), (a["x"], a["w"], a["b"], a["y"], np.int32(N), np.int32(C),
                                                        np.float32(EPS)))


def _ln_block_launch(kern, a):
    """find_bug_sync: one block per row."""
    N, C = a["x"].shape
    kern("layernorm_rows")((N,), (BLOCK,), (a["x"], a["w"], a["b"], a["y"], np.int32(C), np.float32(EPS)))


def _course_ln(a):
    import cupy as cp
    from step3_fused import ops
    y = cp.empty_like(a["x"])
    return lambda: ops.layernorm(a["x"], a["w"], a["b"], eps=EPS, version=3, out=y)


# ------------------------------------------------------------------------------ (11) bias + residual + LayerNorm
def _rln_make(p, rng):
    N, C = p["N"], p["C"]
    return {"x": rand(N, C, rng=rng), "proj": rand(N, C, rng=rng), "bias": rand(C, rng=rng), "w": 1 + 0.1 * rand(C, rng=rng),
            "b": 0.1 * rand(C, rng=rng), "r": Out((N, C)), "y": Out((N, C))}


def _rln_ref(h):
    r, y = reference.residual_layernorm(h["x"], h["proj"], h["bias"], h["w"], h["b"], EPS)
    return {"r": r, "y": y}


def _rln_launch(kern, a):
    N, C = a["x"].shape
    kern("bias_residual_layernorm")(_rows_grid(N), (BLOCK,), (a["x"], a["proj"], a["bias"], a["w"], a["b"], a["r"],
                                                              a["y"], np.int32(N), np.int32(C), np.float32(EPS)))


def _course_rln(a):
    import cupy as cp
    from step3_fused import ops
    r, y = cp.empty_like(a["x"]), cp.empty_like(a["x"])
    return lambda: ops.residual_layernorm(a["x"], a["proj"], a["bias"], a["w"], a["b"], eps=EPS, out_residual=r,
                                          out_ln=y)


# ------------------------------------------------------------------------------ (12) the fused classifier's row
def _cls_make(p, rng):
    B, V = p["B"], p["V"]
    return {"z": rand(B, V, rng=rng) * np.float32(p.get("mag", 1.0)), "targets": rng.integers(0, V, B).astype(np.int32),
            "loss": Out(B)}


def _cls_ref(h):
    z, t = h["z"], h["targets"]
    B = z.shape[0]
    grad = reference.softmax(z)
    grad[np.arange(B), t] -= 1.0
    return {"loss": reference.cross_entropy(z, t), "z": grad / B}


def _cls_launch(kern, a):
    B, V = a["z"].shape
    kern("classifier_row")((B,), (256,), (a["z"], a["targets"], a["loss"], np.int32(V), np.float32(1.0 / B)))


def _course_cls(a):
    import cupy as cp
    from step3_fused import training
    z, bias, losses = a["z"].copy(), cp.zeros(a["z"].shape[1], cp.float32), cp.empty_like(a["loss"])
    return lambda: training.classifier(z, bias, a["targets"], mode="grad", losses=losses, check=False)


# ------------------------------------------------------------------------------ (13) AdamW
def _adamw_make(p, rng):
    n = p["n"]
    return {"p": rand(n, rng=rng), "g": rand(n, rng=rng), "m": 0.1 * rand(n, rng=rng), "v": rand(n, low=0.0, high=0.01, rng=rng)}


def _adamw_ref(h):
    c = ADAMW
    state = {"t": c["t"] - 1, "m": {"W1": h["m"].astype(np.float64)}, "v": {"W1": h["v"].astype(np.float64)}}
    # mlp.adamw_step applies weight decay to the matrices ("W1"), PyTorch's AdamW formula
    p, s = mlp.adamw_step({"W1": h["p"]}, {"W1": h["g"]}, state, c["lr"], (c["b1"], c["b2"]), c["eps"], c["wd"])
    return {"p": p["W1"], "m": s["m"]["W1"], "v": s["v"]["W1"]}


def _adamw_scalars():
    c = ADAMW
    return (np.float32(c["lr"]), np.float32(c["b1"]), np.float32(c["b2"]), np.float32(c["eps"]), np.float32(c["wd"]),
            np.float32(1 - c["b1"] ** c["t"]), np.float32(1 - c["b2"] ** c["t"]))


def _adamw_launch(kern, a):
    n = a["p"].size
    kern("adamw_step")(launch_grid(n, 256, per_sm=8), (256,),
                       (a["p"], a["g"], a["m"], a["v"], np.int64(n), *_adamw_scalars()))


def _course_adamw(a):
    from common import get_kernel
    from step3_fused import training
    c = ADAMW
    p, m, v = a["p"].copy(), a["m"].copy(), a["v"].copy()
    n = p.size
    kernel = get_kernel(training.UPD, "adamw_v1", training.UPD_DEFINES)   # the file and defines training.py uses
    lr, b1, b2, eps, wd, bc1, bc2 = _adamw_scalars()
    args = (p, a["g"], m, v, np.int64(n), lr, b1, b2, np.float32(1 - c["b1"]), np.float32(1 - c["b2"]), eps, wd,
            bc1, bc2)
    return lambda: kernel(launch_grid(n, 256, per_sm=8), (256,), args)


# ------------------------------------------------------------------------------ (14) conv + bias + ReLU
def _conv_make(p, rng):
    N, Cin, H, W, Cout = p["shape"]
    return {"x": rand(N, Cin, H, W, rng=rng), "w": 0.5 * rand(Cout, Cin, 3, 3, rng=rng), "bias": 0.5 * rand(Cout, rng=rng),
            "y": Out((N, Cout, H, W))}


def _conv_launch(kern, a):
    N, Cin, H, W = a["x"].shape
    Cout = a["w"].shape[0]
    kern("conv_bias_relu")(launch_grid(a["y"].size, 256, per_sm=8), (256,),
                           (a["x"], a["w"], a["bias"], a["y"], *(np.int32(d) for d in (N, Cin, H, W, Cout))))


def _course_conv(a):
    import cupy as cp
    from step3_fused import ops
    y = cp.empty_like(a["y"])
    return lambda: ops.conv2d_bias_relu(a["x"], a["w"], a["bias"], fused=True, out=y)


EXERCISES = [
    Exercise(
        id="step3/layernorm_welford", title="LayerNorm with Welford's one-pass mean/variance, one warp per row",
        teaches="Welford's update and Chan's merge through shuffles; why E[x^2] - mean^2 fails",
        stub=f"{HERE}/layernorm_welford.cu", kernels=("layernorm_welford",), defines={"BLOCK": BLOCK},
        make=_ln_make, launch=_ln_launch, reference=lambda h: {"y": reference.layernorm(h["x"], h["w"], h["b"], EPS)},
        outputs=("y",),
        cases=(("1 x 1", {"N": 1, "C": 1}), ("7 x 33", {"N": 7, "C": 33}), ("100 x 768", {"N": 100, "C": 768}),
               ("37 x 1000", {"N": 37, "C": 1000}),
               ("rows around 1000 (spread 1)", {"N": 64, "C": 768, "mean": 1000.0, "tol": (2e-4, 2e-4)})),
        speed=Speed({"N": 16384, "C": 1024}, bytes=lambda a: 8 * a["x"].size,
                    course=("the course's layernorm v3 (Welford)", _course_ln))),
    Exercise(
        id="step3/residual_layernorm", title="fused bias + residual + LayerNorm (writes the residual and the LN)",
        teaches="fusion: 16 bytes per element instead of 28 for three kernels",
        stub=f"{HERE}/residual_layernorm.cu", kernels=("bias_residual_layernorm",), defines={"BLOCK": BLOCK},
        make=_rln_make, launch=_rln_launch, reference=_rln_ref, outputs=("r", "y"),
        cases=tuple((f"{N} x {C}", {"N": N, "C": C}) for N, C in ((1, 1), (5, 33), (64, 768), (37, 1000), (9, 2049))),
        speed=Speed({"N": 16384, "C": 768}, bytes=lambda a: 16 * a["x"].size,
                    course=("the course's residual_layernorm", _course_rln))),
    Exercise(
        id="step3/classifier_row", title="one row of the fused classifier: softmax, cross-entropy and dlogits in one kernel",
        teaches="online softmax in one pass; reading before overwriting in place",
        stub=f"{HERE}/classifier_row.cu", kernels=("classifier_row",), make=_cls_make, launch=_cls_launch,
        reference=_cls_ref, outputs=("loss", "z"),
        cases=(("B=1, V=1", {"B": 1, "V": 1}), ("B=3, V=37", {"B": 3, "V": 37}), ("B=8, V=1000", {"B": 8, "V": 1000}),
               ("B=2, V=50257 (GPT-2)", {"B": 2, "V": 50257}),
               ("B=4, V=5000, logits up to +-200", {"B": 4, "V": 5000, "mag": 200.0, "tol": (1e-4, 1e-4)})),
        speed=Speed({"B": 256, "V": 50257}, bytes=lambda a: 8 * a["z"].size,
                    course=("the course's classifier_fused", _course_cls))),
    Exercise(
        id="step3/adamw", title="an AdamW update over a flat parameter buffer",
        teaches="an optimiser step is pure bandwidth: 28 bytes per parameter",
        stub=f"{HERE}/adamw.cu", kernels=("adamw_step",), make=_adamw_make, launch=_adamw_launch,
        reference=_adamw_ref, outputs=("p", "m", "v"), rtol=2e-5, atol=2e-5,
        cases=tuple((f"n={n:,}", {"n": n}) for n in (1, 1000, 4097, (1 << 20) + 3)),
        speed=Speed({"n": 1 << 24}, bytes=lambda a: 28 * a["p"].size, course=("the course's adamw_v1", _course_adamw))),
    Exercise(
        id="step3/conv_bias_relu", title="a direct 3x3 convolution with bias and ReLU fused into its epilogue",
        teaches="zero padding at image edges; fusing elementwise work into a compute-bound kernel",
        stub=f"{HERE}/conv_bias_relu.cu", kernels=("conv_bias_relu",), defines={"KSIZE": 3}, make=_conv_make,
        launch=_conv_launch, reference=lambda h: {"y": fusion.conv2d_bias_relu(h["x"], h["w"], h["bias"])},
        outputs=("y",),
        cases=tuple((f"N={s[0]}, Cin={s[1]}, {s[2]}x{s[3]}, Cout={s[4]}", {"shape": s})
                    for s in ((1, 1, 1, 1, 1), (2, 3, 7, 5, 4), (1, 16, 33, 17, 8), (2, 8, 64, 64, 16))),
        speed=Speed({"shape": (8, 64, 64, 64, 64)},
                    flops=lambda a: 2.0 * a["y"].size * a["x"].shape[1] * 9,
                    course=("the course's conv2d_bias_relu", _course_conv))),
    # find the bug: the stub is a complete kernel with one bug (docs/exercises.md, "Find the bug")
    Exercise(
        id="step3/find_bug_sync",
        title="find the bug: LayerNorm with one block per row (compute-sanitizer's racecheck)",
        teaches="a value one warp writes to shared memory and other warps read needs a barrier in between",
        stub=f"{HERE}/find_bug_sync.cu", kernels=("layernorm_rows",), defines={"BLOCK": BLOCK}, make=_ln_make,
        launch=_ln_block_launch, reference=lambda h: {"y": reference.layernorm(h["x"], h["w"], h["b"], EPS)},
        outputs=("y",),
        cases=(("1 x 1", {"N": 1, "C": 1}), ("4 x 32", {"N": 4, "C": 32}), ("7 x 33", {"N": 7, "C": 33}),
               ("37 x 1000", {"N": 37, "C": 1000}), ("2048 x 1024 (2048 blocks)", {"N": 2048, "C": 1024}))),
    Exercise(
        id="step3/find_bug_inplace_loss", title="find the bug: one row of the fused classifier, in place",
        teaches="an in-place kernel reads every input before the write that replaces it",
        stub=f"{HERE}/find_bug_inplace_loss.cu", kernels=("classifier_row",), make=_cls_make, launch=_cls_launch,
        reference=_cls_ref, outputs=("loss", "z"),
        cases=(("B=1, V=1", {"B": 1, "V": 1}), ("B=3, V=37", {"B": 3, "V": 37}), ("B=8, V=1000", {"B": 8, "V": 1000}),
               ("B=2, V=50257 (GPT-2)", {"B": 2, "V": 50257}),
               ("B=4, V=5000, logits up to +-200", {"B": 4, "V": 5000, "mag": 200.0, "tol": (1e-4, 1e-4)}))),
]
