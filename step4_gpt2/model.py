"""GPT-2 on the course's own kernels, top to bottom (after nanoGPT's model.py). Every kernel is called
through `ops` (step4_gpt2/ops.py), so an exercise can swap one op by patching `step4_gpt2.ops.<name>`.

    x = wte[idx] + wpe[pos]                                  ops.embedding           (gpt2.cu)
    for each block:
        a = ln_1(x)                                          ops.layernorm           (step 3)
        q, k, v = a @ W_attn + b_attn                        cuBLAS; bias folded into attention
        y = softmax(q k^T / sqrt(D), causal) v               ops.flash_attention_qkv (step 2)
        x, a = x + y @ W_proj + b_proj, ln_2(...)            ops.residual_layernorm  (step 3)
        h = gelu(a @ W_fc + b_fc)                            cuBLAS + ops.bias_gelu  (gpt2.cu)
        x, a = x + h @ W_mproj + b_mproj, ln_1'(...)         ops.residual_layernorm: the next block's ln_1
    logits = ln_f(x) @ wte^T                                 tied LM head

Two ways through the model:
- `forward(idx)`: a whole prompt (prefill) with cuBLAS GEMMs and flash attention; with a KVCache it also
  stores every position's k and v.
- `decode_step(state)`: one new token per sequence against the KV cache. At batch <= 8 every matrix
  product is a GEMV reading each weight once. Two plans (`plan_for`): at batch <= 2 "fused" (gemv_v5,
  LayerNorm fused into the GEMV that reads its output, bias + residual into the projections: a block is
  5 launches); above it "split" (gemv_v4, LayerNorm done once per row by step 3's kernels: 7 launches,
  but no block re-normalises all B rows). Attention is step 2's decode_attention, positions are read on
  the device: the whole step is our own kernels with preallocated buffers, so it can be captured in a
  CUDA graph (generate.py's Decoder does that).
Weights live on the GPU once, Conv1D matrices transposed to (out, in) so a GEMV reads each output's
weights contiguously; cuBLAS reads the same array transposed (no copy) for the prefill.
"""
from __future__ import annotations

import numpy as np

from common import expect_choice, expect_token_ids, require_gpu
from step4_gpt2 import ops
from step4_gpt2.weights import GPTConfig   # n_layer, n_head, n_embd, vocab_size, block_size  # noqa: F401

PLANS = ("fused", "split")
FUSED_MAX_BATCH = 2      # decode plan "fused" (v5 + LayerNorm prologue) up to this batch, "split" above it


