"""Step 1's exercises: what common.exercises.check runs for each stub in this folder.

Each spec says how to make the inputs (NumPy, seeded), how the learner's kernel is launched, the float64
reference (common.reference), the cases (awkward sizes on purpose) and the course's kernel to time it with.
"""
from __future__ import annotations

import numpy as np

from common import launch_grid, rand, reference
from common.exercises import Exercise, Out, Speed

HERE = "step1_simple/exercises"
BLOCK = 256
A, B, LO, HI = 1.5, 0.25, -1.0, 2.0       # y = clamp(A x + B, LO, HI): both ends clamp for x in [-3, 3)


def _clamp_make(p, rng):
    n = p["n"]
    return {"x": rand(n, low=-3, high=3, rng=rng), "y": Out(n), "grid": p.get("grid")}


def _clamp_ref(h):
    return {"y": np.clip(reference.axpb(h["x"], A, B), LO, HI)}


def _clamp_args(a):
    return (a["x"], a["y"], np.float32(A), np.float32(B), np.float32(LO), np.float32(HI), np.int64(a["x"].size))


def _fixed_grid(a, n):
    """The cases pass a tiny grid (so one thread must loop); timing uses a few blocks per SM."""
    return (a["grid"],) if a.get("grid") else launch_grid(n, BLOCK, per_sm=8)


