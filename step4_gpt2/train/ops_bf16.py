"""Checked Python wrappers of mixed-precision training's kernels (mixed.cu, attention_bf16.cu) and its GEMM.

bf16 arrays are CuPy uint16 arrays of bf16 bit patterns (as step 2's flash.to_bf16 makes them). Every function
checks its arguments with common.expect_array (the error names the argument) and writes into `out=` buffers when
given, so that a CUDA graph can record it (mixed.py allocates them once per batch shape).

gemm_bf16: cuBLAS's cublasGemmEx with bf16 A and B (CUDA_R_16BF), an fp32 or bf16 C, and compute type
CUBLAS_COMPUTE_32F: the tensor cores multiply bf16 and accumulate in fp32. It goes through common.cublas's handle
and workspace, so a CUDA graph capture records it like the fp32 GEMMs (CuPy's own cupy_backends.cuda.libs.cublas
exposes gemmEx too, but CuPy refuses cuBLAS calls while a stream is captured).
"""
from __future__ import annotations

import ctypes
import math
from pathlib import Path

import numpy as np

from common import expect_array, get_kernel, launch_grid, null_or, out_array, require_arch
from common.cublas import _ALPHA, _BETA, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT, CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_32F, \
    WORKSPACE_BYTES, _check, _cublas, _handle
from common.graphs import cublas_call

CU_MIXED = Path(__file__).resolve().parent / "mixed.cu"
CU_BF16 = Path(__file__).resolve().parent / "attention_bf16.cu"
HEAD_DIMS = (32, 64)              # HEAD_DIM values attention_bf16.cu supports
ROWS = 64                         # attention_bf16.cu: queries (or keys) per block, 16 per warp
THREADS = 128                     # attention_bf16.cu: 4 warps
BLOCK = 256                       # mixed.cu's grid-stride kernels
CU_DEFINES = {CU_MIXED: {}, CU_BF16: {"HEAD_DIM": 64}}     # for tests/test_compile.py
CUDA_R_16BF = 14
_ONE = ctypes.c_float(1.0)
BF16_ARCH_MESSAGE = "bf16 mixed-precision training (bf16 tensor cores)"


def require_bf16():
    """bf16 tensor cores need sm_80 (A100, RTX 30xx and newer): a RuntimeError naming the GPU below that."""
    require_arch(80, BF16_ARCH_MESSAGE)


def _bf16(a, name: str, **kw):
    return expect_array(a, name, dtype=(np.uint16,), **kw)


# ---------------------------------------------------------------------------------------- casts (mixed.cu)
def _mixed(name: str):
    return get_kernel(CU_MIXED, name)


