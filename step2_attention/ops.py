"""Python side of step 2a: softmax (softmax.cu), matmul (matmul.cu) and the naive three-kernel attention
(attention_naive.cu), plus the cuBLAS-based attention anchor; and, for step 2c's tensor cores, one `mma.sync`
tile by hand (mma_tile.cu) with the map of which lane holds which element (mma_fragment_map). Inputs are
checked with common.expect_array; every GPU function returns a CuPy array (or fills `out`).

Layout: q, k, v and the attention output are (B, H, T, D) float32, C-contiguous: each (batch, head) is one
contiguous T x D matrix, so a head's rows are D consecutive floats and the kernels index head h at h*T*D.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from common import expect_array, expect_choice, float4_rows, get_kernel, out_array, require_arch

HERE = Path(__file__).resolve().parent
SOFTMAX_VERSIONS = (1, 2, 3, 4)
SOFTMAX_STEPS = (1, 2, 3, "4a", 4)     # the notebook's build-up: "4a" is v4's online rule alone (softmax_v4_scalar)
MATMUL_VERSIONS = (1, 2, 3)

SOFTMAX_BLOCK = 256     # v2 threads per row
SOFTMAX_WARPS = 4       # v3/v4 rows per block (one warp each)
SOFTMAX_CACHE = 32      # v4 floats per lane kept in registers: rows up to 32 * SOFTMAX_CACHE are read once
V1_BLOCK = 128          # v1 rows per block (one thread each)
MATMUL_TILE = 32        # v2
MATMUL_V3 = {"BM": 128, "BN": 128, "BK": 8, "TM": 8, "TN": 8, "MIN_BLOCKS": 2}   # lab/tiles.py tries others
ATTN_TILE = 32


def _check_int32(**sizes):
    for name, v in sizes.items():
        if v >= 2 ** 31:
            raise ValueError(f"{name}: {v} does not fit the kernels' 32-bit index (must be < 2**31)")


# ------------------------------------------------------------------------------------------ softmax
def softmax_kernel(version: int, vec: bool = True):
    """(kernel, threads per block) of softmax.cu's softmax_v<version>: what `softmax` launches. `vec=False`
    gives v4's scalar fallback (softmax_v4_scalar, "v4a": any cols, any alignment); rows longer than
    32 * SOFTMAX_CACHE run softmax_v4_long (see _softmax_v4_launch)."""
    expect_choice(version, "version", SOFTMAX_STEPS)
    name = "softmax_v4_scalar" if version == "4a" or (version == 4 and not vec) else f"softmax_v{version}"
    kernel = get_kernel(HERE / "softmax.cu", name,
                        {"BLOCK": SOFTMAX_BLOCK, "WARPS": SOFTMAX_WARPS, "CACHE": SOFTMAX_CACHE})
    return kernel, {1: V1_BLOCK, 2: SOFTMAX_BLOCK}.get(version, 32 * SOFTMAX_WARPS)


def _softmax_v4_launch(x, y, rows: int, cols: int, scale: float = 1.0, causal: bool = False,
                       period: int = 1, offset: int = 0, online_only: bool = False):
    """Launch softmax_v4 (float4, rows up to 32 * SOFTMAX_CACHE), softmax_v4_long (float4, longer rows) or
    softmax_v4_scalar (any cols, any alignment; always with `online_only`, step "4a") on already-checked buffers
    (y may be x)."""
    vec = not online_only and float4_rows(cols, x, y)
    if vec and cols > 32 * SOFTMAX_CACHE:       # the row does not fit in a warp's registers: two passes
        kernel = get_kernel(HERE / "softmax.cu", "softmax_v4_long",
                            {"BLOCK": SOFTMAX_BLOCK, "WARPS": SOFTMAX_WARPS, "CACHE": SOFTMAX_CACHE})
        threads = 32 * SOFTMAX_WARPS
    else:
        kernel, threads = softmax_kernel(4, vec)
    kernel((-(-rows // SOFTMAX_WARPS),), (threads,), (x, y, np.int32(rows), np.int32(cols), np.float32(scale),
                                                      np.int32(bool(causal)), np.int32(max(period, 1)),
                                                      np.int32(offset)))


def softmax(x, version: int | str = 4, out=None):
    """Softmax over the last axis of a (rows, cols) float32 C-contiguous GPU array, with softmax_v<version>
    (version "4a": v4's online rule alone, softmax_v4_scalar).

    A row that is entirely -inf gives zeros (like common.reference.softmax). `out` may be `x` (in place).
    """
    x = expect_array(x, "x", dtype=np.float32, ndim=2)
    expect_choice(version, "version", SOFTMAX_STEPS)
    rows, cols = x.shape
    _check_int32(rows=rows, cols=cols)
    y = out_array(out, x.shape)
    if rows == 0 or cols == 0:
        return y
    if version in (4, "4a"):
        _softmax_v4_launch(x, y, rows, cols, online_only=version == "4a")
        return y
    kernel, threads = softmax_kernel(version)
    if version == 2:        # one block per row
        kernel((rows,), (threads,), (x, y, np.int32(cols)))
    else:                   # v1: one thread per row, v3: one warp per row
        per_block = threads if version == 1 else SOFTMAX_WARPS
        kernel((-(-rows // per_block),), (threads,), (x, y, np.int32(rows), np.int32(cols)))
    return y


def softmax_bytes(rows: int, cols: int, version: int | str) -> dict:
    """DRAM bytes each version moves if nothing is cached between passes (the napkin math), and the floor."""
    expect_choice(version, "version", SOFTMAX_STEPS)
    n = 4 * rows * cols
    reads = {1: 3, 2: 3, 3: 3, "4a": 2, 4: 1 if cols <= 32 * SOFTMAX_CACHE else 2}[version]   # v4: float4 rows
    return {"read": reads * n, "written": n, "floor": 2 * n}


# ------------------------------------------------------------------------------------------ matmul
def matmul_kernel(version: int, vec: bool = True):
    """(kernel, block shape) of matmul.cu's matmul_v<version>: what `matmul` launches. `vec=False` gives v3's
    scalar-load fallback (matmul_v3_scalar)."""
    return _matmul_kernel(version, None, vec)


def _matmul_kernel(version: int, config: dict | None, vec: bool):
    """matmul_kernel with `config` overriding MATMUL_V3's tile defines (v3 only): the lab's tile sweep."""
    expect_choice(version, "version", MATMUL_VERSIONS)
    if version == 3:
        cfg = {**MATMUL_V3, **(config or {})}
        kernel = get_kernel(HERE / "matmul.cu", "matmul_v3" if vec else "matmul_v3_scalar", cfg)
        return kernel, ((cfg["BM"] // cfg["TM"]) * (cfg["BN"] // cfg["TN"]),)
    if config is not None:
        raise ValueError(f"config: only matmul version 3 has tile defines, got version={version}")
    kernel = get_kernel(HERE / "matmul.cu", f"matmul_v{version}", {"TILE": MATMUL_TILE})
    return kernel, ((32, 8) if version == 1 else (MATMUL_TILE, MATMUL_TILE))


def matmul(a, b, version: int = 3, out=None):
    """C = A @ B for float32 GPU arrays A (M, K), B (K, N), with matmul_v<version> of matmul.cu."""
    return _matmul(a, b, version, out, None)


def _matmul(a, b, version: int, out, config: dict | None):
    """matmul with `config` overriding MATMUL_V3's tile defines (v3 only): the one launch path of ops.matmul and
    of the lab's tile sweep."""
    a = expect_array(a, "a", dtype=np.float32, ndim=2)
    b = expect_array(b, "b", dtype=np.float32, ndim=2)
    expect_choice(version, "version", MATMUL_VERSIONS)
    M, K = a.shape
    if b.shape[0] != K:
        raise ValueError(f"b: expected shape ({K}, *) to match a's K={K}, got {b.shape}")
    N = b.shape[1]
    _check_int32(M=M, N=N, K=K)
    c = out_array(out, (M, N))
    if M == 0 or N == 0:
        return c
    if K == 0:
        c.fill(0)
        return c
    vec = N % 4 == 0 and float4_rows(K, a, b, c)   # v3's float4 loads
    kernel, block = _matmul_kernel(version, config, vec)
    cfg = {**MATMUL_V3, **(config or {})}
    tile_n, tile_m = (cfg["BN"], cfg["BM"]) if version == 3 else block     # the C tile one block computes
    grid = (-(-N // tile_n), -(-M // tile_m))
    if grid[1] > 65535:
        raise ValueError(f"a: M={M} needs {grid[1]} row blocks, more than the grid's 65535")
    kernel(grid, block, (a, b, c, np.int32(M), np.int32(N), np.int32(K)))
    return c


# ------------------------------------------------------------------------------------------ attention
def _check_qkv(q, k, v):
    q = expect_array(q, "q", dtype=np.float32, ndim=4)
    B, H, Tq, D = q.shape
    k = expect_array(k, "k", dtype=np.float32, shape=(B, H, None, D))
    v = expect_array(v, "v", dtype=np.float32, shape=k.shape)
    return q, k, v


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
    q, k, v = _check_qkv(q, k, v)
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    o = out_array(out, q.shape)
    if o.size == 0:
        return o
    if Tk == 0:
        o.fill(0)
        return o
    _check_int32(rows=B * H * Tq, Tk=Tk)
    if B * H > 65535:
        raise ValueError(f"q: B*H = {B * H} heads exceed the grid's 65535 (gridDim.z)")
    defines = {"TILE": ATTN_TILE, "WARPS": SOFTMAX_WARPS}
    s = cp.empty((B, H, Tq, Tk), dtype=cp.float32)
    t = ATTN_TILE
    get_kernel(HERE / "attention_naive.cu", "attn_scores", defines)(
        (-(-Tk // t), -(-Tq // t), B * H), (t, t),
        (q, k, s, np.int32(Tq), np.int32(Tk), np.int32(D), np.float32(scale)))
    rows = B * H * Tq
    get_kernel(HERE / "attention_naive.cu", "attn_softmax", defines)(
        (-(-rows // SOFTMAX_WARPS),), (SOFTMAX_WARPS * 32,),
        (s, np.int32(rows), np.int32(Tq), np.int32(Tk), np.int32(bool(causal))))
    get_kernel(HERE / "attention_naive.cu", "attn_pv", defines)(
        (-(-D // t), -(-Tq // t), B * H), (t, t), (s, v, o, np.int32(Tq), np.int32(Tk), np.int32(D)))
    return o


def attention_cublas(q, k, v, causal: bool = True, scale: float | None = None):
    """The cuBLAS-based anchor: S = cupy.matmul(q, k^T) (batched cuBLAS GEMM), the masked, scaled
    softmax_v4 in place, then cupy.matmul(P, v). FP32 GEMMs unless CUPY_TF32=1 is set in the environment.
    Same shapes and causal convention as attention_naive."""
    import cupy as cp
    q, k, v = _check_qkv(q, k, v)
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if q.size == 0 or Tk == 0:
        return cp.zeros(q.shape, dtype=cp.float32)
    _check_int32(rows=B * H * Tq, Tk=Tk)
    s = cp.matmul(q, k.transpose(0, 1, 3, 2))
    _softmax_v4_launch(s, s, B * H * Tq, Tk, scale=scale, causal=causal, period=Tq, offset=Tk - Tq)
    return cp.matmul(s, v)


# ------------------------------------------------------------------------------------------ one mma tile
# mma_tile.cu: one warp, one tensor-core instruction mma.sync.m16n8k16 (fp16 or bf16 in, fp32 accumulate).
MMA_VERSIONS = (1, 2, 3)
MMA_M, MMA_N, MMA_K = 16, 8, 16
MMA_SHAPES = {"a": (MMA_M, MMA_K), "b": (MMA_K, MMA_N), "c": (MMA_M, MMA_N)}
MMA_V3_WARPS = 4        # v3: warps per block, each one 16x8 tile of C
MMA_CU = HERE / "mma_tile.cu"
MMA_DEFINES = {"V3_WARPS": MMA_V3_WARPS}
MMA_KERNELS = tuple(f"{k}<{bf16}>" for k in (*(f"mma_tile_v{v}" for v in MMA_VERSIONS), "mma_fragments")
                    for bf16 in ("false", "true"))        # the template instantiations the wrappers launch
CU_DEFINES = {MMA_CU: MMA_DEFINES}                        # for tests/test_compile.py
CU_TEMPLATES = {MMA_CU: MMA_KERNELS}                      # and for get_kernel: one module for them all


def mma_fragment_map(operand: str) -> np.ndarray:
    """Which elements each lane holds in one `mma.sync.m16n8k16` with fp16/bf16 inputs and fp32 C, from the
    PTX ISA's fragment tables: an int array of shape (32, n, 2), [lane, i] = (row, col) of element i of
    `operand` ("a": 16x16, n = 8; "b": 16x8 as (k, n), n = 4; "c": 16x8, n = 4) in that lane's registers.
    Element i is PTX's a_i / b_i / c_i: register i // 2 holds elements i and i + 1 (even i in the low half)
    for A and B; C has one fp32 element per register. With g = lane >> 2 and t = lane % 4:

        A: row = g + 8 * ((i // 2) % 2),  col = 2t + (i % 2) + 8 * (i >= 4)
        B: row = 2t + (i % 2) + 8 * (i >= 2),  col = g
        C: row = g + 8 * (i >= 2),  col = 2t + (i % 2)
    """
    expect_choice(operand, "operand", tuple(MMA_SHAPES))
    lane = np.arange(32)[:, None]
    g, t = lane >> 2, lane % 4
    i = np.arange(8 if operand == "a" else 4)[None, :]
    if operand == "a":
        row, col = g + 8 * ((i // 2) % 2), 2 * t + (i % 2) + 8 * (i >= 4)
    elif operand == "b":
        row, col = 2 * t + (i % 2) + 8 * (i >= 2), g + 0 * i
    else:
        row, col = g + 8 * (i >= 2), 2 * t + (i % 2)
    return np.stack(np.broadcast_arrays(row, col), axis=-1).astype(np.int64)


def mma_owners(operand: str) -> tuple[np.ndarray, np.ndarray]:
    """(lane, element) grids of the operand's shape: lane[r, c] holds element (r, c) of A, B or C as its
    element number element[r, c] (see mma_fragment_map). What a fragment-layout diagram draws."""
    m = mma_fragment_map(operand)
    lane, elem = np.full(MMA_SHAPES[operand], -1), np.full(MMA_SHAPES[operand], -1)
    lane[m[..., 0], m[..., 1]] = np.arange(32)[:, None]
    elem[m[..., 0], m[..., 1]] = np.arange(m.shape[1])[None, :]
    return lane, elem


def mma_pack(x, operand: str):
    """A 16x16 A, or 16x8 B or C, as the (32, n) registers of the warp: row L is what lane L holds."""
    _, m = _xp_map(x, operand)
    if tuple(x.shape) != MMA_SHAPES[operand]:
        raise ValueError(f"x: expected shape {MMA_SHAPES[operand]} for operand {operand!r}, got {tuple(x.shape)}")
    return x[m[..., 0], m[..., 1]]


def mma_unpack(frag, operand: str):
    """The inverse of mma_pack: (32, n) per-lane registers back to the operand's matrix."""
    xp, m = _xp_map(frag, operand)
    if tuple(frag.shape) != m.shape[:2]:
        raise ValueError(f"frag: expected shape {m.shape[:2]} for operand {operand!r}, got {tuple(frag.shape)}")
    out = xp.empty(MMA_SHAPES[operand], frag.dtype)
    out[m[..., 0], m[..., 1]] = frag
    return out


def _xp_map(x, operand: str):
    """(array module of x, the fragment map as an index array of that module): NumPy or CuPy alike."""
    m = mma_fragment_map(operand)
    if isinstance(x, np.ndarray):
        return np, m
    import cupy as cp
    return cp, cp.asarray(m)


def _mma_bf16(x, name: str) -> bool:
    """Check an fp16/bf16 mma operand's dtype; True when it is bf16 (uint16 bit patterns, as flash.to_bf16 makes)."""
    from step2_attention.flash import _is_bf16
    if x.dtype != np.float16 and not _is_bf16(x):
        raise TypeError(f"{name}: expected dtype float16, or bfloat16 as uint16 bit patterns, got {x.dtype}")
    return _is_bf16(x)


def _mma_require(bf16: bool) -> None:
    if bf16:
        require_arch(80, "bf16 tensor cores (mma.sync m16n8k16.bf16)")
    else:
        require_arch(75, "fp16 tensor cores (mma.sync m16n8k8, ldmatrix)")


def mma_kernel(version: int, bf16: bool = False):
    """mma_tile.cu's mma_tile_v<version> for fp16 (or bf16) inputs: what `mma_tile` launches."""
    expect_choice(version, "version", MMA_VERSIONS)
    return _mma(f"mma_tile_v{version}<{'true' if bf16 else 'false'}>")


def _mma(name: str):
    """A kernel of mma_tile.cu, its templates instantiated."""
    return get_kernel(MMA_CU, name, MMA_DEFINES, templates=CU_TEMPLATES[MMA_CU])


def mma_tile(a, b, version: int = 1, out=None):
    """C = A @ B on tensor cores with mma_tile_v<version> of mma_tile.cu: fp16 inputs (or bf16 as uint16 bit
    patterns), fp32 accumulation, float32 C. v1 and v2 take exactly one tile, A (16, 16) and B (16, 8); v3 any
    A (M, K) and B (K, N). fp16 needs sm_75+, bf16 sm_80+."""
    expect_choice(version, "version", MMA_VERSIONS)
    a = expect_array(a, "a", ndim=2)
    bf16 = _mma_bf16(a, "a")
    if version == 3:
        M, K = a.shape
        b = expect_array(b, "b", dtype=a.dtype, ndim=2)
        if b.shape[0] != K:
            raise ValueError(f"b: expected shape ({K}, *) to match a's K={K}, got {b.shape}")
        N = b.shape[1]
        _check_int32(M=M, N=N, K=K)
    else:
        M, K, N = MMA_M, MMA_K, MMA_N
        a = expect_array(a, "a", shape=(M, K))
        b = expect_array(b, "b", dtype=a.dtype, shape=(K, N))
    c = out_array(out, (M, N))
    _mma_require(bf16)
    if M == 0 or N == 0:
        return c
    if K == 0:
        c.fill(0)
        return c
    kernel = mma_kernel(version, bf16)
    if version == 3:
        grid = (-(-N // MMA_N), -(-M // (MMA_M * MMA_V3_WARPS)))
        if grid[1] > 65535:
            raise ValueError(f"a: M={M} needs {grid[1]} row blocks, more than the grid's 65535")
        kernel(grid, (32 * MMA_V3_WARPS,), (a, b, c, np.int32(M), np.int32(N), np.int32(K)))
    else:
        kernel((1,), (32,), (a, b, c))
    return c


def mma_fragments(a_frag, b_frag, out=None):
    """The bare instruction (mma_tile.cu's mma_fragments): lane L's registers are row L of a_frag (32, 8) and
    b_frag (32, 4), fp16 or bf16 (uint16 bits); returns its fp32 C registers, (32, 4). No layout inside:
    `mma_unpack(mma_fragments(mma_pack(A, "a"), mma_pack(B, "b")), "c")` is A @ B (to fp32 rounding) only if
    mma_fragment_map describes the hardware."""
    a_frag = expect_array(a_frag, "a_frag", shape=(32, 8))
    bf16 = _mma_bf16(a_frag, "a_frag")
    b_frag = expect_array(b_frag, "b_frag", dtype=a_frag.dtype, shape=(32, 4))
    c = out_array(out, (32, 4))
    _mma_require(bf16)
    _mma(f"mma_fragments<{'true' if bf16 else 'false'}>")((1,), (32,), (a_frag, b_frag, c))
    return c
