"""Python side of step 4: the wrappers of gpt2.cu's kernels, and the one namespace every kernel GPT-2 runs
goes through (steps 2 and 3's attention and LayerNorm kernels are imported here too).

    embedding(tokens, positions, wte, wpe, out)      x = wte[token] + wpe[position]
    bias_gelu(h, b)                                  the prefill MLP epilogue after cuBLAS, in place
    kv_cache_fill(qkv, bias, k_cache, v_cache)       a prompt's k and v into the KV cache
    gemv(x, W, bias, out, gelu, version, ln, residual)   the decode-step matrix product (v1 .. v5)
    gemv_qkv(x, W, bias, q, k_cache, v_cache, pos)   the QKV GEMV whose epilogue appends k, v to the cache
        both take W as float32 (gpt2.cu, v1 .. v5), uint16 bf16 bits (gemv_lowp.cu, v6) or int8 with
        scale= its (N,) row scales (v7), or a quantize.LowpWeight: the dtype picks the kernel, lowp_version when
        the tensor-core v8 / v9 run instead (`with ops.tensor_cores(False):` keeps v6 / v7)
    matmul_lowp(x, W, scale, out)                    prefill with bf16/int8 weights: widen once, then cuBLAS
    argmax(logits, tokens, pos, lens), advance(pos, lens)   greedy choice and position update on the device
    programmatic()                                   with ops.programmatic(): the kernels above and the decode
                                                     attention launch with programmatic dependent launch (sm_90)
    layernorm, residual_layernorm                    step 3
    flash_attention_qkv, decode_attention            step 2 (decode_attention launched as this module's)

Swapping one op. `model.py` calls every kernel through this module object (`ops.bias_gelu(...)`, never a
name imported from it), at call time, so replacing an attribute here swaps the op everywhere the model
uses it, for as long as the replacement is in place:

    from unittest import mock
    with mock.patch("step4_gpt2.ops.bias_gelu", my_bias_gelu):
        logits = model.forward(idx)          # the prefill now runs my_bias_gelu(h, b) in every block

The two ops meant for this are `bias_gelu(h, b)` (prefill; must update h (N, C) in place and return it)
and `gemv(x, W, bias=None, out=None, gelu=False, version=None, ln=None, eps=1e-5, residual=False)` (every
matrix product of a decode step; a replacement may handle the plain cases and hand the fused ones, ln= and
residual=, to the original). A CUDA graph replays the kernels it captured: decode with
`generate(..., cuda_graph=False)` (or a fresh Decoder) while an op is swapped.

Every wrapper checks its arguments and returns CuPy arrays; with its output buffers given, a wrapper
allocates nothing and never synchronises with the host, so a decode step can be captured in a CUDA graph.
"""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import numpy as np

from common import (allow_dynamic_smem, device_info, expect_array, expect_choice, get_kernel, launch_grid,
                    null_or, occupancy, out_array)
from step2_attention import flash
from step2_attention.flash import decode_split_count, flash_attention_qkv  # noqa: F401
from step3_fused.ops import layernorm, residual_layernorm  # noqa: F401
from step4_gpt2 import pdl
from step4_gpt2.quantize import BYTES_PER_WEIGHT, KIND_OF_DTYPE, LowpWeight
from step4_gpt2.tc_gemv import TC_ARCH, TC_BLOCKS_PER_SM, TC_ROWS, TC_VERSION, TC_WARPS, tc_defines, tc_smem

