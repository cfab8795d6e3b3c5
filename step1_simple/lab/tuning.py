"""The tuning sweeps of step 1: axpb v4 and sum v3 with their compile-time UNROLL (float4 loads in flight per
thread), their grid and, for the reduction, the block size as arguments. The benchmark tries them to pick the
defaults that step1_simple.ops fixes; the tests check every combination against the float64 reference.
"""
from __future__ import annotations

from step1_simple import ops

UNROLLS, SUM_BLOCKS = ops.UNROLLS, ops.SUM_BLOCKS     # the choices the kernels accept


def axpb(x, a: float, b: float, out=None, version: int = 4, block: int = 256, grid: int | None = None,
         unroll: int = ops.UNROLL):
    """ops.axpb with `unroll` (one of UNROLLS) compiled in."""
    return ops._axpb(x, a, b, out, version, block, grid, unroll)


def total(x, version: int = 3, block: int = ops.SUM_BLOCK, grid: int | None = None, unroll: int = ops.UNROLL):
    """ops.total with `block` threads per block (one of SUM_BLOCKS), `grid` blocks (by default enough to fill
    every SM) and `unroll` (one of UNROLLS) compiled in."""
    return ops._total(x, version, block, grid, unroll)
