"""Step 2's exercises: what common.exercises.check runs for each stub in this folder (see step1's for the shape)."""
from __future__ import annotations

import math

import numpy as np

from common import rand, reference
from common.exercises import Exercise, Out, Speed

HERE = "step2_attention/exercises"
WARPS = 4             # softmax_warp: rows (warps) per block
TILE = 32             # matmul_tiled, attn_scores_masked: TILE x TILE threads
HEAD_DIM = 64         # flash_rescale
NEG_INF = -np.inf



# ------------------------------------------------------------------------------ (5) softmax, one warp per row
def _softmax_make(p, rng):
    return {"x": rand(p["rows"], p["cols"], rng=rng) * np.float32(p.get("mag", 1.0)), "y": Out((p["rows"], p["cols"]))}


def _softmax_launch(kern, a, name="softmax_warp"):
    rows, cols = a["x"].shape
    kern(name)((-(-rows // WARPS),), (WARPS * 32,), (a["x"], a["y"], np.int32(rows), np.int32(cols)))


def _course_softmax(a):
    import cupy as cp
    from step2_attention import ops
    y = cp.empty_like(a["x"])
    return lambda: ops.softmax(a["x"], version=3, out=y)


# ------------------------------------------------------------------------------ (6) merging two partial states
def _merge_make(p, rng):
    """Partial states of real attention rows: keys 0..split-1 and split..L-1 reduced separately (a part
    may be empty), plus `both_empty` rows whose two parts are both empty."""
    R, L, D, mag = p["R"], p["L"], p["D"], p.get("mag", 1.0)
    s = (np.einsum("rd,rld->rl", rand(R, D, rng=rng).astype(np.float64), rand(R, L, D, rng=rng).astype(np.float64))
         * mag / math.sqrt(D))
    v = rand(R, L, D, rng=rng).astype(np.float64)
    split = rng.integers(0, L + 1, R)[:, None]
    j = np.arange(L)[None, :]
    parts = []
    for mask in (j < split, j >= split):
        m = np.where(mask, s, NEG_INF).max(axis=1)
        w = np.exp(np.where(mask, s, NEG_INF) - np.where(np.isfinite(m), m, 0.0)[:, None])   # 0 where masked
        l = w.sum(axis=1)
        o = np.einsum("rl,rld->rd", w, v) / np.where(l > 0, l, 1.0)[:, None]
        parts.append((m, l, o))
    e = p.get("both_empty", 0)
    for m, l, o in parts:
        m[:e], l[:e], o[:e] = NEG_INF, 0.0, 0.0
    h = {}
    for i, (m, l, o) in enumerate(parts, 1):
        h[f"m{i}"], h[f"l{i}"], h[f"o{i}"] = m.astype(np.float32), l.astype(np.float32), o.astype(np.float32)
    h.update(m=Out(R), l=Out(R), o=Out((R, D)), _s=s, _v=v, _empty=e)
    return h


def _merge_ref(h):
    s, v, e = h["_s"], h["_v"], h["_empty"]
    m = s.max(axis=1)
    w = np.exp(s - m[:, None])
    l = w.sum(axis=1)
    o = np.einsum("rl,rld->rd", reference.softmax(s), v)
    m[:e], l[:e], o[:e] = NEG_INF, 0.0, 0.0
    return {"m": m, "l": l, "o": o}


def _merge_launch(kern, a):
    R, D = a["o"].shape
    kern("merge_states")((-(-(R * D) // 256),), (256,), (a["m1"], a["l1"], a["o1"], a["m2"], a["l2"], a["o2"],
                                                         a["m"], a["l"], a["o"], np.int32(R), np.int32(D)))


# ------------------------------------------------------------------------------ (7) tiled matmul
def _matmul_make(p, rng):
    M, N, K = p["M"], p["N"], p["K"]
    return {"a": rand(M, K, rng=rng), "b": rand(K, N, rng=rng), "c": Out((M, N))}


def _matmul_launch(kern, a):
    (M, K), N = a["a"].shape, a["b"].shape[1]
    kern("matmul_tiled")((-(-N // TILE), -(-M // TILE)), (TILE, TILE),
                         (a["a"], a["b"], a["c"], np.int32(M), np.int32(N), np.int32(K)))


def _course_matmul(a):
    import cupy as cp
    from step2_attention import ops
    c = cp.empty_like(a["c"])
    return lambda: ops.matmul(a["a"], a["b"], version=2, out=c)


# ------------------------------------------------------------------------------ (8) scores with scale and mask
def _scores_make(p, rng):
    H, Tq, Tk, D = p["H"], p["Tq"], p["Tk"], p["D"]
    return {"q": rand(H, Tq, D, rng=rng), "k": rand(H, Tk, D, rng=rng), "s": Out((H, Tq, Tk)), "causal": p["causal"]}


def _scores_ref(h):
    return {"s": reference.attention_scores(h["q"], h["k"], causal=bool(h["causal"]))}   # masked: -inf


def _scores_launch(kern, a):
    H, Tq, D = a["q"].shape
    Tk = a["k"].shape[1]
    kern("attn_scores_masked")((-(-Tk // TILE), -(-Tq // TILE), H), (TILE, TILE),
                               (a["q"], a["k"], a["s"], np.int32(Tq), np.int32(Tk), np.int32(D),
                                np.float32(1 / math.sqrt(D)), np.int32(a["causal"])))


def _course_scores(a):
    import cupy as cp
    from common import get_kernel
    H, Tq, D = a["q"].shape
    Tk = a["k"].shape[1]
    s = cp.empty_like(a["s"])
    kernel = get_kernel("step2_attention/attention_naive.cu", "attn_scores", {"TILE": TILE})
    return lambda: kernel((-(-Tk // TILE), -(-Tq // TILE), H), (TILE, TILE),
                          (a["q"], a["k"], s, np.int32(Tq), np.int32(Tk), np.int32(D), np.float32(1 / math.sqrt(D))))


# ------------------------------------------------------------------------------ (9) flash attention's update
def _flash_make(p, rng):
    H, T = p["H"], p["T"]
    return {"q": rand(H, T, HEAD_DIM, rng=rng) * np.float32(p.get("mag", 1.0)), "k": rand(H, T, HEAD_DIM, rng=rng),
            "v": rand(H, T, HEAD_DIM, rng=rng), "o": Out((H, T, HEAD_DIM)), "lse": Out((H, T)), "causal": p["causal"]}


def _flash_ref(h):
    q, k, v, causal = h["q"], h["k"], h["v"], bool(h["causal"])
    s = reference.attention_scores(q, k, causal=causal)
    return {"o": reference.softmax(s) @ reference.f64(v), "lse": reference.logsumexp(s)}


def _flash_launch(kern, a):
    H, T, _ = a["q"].shape
    kern("flash_rescale")((-(-T // 4), H), (128,), (a["q"], a["k"], a["v"], a["o"], a["lse"], np.int32(T),
                                                    np.float32(1 / math.sqrt(HEAD_DIM)), np.int32(a["causal"])))


def _course_flash(a):
    import cupy as cp
    from step2_attention import flash
    o = cp.empty_like(a["o"])[None]
    return lambda: flash.flash_attention(a["q"][None], a["k"][None], a["v"][None], causal=True, version=1, out=o)


def _attention_flops(a):
    H, T, D = a["q"].shape
    return 4.0 * H * T * T * D / 2          # causal: the visible half (the course's convention)


EXERCISES = [
    Exercise(
        id="step2/softmax_warp", title="row softmax with one warp per row (shuffles, max subtracted)",
        teaches="warp-level reductions; why softmax subtracts the row max",
        stub=f"{HERE}/softmax_warp.cu", kernels=("softmax_warp",), defines={"WARPS": WARPS},
        make=_softmax_make, launch=_softmax_launch, reference=lambda h: {"y": reference.softmax(h["x"])},
        outputs=("y",),
        cases=(("1 x 1", {"rows": 1, "cols": 1}), ("7 x 33", {"rows": 7, "cols": 33}),
               ("37 x 1000", {"rows": 37, "cols": 1000}), ("3 x 4097", {"rows": 3, "cols": 4097}),
               ("64 x 1000, values up to +-500", {"rows": 64, "cols": 1000, "mag": 500.0})),
        speed=Speed({"rows": 32768, "cols": 1024}, bytes=lambda a: 8 * a["x"].size,
                    course=("the course's softmax v3 (same plan)", _course_softmax))),
    Exercise(
        id="step2/online_merge", title="merge two partial online-softmax states (m, l, rescaled output)",
        teaches="the online-softmax rule that split-K decoding and flash attention rest on",
        stub=f"{HERE}/online_merge.cu", kernels=("merge_states",), make=_merge_make, launch=_merge_launch,
        reference=_merge_ref, outputs=("m", "l", "o"),
        cases=(("1 row, 1 key, D=1", {"R": 1, "L": 1, "D": 1}),
               ("5 rows, D=64, random splits", {"R": 5, "L": 6, "D": 64}),
               ("333 rows, D=100, 4 rows with both parts empty", {"R": 333, "L": 9, "D": 100, "both_empty": 4}),
               ("64 rows, scores in the hundreds", {"R": 64, "L": 12, "D": 64, "mag": 2000.0,
                                                     "tol": (3e-4, 3e-4)}),
               ("4,096 rows, D=128", {"R": 4096, "L": 4, "D": 128})),
        speed=Speed({"R": 65536, "L": 2, "D": 128}, bytes=lambda a: 4 * (3 * a["o"].size + 6 * a["m"].size))),
    Exercise(
        id="step2/matmul_tiles", title="the tile loads (with bounds) of a shared-memory tiled matmul",
        teaches="shared-memory tiling, zero padding at the edges, the two barriers per tile",
        stub=f"{HERE}/matmul_tiles.cu", kernels=("matmul_tiled",), defines={"TILE": TILE}, make=_matmul_make,
        launch=_matmul_launch, reference=lambda h: {"c": reference.matmul(h["a"], h["b"])}, outputs=("c",),
        atol=2e-5,
        cases=tuple((f"M={M}, N={N}, K={K}", {"M": M, "N": N, "K": K})
                    for M, N, K in ((1, 1, 1), (17, 33, 45), (64, 64, 64), (100, 70, 129), (513, 257, 300))),
        speed=Speed({"M": 2048, "N": 2048, "K": 2048}, flops=lambda a: 2.0 * a["a"].shape[0] * a["a"].shape[1] * a["b"].shape[1],
                    course=("the course's matmul v2 (same tiles)", _course_matmul))),
    Exercise(
        id="step2/attention_scores", title="the scale and the causal mask of the naive attention's scores kernel",
        teaches="the causal rule (queries counted from the end of the keys), -inf for masked scores",
        stub=f"{HERE}/attention_scores.cu", kernels=("attn_scores_masked",), defines={"TILE": TILE},
        make=_scores_make, launch=_scores_launch, reference=_scores_ref, outputs=("s",),
        cases=(("H=1, Tq=Tk=1", {"H": 1, "Tq": 1, "Tk": 1, "D": 64, "causal": 1}),
               ("H=2, Tq=Tk=37, D=64", {"H": 2, "Tq": 37, "Tk": 37, "D": 64, "causal": 1}),
               ("H=3, Tq=5 < Tk=70 (a cache), D=32", {"H": 3, "Tq": 5, "Tk": 70, "D": 32, "causal": 1}),
               ("not causal, Tq=33, Tk=50, D=40", {"H": 2, "Tq": 33, "Tk": 50, "D": 40, "causal": 0}),
               ("H=4, Tq=Tk=129, D=64", {"H": 4, "Tq": 129, "Tk": 129, "D": 64, "causal": 1})),
        speed=Speed({"H": 96, "Tq": 512, "Tk": 512, "D": 64, "causal": 1},
                    bytes=lambda a: 4 * (a["s"].size + a["q"].size + a["k"].size),
                    course=("the course's attn_scores (no mask)", _course_scores))),
    Exercise(
        id="step2/flash_rescale", title="the running max / sum update and rescaling inside flash attention's loop",
        teaches="online softmax over K/V tiles: rescale l and the output when the max grows",
        stub=f"{HERE}/flash_rescale.cu", kernels=("flash_rescale",), defines={"HEAD_DIM": HEAD_DIM},
        make=_flash_make, launch=_flash_launch, reference=_flash_ref, outputs=("o", "lse"), rtol=2e-5, atol=2e-5,
        cases=(("H=1, T=1", {"H": 1, "T": 1, "causal": 1}), ("H=2, T=33", {"H": 2, "T": 33, "causal": 1}),
               ("H=3, T=100", {"H": 3, "T": 100, "causal": 1}), ("H=2, T=257", {"H": 2, "T": 257, "causal": 1}),
               ("not causal, H=2, T=70", {"H": 2, "T": 70, "causal": 0}),
               ("scores near +-100, T=96", {"H": 2, "T": 96, "causal": 1, "mag": 100.0, "tol": (2e-4, 2e-4)})),
        speed=Speed({"H": 96, "T": 1024, "causal": 1}, flops=_attention_flops,
                    course=("the course's flash v1 (same plan)", _course_flash))),
    # find the bug: the stub is a complete kernel with one bug (docs/exercises.md, "Find the bug")
    Exercise(
        id="step2/find_bug_softmax_overflow", title="find the bug: row softmax, one warp per row",
        teaches="expf overflows above 88.7: subtract the row max",
        stub=f"{HERE}/find_bug_softmax_overflow.cu", kernels=("softmax_rows",), defines={"WARPS": WARPS},
        make=_softmax_make, launch=lambda kern, a: _softmax_launch(kern, a, "softmax_rows"),
        reference=lambda h: {"y": reference.softmax(h["x"])}, outputs=("y",),
        cases=(("1 x 1", {"rows": 1, "cols": 1}), ("7 x 33", {"rows": 7, "cols": 33}),
               ("37 x 1000", {"rows": 37, "cols": 1000}),
               ("64 x 1000, values up to +-80", {"rows": 64, "cols": 1000, "mag": 80.0}),
               ("64 x 1000, values up to +-100", {"rows": 64, "cols": 1000, "mag": 100.0}),
               ("64 x 1000, values up to +-500", {"rows": 64, "cols": 1000, "mag": 500.0}))),
    Exercise(
        id="step2/find_bug_matmul_tile", title="find the bug: a shared-memory tiled matmul",
        teaches="a shared-memory tile is indexed [row][col] in its store and in its read",
        stub=f"{HERE}/find_bug_matmul_tile.cu", kernels=("matmul_tiled",), defines={"TILE": TILE}, make=_matmul_make,
        launch=_matmul_launch, reference=lambda h: {"c": reference.matmul(h["a"], h["b"])}, outputs=("c",),
        atol=2e-5,
        cases=tuple((f"M={M}, N={N}, K={K}", {"M": M, "N": N, "K": K})
                    for M, N, K in ((1, 1, 1), (2, 2, 2), (17, 33, 45), (64, 64, 64), (100, 70, 129)))),
]


# ------------------------------------------------------------------------------ Exercise 2c.1: one mma tile per warp
MMA_WARPS = 4         # mma_tile: warps per block, one 16x8 tile of C each
MMA_MIN_SM = 75       # fp16 mma.sync (m16n8k8, two of them per m16n8k16) needs sm_75
MMA_NEEDS = "fp16 tensor cores (mma.sync)"


def _mma_make(p, rng):
    T, K = p["tiles"], p["K"]
    a = rand(T, 16, K, rng=rng, low=-p.get("mag", 1.0), high=p.get("mag", 1.0)).astype(np.float16)
    b = rand(T, K, 8, rng=rng).astype(np.float16)
    return {"a": a, "b": b, "c": Out((T, 16, 8))}


def _mma_ref(h):
    return {"c": np.matmul(h["a"].astype(np.float64), h["b"].astype(np.float64))}   # the fp16 values, exactly


_told = []


def _too_old_for_mma() -> bool:
    """True on a GPU without fp16 mma.sync (said once, in one printed line): the kernel is not launched there, so
    its output stays NaN; the notebook's cell and tests/test_exercises_x2.py skip the check on such a GPU."""
    from common.device import device_info
    sm = device_info()["sm"]
    if sm < MMA_MIN_SM:
        if not _told:
            _told.append(sm)
            print(f"{MMA_NEEDS} need compute capability {MMA_MIN_SM // 10}.{MMA_MIN_SM % 10} or newer; this GPU is "
                  f"{sm // 10}.{sm % 10}: the kernel compiles here (check() without a GPU shows it), but cannot run")
        return True
    return False


def _mma_launch(kern, a):
    if _too_old_for_mma():
        return
    T, _, K = a["a"].shape
    kern("mma_tiles")((-(-T // MMA_WARPS),), (32 * MMA_WARPS,), (a["a"], a["b"], a["c"], np.int32(T), np.int32(K)))


EXERCISES.append(Exercise(
    id="step2/mma_tile", title="one 16x8 tensor-core tile per warp: the fragment loads, mma.sync, the stores",
    teaches="the m16n8k16 fragment layout: which lane holds which element of A, B and C",
    stub=f"{HERE}/mma_tile.cu", kernels=("mma_tiles",), defines={"WARPS": MMA_WARPS}, make=_mma_make,
    launch=_mma_launch, reference=_mma_ref, outputs=("c",), rtol=1e-4, atol=1e-4,
    cases=(("1 tile, K=16", {"tiles": 1, "K": 16}),
           ("3 tiles (a partly idle block), K=16", {"tiles": 3, "K": 16}),
           ("5 tiles, K=32 (two k-steps)", {"tiles": 5, "K": 32}),
           ("37 tiles, K=128", {"tiles": 37, "K": 128}),
           ("8 tiles, K=64, A in the hundreds", {"tiles": 8, "K": 64, "mag": 300.0})),
    min_sm=(MMA_MIN_SM, MMA_NEEDS)))