CU = Path(__file__).resolve().parent / "gpt2.cu"
# Compile-time constants of gpt2.cu, passed as defines (the .cu's own values only serve offline compiles).
MAXB = 8                # batch rows per GEMV launch: each weight load is used for up to MAXB rows
ROWS = 2                # output rows per warp (gemv_v3) / per block (gemv_v4)
V4_WARPS = 4            # gemv_v4: warps sharing ROWS rows, splitting K
V5_ROWS = 4             # gemv_v5: rows per block (a tile)
V5_UNROLL = 4           # gemv_v5: float4 loads per row a lane has in flight
V5_MAXWARPS = 8         # gemv_v5: at most 8 warps (256 threads) per block, its __launch_bounds__
GEMV_THREADS = 128      # gemv_v3: 4 warps, each its own ROWS rows
V5_BLOCKS_PER_SM = 16   # gemv_v5: grid cap; bigger matrices (the LM head) loop over row tiles
V5_LN_BLOCKS_PER_SM = 4  # ... with a LayerNorm prologue over > 2 rows: fewer blocks, each normalising once
V5_LN1_WEIGHTS = 8      # ... over 1 row: weights a lane loads per row, at least one 16-byte load (more warps)
ARGMAX_BATCH = 4        # argmax_v2: 16-byte loads in flight per thread
GEMV_VERSIONS = (1, 2, 3, 4, 5)   # fp32 weights (gpt2.cu)
GEMV_LOWP_VERSIONS = (6, 7, 8, 9)  # bf16 and int8 weights (gemv_lowp.cu): v5's design (6, 7), on tensor cores (8, 9)
LOWP_VERSION = {"bf16": 6, "int8": 7}
LOWP_PER_LOAD = {k: 16 // BYTES_PER_WEIGHT[k] for k in LOWP_VERSION}   # weights per 16-byte load (8, 16)
LOWP_CU = Path(__file__).resolve().parent / "gemv_lowp.cu"
NULL = null_or(None)    # an unused pointer argument
_switch = {"programmatic": False, "tensor_cores": True}   # set by programmatic() and tensor_cores()


@contextlib.contextmanager
def _switched(name: str, on: bool):
    before, _switch[name] = _switch[name], bool(on)
    try:
        yield
    finally:
        _switch[name] = before


def programmatic(on: bool = True):
    """Inside `with ops.programmatic():` this module's kernels (embedding, the GEMVs, argmax, advance) and step
    2's decode attention launch with programmatic dependent launch (step4_gpt2/pdl.py) on sm_90 and newer: each
    may start while the kernel before it drains, and waits (pdl_wait, gpt2.cu's header) only before it reads that
    kernel's output. Elsewhere, and for step 3's LayerNorm kernels, launches stay plain; the results are the same
    either way (no kernel writes a GEMV's weights, which v5 .. v9 load before they wait). A CUDA graph captured
    inside keeps the early starts. Module state, not a thread's: one thread decodes at a time."""
    return _switched("programmatic", on)


def tensor_cores(on: bool = True):
    """Inside `with ops.tensor_cores(False):` a bf16/int8 GEMV given no version stays on v6/v7 (x in fp32) at every
    batch and row length (lowp_version); a Decoder sets it from its tensor_cores option. Module state."""
    return _switched("tensor_cores", on)


def _launch(fn, grid, block, args, shared_mem: int = 0) -> None:
    """fn(grid, block, args): through pdl.launch_pdl inside programmatic() on sm_90+, else CuPy's launch."""
    if _switch["programmatic"] and device_info()["sm"] >= pdl.PDL_ARCH:
        pdl.launch_pdl(fn, grid, block, args, shared_mem=shared_mem)
    else:
        fn(grid, block, args, shared_mem=shared_mem)


def decode_attention(q, k_cache, v_cache, lengths, out=None, scale: float | None = None, version: int = 2):
    """Step 2's decode attention (step2_attention.flash.decode_attention, same arguments), its kernels launched
    as this module's: with programmatic dependent launch inside programmatic() (its kernels wait, then read)."""
    return flash.decode_attention(q, k_cache, v_cache, lengths, out=out, scale=scale, version=version,
                                  launch=_launch)


def defines(rows: int = ROWS, unroll: int = V5_UNROLL, maxb: int = MAXB) -> dict:
    """gpt2.cu's defines; rows/unroll/maxb pick the module (v3/v4 use ROWS, v5 V5_ROWS; maxb: gemv_module)."""
    return {"MAXB": maxb, "ROWS": rows, "V4_WARPS": V4_WARPS, "V5_UNROLL": unroll, "V5_MAXWARPS": V5_MAXWARPS,
            "ARGMAX_BATCH": ARGMAX_BATCH}


def kernel(name: str, rows: int = ROWS, unroll: int = V5_UNROLL, maxb: int = MAXB):
    """Kernel `name` of gpt2.cu with these constants (cached): extern "C", or e.g. "gemv_v5<EPI_BIAS_GELU, true>"."""
    return get_kernel(CU, name, defines(rows, unroll, maxb), templates=CU_TEMPLATES[CU])


def gemv_module(B: int) -> int:
    """MAXB of the module a gemv_v5/v6/v7 call of B rows launches from (every GEMV wrapper asks here, once per call):
    1 at batch 1, MAXB otherwise. Compiled for MAXB rows, acc[ROWS][MAXB] holds registers a batch of 1 never uses
    (sm_90, int8: 165-173 per lane, 102-128 at MAXB 1), so fewer blocks are resident. Both read x the same way."""
    return 1 if B == 1 else MAXB


def _index_vector(a, name: str, n: int):
    """An int32 (n,) index vector on the GPU (token ids, positions, lengths: read by the kernels as int*)."""
    return expect_array(a, name, dtype=np.int32, shape=(n,))


def embedding(tokens, positions, wte, wpe, out):
    """out[i] = wte[tokens[i]] + wpe[positions[i]]; tokens, positions int32 (n,), out (n, C). Ids are not range-checked
    here (a host sync): GPT.check_tokens checks prompts, and every later id comes from the model's argmax or sampler."""
    out = expect_array(out, "out", dtype=np.float32, ndim=2)
    n, C = out.shape
    wte = expect_array(wte, "wte", dtype=np.float32, shape=(None, C))
    expect_array(wpe, "wpe", dtype=np.float32, shape=(None, C))
    _index_vector(tokens, "tokens", n)
    _index_vector(positions, "positions", n)
    _launch(kernel("embedding_v2" if C % 4 == 0 else "embedding_v1"),
            (n,), (min(256, max(32, C // 4)),), (tokens, positions, wte, wpe, out, np.int32(n), np.int32(C)))
    return out


def bias_gelu(h, b):
    """h = gelu_tanh(h + b) in place; h (N, C), b (C,). Returns h."""
    h = expect_array(h, "h", dtype=np.float32, ndim=2)
    b = expect_array(b, "b", dtype=np.float32, shape=(h.shape[1],))
    total, C = h.size, h.shape[1]
    if C % 4 == 0:       # float4s in a grid-stride loop
        kernel("bias_gelu_v2")(launch_grid(total // 4, 256, per_sm=16), (256,), (h, b, np.int64(total), np.int32(C)))
    else:
        kernel("bias_gelu_v1")(launch_grid(total, 256), (256,), (h, b, np.int64(total), np.int32(C)))
    return h


def _check_caches(k_cache, v_cache, B: int, C: int):
    """(H, L, D) of a pair of KV caches (B, H, L, D), float32, contiguous, H * D = C."""
    k_cache = expect_array(k_cache, "k_cache", dtype=np.float32, shape=(B, None, None, None))
    _, H, L, D = k_cache.shape
    expect_array(v_cache, "v_cache", dtype=np.float32, shape=k_cache.shape)
    if H * D != C:
        raise ValueError(f"k_cache: {H} heads x head_dim {D} = {H * D} channels, but the activations have C={C}")
    return H, L, D


def kv_cache_fill(qkv, bias, k_cache, v_cache):
    """Write k and v of a prompt (qkv (B, T, 3C) without bias) into caches (B, H, L, D) at rows 0..T-1."""
    qkv = expect_array(qkv, "qkv", dtype=np.float32, ndim=3)
    B, T, C3 = qkv.shape
    if C3 % 3:
        raise ValueError(f"qkv: the last dimension holds q, k and v (3C), got {C3}, not a multiple of 3")
    expect_array(bias, "bias", dtype=np.float32, shape=(C3,))
    H, L, D = _check_caches(k_cache, v_cache, B, C3 // 3)
    if L < T:
        raise ValueError(f"k_cache: holds {L} positions per sequence, fewer than the prompt's T={T} tokens")
    kernel("kv_cache_fill_v1")((B * T,), (128,), (qkv, bias, k_cache, v_cache, np.int32(B), np.int32(T),
                                                 np.int32(H), np.int32(D), np.int32(L)))


# ----------------------------------------------------------------------------- the decode GEMV
def _v34_launch(version: int, N: int):
    """(grid, block) of gemv_v3 (a warp per ROWS rows) or gemv_v4 (a block per ROWS rows)."""
    if version == 3:
        return launch_grid(N, ROWS * GEMV_THREADS // 32), (GEMV_THREADS,)
    return launch_grid(N, ROWS), (32 * V4_WARPS,)


def _v5_warps(K: int, unroll: int = V5_UNROLL, per_load: int = 4) -> int:
    """Warps of a gemv_v5/v6/v7 block: the fewest (<= V5_MAXWARPS) whose lanes' `unroll` loads cover a row."""
    return min(V5_MAXWARPS, max(1, -(-(K // per_load) // (32 * unroll))))


def _v5_unroll(unroll, ln: bool, maxb: int, per_load: int = 4) -> int:
    """v5/v6/v7's loads per lane and row: unroll, or for None V5_UNROLL, but V5_LN1_WEIGHTS weights a lane for a
    lone row behind the LayerNorm prologue, which the block's warps share (docs/findings/gpt2_decode.md)."""
    return unroll if unroll is not None else max(1, V5_LN1_WEIGHTS // per_load) if ln and maxb == 1 else V5_UNROLL


def _v5_launch(fn, N: int, K: int, nb: int, ln: bool, rows: int = V5_ROWS, unroll: int = V5_UNROLL,
               per_load: int = 4):
    """(grid, block, shared bytes) of gemv_v5/v6/v7 kernel fn: _v5_warps; a block per `rows`-row tile, at most
    V5_BLOCKS_PER_SM per SM and as many as are resident, then blocks loop over tiles; shared: the LN prologue's rows."""
    warps = _v5_warps(K, unroll, per_load)
    smem = nb * K * 4 if ln else 0
    blocks_per_sm = V5_BLOCKS_PER_SM
    if ln and nb > 2:      # every block re-reads and normalises all nb rows: amortise it over more tiles
        blocks_per_sm = min(blocks_per_sm, V5_LN_BLOCKS_PER_SM)
    per_sm = max(1, min(blocks_per_sm, _resident(fn, 32 * warps, smem)))
    return launch_grid(N, rows, per_sm=per_sm), (32 * warps,), smem


@functools.lru_cache(maxsize=None)
def _resident(fn, block: int, smem: int) -> int:
    """Blocks of fn resident per SM (cached: the decode step asks on every launch)."""
    return occupancy(fn, block, smem)["blocks_per_sm"]


def _v5_rows_per_launch(fn, K: int, ln: bool, maxb: int = MAXB) -> int:
    """Batch rows per launch of gemv_v5 kernel fn (from the module of this maxb): maxb, or with the LayerNorm
    prologue (nb rows x K floats in shared memory) as many as this GPU's per-block opt-in limit holds next to
    fn's static shared memory (a T4's 64 KB: 3 rows of K=4100). GPT-2's decode (K=768, batch <= 8) always fits
    in one launch; the MAXB=1 module (gemv_module: batch 1) launches its one row."""
    if not ln or maxb == 1:
        return maxb
    room = device_info()["shared_per_block_optin"] - fn.shared_size_bytes
    return max(1, min(maxb, room // (4 * K)))


def _v5_call(fn, N, K, nb, ln, args, rows=V5_ROWS, unroll=V5_UNROLL, per_load=4):
    grid, block, smem = _v5_launch(fn, N, K, nb, ln, rows, unroll, per_load)
    allow_dynamic_smem(fn, smem, f"ln: the LayerNorm prologue's {nb} row(s) x {K} floats in shared memory")
    _launch(fn, grid, block, args, smem)


def _ln_args(ln, K: int, eps: float):
    """(weight, bias, eps) for the LayerNorm prologue, or null pointers without one."""
    if ln is None:
        return NULL, NULL, np.float32(eps)
    w = expect_array(ln[0], "ln[0] (weight)", dtype=np.float32, shape=(K,))
    b = expect_array(ln[1], "ln[1] (bias)", dtype=np.float32, shape=(K,))
    return w, b, np.float32(eps)


def gemv(x, W, bias=None, out=None, gelu=False, version=None, ln=None, eps: float = 1e-5,
         residual: bool = False, rows: int = V5_ROWS, unroll: int | None = None, scale=None):
    """y (B, N) = x (B, K) @ W^T (+ bias, then GELU) with W (N, K); any B (chunks of MAXB rows).
    version None = 5. Only v5 has the other fusions:
      ln=(weight, bias): x is replaced by LayerNorm(x) first (each block normalises it in shared memory);
      residual=True: out += x @ W^T + bias, in place (out is the residual stream, required).
    rows/unroll: v5's rows per tile and 16-byte loads per lane and row (a module per pair; unroll None: _v5_unroll).
    W uint16 (bf16 bits) or int8 (with scale=, (N,) float32), or a LowpWeight: gemv_v6 / gemv_v7 (gemv_lowp.cu),
    with every v5 fusion, or their tensor-core versions gemv_v8 / gemv_v9 (rows/unroll are v6/v7's); version
    None picks the kernel from W's dtype, the batch and the row length K (lowp_version)."""
    W, scale = _unpack(W, scale)
    if scale is not None or _dtype(W) in (np.uint16, np.int8) or version in GEMV_LOWP_VERSIONS:
        return _gemv_lowp(x, W, scale, bias, out, gelu, version, ln, eps, residual, rows, unroll)
    x = expect_array(x, "x", dtype=np.float32, ndim=2)
    W = expect_array(W, "W", dtype=np.float32, ndim=2, shape=(None, x.shape[1]))
    B, K = x.shape
    N = W.shape[0]
    if K % 4:
        raise ValueError(f"x: the GEMV reads float4s, K must be a multiple of 4, got {K}")
    if bias is not None:
        expect_array(bias, "bias", dtype=np.float32, shape=(N,))
    if residual and out is None:
        raise ValueError("out: residual=True adds into out (the residual stream); pass it")
    y = out_array(out, (B, N))
    version = expect_choice(5 if version is None else version, "version", GEMV_VERSIONS)
    if version != 5 and (ln is not None or residual):
        raise ValueError(f"version: ln= and residual= need version 5, got {version!r}")
    if gelu and bias is None:
        raise ValueError("gelu=True needs a bias (the fused epilogue is gelu(x @ W^T + bias))")
    b_arg = null_or(bias)
    epi = "EPI_RESID" if residual else "EPI_BIAS_GELU" if gelu else "EPI_BIAS" if bias is not None else "EPI_NONE"
    if version == 5:
        if residual and y.data.ptr == x.data.ptr:
            raise ValueError("out: residual=True updates out in place; it must not be x")
        if residual and gelu:
            raise ValueError("gelu: GELU and residual=True cannot be combined")
        if residual and bias is None:
            raise ValueError("bias: residual=True needs the projection bias")
        lw, lb, e = _ln_args(ln, K, eps)
        maxb = gemv_module(B)
        unroll = _v5_unroll(unroll, ln is not None, maxb)
        fn = kernel(f"gemv_v5<{epi}, {'false' if ln is None else 'true'}>", rows, unroll, maxb)
        step = _v5_rows_per_launch(fn, K, ln is not None, maxb)
        for b0 in range(0, B, step):
            nb = min(step, B - b0)
            _v5_call(fn, N, K, nb, ln is not None, (x[b0:b0 + nb], W, b_arg, y[b0:b0 + nb], np.int32(nb),
                                                    np.int32(N), np.int32(K), lw, lb, e, NULL, NULL, NULL,
                                                    np.int32(0), np.int32(0)), rows, unroll)
        return y
    if version in (1, 2):
        if gelu:
            raise ValueError("gelu=True needs version 3 or 4 (the fused epilogue)")
        if version == 1:       # a thread per output: any batch in one launch
            kernel("gemv_v1")(launch_grid(B * N, 128), (128,), (x, W, b_arg, y, np.int32(B), np.int32(N), np.int32(K)))
            return y
        for b0 in range(0, B, MAXB):
            nb = min(MAXB, B - b0)
            kernel("gemv_v2")(launch_grid(N * 32, 128), (128,), (x[b0:b0 + nb], W, b_arg, y[b0:b0 + nb],
                                                                 np.int32(nb), np.int32(N), np.int32(K)))
        return y
    grid, block = _v34_launch(version, N)
    for b0 in range(0, B, MAXB):
        nb = min(MAXB, B - b0)
        _launch(kernel(f"gemv_v{version}<{epi}>"), grid, block, (x[b0:b0 + nb], W, b_arg, y[b0:b0 + nb], np.int32(nb),
                                                                np.int32(N), np.int32(K), NULL, NULL, NULL,
                                                                np.int32(0), np.int32(0)))
    return y


def gemv_qkv(x, W, bias, q, k_cache, v_cache, pos, version=None, ln=None, eps: float = 1e-5, scale=None):
    """q (B, C) = first third of x @ W^T + b; k and v go into the caches (B, H, L, D) at row pos[b].
    version 5 (the default for float32 W) with ln=(weight, bias): x is LayerNorm-ed first, inside the same
    kernel. W uint16 (bf16 bits) or int8 with scale= (or a LowpWeight): version 6 / 7 or 8 / 9 (lowp_version), ln= too.
    pos (B,) int32 is read on the device (so the step is capturable) and not range-checked here:
    0 <= pos[b] < L is the caller's invariant (generate sizes the cache for every position it feeds)."""
    W, scale = _unpack(W, scale)
    if scale is not None or _dtype(W) in (np.uint16, np.int8) or version in GEMV_LOWP_VERSIONS:
        return _gemv_qkv_lowp(x, W, scale, bias, q, k_cache, v_cache, pos, version, ln, eps)
    version = 5 if version is None else version
    x = expect_array(x, "x", dtype=np.float32, ndim=2)
    B, K = x.shape
    W = expect_array(W, "W", dtype=np.float32, ndim=2, shape=(None, K))
    N = W.shape[0]
    if K % 4 or N % 3:
        raise ValueError(f"W: expected (3C, K) with K a multiple of 4 (float4 loads), got {W.shape}")
    C = N // 3
    expect_array(bias, "bias", dtype=np.float32, shape=(N,))
    expect_array(q, "q", dtype=np.float32, shape=(B, C))
    H, L, D = _check_caches(k_cache, v_cache, B, C)
    _index_vector(pos, "pos", B)
    expect_choice(version, "version", (3, 4, 5))
    if version == 5:
        lw, lb, e = _ln_args(ln, K, eps)
        maxb = gemv_module(B)
        unroll = _v5_unroll(None, ln is not None, maxb)
        fn = kernel(f"gemv_v5<EPI_QKV, {'false' if ln is None else 'true'}>", V5_ROWS, unroll, maxb)
        step = _v5_rows_per_launch(fn, K, ln is not None, maxb)
        for b0 in range(0, B, step):
            nb = min(step, B - b0)
            _v5_call(fn, N, K, nb, ln is not None,
                     (x[b0:b0 + nb], W, bias, q[b0:b0 + nb], np.int32(nb), np.int32(N), np.int32(K), lw, lb, e,
                      k_cache[b0:b0 + nb], v_cache[b0:b0 + nb], pos[b0:b0 + nb], np.int32(H), np.int32(L)),
                     V5_ROWS, unroll)
        return q
    if ln is not None:
        raise ValueError(f"version: ln= needs version 5, got {version!r}")
    grid, block = _v34_launch(version, N)
    for b0 in range(0, B, MAXB):
        nb = min(MAXB, B - b0)
        _launch(kernel(f"gemv_v{version}<EPI_QKV>"), grid, block,
                (x[b0:b0 + nb], W, bias, q[b0:b0 + nb], np.int32(nb), np.int32(N), np.int32(K), k_cache[b0:b0 + nb],
                 v_cache[b0:b0 + nb], pos[b0:b0 + nb], np.int32(H), np.int32(L)))
    return q


# ----------------------------------------------------------------------------- fewer bytes per weight
def lowp_defines(rows: int = V5_ROWS, unroll: int = V5_UNROLL, maxb: int = MAXB) -> dict:
    """gemv_lowp.cu's defines for v6/v7 and the prefill's kernels: v5's (rows, unroll; maxb: gemv_module)."""
    return {"MAXB": maxb, "ROWS": rows, "UNROLL": unroll, "MAXWARPS": V5_MAXWARPS}


def _tc_call(fn, N, K, nb, ln, kind, args):
    smem = tc_smem(K, nb, kind, ln)
    allow_dynamic_smem(fn, smem, f"ln / batch: {nb} row(s) of x with K={K} in shared memory")
    per_sm = max(1, min(TC_BLOCKS_PER_SM, _resident(fn, 32 * TC_WARPS, smem)))
    _launch(fn, launch_grid(N, TC_ROWS, per_sm=per_sm), (32 * TC_WARPS,), args, smem)


def lowp_kernel(name: str, rows: int = V5_ROWS, unroll: int = V5_UNROLL, maxb: int = MAXB):
    """Kernel `name` of gemv_lowp.cu, e.g. "gemv_v7<EPI_BIAS, true>" or "dequant_bf16_v1" (cached). v8/v9 come
    from a module of their own (tc_defines), the rest from one per (rows, unroll, maxb)."""
    if name in LOWP_TC_NAMES:
        return get_kernel(LOWP_CU, name, tc_defines(maxb), templates=LOWP_TC_NAMES)
    return get_kernel(LOWP_CU, name, lowp_defines(rows, unroll, maxb), templates=LOWP_CUDA_CORE_NAMES)


def _dtype(W):
    return getattr(W, "dtype", None)


def _unpack(W, scale):
    """(W, scale) from a quantize.LowpWeight or from the two arguments."""
    if isinstance(W, LowpWeight):
        if scale is not None:
            raise ValueError("scale: W is a LowpWeight, which carries its own scale; pass scale=None")
        return W.w, W.scale
    return W, scale


def lowp_format(dtype, K: int, has_scale: bool, version=None) -> tuple[str, int]:
    """(kind, version) of a bf16/int8 weight of `dtype` read with rows of K weights; a named error for another dtype,
    a scale misplaced or missing, K not whole 16-byte loads, or a version for another format (CPU-testable)."""
    kind = KIND_OF_DTYPE.get(np.dtype(dtype) if dtype is not None else None)
    if kind in (None, "fp32"):
        reads = {v: k for table in (LOWP_VERSION, TC_VERSION) for k, v in table.items()}.get(version)
        want = {"bf16": "uint16 (bf16 bit patterns)", "int8": "int8"}.get(reads, "uint16 (bf16 bits) or int8")
        why = f"version {version} reads" if version in GEMV_LOWP_VERSIONS else "scale= is for"
        raise TypeError(f"W: {why} {want} weights, got dtype {np.dtype(dtype) if dtype is not None else None}")
    if kind == "int8" and not has_scale:
        raise ValueError("scale: int8 weights need their (N,) float32 row scales (quantize.quantize_int8)")
    if kind == "bf16" and has_scale:
        raise ValueError("scale: only int8 weights take row scales; W is bf16 (uint16)")
    per = LOWP_PER_LOAD[kind]
    if K % per:
        raise ValueError(f"W: {kind} weights are read 16 bytes ({per} weights) at a time, so K must be a multiple "
                         f"of {per}, got K={K}")
    want = (LOWP_VERSION[kind], TC_VERSION[kind])
    if version is None:
        return kind, want[0]
    if version not in want:
        expect_choice(version, "version", GEMV_VERSIONS + GEMV_LOWP_VERSIONS)
        raise ValueError(f"version: {kind} weights are read by version {want[0]} (gemv_v{want[0]}) or {want[1]} "
                         f"(gemv_v{want[1]}, tensor cores), got {version!r}")
    return kind, version


def lowp_version(kind: str, B: int, K: int, *, rows: int = V5_ROWS, unroll: int | None = None) -> int:
    """The GEMV for B rows of K bf16/int8 weights given no version: v8/v9 (tensor cores; 8 warps share a tile) from
    2 rows on and at 1 row where v6/v7's block would be one warp at V5_UNROLL, if the GPU has them; else v6/v7."""
    tc = _switch["tensor_cores"] and rows == V5_ROWS and unroll in (None, V5_UNROLL) and \
        (B > 1 or _v5_warps(K, V5_UNROLL, LOWP_PER_LOAD[kind]) == 1)
    return TC_VERSION[kind] if tc and device_info()["sm"] >= TC_ARCH[kind] else LOWP_VERSION[kind]


def _lowp_weight(W, scale, K: int, version, B: int = 1, rows: int = V5_ROWS, unroll: int | None = None):
    """Check a bf16/int8 weight (N, K) and its scale: (kind, version, N, scale); no version: lowp_version's."""
    kind, picked = lowp_format(_dtype(W), K, scale is not None, version)
    version = picked if version is not None else lowp_version(kind, B, K, rows=rows, unroll=unroll)
    W = expect_array(W, "W", dtype=(np.uint16, np.int8), ndim=2, shape=(None, K))
    N = W.shape[0]
    if scale is not None:
        scale = expect_array(scale, "scale", dtype=np.float32, shape=(N,))
    return kind, version, N, scale


def _gemv_lowp(x, W, scale, bias, out, gelu, version, ln, eps, residual, rows, unroll):
    """gemv() for bf16 / int8 weights: gemv_v6 / v7 or v8 / v9, with every v5 fusion."""
    x = expect_array(x, "x", dtype=np.float32, ndim=2)
    B, K = x.shape
    kind, version, N, scale = _lowp_weight(W, scale, K, version, B, rows, unroll)
    if bias is not None:
        expect_array(bias, "bias", dtype=np.float32, shape=(N,))
    if residual and out is None:
        raise ValueError("out: residual=True adds into out (the residual stream); pass it")
    y = out_array(out, (B, N))
    if gelu and bias is None:
        raise ValueError("gelu=True needs a bias (the fused epilogue is gelu(x @ W^T + bias))")
    if residual and (gelu or bias is None or y.data.ptr == x.data.ptr):
        raise ValueError("residual: out += x @ W^T + bias needs a bias, no GELU, and out other than x")
    epi = "EPI_RESID" if residual else "EPI_BIAS_GELU" if gelu else "EPI_BIAS" if bias is not None else "EPI_NONE"
    lw, lb, e = _ln_args(ln, K, eps)
    step, launch = _lowp_launcher(kind, version, epi, N, K, ln is not None, gemv_module(B), rows, unroll)
    head = (scale,) if kind == "int8" else ()            # gemv_v7/v9 take the scales after W
    for b0 in range(0, B, step):
        nb = min(step, B - b0)
        launch(nb, (x[b0:b0 + nb], W, *head, null_or(bias), y[b0:b0 + nb], np.int32(nb),
                    np.int32(N), np.int32(K), lw, lb, e, NULL, NULL, NULL, np.int32(0), np.int32(0)))
    return y


def _lowp_launcher(kind, version, epi, N, K, ln: bool, maxb, rows=V5_ROWS, unroll=None):
    """(batch rows per launch, launch(nb, args)) of gemv_v{version}<epi, ln>: v6/v7 as v5, v8/v9 (_tc_call)."""
    tc = version in TC_VERSION.values()
    if tc and device_info()["sm"] < TC_ARCH[kind]:
        raise ValueError(f"version: gemv_v{version} runs {kind} weights on tensor cores, which needs sm_{TC_ARCH[kind]}; "
                         f"this GPU is sm_{device_info()['sm']} (version {LOWP_VERSION[kind]} runs everywhere)")
    if tc and (rows != V5_ROWS or unroll not in (None, V5_UNROLL)):
        raise ValueError(f"rows/unroll: v6/v7's launch shape, not gemv_v{version}'s; got rows={rows}, unroll={unroll}")
    unroll = _v5_unroll(unroll, ln, maxb, LOWP_PER_LOAD[kind])                      # v8/v9's module: no unroll
    fn = lowp_kernel(f"gemv_v{version}<{epi}, {'true' if ln else 'false'}>", rows, unroll, maxb)
    if not tc:
        return (_v5_rows_per_launch(fn, K, ln, maxb),
                lambda nb, args: _v5_call(fn, N, K, nb, ln, args, rows, unroll, LOWP_PER_LOAD[kind]))
    per_row, room = tc_smem(K, 1, kind, ln), device_info()["shared_per_block_optin"] - fn.shared_size_bytes
    if per_row > room:                                                             # x's rows must fit
        raise ValueError(f"K: gemv_v{version} stages x in shared memory, {per_row:,} B for a row of "
                         f"K={K}; this GPU has {room:,} B (version {LOWP_VERSION[kind]} needs none without ln)")
    return min(maxb, room // per_row), lambda nb, args: _tc_call(fn, N, K, nb, ln, kind, args)


def _gemv_qkv_lowp(x, W, scale, bias, q, k_cache, v_cache, pos, version, ln, eps):
    """gemv_qkv() for bf16 / int8 weights (gemv_v6 / v7 or v8 / v9 with the EPI_QKV epilogue)."""
    x = expect_array(x, "x", dtype=np.float32, ndim=2)
    B, K = x.shape
    kind, version, N, scale = _lowp_weight(W, scale, K, version, B)
    if N % 3:
        raise ValueError(f"W: expected (3C, K), got {W.shape} ({N} rows, not a multiple of 3)")
    C = N // 3
    expect_array(bias, "bias", dtype=np.float32, shape=(N,))
    expect_array(q, "q", dtype=np.float32, shape=(B, C))
    H, L, D = _check_caches(k_cache, v_cache, B, C)
    _index_vector(pos, "pos", B)
    lw, lb, e = _ln_args(ln, K, eps)
    step, launch = _lowp_launcher(kind, version, "EPI_QKV", N, K, ln is not None, gemv_module(B))
    head = (scale,) if kind == "int8" else ()
    for b0 in range(0, B, step):
        nb = min(step, B - b0)
        launch(nb, (x[b0:b0 + nb], W, *head, bias, q[b0:b0 + nb], np.int32(nb), np.int32(N), np.int32(K), lw, lb, e,
                    k_cache[b0:b0 + nb], v_cache[b0:b0 + nb], pos[b0:b0 + nb], np.int32(H), np.int32(L)))
    return q


def dequantize(W, scale=None, out=None):
    """W (N, K) bf16 bits or int8 (with its (N,) scale) widened to float32 (N, K) on the GPU, one kernel."""
    W, scale = _unpack(W, scale)
    if getattr(W, "ndim", None) != 2:
        raise ValueError(f"W: expected an (N, K) matrix of uint16 (bf16 bits) or int8, got "
                         f"{getattr(W, 'shape', type(W).__name__)}")
    K = W.shape[1]
    kind, _, N, scale = _lowp_weight(W, scale, K, None)
    y = out_array(out, (N, K), name="out")
    nvec = N * K // LOWP_PER_LOAD[kind]
    grid = launch_grid(max(nvec, 1), 256, per_sm=8)
    if kind == "bf16":
        lowp_kernel("dequant_bf16_v1")(grid, (256,), (W, y, np.int64(nvec)))
    else:
        lowp_kernel("dequant_int8_v1")(grid, (256,), (W, scale, y, np.int64(nvec), np.int32(K)))
    return y


def matmul_lowp(x, W, scale=None, out=None):
    """y (M, N) = x (M, K) @ W^T for a bf16 (uint16 bits) or int8 (+ scale) weight W (N, K), or a LowpWeight: the
    prefill's products. `dequantize` widens W to a float32 scratch matrix, then cuBLAS multiplies (cupy.matmul):
    per prompt of M tokens, (1 or 2 read + 4 written) / M bytes per weight per token more than an fp32 prefill."""
    import cupy as cp
    W, scale = _unpack(W, scale)
    x = expect_array(x, "x", dtype=np.float32, ndim=2)
    M, K = x.shape
    if _dtype(W) == np.float32 and scale is None:
        W = expect_array(W, "W", dtype=np.float32, ndim=2, shape=(None, K))
        y = out_array(out, (M, W.shape[0]))
        return cp.matmul(x, W.T, out=y)
    _, _, N, scale = _lowp_weight(W, scale, K, None)
    y = out_array(out, (M, N))
    return cp.matmul(x, dequantize(W, scale).T, out=y)


# ----------------------------------------------------------------------------- choosing a token
def argmax(logits, tokens, pos=None, lens=None):
    """tokens[b] = argmax(logits[b]) (first index on ties); with pos/lens, also advance both by one.
    logits (B, V) float32; tokens, pos, lens int32 (B,)."""
    logits = expect_array(logits, "logits", dtype=np.float32, ndim=2)
    B, V = logits.shape
    _index_vector(tokens, "tokens", B)
    if (pos is None) != (lens is None):
        raise ValueError("pos, lens: pass both (advance them with the argmax) or neither")
    adv = pos is not None
    if adv:
        _index_vector(pos, "pos", B)
        _index_vector(lens, "lens", B)
    _launch(kernel("argmax_v2"), (B,), (1024,), (logits, np.int32(V), tokens, pos if adv else tokens,
                                                 lens if adv else tokens, np.int32(adv)))
    return tokens


def advance(pos, lens):
    """pos += 1, lens += 1 on the device (int32 (B,) each; after a token sampled outside the graph)."""
    pos = expect_array(pos, "pos", dtype=np.int32, ndim=1)
    _index_vector(lens, "lens", pos.size)
    if pos.size > 1024:
        raise ValueError(f"pos: advance_v1 is one block of at most 1024 threads, got {pos.size} sequences")
    _launch(kernel("advance_v1"), (1,), (max(32, -(-pos.size // 32) * 32),), (pos, lens, np.int32(pos.size)))


# Every kernel name the wrappers above can ask gpt2.cu for (a CPU test compiles each one offline).
KERNEL_NAMES = (
    "embedding_v1", "embedding_v2", "bias_gelu_v1", "bias_gelu_v2", "kv_cache_fill_v1", "gemv_v1", "gemv_v2",
    "argmax_v1", "argmax_v2", "advance_v1",
    *(f"gemv_v{v}<{e}>" for v in (3, 4) for e in ("EPI_NONE", "EPI_BIAS", "EPI_BIAS_GELU", "EPI_QKV")),
    *(f"gemv_v5<{e}, {ln}>" for e in ("EPI_NONE", "EPI_BIAS", "EPI_BIAS_GELU", "EPI_RESID", "EPI_QKV")
      for ln in ("false", "true")))

# gpt2.cu's constants and template instantiations: kernel() compiles every instantiation in one module
# (get_kernel(..., templates=)), and tests/test_compile.py compiles the same offline for every arch.
# gemv_lowp.cu's: gemv_v6/v8 (bf16) and gemv_v7/v9 (int8) with v5's epilogues and prologue, the prefill's widening.
LOWP_KERNEL_NAMES = ("dequant_bf16_v1", "dequant_int8_v1",
                     *(f"gemv_v{v}<{e}, {ln}>" for v in GEMV_LOWP_VERSIONS
                       for e in ("EPI_NONE", "EPI_BIAS", "EPI_BIAS_GELU", "EPI_RESID", "EPI_QKV")
                       for ln in ("false", "true")))
LOWP_TC_NAMES = tuple(n for n in LOWP_KERNEL_NAMES if n.startswith(tuple(f"gemv_v{v}<" for v in TC_VERSION.values())))
LOWP_CUDA_CORE_NAMES = tuple(n for n in LOWP_KERNEL_NAMES if "<" in n and n not in LOWP_TC_NAMES)
CU_DEFINES = {CU: defines(ROWS, V5_UNROLL), LOWP_CU: {**lowp_defines(), **tc_defines(MAXB)}}   # MAXB 8 (tests: MAXB 1 too)
CU_TEMPLATES = {CU: tuple(n for n in KERNEL_NAMES if "<" in n),
                LOWP_CU: tuple(n for n in LOWP_KERNEL_NAMES if "<" in n)}

__all__ = ["embedding", "bias_gelu", "kv_cache_fill", "gemv", "gemv_qkv", "argmax", "advance", "layernorm",
           "residual_layernorm", "flash_attention_qkv", "decode_attention", "decode_split_count", "kernel",
           "defines", "KERNEL_NAMES", "matmul_lowp", "dequantize", "lowp_format", "lowp_kernel", "lowp_defines",
           "LOWP_KERNEL_NAMES", "GEMV_LOWP_VERSIONS", "programmatic", "tensor_cores", "lowp_version", "gemv_module"]