def plan_for(batch: int) -> str:
    """The decode-step plan for a batch size:
    "fused": GEMV v5, LayerNorm in each GEMV's prologue, residual in the epilogue: 5 launches a block.
    Wins at batch 1-2, where a block's prologue re-normalises 1-2 rows.
    "split": GEMV v4 (more, smaller blocks) on rows normalised once by step 3's layernorm /
    residual_layernorm: 7 launches a block, but no block repeats the LayerNorm of all B rows."""
    return "fused" if batch <= FUSED_MAX_BATCH else "split"


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
    """GPT-2 with weights `params` (the HF layout, NumPy, as weights.load returns them) on the GPU."""

    def __init__(self, config: GPTConfig, params: dict):
        require_gpu()                        # the no-GPU message before any CUDA call
        import cupy as cp
        from step4_gpt2.weights import validate
        if config.head_dim not in (32, 64):
            raise ValueError(f"config: head_dim={config.head_dim}; the step-2 attention kernels support 32 and 64")
        validate(params, config)
        self.config = config
        self.wte = cp.asarray(params["wte.weight"], dtype=cp.float32)     # (V, C): also the LM head, (out, in)
        self.wpe = cp.asarray(params["wpe.weight"], dtype=cp.float32)
        self.h = [Block(params, i) for i in range(config.n_layer)]
        self.ln_f = (cp.asarray(params["ln_f.weight"], dtype=cp.float32),
                     cp.asarray(params["ln_f.bias"], dtype=cp.float32))

    @classmethod
    def from_file(cls, path) -> "GPT":
        """From a model.safetensors, or a folder holding one (+ config.json)."""
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
        """(B, T) int32 token ids on the GPU, in range (common.expect_token_ids); T between 1 and block_size."""
        import cupy as cp
        idx = expect_token_ids(idx, self.config.vocab_size, name)
        if idx.ndim == 1:
            idx = idx[None]
        if idx.ndim != 2:
            raise ValueError(f"{name}: expected token ids of shape (B, T), got shape {idx.shape}")
        B, T = idx.shape
        if T == 0 or B == 0:
            raise ValueError(f"{name}: empty prompt (shape {idx.shape}); give at least one token per sequence")
        if T > self.config.block_size:
            raise ValueError(f"{name}: {T} tokens exceed the context length block_size={self.config.block_size}")
        return cp.ascontiguousarray(cp.asarray(idx), dtype=cp.int32)

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
        x = ops.embedding(idx.ravel(), positions, self.wte, self.wpe, cp.empty((B * T, C), cp.float32))
        a = ops.layernorm(x, *self.h[0].ln_1, eps=cfg.eps)
        for i, blk in enumerate(self.h):
            qkv = cp.matmul(a, blk.c_attn.T).reshape(B, T, 3 * C)          # bias: folded in below
            if cache is not None:
                ops.kv_cache_fill(qkv, blk.c_attn_b, cache.k[i], cache.v[i])
            y = ops.flash_attention_qkv(qkv, H, causal=True, bias=blk.c_attn_b).reshape(B * T, C)
            x, a = ops.residual_layernorm(x, cp.matmul(y, blk.c_proj.T), blk.c_proj_b, *blk.ln_2, eps=cfg.eps,
                                      out_residual=x, out_ln=a)
            h = ops.bias_gelu(cp.matmul(a, blk.c_fc.T), blk.c_fc_b)
            x, a = ops.residual_layernorm(x, cp.matmul(h, blk.mlp_proj.T), blk.mlp_proj_b, *self._ln_after(i),
                                      eps=cfg.eps, out_residual=x, out_ln=a)
        if last is None:
            return cp.matmul(a, self.wte.T).reshape(B, T, cfg.vocab_size)
        rows = a.reshape(B, T, C)[cp.arange(B), last]                      # (B, C): ln_f at each last token
        return ops.gemv(cp.ascontiguousarray(rows), self.wte)

    # ------------------------------------------------------------------ decode: one token per sequence
    def decode_step(self, s: DecodeState, greedy: bool = False, attention_version: int = 2,
                    plan: str | None = None):
        """Logits for s.tokens at positions s.pos into s.logits, k/v appended to the cache at s.pos.
        greedy: also s.tokens = argmax and pos, lens += 1, on the device. No allocation, no host sync:
        capturable. s.x is the residual stream. attention_version: step 2's decode_attention version
        (1: one launch, 2: split-K over the cache + a combine kernel); plan: "fused" / "split" (default
        plan_for(batch))."""
        cfg = self.config
        B, H, D, eps = s.batch, cfg.n_head, cfg.head_dim, cfg.eps
        fused = expect_choice(plan or plan_for(B), "plan", PLANS) == "fused"
        ops.embedding(s.tokens, s.pos, self.wte, self.wpe, s.x)
        if not fused:
            ops.layernorm(s.x, *self.h[0].ln_1, eps=eps, out=s.a)
        for i, blk in enumerate(self.h):
            if fused:
                ops.gemv_qkv(s.x, blk.c_attn, blk.c_attn_b, s.q, s.cache.k[i], s.cache.v[i], s.pos, ln=blk.ln_1,
                             eps=eps)
            else:
                ops.gemv_qkv(s.a, blk.c_attn, blk.c_attn_b, s.q, s.cache.k[i], s.cache.v[i], s.pos, version=4)
            ops.decode_attention(s.q.reshape(B, H, D), s.cache.k[i], s.cache.v[i], s.lens,
                                 out=s.att.reshape(B, H, D), version=attention_version)
            if fused:
                ops.gemv(s.att, blk.c_proj, blk.c_proj_b, out=s.x, residual=True)
                ops.gemv(s.x, blk.c_fc, blk.c_fc_b, out=s.h, gelu=True, ln=blk.ln_2, eps=eps)
                ops.gemv(s.h, blk.mlp_proj, blk.mlp_proj_b, out=s.x, residual=True)
            else:
                ops.gemv(s.att, blk.c_proj, out=s.y, version=4)
                ops.residual_layernorm(s.x, s.y, blk.c_proj_b, *blk.ln_2, eps=eps, out_residual=s.x, out_ln=s.a)
                ops.gemv(s.a, blk.c_fc, blk.c_fc_b, out=s.h, gelu=True, version=4)
                ops.gemv(s.h, blk.mlp_proj, out=s.y, version=4)
                ops.residual_layernorm(s.x, s.y, blk.mlp_proj_b, *self._ln_after(i), eps=eps,
                                       out_residual=s.x, out_ln=s.a)
        if fused:
            ops.gemv(s.x, self.wte, out=s.logits, ln=self.ln_f, eps=eps)
        else:                      # a = ln_f(x) already; v5 beats v4 on the LM head at batch 8
            ops.gemv(s.a, self.wte, out=s.logits)
        if greedy:
            ops.argmax(s.logits, s.tokens, s.pos, s.lens)
        return s.logits


__all__ = ["GPTConfig", "GPT", "Block", "KVCache", "DecodeState", "plan_for", "PLANS"]