def _head(x) -> int:
    """Elements before x's first 16-byte-aligned one (what the float4 kernel handles one by one)."""
    return min(x.size, (16 - x.data.ptr % 16) % 16 // 4)


def _course_axpb(version):
    def factory(a):
        import cupy as cp
        from step1_simple import ops
        y = cp.empty_like(a["x"])
        return lambda: ops.axpb(a["x"], A, B, out=y, version=version)
    return factory


def _max_make(p, rng):
    n = p["n"]
    x = rand(n, low=-5, high=-1, rng=rng)       # all negative: a max that starts at 0 is wrong
    if p.get("max_last"):
        x[-1] = -0.5                                     # the largest element in the last, partial block
    return {"x": x, "out": Out(1), "grid": p.get("grid")}


def _max_launch(kern, a):
    import cupy as cp
    x, n = a["x"], a["x"].size
    blocks = min(launch_grid(n, BLOCK)[0], a.get("grid") or launch_grid(n, BLOCK, per_sm=4)[0])
    partial = cp.empty(blocks, dtype=cp.float32)
    k = kern("block_max")
    k((blocks,), (BLOCK,), (x, partial, np.int64(n)))        # G blocks -> G partial maxima
    k((1,), (BLOCK,), (partial, a["out"], np.int64(blocks)))  # one block -> the answer


def _course_sum(a):
    from step1_simple import ops
    return lambda: ops.total(a["x"], version=2)


# ------------------------------------------------------------------------------ find the bug (docs/exercises.md)
def _sum_make(p, rng):
    n = p["n"]
    return {"x": rand(n, low=0.0, high=1.0, rng=rng), "out": Out(1), "grid": p.get("grid")}   # all positive


def _sum_ref(h):
    return {"out": np.array([h["x"].astype(np.float64).sum()])}


def _blocks(a) -> int:
    n = a["x"].size
    return min(launch_grid(n, BLOCK)[0], a.get("grid") or launch_grid(n, BLOCK, per_sm=4)[0])


def _warp_sum_launch(kern, a):
    import cupy as cp
    blocks = _blocks(a)
    partial = cp.empty(blocks, dtype=cp.float32)
    k = kern("block_sum")
    k((blocks,), (BLOCK,), (a["x"], partial, np.int64(a["x"].size)))      # G blocks -> G partial sums
    k((1,), (BLOCK,), (partial, a["out"], np.int64(blocks)))              # one block -> the answer


def _last_block_make(p, rng):
    return {**_sum_make(p, rng), "out": Out(2)}


def _last_block_ref(h):
    return {"out": np.repeat(_sum_ref(h)["out"], 2)}


def _last_block_launch(kern, a):
    """Two launches with the same tickets and partials, as a training loop would make; each writes its own
    slot of out and both are compared (a fix that only works on one launch fails)."""
    import cupy as cp
    blocks = _blocks(a)
    partials, tickets = cp.empty(blocks, dtype=cp.float32), cp.zeros(1, dtype=cp.uint32)
    k = kern("sum_last_block")
    for launch in range(2):
        k((blocks,), (BLOCK,), (a["x"], partials, tickets, a["out"][launch:launch + 1], np.int64(a["x"].size)))


SUM_CASES = (("n=1", {"n": 1}), ("n=2", {"n": 2}), ("n=33", {"n": 33}), ("n=1,000, 3 blocks", {"n": 1000, "grid": 3}),
             ("n=70,001, 7 blocks", {"n": 70001, "grid": 7}), ("n=4,194,311 (large)", {"n": (1 << 22) + 7}))


CLAMP_CASES = (("n=1", {"n": 1}), ("n=255 (one partial block)", {"n": 255}),
               ("n=9,473 (37 blocks + 1)", {"n": 37 * 256 + 1}), ("n=4,194,307 (large)", {"n": (1 << 22) + 3}))
STRIDE_CASES = tuple((f"{name}, grid of 3 blocks", {**p, "grid": 3}) for name, p in CLAMP_CASES)
FLOAT4_CASES = tuple((f"n={n:,}, start {off} floats past 16 B", {"n": n, "offset": off, "grid": 5})
                     for n, off in ((1, 1), (2, 3), (3, 0), (7, 2), (1001, 1), (4096, 0), ((1 << 22) + 5, 3)))
CLAMP_SPEED = Speed({"n": 1 << 25}, bytes=lambda a: 8 * a["x"].size)

EXERCISES = [
    Exercise(
        id="step1/scale_clamp", title="y = clamp(a*x + b, lo, hi), one thread per element, with a bounds check",
        teaches="the global index, the bounds check of the last block",
        stub=f"{HERE}/scale_clamp.cu", kernels=("scale_clamp",), make=_clamp_make,
        launch=lambda kern, a: kern("scale_clamp")(launch_grid(a["x"].size, BLOCK), (BLOCK,), _clamp_args(a)),
        reference=_clamp_ref, outputs=("y",), cases=CLAMP_CASES,
        speed=Speed(CLAMP_SPEED.params, CLAMP_SPEED.bytes, course=("the course's axpb v1", _course_axpb(1)))),
    Exercise(
        id="step1/scale_clamp_grid_stride", title="the same kernel as a grid-stride loop over a fixed grid",
        teaches="grid-stride loops: the launch size becomes a choice, not a function of n",
        stub=f"{HERE}/scale_clamp_grid_stride.cu", kernels=("scale_clamp_grid_stride",), make=_clamp_make,
        launch=lambda kern, a: kern("scale_clamp_grid_stride")(_fixed_grid(a, a["x"].size), (BLOCK,), _clamp_args(a)),
        reference=_clamp_ref, outputs=("y",), cases=STRIDE_CASES,
        speed=Speed(CLAMP_SPEED.params, CLAMP_SPEED.bytes, course=("the course's axpb v2", _course_axpb(2)))),
    Exercise(
        id="step1/scale_clamp_float4", title="float4 loads and stores, with a scalar head (misaligned start) and tail",
        teaches="16-byte vector accesses and their alignment rule",
        stub=f"{HERE}/scale_clamp_float4.cu", kernels=("scale_clamp_float4",), make=_clamp_make,
        launch=lambda kern, a: kern("scale_clamp_float4")(_fixed_grid(a, a["x"].size // 4 + 1), (BLOCK,),
                                                          (*_clamp_args(a), np.int32(_head(a["x"])))),
        reference=_clamp_ref, outputs=("y",), cases=FLOAT4_CASES,
        speed=Speed(CLAMP_SPEED.params, CLAMP_SPEED.bytes, course=("the course's axpb v4", _course_axpb(4)))),
    Exercise(
        id="step1/block_max", title="the maximum of n floats: a block-level reduction with warp shuffles",
        teaches="__shfl_xor_sync, one value per warp through shared memory, the identity of max (-inf)",
        stub=f"{HERE}/block_max.cu", kernels=("block_max",), defines={"BLOCK": BLOCK}, make=_max_make,
        launch=_max_launch, reference=lambda h: {"out": np.array([h["x"].astype(np.float64).max()])},
        outputs=("out",), rtol=0.0, atol=0.0,
        cases=(("n=1", {"n": 1}), ("n=31", {"n": 31}), ("n=33, max in the last element", {"n": 33, "max_last": True}),
               ("n=1,000, 3 blocks", {"n": 1000, "grid": 3}),
               ("n=70,001, max in the last element", {"n": 70001, "max_last": True, "grid": 7}),
               ("n=4,194,311 (large)", {"n": (1 << 22) + 7})),
        speed=Speed({"n": 1 << 26}, bytes=lambda a: 4 * a["x"].size,
                    course=("the course's sum v2 (same two-launch plan)", _course_sum))),
    # find the bug: the stub is a complete kernel with one bug (docs/exercises.md, "Find the bug")
    Exercise(
        id="step1/find_bug_tail", title="find the bug: y = clamp(a*x + b, lo, hi), four elements per thread",
        teaches="the tail: the last thread's partial group of elements",
        stub=f"{HERE}/find_bug_tail.cu", kernels=("scale_clamp4",), make=_clamp_make,
        launch=lambda kern, a: kern("scale_clamp4")(launch_grid(-(-a["x"].size // 4), BLOCK), (BLOCK,), _clamp_args(a)),
        reference=_clamp_ref, outputs=("y",),
        cases=(("n=1", {"n": 1}), ("n=4", {"n": 4}), ("n=1,027 (256 groups of 4 + 3)", {"n": 1027}),
               ("n=4,096", {"n": 4096}), ("n=4,194,307 (large)", {"n": (1 << 22) + 3}))),
    Exercise(
        id="step1/find_bug_warp_sum", title="find the bug: the sum of n floats with warp shuffles (two launches)",
        teaches="the offsets of a butterfly warp reduction: 16, 8, 4, 2, 1",
        stub=f"{HERE}/find_bug_warp_sum.cu", kernels=("block_sum",), defines={"BLOCK": BLOCK}, make=_sum_make,
        launch=_warp_sum_launch, reference=_sum_ref, outputs=("out",), cases=SUM_CASES),
    Exercise(
        id="step1/find_bug_last_block", title="find the bug: a one-launch sum whose last block adds the partials",
        teaches="a kernel that keeps state between launches must leave it as it found it",
        stub=f"{HERE}/find_bug_last_block.cu", kernels=("sum_last_block",), defines={"BLOCK": BLOCK},
        make=_last_block_make, launch=_last_block_launch, reference=_last_block_ref, outputs=("out",), cases=SUM_CASES),
]
