"""GPT-2 on the course's own kernels, top to bottom (after nanoGPT's model.py).

    x = wte[idx] + wpe[pos]                                  embedding_v2            (gpt2.cu)
    for each block:
        a = ln_1(x)                                          layernorm / fused below (step 3)
        q, k, v = a @ W_attn + b_attn                        cuBLAS; bias folded into attention
        y = softmax(q k^T / sqrt(D), causal) v               flash_attention_qkv     (step 2)
        x, a = x + y @ W_proj + b_proj, ln_2(...)            residual_layernorm      (step 3)
        h = gelu(a @ W_fc + b_fc)                            cuBLAS + bias_gelu_v2   (gpt2.cu)
        x, a = x + h @ W_mproj + b_mproj, ln_1'(...)         residual_layernorm: the next block's ln_1
    logits = ln_f(x) @ wte^T                                 tied LM head

Two ways through the model:
- `forward(idx)`: a whole prompt (prefill) with cuBLAS GEMMs and flash attention; with a KVCache it also
  stores every position's k and v.
- `decode_step(state)`: one new token per sequence against the KV cache. At batch <= 8 every matrix
  product is a GEMV reading each weight once. Two plans (`GPT.plan_for`): at batch <= 2 "fused" (gemv_v5,
  LayerNorm fused into the GEMV that reads its output, bias + residual into the projections: a block is
  5 launches); above it "split" (gemv_v4, LayerNorm done once per row by step 3's kernels: 7 launches,
  but no block re-normalises all B rows). The attention is step 2's decode_attention (v1 while the
  cache is short, v2 when long: `GPT.attention_version_for`) and positions are read on the device: the
  whole step is our own kernels with preallocated buffers, so generate.py can capture it in CUDA graphs.
Weights live on the GPU once, Conv1D matrices transposed to (out, in) so a GEMV reads each output's
weights contiguously; cuBLAS reads the same array transposed (no copy) for the prefill.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from common import allow_dynamic_smem, device_info, expect_array, get_kernel
from step4_gpt2.weights import GPTConfig   # n_layer, n_head, n_embd, vocab_size, block_size  # noqa: F401

HERE = Path(__file__).resolve().parent
MAXB = 8           # batch rows per GEMV launch (gpt2.cu MAXB)
ROWS = 2           # output rows per warp (v3) / per block (v4)
V5_ROWS = 4        # gemv_v5: rows per block (4 beat 1 and 2 on 4 of the 5 GPT-2 shapes at batch 1: H200,
                   # 2026-11-21; at batch 8 it is slower than v4, see docs/gpt2.md)
GEMV_THREADS = 128  # gemv_v3: 4 warps, each its own ROWS rows
V4_WARPS = 4       # gemv_v4: 4 warps share ROWS rows, splitting K
V5_UNROLL = 4      # gemv_v5: float4 loads per row in flight per lane
V5_BLOCKS_PER_SM = 16   # gemv_v5: grid cap; bigger matrices (the LM head) loop over row tiles
V5_LN_BLOCKS_PER_SM = 4  # ... with a LayerNorm prologue over > 2 rows: fewer blocks, each normalising once
FUSED_MAX_BATCH = 2      # decode plan "fused" (v5 + LayerNorm prologue) up to this batch, "split" above it
ATTN_V1_MAX_LEN = 128    # step 2's decode_attention v1 beats v2 up to ~128 cached rows (H200, 2026-11-21)


# ----------------------------------------------------------------------------- the kernels of gpt2.cu
def _fn(name: str, rows: int = ROWS, unroll: int = V5_UNROLL):
    return get_kernel(HERE / "gpt2.cu", name, {"MAXB": MAXB, "ROWS": rows, "V4_WARPS": V4_WARPS,
                                               "V5_UNROLL": unroll})


def _index_vector(a, name: str, n: int):
    """An int32 (n,) index vector on the GPU (token ids, positions, lengths: read by the kernels as int*)."""
    return expect_array(a, name, dtype=np.int32, shape=(n,))


def embedding(tokens, positions, wte, wpe, out):
    """out[i] = wte[tokens[i]] + wpe[positions[i]]; tokens, positions int32 (n,), out (n, C). The ids are
    not range-checked here (that needs a host sync, and the decode step reads them on the device):
    GPT.check_tokens checks prompts, and every later id comes from the model's own argmax or sampler."""
    out = expect_array(out, "out", dtype=np.float32, ndim=2)
    n, C = out.shape
    wte = expect_array(wte, "wte", dtype=np.float32, shape=(None, C))
    expect_array(wpe, "wpe", dtype=np.float32, shape=(None, C))
    _index_vector(tokens, "tokens", n)
    _index_vector(positions, "positions", n)
    _fn("embedding_v2" if C % 4 == 0 else "embedding_v1")((n,), (min(256, max(32, C // 4)),),
                                                         (tokens, positions, wte, wpe, out, np.int32(n), np.int32(C)))
    return out


def bias_gelu(h, b):
    """h = gelu_tanh(h + b) in place; h (N, C), b (C,)."""
    h = expect_array(h, "h", dtype=np.float32, ndim=2)
    b = expect_array(b, "b", dtype=np.float32, shape=(h.shape[1],))
    total, C = h.size, h.shape[1]
    if C % 4 == 0:
        _fn("bias_gelu_v2")((min(-(-total // 1024), 65535),), (256,), (h, b, np.int64(total), np.int32(C)))
    else:
        _fn("bias_gelu_v1")((-(-total // 256),), (256,), (h, b, np.int64(total), np.int32(C)))
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
    _fn("kv_cache_fill_v1")((B * T,), (128,), (qkv, bias, k_cache, v_cache, np.int32(B), np.int32(T),
                                               np.int32(H), np.int32(D), np.int32(L)))


def _gemv_launch(version: int, N: int):
    """(grid, block) of gemv_v3 (a warp per ROWS rows) or gemv_v4 (a block per ROWS rows)."""
    if version == 3:
        return (-(-N // (ROWS * GEMV_THREADS // 32)),), (GEMV_THREADS,)
    return (-(-N // ROWS),), (32 * V4_WARPS,)


def _v5_launch(N: int, K: int, nb: int, ln: bool, rows: int = V5_ROWS, unroll: int = V5_UNROLL,
               blocks_per_sm: int = V5_BLOCKS_PER_SM):
    """(grid, block, shared bytes) of gemv_v5: the fewest warps (<= 8) whose lanes cover a row with
    `unroll` float4s each, one block per ROWS-row tile up to blocks_per_sm per SM (then blocks loop),
    fewer when this GPU's threads, shared memory or block slots per SM cannot hold that many."""
    d = device_info()
    warps = min(8, max(1, -(-(K // 4) // (32 * unroll))))
    smem = nb * K * 4 if ln else 0
    if ln and nb > 2:      # every block re-reads and normalises all nb rows: amortise it over more tiles
        blocks_per_sm = min(blocks_per_sm, V5_LN_BLOCKS_PER_SM)
    fit = min(d["max_blocks_per_sm"], d["max_threads_per_sm"] // (32 * warps))
    if smem:               # the CUDA runtime reserves 1 KB of shared memory per block
        fit = min(fit, d["shared_per_sm"] // (smem + 1024))
    per_sm = max(1, min(blocks_per_sm, fit))
    return (min(-(-N // rows), d["multiprocessors"] * per_sm),), (32 * warps,), smem


def _v5_rows_per_launch(fn, K: int, ln: bool) -> int:
    """Batch rows per launch of gemv_v5 kernel fn: MAXB, or with the LayerNorm prologue (nb rows x K floats
    in shared memory) as many as this GPU's per-block opt-in limit holds next to fn's static shared memory
    (a T4's 64 KB: 3 rows of K=4100). GPT-2's decode (K=768, batch <= 8) always fits in one launch."""
    if not ln:
        return MAXB
    room = device_info()["shared_per_block_optin"] - fn.shared_size_bytes
    return max(1, min(MAXB, room // (4 * K)))


def _v5_call(name, N, K, nb, ln, args, rows=V5_ROWS, unroll=V5_UNROLL, blocks_per_sm=V5_BLOCKS_PER_SM):
    grid, block, smem = _v5_launch(N, K, nb, ln, rows, unroll, blocks_per_sm)
    fn = _fn(name, rows, unroll)
    allow_dynamic_smem(fn, smem, f"ln: the LayerNorm prologue's {nb} row(s) x {K} floats in shared memory")
    fn(grid, block, args, shared_mem=smem)


def _ln_args(ln, K: int, eps: float):
    """(weight, bias, eps) for the LayerNorm prologue, or null pointers without one."""
    if ln is None:
        return np.uint64(0), np.uint64(0), np.float32(eps)
    w = expect_array(ln[0], "ln[0] (weight)", dtype=np.float32, shape=(K,))
    b = expect_array(ln[1], "ln[1] (bias)", dtype=np.float32, shape=(K,))
    return w, b, np.float32(eps)


def gemv(x, W, bias=None, out=None, gelu=False, version=None, ln=None, eps: float = 1e-5,
         residual: bool = False, rows: int = V5_ROWS, unroll: int = V5_UNROLL):
    """y (B, N) = x (B, K) @ W^T (+ bias, then GELU) with W (N, K); any B (chunks of MAXB rows).
    version None = 5. Only v5 has the other fusions:
      ln=(weight, bias): x is replaced by LayerNorm(x) first (each block normalises it in shared memory);
      residual=True: out += x @ W^T + bias, in place (out is the residual stream, required).
    rows/unroll: v5's ROWS and V5_UNROLL (a module compiled per pair; for the benchmarks)."""
    import cupy as cp
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
    y = cp.empty((B, N), cp.float32) if out is None else expect_array(out, "out", dtype=np.float32, shape=(B, N))
    if version is None:
        version = 5
    if version != 5 and (ln is not None or residual):
        raise ValueError(f"version: ln= and residual= need version 5, got {version!r}")
    if version == 5:
        if residual and y.data.ptr == x.data.ptr:
            raise ValueError("out: residual=True updates out in place; it must not be x")
        if residual and gelu:
            raise ValueError("gelu: GELU and residual=True cannot be combined")
        lw, lb, e = _ln_args(ln, K, eps)
        name = ("gemv_resid_v5" if residual else
                "gemv" + ("_ln" if ln is not None else "") + ("_bias" if bias is not None else "")
                + ("_gelu" if gelu else "") + "_v5")
        if gelu and bias is None:
            raise ValueError("gelu=True needs a bias (the fused epilogue is gelu(x @ W^T + bias))")
        if residual and bias is None:
            raise ValueError("bias: residual=True needs the projection bias")
        step = _v5_rows_per_launch(_fn(name, rows, unroll), K, ln is not None)
        for b0 in range(0, B, step):
            nb = min(step, B - b0)
            _v5_call(name, N, K, nb, ln is not None,
                     (x[b0:b0 + nb], W, bias if bias is not None else np.uint64(0), y[b0:b0 + nb], np.int32(nb),
                      np.int32(N), np.int32(K), lw, lb, e), rows, unroll)
        return y
    if version in (1, 2):
        if gelu:
            raise ValueError("gelu=True needs version 3 or 4 (the fused epilogue)")
        b_arg = bias if bias is not None else np.uint64(0)
        if version == 1:       # a thread per output: any batch in one launch
            _fn("gemv_v1")((-(-B * N // 128),), (128,), (x, W, b_arg, y, np.int32(B), np.int32(N), np.int32(K)))
            return y
        for b0 in range(0, B, MAXB):
            nb = min(MAXB, B - b0)
            _fn("gemv_v2")((-(-N * 32 // 128),), (128,), (x[b0:b0 + nb], W, b_arg, y[b0:b0 + nb], np.int32(nb),
                                                         np.int32(N), np.int32(K)))
        return y
    if version not in (3, 4):
        raise ValueError(f"version: expected 1, 2, 3, 4 or 5, got {version!r}")
    grid, block = _gemv_launch(version, N)
    for b0 in range(0, B, MAXB):
        nb = min(MAXB, B - b0)
        xs, ys = x[b0:b0 + nb], y[b0:b0 + nb]
        if bias is None:
            _fn(f"gemv_v{version}")(grid, block, (xs, W, ys, np.int32(nb), np.int32(N), np.int32(K)))
        else:
            _fn(f"gemv_bias_gelu_v{version}" if gelu else f"gemv_bias_v{version}")(
                grid, block, (xs, W, bias, ys, np.int32(nb), np.int32(N), np.int32(K)))
    return y


def gemv_qkv(x, W, bias, q, k_cache, v_cache, pos, version=5, ln=None, eps: float = 1e-5):
    """q (B, C) = first third of x @ W^T + b; k and v go into the caches (B, H, L, D) at row pos[b].
    version 5 with ln=(weight, bias): x is LayerNorm-ed first, inside the same kernel.
    pos (B,) int32 is read on the device (so the step is capturable) and not range-checked here:
    0 <= pos[b] < L is the caller's invariant (generate sizes the cache for every position it feeds)."""
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
    if version not in (3, 4, 5):
        raise ValueError(f"version: expected 3, 4 or 5, got {version!r}")
    if version == 5:
        lw, lb, e = _ln_args(ln, K, eps)
        name = "gemv_ln_qkv_v5" if ln is not None else "gemv_qkv_v5"
        step = _v5_rows_per_launch(_fn(name, V5_ROWS), K, ln is not None)
        for b0 in range(0, B, step):
            nb = min(step, B - b0)
            _v5_call(name, N, K, nb, ln is not None,
                     (x[b0:b0 + nb], W, bias, q[b0:b0 + nb], np.int32(nb), np.int32(N), np.int32(K), lw, lb, e,
                      k_cache[b0:b0 + nb], v_cache[b0:b0 + nb], pos[b0:b0 + nb], np.int32(H), np.int32(L)))
        return q
    if ln is not None:
        raise ValueError(f"version: ln= needs version 5, got {version!r}")
    grid, block = _gemv_launch(version, N)
    for b0 in range(0, B, MAXB):
        nb = min(MAXB, B - b0)
        _fn(f"gemv_qkv_v{version}")(grid, block, (x[b0:b0 + nb], W, bias, q[b0:b0 + nb], k_cache[b0:b0 + nb],
                                                   v_cache[b0:b0 + nb], pos[b0:b0 + nb], np.int32(nb),
                                                   np.int32(N), np.int32(K), np.int32(H), np.int32(L)))
    return q


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
    _fn("argmax_v1")((B,), (1024,), (logits, np.int32(V), tokens, pos if adv else tokens,
                                     lens if adv else tokens, np.int32(adv)))
    return tokens


def advance(pos, lens):
    """pos += 1, lens += 1 on the device (int32 (B,) each; after a token sampled outside the graph)."""
    pos = expect_array(pos, "pos", dtype=np.int32, ndim=1)
    _index_vector(lens, "lens", pos.size)
    if pos.size > 1024:
        raise ValueError(f"pos: advance_v1 is one block of at most 1024 threads, got {pos.size} sequences")
    _fn("advance_v1")((1,), (max(32, -(-pos.size // 32) * 32),), (pos, lens, np.int32(pos.size)))


# ----------------------------------------------------------------------------- the model
class Block:
    """One transformer block's weights on the GPU. Matrices are (out, in) = HF Conv1D weight transposed."""

    def __init__(self, params: dict, i: int):
        import cupy as cp
        g = lambda name: cp.asarray(params[f"h.{i}.{name}"], dtype=cp.float32)           # noqa: E731
        gt = lambda name: cp.ascontiguousarray(g(name).T)                                  # noqa: E731
        self.ln_1 = (g("ln_1.weight"), g("ln_1.bias"))
        self.c_attn, self.c_attn_b = gt("attn.c_attn.weight"), g("attn.c_attn.bias")     # (3C, C)
        self.c_proj, self.c_proj_b = gt("attn.c_proj.weight"), g("attn.c_proj.bias")     # (C, C)
        self.ln_2 = (g("ln_2.weight"), g("ln_2.bias"))
        self.c_fc, self.c_fc_b = gt("mlp.c_fc.weight"), g("mlp.c_fc.bias")               # (4C, C)
        self.mlp_proj, self.mlp_proj_b = gt("mlp.c_proj.weight"), g("mlp.c_proj.bias")   # (C, 4C)


class KVCache:
    """Keys and values of every layer, preallocated: (B, H, L, D) each, L = the longest sequence needed."""

    def __init__(self, config: GPTConfig, batch: int, length: int):
        import cupy as cp
        if not 1 <= length <= config.block_size:
            raise ValueError(f"length: the KV cache holds 1 .. block_size={config.block_size} positions, got {length}")
        shape = (batch, config.n_head, length, config.head_dim)
        self.k = [cp.empty(shape, cp.float32) for _ in range(config.n_layer)]
        self.v = [cp.empty(shape, cp.float32) for _ in range(config.n_layer)]
        self.length = length

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)


class DecodeState:
    """Every buffer one decode step touches, allocated once (a CUDA graph replays fixed addresses).

    tokens (B,): the token to feed; pos (B,): its position = rows already in the cache; lens = pos + 1."""

    def __init__(self, config: GPTConfig, batch: int, length: int):
        import cupy as cp
        C, B = config.n_embd, batch
        self.cache = KVCache(config, B, length)
        self.tokens = cp.zeros(B, cp.int32)
        self.pos = cp.zeros(B, cp.int32)
        self.lens = cp.ones(B, cp.int32)
        self.x, self.q, self.att = (cp.empty((B, C), cp.float32) for _ in range(3))
        self.a, self.y = cp.empty((B, C), cp.float32), cp.empty((B, C), cp.float32)   # "split" plan: ln out, proj out
        self.h = cp.empty((B, 4 * C), cp.float32)
        self.logits = cp.empty((B, config.vocab_size), cp.float32)
        self.batch = B


class GPT:
    decode_attention_version = 2     # step 2's decode_attention: 1 = one launch, 2 = split-K + combine
    attention_v1_max_len = ATTN_V1_MAX_LEN   # ... but v1 while the longest sequence has <= this many rows
    decode_plan = None               # None: plan_for(batch) picks "fused" (B <= FUSED_MAX_BATCH) or "split"
    keep_graphs = True               # generate() keeps the decode state + CUDA graphs for the next call

    def __init__(self, config: GPTConfig, params: dict):
        import cupy as cp
        from step4_gpt2.weights import validate
        if config.n_embd % config.n_head:
            raise ValueError(f"config: n_embd={config.n_embd} is not a multiple of n_head={config.n_head}")
        if config.head_dim not in (32, 64):
            raise ValueError(f"config: head_dim={config.head_dim}; the step-2 attention kernels support 32 and 64")
        validate(params, config)
        self.config = config
        self.wte = cp.asarray(params["wte.weight"], dtype=cp.float32)     # (V, C): also the LM head, (out, in)
        self.wpe = cp.asarray(params["wpe.weight"], dtype=cp.float32)
        self.h = [Block(params, i) for i in range(config.n_layer)]
        self.ln_f = (cp.asarray(params["ln_f.weight"], dtype=cp.float32), cp.asarray(params["ln_f.bias"], dtype=cp.float32))
        _fn("gemv_v5", V5_ROWS)    # compile gpt2.cu now (both plans' modules), not inside a graph capture
        _fn("gemv_v4")
        self._decode_cache = None  # generate(): (key, DecodeState, {(plan, attn version): graph}, warmed plans)

    @classmethod
    def from_file(cls, path) -> "GPT":
        from step4_gpt2.weights import load_file
        return cls(*load_file(path))

    def n_params(self) -> int:
        return self.config.n_params()

    def weight_bytes_per_token(self) -> int:
        """Bytes a decode step must read (GPTConfig.weight_bytes_per_token: every weight once, fp32)."""
        return self.config.weight_bytes_per_token()

    def _ln_after(self, i: int):
        """The LayerNorm that follows block i's residual: the next block's ln_1, or ln_f after the last."""
        return self.h[i + 1].ln_1 if i + 1 < len(self.h) else self.ln_f

    def check_tokens(self, idx, name: str = "idx"):
        """(B, T) int32 token ids on the GPU, in range; T between 1 and block_size."""
        import cupy as cp
        if isinstance(idx, np.ndarray) or isinstance(idx, (list, tuple)):
            idx = cp.asarray(np.asarray(idx))
        idx = expect_array(idx, name, contiguous=False)
        if idx.ndim == 1:
            idx = idx[None]
        if idx.ndim != 2 or idx.dtype.kind not in "iu":
            raise ValueError(f"{name}: expected integer token ids of shape (B, T), got {idx.dtype} {idx.shape}")
        B, T = idx.shape
        if T == 0 or B == 0:
            raise ValueError(f"{name}: empty prompt (shape {idx.shape}); give at least one token per sequence")
        if T > self.config.block_size:
            raise ValueError(f"{name}: {T} tokens exceed the context length block_size={self.config.block_size}")
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name}: token id {bad} is out of range [0, {self.config.vocab_size})")
        return cp.ascontiguousarray(idx, dtype=cp.int32)

    @staticmethod
    def _check_last(last, B: int, T: int):
        """`last` as int64 positions (B,) on the GPU, each in [0, T): CuPy would wrap an out-of-range
        fancy index silently (last=T would read position 0), so it is checked here, on the host."""
        import cupy as cp
        host = np.asarray(last.get() if isinstance(last, cp.ndarray) else last)
        if host.shape != (B,) or (host.size and host.dtype.kind not in "iu"):
            raise ValueError(f"last: expected one integer position per sequence, shape ({B},), "
                             f"got {host.dtype} {host.shape}")
        if host.size and (host.min() < 0 or host.max() >= T):
            bad = int(host.min()) if host.min() < 0 else int(host.max())
            raise ValueError(f"last: position {bad} is out of range [0, {T}) for prompts of T={T} tokens")
        return cp.asarray(host.astype(np.int64))

    # ------------------------------------------------------------------ prefill: a whole prompt at once
    def forward(self, idx, cache: KVCache | None = None, last=None):
        """Logits for token ids idx (B, T): (B, T, V), or with `last` (B,) the logits at position
        last[b] only, (B, V). With a cache, every layer's k and v are stored at rows 0..T-1."""
        import cupy as cp
        from step2_attention.flash import flash_attention_qkv
        from step3_fused.ops import layernorm, residual_layernorm
        cfg = self.config
        idx = self.check_tokens(idx)
        B, T = idx.shape
        C, H = cfg.n_embd, cfg.n_head
        if last is not None:
            last = self._check_last(last, B, T)
        if cache is not None and (cache.k[0].shape[0] != B or cache.length < T):
            raise ValueError(f"cache: holds {cache.k[0].shape[0]} sequences x {cache.length} positions, "
                             f"the prompt is {B} x {T}")
        positions = cp.tile(cp.arange(T, dtype=cp.int32), B)
        x = embedding(idx.ravel(), positions, self.wte, self.wpe, cp.empty((B * T, C), cp.float32))
        a = layernorm(x, *self.h[0].ln_1, eps=cfg.eps)
        for i, blk in enumerate(self.h):
            qkv = cp.matmul(a, blk.c_attn.T).reshape(B, T, 3 * C)          # bias: folded in below
            if cache is not None:
                kv_cache_fill(qkv, blk.c_attn_b, cache.k[i], cache.v[i])
            y = flash_attention_qkv(qkv, H, causal=True, bias=blk.c_attn_b).reshape(B * T, C)
            x, a = residual_layernorm(x, cp.matmul(y, blk.c_proj.T), blk.c_proj_b, *blk.ln_2, eps=cfg.eps,
                                      out_residual=x, out_ln=a)
            h = bias_gelu(cp.matmul(a, blk.c_fc.T), blk.c_fc_b)
            x, a = residual_layernorm(x, cp.matmul(h, blk.mlp_proj.T), blk.mlp_proj_b, *self._ln_after(i),
                                      eps=cfg.eps, out_residual=x, out_ln=a)
        if last is None:
            return cp.matmul(a, self.wte.T).reshape(B, T, cfg.vocab_size)
        rows = a.reshape(B, T, C)[cp.arange(B), last]                      # (B, C): ln_f at each last token
        return gemv(cp.ascontiguousarray(rows), self.wte)

    # ------------------------------------------------------------------ decode: one token per sequence
    def plan_for(self, batch: int) -> str:
        """The decode-step plan for a batch size (self.decode_plan overrides it; benchmarks.py A/Bs both):
        "fused": GEMV v5 (ROWS=4), LayerNorm in each GEMV's prologue, residual in the epilogue: 5 launches
        a block. Wins at batch 1-2, where a block's prologue re-normalises 1-2 rows.
        "split": GEMV v4 (more, smaller blocks) on rows normalised once by step 3's layernorm /
        residual_layernorm: 7 launches a block, but no block repeats the LayerNorm of all B rows."""
        plan = self.decode_plan or ("fused" if batch <= FUSED_MAX_BATCH else "split")
        if plan not in ("fused", "split"):
            raise ValueError(f"decode_plan: expected None, 'fused' or 'split', got {plan!r}")
        return plan

    def attention_version_for(self, max_len: int) -> int:
        """step 2's decode_attention version for a step whose longest sequence has max_len cache rows:
        v1 (one launch) while the cache is short, v2 (split-K + combine) once it is long."""
        lim = self.attention_v1_max_len
        return 1 if lim is not None and max_len <= lim else self.decode_attention_version

    def warm(self, s: DecodeState, attention_version: int) -> None:
        """Run (eagerly) what a first decode_step call with this attention version would set up
        (decode_attention's workspace), so that the step can be captured without allocating. Writes s.att only."""
        from step2_attention.flash import decode_attention
        B, H, D = s.batch, self.config.n_head, self.config.head_dim
        decode_attention(s.q.reshape(B, H, D), s.cache.k[0], s.cache.v[0], s.lens, out=s.att.reshape(B, H, D),
                         version=attention_version)

    def decode_step(self, s: DecodeState, greedy: bool = False, mark=None, attention_version: int | None = None,
                    plan: str | None = None):
        """Logits for s.tokens at positions s.pos into s.logits, k/v appended to the cache at s.pos.
        greedy: also s.tokens = argmax and pos, lens += 1, on the device. No allocation, no host sync:
        capturable. `mark(name)` (optional) is called after each op, for the per-kernel breakdown.
        s.x is the residual stream. attention_version: step 2's decode_attention version (default
        self.decode_attention_version); plan: "fused" / "split" (default self.plan_for(batch))."""
        from step2_attention.flash import decode_attention
        from step3_fused.ops import layernorm, residual_layernorm
        cfg = self.config
        B, H, D, eps = s.batch, cfg.n_head, cfg.head_dim, cfg.eps
        av = attention_version or self.decode_attention_version
        fused = (plan or self.plan_for(B)) == "fused"
        mark = mark or (lambda name: None)
        embedding(s.tokens, s.pos, self.wte, self.wpe, s.x)
        mark("embedding")
        if not fused:
            layernorm(s.x, *self.h[0].ln_1, eps=eps, out=s.a)
            mark("ln_1 (step 3)")
        for i, blk in enumerate(self.h):
            if fused:
                gemv_qkv(s.x, blk.c_attn, blk.c_attn_b, s.q, s.cache.k[i], s.cache.v[i], s.pos, ln=blk.ln_1, eps=eps)
            else:
                gemv_qkv(s.a, blk.c_attn, blk.c_attn_b, s.q, s.cache.k[i], s.cache.v[i], s.pos, version=4)
            mark("ln_1 + qkv GEMV + KV append" if fused else "qkv GEMV + KV append")
            decode_attention(s.q.reshape(B, H, D), s.cache.k[i], s.cache.v[i], s.lens, out=s.att.reshape(B, H, D),
                             version=av)
            mark("decode attention")
            if fused:
                gemv(s.att, blk.c_proj, blk.c_proj_b, out=s.x, residual=True)
                mark("attn proj GEMV + residual")
                gemv(s.x, blk.c_fc, blk.c_fc_b, out=s.h, gelu=True, ln=blk.ln_2, eps=eps)
                mark("ln_2 + fc GEMV + GELU")
                gemv(s.h, blk.mlp_proj, blk.mlp_proj_b, out=s.x, residual=True)
                mark("mlp proj GEMV + residual")
            else:
                gemv(s.att, blk.c_proj, out=s.y, version=4)
                mark("attn proj GEMV")
                residual_layernorm(s.x, s.y, blk.c_proj_b, *blk.ln_2, eps=eps, out_residual=s.x, out_ln=s.a)
                mark("bias + residual + ln_2 (step 3)")
                gemv(s.a, blk.c_fc, blk.c_fc_b, out=s.h, gelu=True, version=4)
                mark("fc GEMV + GELU")
                gemv(s.h, blk.mlp_proj, out=s.y, version=4)
                mark("mlp proj GEMV")
                residual_layernorm(s.x, s.y, blk.mlp_proj_b, *self._ln_after(i), eps=eps, out_residual=s.x,
                                   out_ln=s.a)
                mark("bias + residual + next LayerNorm (step 3)")
        if fused:
            gemv(s.x, self.wte, out=s.logits, ln=self.ln_f, eps=eps)
            mark("ln_f + LM head GEMV")
        else:                      # a = ln_f(x) already; v5 beats v4 on the LM head at batch 8
            gemv(s.a, self.wte, out=s.logits)
            mark("LM head GEMV")
        if greedy:
            argmax(s.logits, s.tokens, s.pos, s.lens)
            mark("argmax")
        return s.logits



__all__ = ["GPTConfig", "GPT", "Block", "KVCache", "DecodeState", "embedding", "bias_gelu", "kv_cache_fill",
           "gemv", "gemv_qkv", "argmax", "advance"]
