"""Checked Python wrappers of train_gpt2.cu, attention.cu and attention_tc.cu: the kernels of a GPT-2 training
step.

Every function takes CuPy float32 arrays (token ids int32), checks them with common.expect_array (the error
names the argument), and writes into `out=`-style buffers when given, so the step's activations and gradients are
allocated once (the reductions' partial sums, and the attention backward's row terms and stored dS, are still per call).
Three take a bf16 output (uint16 bit patterns) for mixed-precision training (mixed.py), whose next GEMM reads bf16:
layernorm_forward's out16 and gelu_bias_backward's dpre16 in place of the fp32 output, layernorm_backward's dx16
beside dx. The kernel rounds the fp32 value it has just computed (ops_bf16.to_bf16's bits), so no cast kernel
reads it back; left out, the kernels run as the fp32 model has them.
The fused classifier and the multi-tensor AdamW are step 3's (train_forward.cu, train_update.cu), the attention
forward is step 2's flash attention (flash_attention.cu), asked to save each row's log-sum-exp, or, in version 3,
the tensor-core kernels of attention_tc.cu (forward and backward at fp32 accuracy, 3xTF32); the global
gradient norm is a CuPy-generated reduction, and the clipping is AdamW's (adamw_schedule makes its factor).
"""
from __future__ import annotations

import contextlib
import functools
import math
from pathlib import Path

import numpy as np

from common import (allow_dynamic_smem, device_info, expect_array, expect_choice, float4_rows, get_kernel, launch_grid,
                    null_or, out_array, require_arch)
from common.cublas import gemm, tf32_enabled

CU = Path(__file__).resolve().parent / "train_gpt2.cu"
CU_ATT = Path(__file__).resolve().parent / "attention.cu"            # attention backward versions 1 and 2
CU_TC = Path(__file__).resolve().parent / "attention_tc.cu"     # attention version 3 (sm_80+)
HEAD_DIMS = (32, 64)      # HEAD_DIM values attention.cu and attention_tc.cu support
# Launch shapes, defined here only and passed to the .cu files as defines (they have no defaults for them).
ATT_ROWS = 64                         # attention backward v2: query (or key) rows per block, 2 threads each
COLS, ROWS = 32, 8                    # column kernels: block (COLS, ROWS)
FINISH_ROWS = 32                      # column_finish: block (COLS, FINISH_ROWS)
LN_WARPS = 4                          # layernorm_backward: warps per block
DEFINES = {"COLS": COLS, "ROWS": ROWS, "FINISH_ROWS": FINISH_ROWS, "LN_WARPS": LN_WARPS}
ATT_DEFINES = {"ATT_ROWS": ATT_ROWS}
LN_VECS = (1, 2, 3, 4, 6, 8)          # the LayerNorms' _vec kernels: float4 per lane (C <= 128 * VEC)
# for tests/test_compile.py (HEAD_DIM: the .cu's default, 64)
CU_DEFINES = {CU: DEFINES, CU_ATT: ATT_DEFINES}
BF16_OF = {"float": "unsigned short", "float4": "uint2"}   # gelu_backward_partial's bf16 element per T
CU_TEMPLATES = {CU: tuple(f"{k}<{t}>" for k in ("column_partial", "gelu_bias_forward") for t in ("float", "float4"))
                    + tuple(f"gelu_backward_partial<{t}, {o}, {h}>" for t, b in BF16_OF.items() for o in (t, b)
                            for h in (t, b))
                    + tuple(f"layernorm_{d}_vec<{v}>" for d in ("forward", "backward") for v in LN_VECS)}
CHUNK_ROWS = 256                      # rows per partial in the column sums
LN_ROWS_PER_BLOCK = 32                # layernorm_backward: rows per block (8 per warp)
V3_MAX_T = 65536                      # attention v3: a head's (T/16)^2/2 dS tiles of 256 floats, below 2^31
BLOCK = 256
EMBEDDING_VERSIONS = (1, 2)           # 1: atomicAdd scatter; 2: sorted, deterministic
# Attention: 1 materialises P in the backward (cuBLAS); 2 is flash-style on the FMA units (recomputes P from lse);
# 3 is flash-style on tensor cores at fp32 accuracy (3xTF32, sm_80+). The forward of 1 and 2 is step 2's kernel.
ATTENTION_VERSIONS = (1, 2, 3)
TC_WARPS, TC_ROWS = 4, 64             # attention_tc.cu: 4 warps, 16 rows each