def _grid4(n: int) -> tuple[int]:
    """mixed.cu's casts: a thread per four elements (their vector path; the grid-stride loop covers the rest)."""
    return launch_grid(-(-n // 4), BLOCK)


def to_bf16(x, out=None):
    """out (uint16, x's shape) = bf16(x), round to nearest even (flash.to_bf16's bits for every number; a NaN
    stays NaN, which flash.to_bf16 would round into another value). x contiguous float32: the parameters once per
    step (wte into the LM head's padded copy, the rest of the flat buffer in a second launch). The kernels whose
    outputs a bf16 GEMM reads next write these same bits themselves (ops.py's out16, dpre16, dx16;
    attention_backward_bf16's dqkv16)."""
    x = expect_array(x, "x", dtype=np.float32)
    out = out_array(out, x.shape, np.uint16)
    if x.size:
        _mixed("to_bf16")(_grid4(x.size), (BLOCK,), (x, out, np.int64(x.size)))
    return out


def bias_bf16(y, bias):
    """y (uint16 (rows, cols)) = bf16(y + bias) in place: y bf16 (a GEMM's output), bias (cols,) float32, the sum
    in fp32. Returns y."""
    y = _bf16(y, "y", ndim=2)
    bias = expect_array(bias, "bias", dtype=np.float32, shape=(y.shape[1],))
    if y.size:
        _mixed("bias_bf16")(_grid4(y.size), (BLOCK,), (y, bias, np.int64(y.size), np.int32(y.shape[1])))
    return y


def gelu_bias_bf16(x, bias, out=None):
    """out (uint16 (rows, cols)) = bf16(gelu(x + bias)): x bf16 (uint16 (rows, cols), the c_fc GEMM's output), bias
    (cols,) float32; the sum and the GELU in fp32 (train_gpt2.cu's formula)."""
    x = _bf16(x, "x", ndim=2)
    bias = expect_array(bias, "bias", dtype=np.float32, shape=(x.shape[1],))
    out = out_array(out, x.shape, np.uint16)
    if x.size:
        _mixed("gelu_bias_bf16")(_grid4(x.size), (BLOCK,), (x, bias, out, np.int64(x.size), np.int32(x.shape[1])))
    return out


# ---------------------------------------------------------------------------------------- the GEMM
def _operand(x, name: str):
    """(op, ld) that makes the row-major bf16 matrix x (r, c) appear as x^T in cuBLAS's column-major terms
    (common.cublas._operand for 2-byte elements)."""
    r, c = x.shape
    s0, s1 = x.strides
    if x.flags.c_contiguous:
        return CUBLAS_OP_N, max(1, c)
    if x.flags.f_contiguous:
        return CUBLAS_OP_T, max(1, r)
    if s1 == 2 and s0 % 2 == 0 and s0 // 2 >= c:
        return CUBLAS_OP_N, s0 // 2
    if s0 == 2 and s1 % 2 == 0 and s1 // 2 >= r:
        return CUBLAS_OP_T, s1 // 2
    raise ValueError(f"{name}: expected rows or columns with unit stride (a contiguous matrix or a transposed "
                     f"view of one), got strides {x.strides} for shape {x.shape}")


def gemm_bf16(a, b, out=None, accumulate: bool = False):
    """out (m, n) = a (m, k) @ b (k, n) (+= with accumulate): a, b bf16 (uint16; transposed views allowed), out
    float32 or bf16 (uint16), C-contiguous; bf16 products, fp32 accumulation (cuBLAS, tensor cores). Without out:
    a new float32 array. Safe inside common.capture_graph when out is given."""
    import cupy as cp
    a = _bf16(a, "a", ndim=2, contiguous=False)
    b = _bf16(b, "b", ndim=2, contiguous=False)
    (m, k), (k2, n) = a.shape, b.shape
    if k2 != k:
        raise ValueError(f"b: expected {k} rows to match a's {a.shape}, got shape {b.shape}")
    if out is None:
        out = cp.empty((m, n), cp.float32)
    out = expect_array(out, "out", dtype=(np.float32, np.uint16), shape=(m, n))
    if m == 0 or n == 0:
        return out
    if k == 0:
        if not accumulate:
            out.fill(0)
        return out
    op_a, lda = _operand(a, "a")
    op_b, ldb = _operand(b, "b")
    for name, v in (("m", m), ("n", n), ("k", k), ("a's row stride", lda), ("b's row stride", ldb)):
        if v >= 2 ** 31:
            raise ValueError(f"gemm_bf16: {name} = {v} does not fit cuBLAS's 32-bit int (a, b: {a.shape}, {b.shape})")
    ctype = CUDA_R_32F if out.dtype == np.float32 else CUDA_R_16BF
    stream = cp.cuda.get_current_stream().ptr
    lib, (h, ws) = _cublas(), _handle(stream)
    beta = _ONE if accumulate else _BETA
    with cublas_call(stream, (ws.ptr, WORKSPACE_BYTES)):     # column-major: out^T = b^T a^T
        _check(lib.cublasGemmEx(h, op_b, op_a, n, m, k, ctypes.byref(_ALPHA), ctypes.c_void_p(b.data.ptr),
                                CUDA_R_16BF, ldb, ctypes.c_void_p(a.data.ptr), CUDA_R_16BF, lda, ctypes.byref(beta),
                                ctypes.c_void_p(out.data.ptr), ctype, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               f"cublasGemmEx bf16 ({m}x{k} @ {k}x{n})")
    return out


def classifier_bf16(logits, targets, losses=None, dlogits=None, scale: float | None = None, grad: bool = True):
    """Per-row losses of logits (N, V) bf16 (uint16, read only; widened to fp32 as read) against targets (N,)
    int32, and with grad, dlogits (N, V) bf16 = (softmax - onehot) * scale (default 1/N): step 3's fused
    classifier on bf16 logits with its gradient in bf16, one block per row. Returns losses."""
    from step3_fused.training import _row_block
    logits = _bf16(logits, "logits", ndim=2)
    N, V = logits.shape
    targets = expect_array(targets, "targets", dtype=np.int32, shape=(N,))
    losses = out_array(losses, (N,), name="losses")
    if grad:
        dlogits = out_array(dlogits, (N, V), np.uint16, name="dlogits")
    elif dlogits is not None:
        raise ValueError("dlogits: pass it with grad=True only (grad=False computes the losses alone)")
    if N and V:
        _mixed("classifier_bf16")((N,), (_row_block(V),), (logits, targets, losses, null_or(dlogits),
                                                            np.int32(V), np.float32(1.0 / N if scale is None else scale)))
    return losses


# ---------------------------------------------------------------------------------------- attention
def _att(name: str, head_dim: int):
    return get_kernel(CU_BF16, name, {"HEAD_DIM": head_dim})


def _qkv(qkv, n_head: int):
    qkv = _bf16(qkv, "qkv", ndim=3)
    B, T, C3 = qkv.shape
    if C3 % 3 or (C3 // 3) % n_head:
        raise ValueError(f"qkv: last dimension {C3} must be 3 * C with C a multiple of n_head={n_head}")
    D = C3 // 3 // n_head
    if D not in HEAD_DIMS:
        raise ValueError(f"n_head: head_dim = C / n_head = {D}; attention_bf16.cu supports {HEAD_DIMS}")
    _aligned(qkv, "qkv")
    return qkv, B, T, C3 // 3, D


def _aligned(x, name: str):
    """The attention kernels copy rows 16 bytes at a time (cp.async) and store pairs of values: each array they
    read or write must start on a 16-byte boundary (a fresh CuPy array does)."""
    if x.data.ptr % 16:
        raise ValueError(f"{name}: expected an array starting on a 16-byte boundary (attention_bf16.cu moves "
                         f"rows in 16-byte pieces), got an address {x.data.ptr % 16} bytes past one: pass a copy")


def attention_forward_bf16(qkv, n_head: int, out=None, lse=None):
    """Causal attention on bf16 tensor cores: qkv (B, T, 3C) bf16 with its bias added -> (out (B, T, C) bf16,
    lse (B, H, T) float32, natural log). sm_80+."""
    require_bf16()
    qkv, B, T, C, D = _qkv(qkv, n_head)
    out = out_array(out, (B, T, C), np.uint16)
    _aligned(out, "out")
    lse = out_array(lse, (B, n_head, T), name="lse")
    if out.size:
        _att("attention_forward_bf16", D)((-(-T // ROWS), B * n_head), (THREADS,),
                                          (qkv, out, lse, np.int32(T), np.int32(n_head), np.float32(1 / math.sqrt(D))))
    return out, lse


def attention_backward_bf16(dout, qkv, out, lse, n_head: int, dqkv=None, delta=None, dqkv16=None):
    """dqkv (B, T, 3C) float32 of causal attention from dout (B, T, C) bf16 and the forward's qkv, out (bf16) and
    lse: delta = rowsum(dO * O), then dK, dV (a block per 64 keys) and dQ (a block per 64 queries, S and dP
    recomputed). The qkv bias gradient is the column sum of dqkv. dqkv16 (B, T, 3C) uint16: also dqkv's bf16
    bits (to_bf16's), for the qkv GEMMs. sm_80+."""
    require_bf16()
    qkv, B, T, C, D = _qkv(qkv, n_head)
    H = n_head
    dout = _bf16(dout, "dout", shape=(B, T, C))
    _aligned(dout, "dout")
    out = _bf16(out, "out", shape=(B, T, C))
    lse = expect_array(lse, "lse", dtype=np.float32, shape=(B, H, T))
    dqkv = out_array(dqkv, (B, T, 3 * C), name="dqkv")
    _aligned(dqkv, "dqkv")
    if dqkv16 is not None:
        dqkv16 = _bf16(dqkv16, "dqkv16", shape=(B, T, 3 * C))
        _aligned(dqkv16, "dqkv16")
    delta = out_array(delta, (B, H, T), name="delta")
    if not dqkv.size:
        return dqkv
    rows = B * H * T
    _att("attention_delta_bf16", D)(launch_grid(rows * 32, BLOCK), (BLOCK,),
                                    (dout, out, delta, np.int32(T), np.int32(H), np.int64(rows)))
    args = (qkv, dout, lse, delta, dqkv, null_or(dqkv16), np.int32(T), np.int32(H),
            np.float32(1 / math.sqrt(D)))
    grid = (-(-T // ROWS), B * H)
    _att("attention_dkv_bf16", D)(grid, (THREADS,), args)
    _att("attention_dq_bf16", D)(grid, (THREADS,), args)
    return dqkv
