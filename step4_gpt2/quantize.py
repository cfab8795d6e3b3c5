"""Weights in fewer bytes: bf16 bit patterns and int8 with one scale per output row. NumPy and CuPy alike
(the result lives where the input does), so a checkpoint is converted at load, on the host or the GPU.

    to_bf16(w) -> u            float32 -> uint16 bf16 bit patterns, round to nearest even (step 2's to_bf16)
    from_bf16(u) -> w          uint16 bf16 bits -> float32 (exact: a bf16 is the top half of a float32)
    quantize_int8(w) -> q, s   (N, K) -> int8 (N, K) and float32 scale (N,): w ~= q * s[:, None], symmetric,
                               round to nearest, s = max|w_row| / 127 (a row of zeros gets s = 0, q = 0)
    dequantize_int8(q, s) -> w float32 (N, K) = q * s[:, None] (in float32: what the GEMV's registers compute)
    quantize(w, kind) -> LowpWeight                 one matrix in "fp32", "bf16" or "int8"

CuPy has no bfloat16 dtype, so bf16 travels as uint16 (as in step 2). A matrix and its scales travel together
as a `LowpWeight(w, scale)`: `ops.gemv(x, lw)` accepts one in place of `W` (or pass `W=lw.w, scale=lw.scale`).
The kind is read from the dtype: float32 -> "fp32", uint16 -> "bf16", int8 -> "int8".
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PRECISIONS = ("fp32", "bf16", "int8")
KIND_OF_DTYPE = {np.dtype(np.float32): "fp32", np.dtype(np.uint16): "bf16", np.dtype(np.int8): "int8"}
BYTES_PER_WEIGHT = {"fp32": 4, "bf16": 2, "int8": 1}
INT8_MAX = 127          # symmetric: -127 .. 127 (the code -128 is never used, so -q is always representable)


def _is_cupy(a) -> bool:
    return type(a).__module__.split(".")[0] == "cupy"


def _xp(a):
    if _is_cupy(a):
        import cupy
        return cupy
    return np


def _expect(a, name: str, dtypes: tuple, ndim: int | None = None):
    """A NumPy or CuPy array of one of `dtypes` (and `ndim` dimensions), else an error naming `name`."""
    if not isinstance(a, np.ndarray) and not _is_cupy(a):
        raise TypeError(f"{name}: expected a NumPy or CuPy array, got {type(a).__name__}")
    if a.dtype not in [np.dtype(d) for d in dtypes]:
        raise TypeError(f"{name}: expected dtype {' or '.join(str(np.dtype(d)) for d in dtypes)}, got {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(a.shape)}")
    return a


def to_bf16(w):
    """float32 -> uint16 bf16 bit patterns, round to nearest even; NumPy or CuPy (step 2's flash.to_bf16)."""
    _expect(w, "w", (np.float32,))
    if _is_cupy(w):
        from step2_attention.flash import to_bf16 as gpu_to_bf16
        return gpu_to_bf16(w)
    u = np.ascontiguousarray(w).view(np.uint32)
    # add 0x7FFF plus the lowest kept bit, then truncate: halfway cases go to the even neighbour
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(u):
    """uint16 bf16 bit patterns -> float32 (exact); NumPy or CuPy."""
    _expect(u, "u", (np.uint16,))
    xp = _xp(u)
    return (xp.ascontiguousarray(u).astype(xp.uint32) << 16).view(xp.float32)


def quantize_int8(w):
    """(N, K) float32 (or uint16 bf16 bits, widened first) -> (q int8 (N, K), scale float32 (N,)).
    Symmetric per output row: scale = max|w_row| / 127, q = round(w / scale) (ties to even), |q| <= 127,
    so |w - q * scale| <= scale / 2 for every weight (up to float32 rounding)."""
    _expect(w, "w", (np.float32, np.uint16), ndim=2)
    xp = _xp(w)
    if w.dtype == np.uint16:
        w = from_bf16(w)
    scale = (xp.abs(w).max(axis=1) / np.float32(INT8_MAX)).astype(xp.float32) if w.shape[1] else \
        xp.zeros(w.shape[0], xp.float32)
    inv = xp.where(scale > 0, scale, np.float32(1))          # a zero row: q = 0 whatever the divisor
    q = xp.clip(xp.rint(w / inv[:, None]), -INT8_MAX, INT8_MAX).astype(xp.int8)
    return q, scale


def dequantize_int8(q, scale):
    """float32 (N, K) = q * scale[:, None], rounded once in float32 (as the kernels compute it)."""
    _expect(q, "q", (np.int8,), ndim=2)
    _expect(scale, "scale", (np.float32,), ndim=1)
    if scale.shape[0] != q.shape[0]:
        raise ValueError(f"scale: expected one per row of q, shape ({q.shape[0]},), got {tuple(scale.shape)}")
    if _is_cupy(q) != _is_cupy(scale):
        raise TypeError("scale: must live where q does (both NumPy or both CuPy)")
    xp = _xp(q)
    return q.astype(xp.float32) * scale[:, None]


@dataclass(frozen=True)
class LowpWeight:
    """One (N, K) weight matrix in one precision: `w` float32, uint16 (bf16 bits) or int8, and for int8 its
    row scales `scale` (N,) float32. `kind` comes from w's dtype."""
    w: object
    scale: object = None

    def __post_init__(self):
        _expect(self.w, "w", tuple(KIND_OF_DTYPE), ndim=2)
        if self.kind == "int8":
            if self.scale is None:
                raise ValueError("scale: an int8 weight needs its (N,) float32 row scales")
            _expect(self.scale, "scale", (np.float32,), ndim=1)
            if self.scale.shape[0] != self.w.shape[0]:
                raise ValueError(f"scale: expected shape ({self.w.shape[0]},), got {tuple(self.scale.shape)}")
        elif self.scale is not None:
            raise ValueError(f"scale: only int8 weights have scales; w is {self.kind} ({self.w.dtype})")

    @property
    def kind(self) -> str:
        return KIND_OF_DTYPE[np.dtype(self.w.dtype)]

    @property
    def shape(self) -> tuple:
        return tuple(self.w.shape)

    @property
    def nbytes(self) -> int:
        """Bytes a GEMV reads: the weights, plus the scales for int8."""
        return int(self.w.nbytes) + (int(self.scale.nbytes) if self.scale is not None else 0)

    def dequantize(self):
        """The float32 matrix this one stands for (what a float64 reference multiplies by)."""
        if self.kind == "fp32":
            return self.w
        if self.kind == "bf16":
            return from_bf16(self.w)
        return dequantize_int8(self.w, self.scale)


def quantize(w, kind: str) -> LowpWeight:
    """A float32 (or bf16-bits) (N, K) matrix as a LowpWeight of `kind` ("fp32", "bf16" or "int8")."""
    if kind not in PRECISIONS:
        raise ValueError(f"kind: expected one of {PRECISIONS}, got {kind!r}")
    _expect(w, "w", (np.float32, np.uint16), ndim=2)
    if kind == "int8":
        return LowpWeight(*quantize_int8(w))
    if kind == "bf16":
        return LowpWeight(w if w.dtype == np.uint16 else to_bf16(w))
    return LowpWeight(from_bf16(w) if w.dtype == np.uint16 else w)


__all__ = ["PRECISIONS", "BYTES_PER_WEIGHT", "to_bf16", "from_bf16", "quantize_int8", "dequantize_int8",
           "LowpWeight", "quantize"]
