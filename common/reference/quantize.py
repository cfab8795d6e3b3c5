"""float64 references for low-precision weights (step 4's quantize.py and gemv_lowp.cu).

Written from the definitions, not from the bit tricks the course's code uses, so that each checks the other:

    bf16_round(w)         the float64 value of w rounded to bf16 (8 significant bits, ties to even)
    bf16_bits_value(u)    the float64 value of uint16 bf16 bit patterns (sign, exponent, mantissa decoded)
    int8_quantize(w)      (q, scale): symmetric per row, scale = max|w_row| / 127, q = round(w / scale)
    weight(W, scale=None) the float64 matrix a stored weight stands for (float32 as is, bf16 bits decoded,
                          int8 times its row scales in float64: what a GEMV that scales once per row computes)
    fp16_round(x)         the float64 value of x rounded to fp16 (11 significant bits, ties to even)
    gemv(x, W, scale=None, bias=None, gelu=False, ln=None, eps=1e-5, residual=None, operand=None)
                          y = LN(x) @ weight(W)^T + bias, then GELU; residual given: residual + y;
                          operand "bf16" / "fp16": LN(x) rounded to it first (a tensor-core GEMV's A operand)
"""
from __future__ import annotations

import numpy as np

from common.reference.ops import f64, layernorm
from common.reference.ops import gelu as gelu_tanh

__all__ = ["bf16_round", "fp16_round", "bf16_bits_value", "int8_quantize", "weight", "gemv"]


def _host(a):
    return np.asarray(a.get() if hasattr(a, "get") else a)


def bf16_round(w) -> np.ndarray:
    """Round to the nearest value with an 8-bit significand (bf16 keeps float32's exponent range), ties to
    the even significand. Normal numbers only (the course's weights have no float32 subnormals)."""
    w = f64(w)
    m, e = np.frexp(w)                       # w = m * 2**e, 0.5 <= |m| < 1: the significand's 8 bits are m * 2**8
    return np.ldexp(np.rint(m * 256.0) / 256.0, e)


def fp16_round(x) -> np.ndarray:
    """Round to the nearest fp16 (11-bit significand, ties to even; NumPy's float16 cast rounds so), as float64."""
    return f64(x).astype(np.float16).astype(np.float64)


def bf16_bits_value(u) -> np.ndarray:
    """uint16 bf16 bits -> float64: (-1)^s * 2^(E - 127) * (1 + M / 128) for a normal number; 0 for E = M = 0."""
    u = _host(u).astype(np.int64)
    s, E, M = u >> 15, (u >> 7) & 0xFF, u & 0x7F
    if np.any(E == 0xFF):
        raise ValueError("u: holds an Inf or NaN bit pattern (exponent 255)")
    v = np.where(E == 0, M / 128.0 * 2.0 ** -126, (1 + M / 128.0) * 2.0 ** (E.astype(np.float64) - 127))
    return np.where(s == 1, -v, v)


def int8_quantize(w) -> tuple[np.ndarray, np.ndarray]:
    """(q int64 (N, K), scale float64 (N,)) in float64: scale = max|w_row| / 127, q = round(w / scale)
    (ties to even), a row of zeros gets scale 0 and q 0."""
    w = f64(w)
    scale = np.abs(w).max(axis=1) / 127.0
    q = np.rint(w / np.where(scale > 0, scale, 1.0)[:, None])
    return np.clip(q, -127, 127).astype(np.int64), scale


def weight(W, scale=None) -> np.ndarray:
    """The float64 (N, K) matrix a stored weight stands for: float32 as is, uint16 as bf16 bits, int8 times
    its (N,) scale (the product in float64, as the GEMV's single multiply per output row makes it)."""
    W = _host(W)
    if W.dtype == np.uint16:
        return bf16_bits_value(W)
    if W.dtype == np.int8:
        if scale is None:
            raise ValueError("scale: int8 weights need their row scales")
        return W.astype(np.float64) * f64(scale)[:, None]
    return f64(W)


def gemv(x, W, scale=None, bias=None, gelu: bool = False, ln=None, eps: float = 1e-5, residual=None,
         operand: str | None = None) -> np.ndarray:
    """y (B, N) = LN(x) @ weight(W, scale)^T (+ bias, then GELU); with `residual` (B, N): residual + y.
    operand "bf16" or "fp16": LN(x) rounded to that format before the product (None: kept as is)."""
    xs = f64(x) if ln is None else layernorm(x, ln[0], ln[1], eps)
    if operand is not None:
        xs = {"bf16": bf16_round, "fp16": fp16_round}[operand](xs)
    y = xs @ weight(W, scale).T
    if bias is not None:
        y = y + f64(bias)
    if gelu:
        y = gelu_tanh(y)
    return y if residual is None else f64(residual) + y
