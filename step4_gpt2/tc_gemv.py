"""The tensor-core decode GEMVs of gemv_lowp.cu (v8: bf16 weights, v9: int8): the GPU they need, their launch
shape and the shared memory a launch asks for. ops.py launches them (ops.gemv, ops.gemv_qkv; ops.lowp_version
picks them from batch 2 on, and at batch 1 for rows that v6/v7 would give one warp)."""
from __future__ import annotations

from step4_gpt2.quantize import BYTES_PER_WEIGHT

TC_VERSION = {"bf16": 8, "int8": 9}
TC_ARCH = {"bf16": 80, "int8": 75}   # mma.sync with bf16 operands needs sm_80, with fp16 sm_75
TC_ROWS = 16            # rows of W per block (two 8-row mma tiles)
TC_WARPS = 8            # warps per block, splitting K chunk by chunk
TC_UNROLL = 4           # 16-byte loads per tile a lane has in flight
TC_BLOCKS_PER_SM = 4    # grid cap; past it blocks loop over tiles


def tc_defines(maxb: int) -> dict:
    """gemv_lowp.cu's defines for v8/v9 (a module of their own: v6/v7's rows and unroll play no part)."""
    return {"MAXB": maxb, "TC_ROWS": TC_ROWS, "TC_WARPS": TC_WARPS, "TC_UNROLL": TC_UNROLL}


def tc_row_words(K: int, kind: str) -> int:
    """4-byte words per row of x in v8/v9's shared memory: gemv_lowp.cu's Tc::row_words (chunks of 4 lanes x
    one 16-byte load, rounded up to 32 words, plus a bank shift)."""
    chunk = 4 * 16 // BYTES_PER_WEIGHT[kind]
    return (-(-K // chunk) * chunk // 2 + 31) // 32 * 32 + (16 if kind == "bf16" else 4)


def tc_smem(K: int, nb: int, kind: str, ln: bool) -> int:
    """Dynamic shared memory of a v8/v9 launch: nb rows of x as operands, after nb x K floats with LN."""
    return (nb * K * 4 if ln else 0) + nb * tc_row_words(K, kind) * 4