def _k(name: str):
    return get_kernel(CU, name, DEFINES, templates=CU_TEMPLATES[CU])


def _att(name: str, head_dim: int = 64):
    return get_kernel(CU_ATT, name, {"HEAD_DIM": head_dim, **ATT_DEFINES})


def _elem(cols: int, *arrays) -> tuple[str, int]:
    """(T, cols in T) for the column kernels' template: float4 where common.float4_rows allows it, else float."""
    return ("float4", cols // 4) if float4_rows(cols, *arrays) else ("float", cols)


def _ln_vec(C: int, *arrays, bf16=None) -> int | None:
    """The LayerNorms' VEC for a row of C floats (the smallest in LN_VECS that holds it), or None: scalar kernels.
    bf16: their bf16 output, if any (written four values to an 8-byte store there)."""
    if not float4_rows(C, *arrays) or not _bf16x4_rows(bf16):
        return None
    return next((v for v in LN_VECS if 128 * v >= C), None)


def _bf16x4_rows(a) -> bool:
    """Whether the float4 kernels may store four bf16 at a time (8 bytes) into a (None: no bf16 output). The rows'
    length is the float inputs' (float4_rows checks it is a multiple of 4); only the start may be off."""
    return a is None or a.data.ptr % 8 == 0


def _bf16_out(a, name: str, shape: tuple, instead_of=None, fp32_name: str = ""):
    """A bf16 output (uint16 bit patterns) of this shape, given by the caller (mixed.py's buffers), or None.
    instead_of: the fp32 output it replaces, which must then be left out."""
    if a is None:
        return None
    if instead_of is not None:
        raise ValueError(f"{name}: the bf16 output replaces {fp32_name}; pass {fp32_name} or {name}, not both")
    return expect_array(a, name, dtype=np.uint16, shape=shape)


def _tc(name: str, head_dim: int = 64):
    return get_kernel(CU_TC, name, {"HEAD_DIM": head_dim})


def _grid(n: int) -> tuple:
    return launch_grid(n, BLOCK, per_sm=16)


def _i32(a, name: str, ndim: int):
    return expect_array(a, name, dtype=np.int32, ndim=ndim)


# ---------------------------------------------------------------------------------------- embeddings
def encoder_forward(idx, wte, wpe, out=None):
    """x (B*T, C) = wte[idx] + wpe[:T] for idx (B, T) int32 (ids are checked by the model, once per batch;
    an id out of range gives NaN here, never an out-of-bounds read)."""
    idx = _i32(idx, "idx", 2)
    wte = expect_array(wte, "wte", dtype=np.float32, ndim=2)
    V, C = wte.shape
    B, T = idx.shape
    wpe = expect_array(wpe, "wpe", dtype=np.float32, shape=(None, C))
    if T > wpe.shape[0]:
        raise ValueError(f"idx: T={T} positions exceed wpe's {wpe.shape[0]} rows (block_size)")
    out = out_array(out, (B * T, C))
    if out.size:
        _k("encoder_forward")(_grid(out.size), (BLOCK,), (idx, wte, wpe, out, np.int64(out.size), np.int32(T),
                                                          np.int32(C), np.int32(V)))
    return out


def encoder_backward(dx, idx, dwte, dwpe, version: int = 2):
    """dwte += scatter of dx's rows by token (the LM head's gradient is already in it: tied embeddings);
    dwpe[:T] = sum over the batch of dx, dwpe[T:] = 0. version 1: atomics (run-to-run bit differences when a
    token repeats); version 2: sorted by token, a fixed order of additions (deterministic)."""
    import cupy as cp
    expect_choice(version, "version", EMBEDDING_VERSIONS)
    idx = _i32(idx, "idx", 2)
    B, T = idx.shape
    dwte = expect_array(dwte, "dwte", dtype=np.float32, ndim=2)
    V, C = dwte.shape
    dx = expect_array(dx, "dx", dtype=np.float32, shape=(B * T, C))
    dwpe = expect_array(dwpe, "dwpe", dtype=np.float32, shape=(None, C))
    if dx.size:
        if version == 1:
            _k("encoder_backward_v1")(_grid(dx.size), (BLOCK,), (dx, idx, dwte, np.int64(dx.size), np.int32(C), np.int32(V)))
        else:
            flat = idx.ravel()
            order = cp.argsort(flat).astype(cp.int32)          # a radix sort: stable, so a fixed order
            tok = flat[order]
            start = cp.searchsorted(tok, cp.arange(V + 1, dtype=cp.int32)).astype(cp.int32)
            by_position = V > flat.size                        # fewer blocks: min(V, N) per column strip
            _k("encoder_backward_v2")((min(V, flat.size), -(-C // COLS)), (COLS, ROWS),
                                      (dx, order, tok, start, dwte, np.int32(C), np.int32(V), np.int32(by_position)))
    dwpe[T:].fill(0)
    column_sum(dx.reshape(B, T * C), out=dwpe[:T].reshape(T * C))
    return dwte, dwpe


# ---------------------------------------------------------------------------------------- column sums
def _finish(partial, chunks: int, cols: int, out, out2=None, split: int | None = None, accumulate=False):
    split = cols if split is None else split
    _k("column_finish")((-(-cols // COLS),), (COLS, FINISH_ROWS),
                        (partial, out, out if out2 is None else out2, np.int32(chunks), np.int32(cols),
                         np.int32(split), np.int32(bool(accumulate))))


def column_sum(a, out=None, accumulate: bool = False):
    """out (cols,) = column sums of a (rows, cols): a bias gradient. Two launches, a fixed order of additions."""
    import cupy as cp
    a = expect_array(a, "a", dtype=np.float32, ndim=2)
    rows, cols = a.shape
    out = out_array(out, (cols,))
    if cols == 0:
        return out
    chunks = max(1, -(-rows // CHUNK_ROWS))
    partial = cp.empty((chunks, cols), cp.float32)
    if rows:
        t, n = _elem(cols, a)
        _k(f"column_partial<{t}>")((-(-n // COLS), chunks), (COLS, ROWS),
                                   (a, partial, np.int32(rows), np.int32(n), np.int32(CHUNK_ROWS)))
    else:
        partial.fill(0)
    _finish(partial, chunks, cols, out, accumulate=accumulate)
    return out


# ---------------------------------------------------------------------------------------- GELU
def gelu_bias_forward(h, bias, out=None):
    """out = gelu(h + bias), one pass; h (the c_fc GEMM's output) is left as it is for the backward pass."""
    h = expect_array(h, "h", dtype=np.float32, ndim=2)
    bias = expect_array(bias, "bias", dtype=np.float32, shape=(h.shape[1],))
    out = out_array(out, h.shape)
    if h.size:
        t, n = _elem(h.shape[1], h, bias, out)
        size = h.shape[0] * n
        _k(f"gelu_bias_forward<{t}>")(_grid(size), (BLOCK,), (h, bias, out, np.int64(size), np.int32(n)))
    return out


def gelu_bias_backward(dout, h, bias, dpre=None, dbias=None, dpre16=None):
    """dpre = dout * gelu'(h + bias) (dpre may be dout itself) and dbias = its column sums: one pass + a finish.
    dpre16 (rows, cols) uint16: dpre's bf16 bits go there and no fp32 dpre is written (mixed.py); dbias is the
    same fp32 sum either way. h float32, or uint16 bf16 bits (mixed.py's GEMM output), widened as read.
    Returns (dpre or dpre16, dbias)."""
    import cupy as cp
    dout = expect_array(dout, "dout", dtype=np.float32, ndim=2)
    rows, cols = dout.shape
    h = expect_array(h, "h", dtype=(np.float32, np.uint16), shape=(rows, cols))
    h16 = h.dtype == np.uint16
    bias = expect_array(bias, "bias", dtype=np.float32, shape=(cols,))
    dpre16 = _bf16_out(dpre16, "dpre16", (rows, cols), instead_of=dpre, fp32_name="dpre")
    dpre = out_array(dpre, (rows, cols), name="dpre") if dpre16 is None else None
    dbias = out_array(dbias, (cols,), name="dbias")
    chunks = max(1, -(-rows // CHUNK_ROWS))
    partial = cp.empty((chunks, cols), cp.float32)
    if not rows:
        partial.fill(0)
    if dout.size:
        vec = _bf16x4_rows(dpre16) and (not h16 or _bf16x4_rows(h))
        t, n = _elem(cols, dout, bias, dpre, *(() if h16 else (h,))) if vec else ("float", cols)
        o = BF16_OF[t] if dpre16 is not None else t          # dpre's element
        hh = BF16_OF[t] if h16 else t                        # h's element
        _k(f"gelu_backward_partial<{t}, {o}, {hh}>")((-(-n // COLS), chunks), (COLS, ROWS),
                 (dout, h, bias, dpre if dpre16 is None else dpre16, partial, np.int32(rows), np.int32(n),
                  np.int32(CHUNK_ROWS)))
    if cols:
        _finish(partial, chunks, cols, dbias)
    return dpre if dpre16 is None else dpre16, dbias


# ---------------------------------------------------------------------------------------- LayerNorm
def layernorm_forward(x, weight, bias, eps: float = 1e-5, y=None, ybias=None, out=None, resid=None, mean=None,
                      rstd=None, out16=None):
    """(out, mean, rstd) = LayerNorm of x (N, C), saving mean and rstd (N,). With y (N, C): the residual is
    fused in, resid = x + y (+ ybias) is written too and normalised; returns (resid, out, mean, rstd).
    out16 (N, C) uint16: the output's bf16 bits go there instead of an fp32 out (mixed.py), returned as out."""
    x = expect_array(x, "x", dtype=np.float32, ndim=2)
    N, C = x.shape
    weight = expect_array(weight, "weight", dtype=np.float32, shape=(C,))
    bias = expect_array(bias, "bias", dtype=np.float32, shape=(C,))
    if y is not None:
        y = expect_array(y, "y", dtype=np.float32, shape=(N, C))
        resid = out_array(resid, (N, C), name="resid")
        if ybias is not None:
            ybias = expect_array(ybias, "ybias", dtype=np.float32, shape=(C,))
    out16 = _bf16_out(out16, "out16", (N, C), instead_of=out, fp32_name="out")
    out = out_array(out, (N, C)) if out16 is None else None
    mean, rstd = out_array(mean, (N,), name="mean"), out_array(rstd, (N,), name="rstd")
    resid = resid if y is not None else None
    vec = _ln_vec(C, x, y, ybias, resid, weight, bias, out, bf16=out16)
    name = "layernorm_forward" if vec is None else f"layernorm_forward_vec<{vec}>"
    if N:
        _k(name)(launch_grid(N, BLOCK // 32), (BLOCK,), (x, null_or(y), null_or(ybias), null_or(resid), weight,
                                                         bias, null_or(out), null_or(out16), mean, rstd, np.int32(N),
                                                         np.int32(C), np.float32(eps)))
    out = out if out16 is None else out16
    return (out, mean, rstd) if y is None else (resid, out, mean, rstd)


def layernorm_backward(dy, x, weight, mean, rstd, dx=None, dweight=None, dbias=None, accumulate: bool = False,
                       dx16=None):
    """dx (= or += with accumulate: the residual stream's gradient), dweight, dbias in one kernel + a finish.
    dx16 (N, C) uint16: also the bf16 bits of the final dx, after accumulating (mixed.py's next GEMM reads them)."""
    import cupy as cp
    dy = expect_array(dy, "dy", dtype=np.float32, ndim=2)
    N, C = dy.shape
    x = expect_array(x, "x", dtype=np.float32, shape=(N, C))
    weight = expect_array(weight, "weight", dtype=np.float32, shape=(C,))
    mean = expect_array(mean, "mean", dtype=np.float32, shape=(N,))
    rstd = expect_array(rstd, "rstd", dtype=np.float32, shape=(N,))
    dx = out_array(dx, (N, C), name="dx")
    dweight, dbias = out_array(dweight, (C,), name="dweight"), out_array(dbias, (C,), name="dbias")
    dx16 = _bf16_out(dx16, "dx16", (N, C))
    blocks = max(1, -(-N // LN_ROWS_PER_BLOCK))
    partial = cp.empty((blocks, 2 * C), cp.float32)
    if not N:
        partial.fill(0)
    if N and C:
        vec = _ln_vec(C, dy, x, weight, dx, bf16=dx16)
        kernel = _k("layernorm_backward" if vec is None else f"layernorm_backward_vec<{vec}>")
        smem = LN_WARPS * 2 * C * 4
        allow_dynamic_smem(kernel, smem, f"layernorm_backward with C={C}")
        kernel((blocks,), (LN_WARPS * 32,), (dy, x, weight, mean, rstd, dx, null_or(dx16), partial, np.int32(N),
                                             np.int32(C), np.int32(LN_ROWS_PER_BLOCK), np.int32(bool(accumulate))),
               shared_mem=smem)
    if C:
        _finish(partial, blocks, 2 * C, dweight, dbias, split=C)
    return dx, dweight, dbias


# ---------------------------------------------------------------------------------------- attention
def _qkv_shape(qkv, n_head: int):
    qkv = expect_array(qkv, "qkv", dtype=np.float32, ndim=3)
    B, T, C3 = qkv.shape
    if C3 % 3 or (C3 // 3) % n_head:
        raise ValueError(f"qkv: last dimension {C3} must be 3 * C with C a multiple of n_head={n_head}")
    C = C3 // 3
    D = C // n_head
    if D not in HEAD_DIMS:
        raise ValueError(f"n_head: head_dim = C / n_head = {D}; the attention kernels support {HEAD_DIMS}")
    return qkv, B, T, C, D


def default_attention_version() -> int:
    """3 (tensor cores) where the GPU has TF32 tensor cores (sm_80+), else 2."""
    return 3 if device_info()["sm"] >= 80 else 2


def _attention_version(version):
    version = default_attention_version() if version is None else expect_choice(version, "version", ATTENTION_VERSIONS)
    if version == 3:
        require_arch(80, "attention version 3 (TF32 tensor cores)")
    return version


def attention_forward(qkv, bias, n_head: int, out=None, lse=None, version: int | None = None):
    """Causal attention on GPT-2's fused qkv (B, T, 3C) (+ bias (3C,), added while loading; version 3 adds it to its
    register operands and once per row for its shared-memory tiles) ->
    (out (B, T, C), lse (B, H, T)); the T x T scores never leave the chip. Versions 1 and 2: step 2's flash
    attention (flash_attention_qkv), which also writes each row's log-sum-exp when given a buffer; 3: on tensor
    cores (attention_tc.cu); None: default_attention_version()."""
    version = _attention_version(version)
    qkv, B, T, C, D = _qkv_shape(qkv, n_head)
    lse = out_array(lse, (B, n_head, T), name="lse")
    if version != 3:
        from step2_attention.flash import flash_attention_qkv
        return flash_attention_qkv(qkv, n_head, causal=True, bias=bias, out=out, lse=lse), lse
    out = out_array(out, (B, T, C), name="out")
    if bias is not None:
        bias = expect_array(bias, "bias", dtype=np.float32, shape=(3 * C,))
    if out.size:
        _tc("attention_forward_tc", D)((-(-T // TC_ROWS), B * n_head), (TC_WARPS * 32,),
                                       (qkv, null_or(bias), out, lse, np.int32(T), np.int32(n_head),
                                        np.float32(1.0 / math.sqrt(D))))
    return out, lse


def attention_delta(dout, out, n_head: int, delta=None):
    """delta (B, H, T) = rowwise dO . O per head: the softmax backward's row term."""
    dout = expect_array(dout, "dout", dtype=np.float32, ndim=3)
    B, T, C = dout.shape
    out = expect_array(out, "out", dtype=np.float32, shape=(B, T, C))
    delta = out_array(delta, (B, n_head, T), name="delta")
    rows = B * T * n_head
    if rows:
        _att("attention_delta", C // n_head)(launch_grid(rows * 32, BLOCK), (BLOCK,),
                                           (dout, out, delta, np.int32(T), np.int32(n_head), np.int64(rows)))
    return delta


def attention_backward(dout, qkv, bias, out, lse, n_head: int, dqkv=None, version: int | None = None):
    """dqkv (B, T, 3C) of causal attention, from dout (B, T, C) and the forward's out and lse. The qkv bias
    gradient is column_sum(dqkv). version 1 writes the T x T probabilities (and dP) to memory and uses
    cuBLAS batched GEMMs; version 2 recomputes them tile by tile from lse and never writes a T x T matrix;
    version 3 runs on tensor cores (3xTF32) and writes dS once (the causal half of T x T) for the dQ kernel,
    where version 2 recomputes S and dP; None: default_attention_version()."""
    import cupy as cp
    version = _attention_version(version)
    qkv, B, T, C, D = _qkv_shape(qkv, n_head)
    H = n_head
    dout = expect_array(dout, "dout", dtype=np.float32, shape=(B, T, C))
    out = expect_array(out, "out", dtype=np.float32, shape=(B, T, C))
    lse = expect_array(lse, "lse", dtype=np.float32, shape=(B, H, T))
    if bias is not None:
        bias = expect_array(bias, "bias", dtype=np.float32, shape=(3 * C,))
    dqkv = out_array(dqkv, (B, T, 3 * C), name="dqkv")
    if not dqkv.size:
        return dqkv
    if version == 3 and T > V3_MAX_T:
        raise ValueError(f"qkv: T = {T} is longer than attention version 3 takes ({V3_MAX_T}: its kernels "
                         f"address a head's dS tiles with 32-bit offsets); use version=2")
    scale = 1.0 / math.sqrt(D)
    delta = attention_delta(dout, out, H)
    if version == 3:                 # dkv writes dS (16 x 16 tiles of the lower triangle), dq reads it back
        nt = -(-T // 16)
        ds = cp.empty(B * H * (nt * (nt + 1) // 2) * 256, cp.float32)
        grid, ints = (-(-T // TC_ROWS), B * H), (np.int32(T), np.int32(H), np.float32(scale))
        _tc("attention_dkv_tc", D)(grid, (TC_WARPS * 32,),
                                               (qkv, null_or(bias), dout, lse, delta, dqkv, ds, *ints))
        _tc("attention_dq_tc", D)(grid, (TC_WARPS * 32,), (qkv, null_or(bias), ds, dqkv, *ints))
        return dqkv
    args = (qkv, null_or(bias), dout, lse, delta, dqkv, np.int32(T), np.int32(H), np.float32(scale))
    if version == 2:
        grid = (-(-T // ATT_ROWS), B * H)
        _att("attention_backward_dkv", D)(grid, (2 * ATT_ROWS,), args)
        _att("attention_backward_dq", D)(grid, (2 * ATT_ROWS,), args)
        return dqkv
    from step3_fused.ops import split_heads
    q, k, v = split_heads(qkv if bias is None else qkv + bias, H)   # each (B, H, T, D), C-contiguous
    do = cp.ascontiguousarray(dout.reshape(B, T, H, D).transpose(0, 2, 1, 3))
    p = cp.matmul(q, k.transpose(0, 1, 3, 2))                        # (B, H, T, T): the scores, in DRAM
    n = p.size
    _att("attention_probs", D)(_grid(n), (BLOCK,), (p, lse, np.int32(T), np.int64(n), np.float32(scale)))
    dv = cp.matmul(p.transpose(0, 1, 3, 2), do)
    dp = cp.matmul(do, v.transpose(0, 1, 3, 2))
    _att("attention_dscores", D)(_grid(n), (BLOCK,), (p, dp, delta, np.int32(T), np.int64(n), np.float32(scale)))
    dq = cp.matmul(dp, k)
    dk = cp.matmul(dp.transpose(0, 1, 3, 2), q)
    view = dqkv.reshape(B, T, 3, H, D)
    for j, g in enumerate((dq, dk, dv)):
        view[:, :, j] = g.transpose(0, 2, 1, 3)
    return dqkv


# ---------------------------------------------------------------------------------------- matmuls
def weight_grad(x, dy, out=None):
    """dW = x^T dy for y = x W: x (N, n_in), dy (N, n_out) -> (n_in, n_out), through cuBLAS (a transposed
    view: no copy; common.cublas.gemm, which a CUDA graph can capture).

    The reduction runs over the N = B*T tokens and the output is small (C x 4C at most), which looks like too
    few output tiles to fill the GPU; splitting the rows by hand ("split-K", lab/split_k.py) measures slower
    than cuBLAS's own kernel choice for the single GEMM. For the MLP's c_proj (n_in = 4 n_out) with TF32 on,
    cuBLAS picks a slower kernel for x^T dy than for the same product the other way round, dy^T x (C x 4C, as
    c_fc's): that one is made, and its transpose copied into out (2.4 MB at C = 384, a few microseconds). In
    fp32 the first orientation is the faster one. docs/training.md has the numbers."""
    import cupy as cp
    x = expect_array(x, "x", dtype=np.float32, ndim=2)
    N, n_in = x.shape
    dy = expect_array(dy, "dy", dtype=np.float32, shape=(N, None))
    n_out = dy.shape[1]
    out = out_array(out, (n_in, n_out))
    if n_in == 4 * n_out and tf32_enabled():       # the MLP's c_proj: the faster orientation in TF32, then copied
        cp.copyto(out, gemm(dy.T, x).T)
        return out
    return gemm(x.T, dy, out)


@contextlib.contextmanager
def beside(stream):
    """Inside, work goes to `stream` (None: stays on the current one), after all the current stream's work so
    far; the current stream does not wait for it (record an event on `stream` for that). Inside a CUDA graph
    capture the event pulls `stream` into the capture: the graph gets two branches."""
    if stream is None:
        yield
        return
    import cupy as cp
    stream.wait_event(cp.cuda.get_current_stream().record(cp.cuda.Event(disable_timing=True)))
    with stream:
        yield


def matmul_backward(dy, x, weight, dx=None, dweight=None, dbias=None, stream=None):
    """y = x @ W + b (Conv1D layout, W (in, out)): dx = dy W^T (cuBLAS, a transposed view, no copy),
    dW = weight_grad(x, dy), db = column_sum(dy) (skipped when dbias is False).

    stream: where dW and db run (default: the current stream, like dx). Only dx is on the backward pass's
    critical path: on another stream, dW and db start after the current stream's work so far and run beside
    what follows it. The caller then records an event on `stream` and makes the current stream wait for it
    before anything overwrites dy or x or reads dW or db (TrainGPT.backward)."""
    dy = expect_array(dy, "dy", dtype=np.float32, ndim=2)
    N, n_out = dy.shape
    weight = expect_array(weight, "weight", dtype=np.float32, shape=(None, n_out))
    x = expect_array(x, "x", dtype=np.float32, shape=(N, weight.shape[0]))
    dx = gemm(dy, weight.T, out_array(dx, x.shape, name="dx"))
    with beside(stream):
        dweight = weight_grad(x, dy, out=dweight)
        if dbias is not False:
            dbias = column_sum(dy, out=dbias)
    return dx, dweight, dbias


# ---------------------------------------------------------------------------------------- classifier
def classifier(logits, targets, losses=None, scale: float | None = None, grad: bool = True):
    """Step 3's fused classifier with no bias: per-row losses, and (grad=True) logits overwritten in place
    with dlogits = (softmax - onehot) * scale (default 1/N). One block per row; probabilities never stored."""
    from step3_fused.training import classifier as fused
    logits = expect_array(logits, "logits", dtype=np.float32, ndim=2)    # named as this function's argument
    return fused(logits, None, targets, mode="grad" if grad else "loss", scale=scale, losses=losses, check=False)


# ---------------------------------------------------------------------------------------- optimiser schedule
def adamw_schedule(counters, sched, lr: float, min_lr: float, warmup: int, max_steps: int, betas, norm,
                   max_norm: float):
    """One thread on the GPU: sched (4,) float32 = (lr_at(counters[0]), 1 - b1^t, 1 - b2^t, clipping factor
    min(1, max_norm / (norm + 1e-6)), or 1 for max_norm = 0) with t = counters[1] + 1, then counters (2,) int64
    += 1: the values step 3's AdamW reads with sched=, from the GPU. norm: grad_norm's result (a CuPy scalar)."""
    counters = expect_array(counters, "counters", dtype=np.int64, shape=(2,))
    sched = expect_array(sched, "sched", dtype=np.float32, shape=(4,))
    norm = expect_array(norm, "norm", dtype=np.float32, shape=())
    _k("adamw_schedule")((1,), (1,), (counters, sched, np.float64(lr), np.float64(min_lr), np.int64(warmup),
                                      np.int64(max_steps), np.float64(betas[0]), np.float64(betas[1]), norm,
                                      np.float32(max_norm)))
    return sched


# ---------------------------------------------------------------------------------------- gradient clipping
@functools.lru_cache(maxsize=None)
def _norm_kernel():
    import cupy as cp
    return cp.ReductionKernel("float32 g", "float32 n", "g * g", "a + b", "n = sqrt(a)", "0", "grad_norm")


def grad_norm(gflat):
    """The global gradient norm over the flat gradient buffer, on the GPU (no sync; a CuPy scalar). Clipping
    costs no pass of its own: adamw_schedule turns the norm into the clipping factor, and AdamW multiplies each
    gradient by it as it reads it."""
    return _norm_kernel()(expect_array(gflat, "gflat", dtype=np.float32, ndim=1))
