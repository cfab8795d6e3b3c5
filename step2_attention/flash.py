"""Fused attention for the rest of the course: fp32 flash attention (flash_attention.cu), its variant
that reads GPT-2's fused QKV buffer, tensor-core attention in fp16/bf16 (flash_attention_tc.cu) and
decode attention against a KV cache (decode_attention.cu).

CuPy has no bfloat16 dtype: bf16 tensors travel as uint16 arrays holding the bf16 bit patterns
(`to_bf16` / `bf16_to_float32` convert). A CuPy dtype named "bfloat16" (ml_dtypes) is accepted too.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from common import (allow_dynamic_smem, device_info, expect_array, expect_choice, get_kernel, out_array,
                    require_arch)

HERE = Path(__file__).resolve().parent
FLASH_VERSIONS = (1, 2, 3)
BEST = 3
HEAD_DIMS = (32, 64)
LOG2E = 1.4426950408889634
# tile sizes of flash_attention.cu v2/v3 (compile-time defines; benchmarks_flash.py can sweep them)
TILES = {"BR": 64, "BC": 64, "TM": 4}
V1_ROWS = 4             # flash_v1: query rows per block, one warp each
DECODE_ATTENTION_VERSIONS = (1, 2)
DECODE_WARPS = 4        # decode_split: warps per block


def _ptr(a) -> np.uint64:
    return np.uint64(0 if a is None else a.data.ptr)


def fp32_smem_bytes(d: int, tiles: dict | None = None) -> int:
    """Dynamic shared memory of flash_attention.cu v2/v3 per block: Q (BR x D+4), K or P (whichever is
    larger: BC x D+4 or BR x BC+8) and V (BC x D), floats."""
    t = tiles or TILES
    kp = max(t["BC"] * (d + 4), t["BR"] * (t["BC"] + 8))
    return (t["BR"] * (d + 4) + kp + t["BC"] * d) * 4


def tc_smem_bytes(d: int, tiles: dict | None = None) -> int:
    """Dynamic shared memory of flash_attention_tc.cu per block: Q (16*WARPS rows) and double-buffered K
    and V tiles (4 * BC rows), rows of D+8 16-bit values."""
    t = tiles or TC_TILES
    return (16 * t["WARPS"] + 4 * t["BC"]) * (d + 8) * 2


def smem_fits(nbytes: int) -> bool:
    """Whether a block may use nbytes of dynamic shared memory on this GPU (the opt-in limit: 48 KB
    without opting in, 64 KB on a T4, 99 KB on an RTX 30/40, 163 KB on an A100, 227 KB on an H100)."""
    return nbytes <= device_info()["shared_per_block_optin"]


def _check_grid(heads: int, name: str) -> None:
    if heads > 65535:
        raise ValueError(f"{name} = {heads} exceeds the grid's 65535 (gridDim.y); split the batch")


def _check_aligned(**arrays) -> None:
    for name, a in arrays.items():
        if a.data.ptr % 16:
            raise ValueError(f"{name}: expected a 16-byte aligned array (16-byte loads), got a view starting "
                             f"{a.data.ptr % 16} bytes past a 16-byte boundary; pass a copy ({name}.copy())")


def fp32_kernel(version: int, d: int, tiles: dict | None = None):
    """(kernel, threads per block, dynamic shared bytes) of flash_attention.cu's flash_v<version> at head
    dim d: exactly what flash_attention launches (the notebook reads its resources from it). Raises
    ValueError when the tiles need more shared memory than the GPU has."""
    expect_choice(version, "version", FLASH_VERSIONS)
    t = tiles or TILES
    kernel = get_kernel(HERE / "flash_attention.cu", f"flash_v{version}", {"HEAD_DIM": d, "V1_ROWS": V1_ROWS, **t})
    if version == 1:
        return kernel, 32 * V1_ROWS, 0
    smem = fp32_smem_bytes(d, t)
    allow_dynamic_smem(kernel, smem, f"tiles: {t} at head dim D={d}")
    return kernel, (t["BR"] // t["TM"]) * 8, smem


def _scale(scale, d) -> float:
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not s > 0:
        raise ValueError(f"scale: expected a positive number, got {scale!r}")
    return s


def _launch_fp32(q, k, v, bias, out, B, H, T, d, strides, ostrides, scale, causal, version, tiles=None, lse=None):
    t = tiles or TILES
    if version == 3 and any(a.data.ptr % 16 for a in (q, k, v, out)):
        version = 2    # float4 loads need 16-byte aligned rows
    bq, bk, bv = bias if bias is not None else (None, None, None)
    # raw pointers: k and v may be column views into the fused QKV buffer
    args = (_ptr(q), _ptr(k), _ptr(v), _ptr(bq), _ptr(bk), _ptr(bv), _ptr(out), _ptr(lse), np.int32(T), np.int32(H),
            *(np.int64(s) for s in strides), *(np.int64(s) for s in ostrides),
            np.float32(scale * LOG2E), np.int32(bool(causal)))
    kernel, threads, smem = fp32_kernel(version, d, t)
    rows = V1_ROWS if version == 1 else t["BR"]     # query rows per block
    kernel((-(-T // rows), B * H), (threads,), args, shared_mem=smem)
    return out


def flash_attention(q, k, v, causal: bool = True, scale: float | None = None, out=None, version: int = BEST,
                    tiles: dict | None = None):
    """Fused attention, fp32, q/k/v/out (B, H, T, D) contiguous, D in {32, 64}; softmax(q k^T * scale) v."""
    q = expect_array(q, "q", dtype=np.float32, ndim=4)
    B, H, T, d = q.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"q: expected head dim D in {HEAD_DIMS}, got shape {q.shape}")
    k = expect_array(k, "k", dtype=np.float32, shape=q.shape)
    v = expect_array(v, "v", dtype=np.float32, shape=q.shape)
    out = out_array(out, q.shape)
    if q.size == 0:
        return out
    _check_grid(B * H, "q: B*H")
    st = (H * T * d, T * d, d)
    return _launch_fp32(q, k, v, None, out, B, H, T, d, st, st, _scale(scale, d), causal, version, tiles)


def flash_attention_qkv(qkv, n_head: int, causal: bool = True, bias=None, out=None, scale: float | None = None,
                        version: int = BEST, lse=None):
    """Attention straight from GPT-2's c_attn output: qkv (B, T, 3C) fp32 = [q | k | v] along the last
    axis, head h at columns h*D .. h*D+D-1 of each C block; optional bias (3C,) is added while loading.
    Returns the merged-heads output (B, T, C), ready for c_proj. No permute, one launch. Given lse
    (B, n_head, T) fp32, also writes each row's log-sum-exp, log sum_j exp(scale * q_i . k_j) (natural log):
    what a backward pass keeps (step 4b's training)."""
    qkv = expect_array(qkv, "qkv", dtype=np.float32, ndim=3)
    B, T, C3 = qkv.shape
    if C3 % 3:
        raise ValueError(f"qkv: expected a last dim of 3*C, got shape {qkv.shape}")
    C = C3 // 3
    if not isinstance(n_head, (int, np.integer)) or n_head <= 0 or C % n_head:
        raise ValueError(f"n_head: expected a positive divisor of C={C}, got {n_head!r}")
    d = C // n_head
    if d not in HEAD_DIMS:
        raise ValueError(f"n_head: head dim C/n_head = {d}, expected one of {HEAD_DIMS}")
    if bias is not None:
        bias = expect_array(bias, "bias", dtype=np.float32, shape=(C3,))
    out = out_array(out, (B, T, C))
    if lse is not None:
        lse = out_array(lse, (B, n_head, T), name="lse")
    if qkv.size == 0:
        return out
    _check_grid(B * n_head, "qkv: B*n_head")
    biases = None if bias is None else (bias, bias[C:], bias[2 * C:])
    if version == 3 and bias is not None and any(b.data.ptr % 16 for b in biases):
        version = 2
    return _launch_fp32(qkv, qkv[..., C:], qkv[..., 2 * C:], biases, out, B, n_head, T, d,
                        (T * C3, d, C3), (T * C, d, C), _scale(scale, d), causal, version, lse=lse)


# ----------------------------------------------------------------------------------- tensor cores
def _is_bf16(a) -> bool:
    return a.dtype == np.uint16 or a.dtype.name == "bfloat16"


def to_bf16(x):
    """float32 CuPy array -> uint16 array of bf16 bit patterns (round to nearest even)."""
    import cupy as cp
    x = expect_array(x, "x", dtype=np.float32, contiguous=False)
    u = cp.ascontiguousarray(x).view(cp.uint32)
    return ((u + cp.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(cp.uint16)


def bf16_to_float32(x):
    """uint16 bf16 bit patterns -> float32."""
    import cupy as cp
    x = expect_array(x, "x", dtype=(np.uint16,), contiguous=False)
    return (x.astype(cp.uint32) << 16).view(cp.float32)


# flash_attention_tc.cu: 16*WARPS query rows per block, BC keys per tile (step2_attention/lab/tiles.py sweeps them)
TC_TILES = {"WARPS": 4, "BC": 64}


def tc_kernel(bf16: bool, d: int, tiles: dict | None = None):
    """(kernel, threads per block, dynamic shared bytes) of flash_attention_tc.cu at head dim d: what
    flash_attention_tc launches. Raises ValueError when the tiles need more shared memory than the GPU has."""
    t = tiles or TC_TILES
    kernel = get_kernel(HERE / "flash_attention_tc.cu", "flash_tc_bf16" if bf16 else "flash_tc_fp16",
                        {"HEAD_DIM": d, **t})
    smem = tc_smem_bytes(d, t)
    allow_dynamic_smem(kernel, smem, f"tiles: {t} at head dim D={d}")
    return kernel, 32 * t["WARPS"], smem


def flash_attention_tc(q, k, v, causal: bool = True, scale: float | None = None, out=None):
    """Tensor-core flash attention: q/k/v (B, H, T, D) fp16, or bf16 (uint16 bit patterns), D in
    {32, 64, 128}; fp32 accumulation; returns the input dtype. fp16 needs sm_75+, bf16 sm_80+.

    On a V100 (sm_70), which lacks the m16n8k8 instruction, fp16 inputs run through the fp32 flash kernel
    (upcast, attend, round back) with a warning: same results within fp16 tolerance, no tensor cores."""
    return _flash_attention_tc(q, k, v, causal, scale, out, None, None)


def _flash_attention_tc(q, k, v, causal, scale, out, tiles: dict | None, fp32_fallback: bool | None):
    """flash_attention_tc with other TC_TILES (`tiles`) and `fp32_fallback` (True: the sm_70 path on any GPU;
    None: only on sm_70): the one launch path of flash_attention_tc and of step2_attention/lab/tiles.py."""
    import cupy as cp
    q = expect_array(q, "q", ndim=4)
    if q.dtype != np.float16 and not _is_bf16(q):
        raise TypeError(f"q: expected dtype float16, or bfloat16 as uint16 bit patterns, got {q.dtype}")
    B, H, T, d = q.shape
    if d not in (32, 64, 128):
        raise ValueError(f"q: expected head dim D in (32, 64, 128), got shape {q.shape}")
    k = expect_array(k, "k", dtype=q.dtype, shape=q.shape)
    v = expect_array(v, "v", dtype=q.dtype, shape=q.shape)
    out = out_array(out, q.shape, q.dtype)
    bf16 = _is_bf16(q)
    if bf16:
        require_arch(80, "bf16 tensor cores (mma.sync m16n8k16.bf16)")
    elif fp32_fallback or (fp32_fallback is None and device_info()["sm"] < 75):
        if d not in HEAD_DIMS:
            raise ValueError(f"q: the fp32 fallback supports head dim D in {HEAD_DIMS}, got shape {q.shape}")
        if fp32_fallback is None:
            import warnings
            warnings.warn("fp16 tensor-core attention needs sm_75 (mma.sync m16n8k8); this GPU is sm_70, so "
                          "flash_attention_tc runs the fp32 flash kernel on upcast inputs instead", stacklevel=3)
        res = flash_attention(q.astype(cp.float32), k.astype(cp.float32), v.astype(cp.float32), causal, scale)
        out[...] = res.astype(cp.float16)
        return out
    if q.size == 0:
        return out
    _check_grid(B * H, "q: B*H")
    _check_aligned(q=q, k=k, v=v, out=out)   # cp.async / uint4 copies: a misaligned view would fault
    t = tiles or TC_TILES
    kernel, threads, smem = tc_kernel(bf16, d, t)
    kernel((-(-T // (16 * t["WARPS"])), B * H), (threads,),
           (q, k, v, out, np.int32(T), np.float32(_scale(scale, d) * LOG2E), np.int32(bool(causal))),
           shared_mem=smem)
    return out


# ------------------------------------------------------------------------------------------ decode
_workspaces: dict = {}


def decode_split_count(B: int, H: int, Lmax: int) -> tuple[int, int]:
    """(n_split, chunk): enough blocks for ~2 waves over the SMs, chunks of at least 64 cache rows."""
    sms = device_info()["multiprocessors"]
    want = max(1, -(-2 * sms // (B * H)))
    chunk = max(64, -(-Lmax // want))
    chunk = -(-chunk // 64) * 64
    return -(-Lmax // chunk), chunk


def decode_attention(q, k_cache, v_cache, lengths, out=None, scale: float | None = None, version: int = 2,
                     launch=None):
    """One query per (sequence, head) against a KV cache: q (B, H, D) fp32, caches (B, H, Lmax, D) fp32,
    lengths (B,) int32 on the GPU (1 <= lengths[b] <= Lmax, read on the device). With `out` given and
    after one call with these shapes, the call only launches kernels: safe inside a CUDA graph capture.
    version 1: one block per (sequence, head); 2: split-K over the cache + a combine kernel. launch(fn, grid,
    block, args): how each kernel is launched, fn(grid, block, args) by default (step 4's decode passes the
    launch that adds programmatic dependent launch)."""
    import cupy as cp
    q = expect_array(q, "q", dtype=np.float32, ndim=3)
    B, H, d = q.shape
    if d not in (32, 64, 128):
        raise ValueError(f"q: expected head dim D in (32, 64, 128), got shape {q.shape}")
    k_cache = expect_array(k_cache, "k_cache", dtype=np.float32, shape=(B, H, None, d))
    Lmax = k_cache.shape[2]
    v_cache = expect_array(v_cache, "v_cache", dtype=np.float32, shape=(B, H, Lmax, d))
    lengths = expect_array(lengths, "lengths", dtype=np.int32, shape=(B,))
    out = out_array(out, q.shape)
    expect_choice(version, "version", DECODE_ATTENTION_VERSIONS)
    _check_aligned(q=q, k_cache=k_cache, v_cache=v_cache)   # float4 loads
    if Lmax == 0:
        raise ValueError(f"k_cache: expected at least one cache row, got shape {k_cache.shape}")
    if q.size == 0:
        return out
    n_split, chunk = decode_split_count(B, H, Lmax) if version == 2 else (1, Lmax)
    key = (B, H, d, n_split, cp.cuda.Device().id)
    if n_split > 1 and key not in _workspaces:
        _workspaces[key] = cp.empty((B * H * n_split * (d + 2),), dtype=cp.float32)
    partial = _workspaces[key] if n_split > 1 else None
    args = (q, k_cache, v_cache, lengths, out, _ptr(partial), np.int32(H), np.int32(Lmax), np.int32(chunk),
            np.float32(_scale(scale, d) * LOG2E))
    defines = {"HEAD_DIM": d, "WARPS": DECODE_WARPS}
    launch = launch or (lambda fn, grid, block, args: fn(grid, block, args))
    launch(get_kernel(HERE / "decode_attention.cu", "decode_split", defines), (B * H, n_split), (32 * DECODE_WARPS,),
           args)
    if n_split > 1:
        launch(get_kernel(HERE / "decode_attention.cu", "decode_combine", defines), (B * H,), (d,),
               (partial, out, np.int32(n_split)))
    return out
