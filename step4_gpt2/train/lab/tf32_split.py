"""Lab: attention v3 with each way of splitting an operand into TF32 parts (attention_tc.cu's TF32_SPLIT).

3xTF32 writes x = big + small, big = x rounded to TF32. The mainline (split 0) rounds `big` with an integer add
and a mask and leaves `small` to the tensor core, which truncates it to TF32. The variants, compiled from the
same attention_tc.cu with -DTF32_SPLIT:
    1  both parts rounded to nearest in integer instructions;
    2  both rounded by PTX's cvt.rna.tf32.f32 (the same bits as 1, more instructions after ptxas).
Splits 1 and 2 giving the same bits is what shows the integer rounding is cvt.rna's (the lab's tests).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from common import expect_array, expect_choice, get_kernel, out_array, require_arch

CU_TC = (Path(__file__).resolve().parent / "../attention_tc.cu").resolve()
SPLITS = (0, 1, 2)            # 0: the mainline's (small part truncated by the tensor core)


def _kernel(name: str, head_dim: int, split: int):
    split = expect_choice(split, "split", SPLITS)
    return get_kernel(CU_TC, name, {"HEAD_DIM": head_dim, "TF32_SPLIT": split})


def kernels(head_dim: int, split: int) -> dict:
    """{name: kernel} of attention v3's three kernels compiled with TF32_SPLIT=split."""
    return {"attention_forward_tc": _kernel("attention_forward_tc", head_dim, split),
            "attention_dkv_tc": _kernel("attention_dkv_tc", head_dim, split),
            "attention_dq_tc": _kernel("attention_dq_tc", head_dim, split)}


def attention_forward(qkv, bias, n_head: int, out=None, lse=None, split: int = 0):
    """ops.attention_forward(version=3) with TF32_SPLIT=split: (out (B, T, C), lse (B, H, T))."""
    from step4_gpt2.train import ops
    require_arch(80, "attention version 3 (TF32 tensor cores)")
    qkv, B, T, C, D = ops._qkv_shape(qkv, n_head)
    bias = expect_array(bias, "bias", dtype=np.float32, shape=(3 * C,))
    out = out_array(out, (B, T, C), name="out")
    lse = out_array(lse, (B, n_head, T), name="lse")
    if out.size:
        kernels(D, split)["attention_forward_tc"]((-(-T // ops.TC_ROWS), B * n_head), (ops.TC_WARPS * 32,),
                                                  (qkv, bias, out, lse, np.int32(T), np.int32(n_head),
                                                   np.float32(1.0 / math.sqrt(D))))
    return out, lse


def attention_backward(dout, qkv, bias, out, lse, n_head: int, dqkv=None, split: int = 0):
    """ops.attention_backward(version=3) with TF32_SPLIT=split: dqkv (B, T, 3C)."""
    import cupy as cp
    from step4_gpt2.train import ops
    require_arch(80, "attention version 3 (TF32 tensor cores)")
    qkv, B, T, C, D = ops._qkv_shape(qkv, n_head)
    H = n_head
    dout = expect_array(dout, "dout", dtype=np.float32, shape=(B, T, C))
    bias = expect_array(bias, "bias", dtype=np.float32, shape=(3 * C,))
    lse = expect_array(lse, "lse", dtype=np.float32, shape=(B, H, T))
    dqkv = out_array(dqkv, (B, T, 3 * C), name="dqkv")
    if not dqkv.size:
        return dqkv
    if T > ops.V3_MAX_T:
        raise ValueError(f"qkv: T = {T} is longer than attention version 3 takes ({ops.V3_MAX_T})")
    delta = ops.attention_delta(dout, out, H)
    nt = -(-T // 16)
    ds = cp.empty(B * H * (nt * (nt + 1) // 2) * 256, cp.float32)
    k = kernels(D, split)
    grid, ints = (-(-T // ops.TC_ROWS), B * H), (np.int32(T), np.int32(H), np.float32(1.0 / math.sqrt(D)))
    k["attention_dkv_tc"](grid, (ops.TC_WARPS * 32,), (qkv, bias, dout, lse, delta, dqkv, ds, *ints))
    k["attention_dq_tc"](grid, (ops.TC_WARPS * 32,), (qkv, bias, ds, dqkv, *ints))
    return dqkv


def split_rows(inputs, n_head: int) -> list:
    """Benchmark rows: attention v3's kernels with each split (2 = cvt.rna, 1 = integer rounding, 0 = the small
    part truncated, the mainline), the forward and the backward's two kernels (dK/dV with dS, then dQ), on
    `inputs` [(T, B, qkv, bias, dout)] of `n_head` heads; sm_80+ only (else no rows). The kernels are launched
    here directly, so that the rows time the kernels alone, not the wrappers' argument checks and allocations."""
    import cupy as cp
    from common import bench
    from common.benchmarks import Row
    from step4_gpt2.train import ops
    if ops.default_attention_version() != 3:
        return []
    rows = []
    for T_, B_, qkv, bias, dout in inputs:
        H = n_head
        D = qkv.shape[2] // 3 // H
        nt = -(-T_ // 16)
        out, lse = ops.attention_forward(qkv, bias, H, version=3)
        delta = ops.attention_delta(dout, out, H)
        dqkv, ds = cp.empty_like(qkv), cp.empty(B_ * H * (nt * (nt + 1) // 2) * 256, cp.float32)
        grid, block = (-(-T_ // ops.TC_ROWS), B_ * H), (ops.TC_WARPS * 32,)
        ints = (np.int32(T_), np.int32(H), np.float32(1 / math.sqrt(D)))
        size, base = f"B{B_} H{H} T{T_} D{D}", {}
        for split, what in ((2, "cvt.rna"), (1, "integer rounding"), (0, "small part truncated")):
            k = kernels(D, split)

            def fwd(k=k):
                k["attention_forward_tc"](grid, block, (qkv, bias, out, lse, *ints))

            def bwd(k=k):
                k["attention_dkv_tc"](grid, block, (qkv, bias, dout, lse, delta, dqkv, ds, *ints))
                k["attention_dq_tc"](grid, block, (qkv, bias, ds, dqkv, *ints))
            for part, fn in (("forward", fwd), ("backward kernels", bwd)):
                t = bench(fn, name=f"attention v3 {part}, split {split} ({what}) T={T_}")
                base.setdefault(part, t)
                rows.append(Row.of(t, size, anchor=("split 2 (cvt.rna)", base[part]) if split != 2 else None))
    return rows
