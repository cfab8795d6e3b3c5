"""Python side of step 2a: softmax (softmax.cu), matmul (matmul.cu) and the naive three-kernel attention
(attention_naive.cu), plus the cuBLAS-based attention anchor. Inputs are checked with common.expect_array;
every function returns a CuPy array (or fills `out`).

Layout: q, k, v and the attention output are (B, H, T, D) float32, C-contiguous: each (batch, head) is one
contiguous T x D matrix, so a head's rows are D consecutive floats and the kernels index head h at h*T*D.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from common import expect_array, load_module

HERE = Path(__file__).resolve().parent
SOFTMAX_VERSIONS = (1, 2, 3, 4)
MATMUL_VERSIONS = (1, 2, 3)

SOFTMAX_BLOCK = 256     # v2 threads per row
SOFTMAX_WARPS = 4       # v3/v4 rows per block (one warp each)
V1_BLOCK = 128          # v1 rows per block (one thread each)
MATMUL_TILE = 32        # v2
MATMUL_V3 = {"BM": 128, "BN": 128, "BK": 8, "TM": 8, "TN": 8}
ATTN_TILE = 32


# fp32 FMA lanes per SM by compute capability (V100, Xavier, T4 and A100 have 64; sm_61 and sm_86+ have 128)
FP32_LANES_PER_SM = {60: 64, 70: 64, 72: 64, 75: 64, 80: 64}


def fp32_peak_tflops() -> float | None:
    """fp32 FMA peak of the current device at its reported boost clock: SMs x fp32 lanes per SM x 2 FLOPs
    x clock, in TFLOP/s (a ceiling to compare kernels with, from the device's own attributes). None when
    the driver reports no clock."""
    import cupy as cp
    rt = cp.cuda.runtime
    dev = cp.cuda.Device()
    try:
        clock_khz = rt.deviceGetAttribute(rt.cudaDevAttrClockRate, dev.id)
        sms = rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, dev.id)
    except rt.CUDARuntimeError:
        return None
    if not clock_khz:
        return None
    lanes = FP32_LANES_PER_SM.get(int(dev.compute_capability), 128)
    return 2.0 * sms * lanes * clock_khz * 1e3 / 1e12


def _out(out, shape, name="out"):
    import cupy as cp
    if out is None:
        return cp.empty(shape, dtype=cp.float32)
    return expect_array(out, name, dtype=np.float32, shape=tuple(shape))


def _check_version(version, allowed):
    if version not in allowed:
        raise ValueError(f"version: expected one of {allowed}, got {version!r}")


def _check_int32(**sizes):
    for name, v in sizes.items():
        if v >= 2 ** 31:
            raise ValueError(f"{name}: {v} does not fit the kernels' 32-bit index (must be < 2**31)")


# ------------------------------------------------------------------------------------------ softmax
def _softmax_module():
    return load_module(HERE / "softmax.cu", defines={"BLOCK": SOFTMAX_BLOCK, "WARPS": SOFTMAX_WARPS})


def _softmax_v4_launch(x, y, rows: int, cols: int, scale: float = 1.0, causal: bool = False,
                       period: int = 1, offset: int = 0):
    """Launch softmax_v4 (float4) or softmax_v4_scalar on already-checked buffers (y may be x)."""
    vec = cols % 4 == 0 and x.data.ptr % 16 == 0 and y.data.ptr % 16 == 0
    kernel = _softmax_module().get_function("softmax_v4" if vec else "softmax_v4_scalar")
    grid = (rows + SOFTMAX_WARPS - 1) // SOFTMAX_WARPS
    kernel((grid,), (SOFTMAX_WARPS * 32,), (x, y, np.int32(rows), np.int32(cols), np.float32(scale),
                                           np.int32(bool(causal)), np.int32(max(period, 1)), np.int32(offset)))


def softmax(x, version: int = 4, out=None):
    """Softmax over the last axis of a (rows, cols) float32 C-contiguous GPU array, with softmax_v<version>.

    A row that is entirely -inf gives zeros (like common.reference.softmax). `out` may be `x` (in place).
    """
    x = expect_array(x, "x", dtype=np.float32, ndim=2)
    _check_version(version, SOFTMAX_VERSIONS)
    rows, cols = x.shape
    _check_int32(rows=rows, cols=cols)
    y = _out(out, x.shape)
    if rows == 0 or cols == 0:
        return y
    mod = _softmax_module()
    if version == 1:
        mod.get_function("softmax_v1")(((rows + V1_BLOCK - 1) // V1_BLOCK,), (V1_BLOCK,),
                                       (x, y, np.int32(rows), np.int32(cols)))
    elif version == 2:
        mod.get_function("softmax_v2")((rows,), (SOFTMAX_BLOCK,), (x, y, np.int32(cols)))
    elif version == 3:
        mod.get_function("softmax_v3")(((rows + SOFTMAX_WARPS - 1) // SOFTMAX_WARPS,), (SOFTMAX_WARPS * 32,),
                                       (x, y, np.int32(rows), np.int32(cols)))
    else:
        _softmax_v4_launch(x, y, rows, cols)
    return y


def softmax_bytes(rows: int, cols: int, version: int) -> dict:
    """DRAM bytes each version moves if nothing is cached between passes (the napkin math), and the floor."""
    n = 4 * rows * cols
    reads = {1: 3, 2: 3, 3: 3, 4: 1 if cols <= 32 * 32 else 2}[version]
    return {"read": reads * n, "written": n, "floor": 2 * n}


# ------------------------------------------------------------------------------------------ matmul
def _matmul_module(version: int, config: dict | None = None):
    if version == 3:
        return load_module(HERE / "matmul.cu", defines=config or MATMUL_V3)
    return load_module(HERE / "matmul.cu", defines={"TILE": MATMUL_TILE})


def matmul(a, b, version: int = 3, out=None, config: dict | None = None):
    """C = A @ B for float32 GPU arrays A (M, K), B (K, N), with matmul_v<version> of matmul.cu.

    `config` (v3 only) overrides the tile defines, e.g. {"BM": 128, "BN": 128, "BK": 16, "TM": 8, "TN": 8}."""
    a = expect_array(a, "a", dtype=np.float32, ndim=2)
    b = expect_array(b, "b", dtype=np.float32, ndim=2)
    _check_version(version, MATMUL_VERSIONS)
    M, K = a.shape
    if b.shape[0] != K:
        raise ValueError(f"b: expected shape ({K}, *) to match a's K={K}, got {b.shape}")
    N = b.shape[1]
    _check_int32(M=M, N=N, K=K)
    c = _out(out, (M, N))
    if M == 0 or N == 0:
        return c
    if K == 0:
        c.fill(0)
        return c
    cfg = {**MATMUL_V3, **(config or {})}
    if config is not None and version != 3:
        raise ValueError(f"config: only matmul version 3 has tile defines, got version={version}")
    mod = _matmul_module(version, cfg)
    args = (a, b, c, np.int32(M), np.int32(N), np.int32(K))
    if version == 1:
        grid = ((N + 31) // 32, (M + 7) // 8)
        block = (32, 8)
        name = "matmul_v1"
    elif version == 2:
        t = MATMUL_TILE
        grid, block, name = ((N + t - 1) // t, (M + t - 1) // t), (t, t), "matmul_v2"
    else:
        threads = (cfg["BM"] // cfg["TM"]) * (cfg["BN"] // cfg["TN"])
        grid, block = ((N + cfg["BN"] - 1) // cfg["BN"], (M + cfg["BM"] - 1) // cfg["BM"]), (threads,)
        vec = K % 4 == 0 and N % 4 == 0 and all(p.data.ptr % 16 == 0 for p in (a, b, c))
        name = "matmul_v3" if vec else "matmul_v3_any"
    if grid[1] > 65535:
        raise ValueError(f"a: M={M} needs {grid[1]} row blocks, more than the grid's 65535")
    mod.get_function(name)(grid, block, args)
    return c


# ------------------------------------------------------------------------------------------ attention
def _check_qkv(q, k, v, out):
    q = expect_array(q, "q", dtype=np.float32, ndim=4)
    B, H, Tq, D = q.shape
    k = expect_array(k, "k", dtype=np.float32, shape=(B, H, None, D))
    v = expect_array(v, "v", dtype=np.float32, shape=k.shape)
    if out is not None:
        out = expect_array(out, "out", dtype=np.float32, shape=q.shape)
    return q, k, v, out


def attention_flops(B: int, H: int, T: int, D: int, causal: bool = True) -> float:
    """FLOPs of attention's two matmuls, 4*B*H*T*T*D, halved when causal (only the visible half is
    useful work: the FlashAttention convention). Used for every attention TFLOP/s in the course."""
    return 4.0 * B * H * T * T * D / (2 if causal else 1)


def attention_naive(q, k, v, causal: bool = True, scale: float | None = None, out=None):
    """Multi-head attention with three kernels (scores, masked softmax in place, P V) of attention_naive.cu.

    q: (B, H, Tq, D), k and v: (B, H, Tk, D), float32, C-contiguous. Returns (B, H, Tq, D). With causal=True,
    query i sees keys 0 .. i + (Tk - Tq). Allocates the (B, H, Tq, Tk) float32 scores.
    """
    import cupy as cp
    q, k, v, out = _check_qkv(q, k, v, out)
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    o = out if out is not None else cp.empty(q.shape, dtype=cp.float32)
    if o.size == 0:
        return o
    if Tk == 0:
        o.fill(0)
        return o
    _check_int32(rows=B * H * Tq, Tk=Tk)
    if B * H > 65535:
        raise ValueError(f"q: B*H = {B * H} heads exceed the grid's 65535 (gridDim.z)")
    mod = load_module(HERE / "attention_naive.cu", defines={"TILE": ATTN_TILE, "WARPS": SOFTMAX_WARPS})
    s = cp.empty((B, H, Tq, Tk), dtype=cp.float32)
    t = ATTN_TILE
    mod.get_function("attn_scores")(((Tk + t - 1) // t, (Tq + t - 1) // t, B * H), (t, t),
                                    (q, k, s, np.int32(Tq), np.int32(Tk), np.int32(D), np.float32(scale)))
    rows = B * H * Tq
    mod.get_function("attn_softmax")(((rows + SOFTMAX_WARPS - 1) // SOFTMAX_WARPS,), (SOFTMAX_WARPS * 32,),
                                     (s, np.int32(rows), np.int32(Tq), np.int32(Tk), np.int32(bool(causal))))
    mod.get_function("attn_pv")(((D + t - 1) // t, (Tq + t - 1) // t, B * H), (t, t),
                                (s, v, o, np.int32(Tq), np.int32(Tk), np.int32(D)))
    return o


def attention_cublas(q, k, v, causal: bool = True, scale: float | None = None):
    """The cuBLAS-based anchor: S = cupy.matmul(q, k^T) (batched cuBLAS GEMM), the masked, scaled
    softmax_v4 in place, then cupy.matmul(P, v). FP32 GEMMs unless CUPY_TF32=1 is set in the environment.
    Same shapes and causal convention as attention_naive."""
    import cupy as cp
    q, k, v, _ = _check_qkv(q, k, v, None)
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if q.size == 0 or Tk == 0:
        return cp.zeros(q.shape, dtype=cp.float32)
    _check_int32(rows=B * H * Tq, Tk=Tk)
    s = cp.matmul(q, k.transpose(0, 1, 3, 2))
    _softmax_v4_launch(s, s, B * H * Tq, Tk, scale=scale, causal=causal, period=Tq, offset=Tk - Tq)
    return cp.matmul(s, v)
