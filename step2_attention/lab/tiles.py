"""The tile sweeps of step 2: matmul v3 with other tile defines than ops.MATMUL_V3, and tensor-core flash
attention with other tiles than flash.TC_TILES or on its V100 fallback path. The benchmarks try them (the
defaults were chosen from these rows); the tests check them against the float64 references.
"""
from __future__ import annotations

from step2_attention import flash, ops


def matmul(a, b, version: int = 3, out=None, config: dict | None = None):
    """ops.matmul with `config` overriding the v3 tile defines, e.g. {"BM": 128, "BN": 128, "BK": 16, "TM": 8,
    "TN": 8}; other versions take no config."""
    return ops._matmul(a, b, version, out, config)


def flash_attention_tc(q, k, v, causal: bool = True, scale: float | None = None, out=None,
                       tiles: dict | None = None, fp32_fallback: bool | None = None):
    """flash.flash_attention_tc with `tiles` ({"WARPS": .., "BC": ..}, default flash.TC_TILES) and, with
    fp32_fallback=True, the fp32 path that a V100 (sm_70) takes, forced on any GPU."""
    return flash._flash_attention_tc(q, k, v, causal, scale, out, tiles, fp32_fallback)
