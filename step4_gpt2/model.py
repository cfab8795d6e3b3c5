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

Fewer bytes per token (lesson 4f, step4_gpt2/precision/): `GPT(config, params, precision="bf16")` or "int8"
converts the weight matrices once, at load (`convert`): bf16 keeps 16-bit patterns (round to nearest even),
int8 one byte per weight and one float32 scale per output row (w ~ q * scale). The decode GEMVs read them and
convert in registers, accumulating in fp32; the prefill goes through ops.matmul_lowp. Embeddings, LayerNorms,
biases, activations and the KV cache stay fp32: they are a small share of the bytes a step reads
(`weight_bytes_per_token`), and the embedding reads one row of wte per token, so it keeps wte in fp32 while the
LM head gets its own converted copy (int8, or bf16 with lm_head="bf16").
"""
from __future__ import annotations

import numpy as np

from common import expect_choice, expect_token_ids, require_gpu
from step4_gpt2 import ops, quantize
from step4_gpt2.quantize import BYTES_PER_WEIGHT, PRECISIONS   # how the weight matrices are stored
from step4_gpt2.weights import GPTConfig   # n_layer, n_head, n_embd, vocab_size, block_size  # noqa: F401

PLANS = ("fused", "split")
SCALE_BYTES = 4          # int8: one float32 scale per output row
FUSED_MAX_BATCH = 2      # decode plan "fused" (v5 + LayerNorm prologue) up to this batch, "split" above it


def plan_for(batch: int) -> str:
    """The decode-step plan for a batch size:
    "fused": GEMV v5, LayerNorm in each GEMV's prologue, residual in the epilogue: 5 launches a block.
    Wins at batch 1-2, where a block's prologue re-normalises 1-2 rows.
    "split": GEMV v4 (more, smaller blocks) on rows normalised once by step 3's layernorm /
    residual_layernorm: 7 launches a block, but no block repeats the LayerNorm of all B rows."""
    return "fused" if batch <= FUSED_MAX_BATCH else "split"


def lm_head_precision(precision: str, lm_head: str | None = None) -> str:
    """The LM head's storage: the model's precision, or with int8 weights lm_head="bf16" (the head alone in bf16:
    its 38.6M weights are a third of GPT-2 124M's, and every logit is a dot product with one of its rows)."""
    expect_choice(precision, "precision", PRECISIONS)
    if lm_head is None or lm_head == precision:
        return precision
    if precision != "int8" or lm_head != "bf16":
        raise ValueError(f"lm_head: expected None or {precision!r} for precision={precision!r}"
                         + (" (or 'bf16')" if precision == "int8" else "") + f", got {lm_head!r}")
    return lm_head


def weight_bytes_per_token(config: GPTConfig, precision: str = "fp32", lm_head: str | None = None) -> int:
    """Bytes a decode step must read with the weight matrices stored in `precision`: every matrix once at
    BYTES_PER_WEIGHT per weight (int8: + a 4-byte scale per output row), the LM head in its own precision, and in
    fp32 every bias and LayerNorm parameter and one row of wpe. With "fp32" this is
    GPTConfig.weight_bytes_per_token() exactly (494.6 MB for GPT-2 124M)."""
    head = lm_head_precision(precision, lm_head)
    C, L, V = config.n_embd, config.n_layer, config.vocab_size
    matrices, head_weights = L * 12 * C * C, V * C      # c_attn 3C x C, c_proj C x C, c_fc 4C x C, mlp_proj C x 4C
    rest = config.weight_bytes_per_token() - 4 * (matrices + head_weights)     # fp32 biases, LayerNorms, wpe row

    def stored(weights: int, rows: int, p: str) -> int:
        return weights * BYTES_PER_WEIGHT[p] + (rows * SCALE_BYTES if p == "int8" else 0)
    return rest + stored(matrices, L * 9 * C, precision) + stored(head_weights, V, head)


def convert(w, precision: str):
    """A weight matrix (out, in), float32, as the model stores it: (W, scale). fp32: (w, None); bf16: (uint16
    bit patterns, None); int8: (int8 weights, float32 scale per output row) (step4_gpt2.quantize). Kept as two
    arrays, not a LowpWeight, so that every op a learner swaps in still receives a plain fp32 matrix."""
    expect_choice(precision, "precision", PRECISIONS)
    lw = quantize.quantize(w, precision)
    return lw.w, lw.scale


def as_float32(w, scale=None):
    """What a stored matrix (W, scale) computes with, as float32: the inverse of `convert` up to its rounding."""
    return quantize.LowpWeight(w, scale).dequantize()


def _on_gpu(a):
    """A parameter as float32 on the GPU; a checkpoint's bf16 bit patterns (uint16) are widened exactly."""
    import cupy as cp
    a = cp.asarray(a)
    return quantize.from_bf16(a) if a.dtype == np.uint16 else a.astype(cp.float32, copy=False)


def _scale(obj, name: str) -> dict:
    """The scale= keyword of a GEMV on matrix `name` of obj (a Block, or the GPT for "lm_head") when it is int8;
    nothing otherwise, so that an fp32 op swapped in by an exercise (ops.gemv's original signature) still fits."""
    scale = getattr(obj, name + "_s", None)
    return {} if scale is None else {"scale": scale}


# ----------------------------------------------------------------------------- the model
class Block:
    """One transformer block's weights on the GPU. Matrices are (out, in) = HF Conv1D weight transposed, stored
    in `precision` (convert); `<name>_s` is each matrix's int8 scale, or None."""

    def __init__(self, params: dict, i: int, precision: str = "fp32"):
        import cupy as cp
        g = lambda name: _on_gpu(params[f"h.{i}.{name}"])                                   # noqa: E731
        gt = lambda name: convert(cp.ascontiguousarray(g(name).T), precision)              # noqa: E731
        self.ln_1 = (g("ln_1.weight"), g("ln_1.bias"))
        (self.c_attn, self.c_attn_s), self.c_attn_b = gt("attn.c_attn.weight"), g("attn.c_attn.bias")     # (3C, C)
        (self.c_proj, self.c_proj_s), self.c_proj_b = gt("attn.c_proj.weight"), g("attn.c_proj.bias")     # (C, C)
        self.ln_2 = (g("ln_2.weight"), g("ln_2.bias"))
        (self.c_fc, self.c_fc_s), self.c_fc_b = gt("mlp.c_fc.weight"), g("mlp.c_fc.bias")                 # (4C, C)
        (self.mlp_proj, self.mlp_proj_s), self.mlp_proj_b = gt("mlp.c_proj.weight"), g("mlp.c_proj.bias")  # (C, 4C)

    MATRICES = ("c_attn", "c_proj", "c_fc", "mlp_proj")


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
    """GPT-2 with weights `params` (the HF layout, NumPy, as weights.load returns them, bf16 matrices as uint16
    bit patterns with dtype="bf16") on the GPU.
    precision: how the weight matrices are stored ("fp32", "bf16", "int8": see the module docstring);
    lm_head: the LM head's, None = the same (an int8 model may keep it in "bf16")."""

    def __init__(self, config: GPTConfig, params: dict, precision: str = "fp32", lm_head: str | None = None):
        head = lm_head_precision(precision, lm_head)      # argument errors before the no-GPU message
        require_gpu()                        # the no-GPU message before any CUDA call
        from step4_gpt2.weights import validate
        if config.head_dim not in (32, 64):
            raise ValueError(f"config: head_dim={config.head_dim}; the step-2 attention kernels support 32 and 64")
        validate(params, config, bf16=frozenset(n for n in params if np.dtype(params[n].dtype) == np.uint16))
        self.config, self.precision, self.lm_head_precision = config, precision, head
        self.wte = _on_gpu(params["wte.weight"])            # (V, C): the embedding, and in fp32 the LM head too
        self.wpe = _on_gpu(params["wpe.weight"])
        self.h = [Block(params, i, precision) for i in range(config.n_layer)]
        self.ln_f = (_on_gpu(params["ln_f.weight"]), _on_gpu(params["ln_f.bias"]))
        self.lm_head, self.lm_head_s = convert(self.wte, head)   # fp32: the same array as wte (tied)

    @classmethod
    def from_file(cls, path) -> "GPT":
        """From a model.safetensors, or a folder holding one (+ config.json)."""
        from step4_gpt2.weights import load_file
        return cls(*load_file(path))

    def n_params(self) -> int:
        return self.config.n_params()

    def weight_bytes_per_token(self) -> int:
        """Bytes a decode step of this model must read: every weight once, in its precisions (module-level
        weight_bytes_per_token)."""
        return weight_bytes_per_token(self.config, self.precision, self.lm_head_precision)

    def reference(self) -> "GPT":
        """An fp32 GPT computing with exactly this model's weights, widened (bf16) or dequantized (int8), and
        its fp32 wte for the embedding: it leaves out the rounding of the weights, so a test can compare this
        model's kernels with it, and a measurement can tell the two costs apart. Beside the order of the fp32
        sums, int8 differs in where the row's scale is applied: here to each weight, in gemv_v7 to the sum."""
        import cupy as cp
        host = lambda a: cp.asnumpy(a)                                                     # noqa: E731
        p = {"wte.weight": host(self.wte), "wpe.weight": host(self.wpe),
             "ln_f.weight": host(self.ln_f[0]), "ln_f.bias": host(self.ln_f[1])}
        hf = {"c_attn": "attn.c_attn", "c_proj": "attn.c_proj", "c_fc": "mlp.c_fc", "mlp_proj": "mlp.c_proj"}
        for i, blk in enumerate(self.h):
            for ln in ("ln_1", "ln_2"):
                p[f"h.{i}.{ln}.weight"], p[f"h.{i}.{ln}.bias"] = host(getattr(blk, ln)[0]), host(getattr(blk, ln)[1])
            for m in Block.MATRICES:
                w = as_float32(getattr(blk, m), getattr(blk, m + "_s"))
                p[f"h.{i}.{hf[m]}.weight"], p[f"h.{i}.{hf[m]}.bias"] = host(w.T), host(getattr(blk, m + "_b"))
        ref = GPT(self.config, p)
        ref.lm_head = cp.ascontiguousarray(as_float32(self.lm_head, self.lm_head_s))   # untied: wte stays fp32
        return ref

    def _matmul(self, x, W, scale=None):
        """x @ W^T for the prefill: cuBLAS on an fp32 matrix (its transpose read in place), ops.matmul_lowp on a
        bf16 or int8 one."""
        import cupy as cp
        return cp.matmul(x, W.T) if W.dtype == np.float32 else ops.matmul_lowp(x, W, scale=scale)

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
            qkv = self._matmul(a, blk.c_attn, blk.c_attn_s).reshape(B, T, 3 * C)   # bias: folded in below
            if cache is not None:
                ops.kv_cache_fill(qkv, blk.c_attn_b, cache.k[i], cache.v[i])
            y = ops.flash_attention_qkv(qkv, H, causal=True, bias=blk.c_attn_b).reshape(B * T, C)
            x, a = ops.residual_layernorm(x, self._matmul(y, blk.c_proj, blk.c_proj_s), blk.c_proj_b, *blk.ln_2,
                                          eps=cfg.eps, out_residual=x, out_ln=a)
            h = ops.bias_gelu(self._matmul(a, blk.c_fc, blk.c_fc_s), blk.c_fc_b)
            x, a = ops.residual_layernorm(x, self._matmul(h, blk.mlp_proj, blk.mlp_proj_s), blk.mlp_proj_b,
                                          *self._ln_after(i), eps=cfg.eps, out_residual=x, out_ln=a)
        if last is None:
            return self._matmul(a, self.lm_head, self.lm_head_s).reshape(B, T, cfg.vocab_size)
        rows = a.reshape(B, T, C)[cp.arange(B), last]                      # (B, C): ln_f at each last token
        return ops.gemv(cp.ascontiguousarray(rows), self.lm_head, **_scale(self, "lm_head"))

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
        v4 = {"version": 4} if self.h[0].c_attn.dtype == np.float32 else {}   # "split": v4 on fp32, else ops picks
        lm_head = getattr(self, "lm_head", self.wte)     # a GPT has one (fp32: wte itself); a stand-in may not
        ops.embedding(s.tokens, s.pos, self.wte, self.wpe, s.x)
        if not fused:
            ops.layernorm(s.x, *self.h[0].ln_1, eps=eps, out=s.a)
        for i, blk in enumerate(self.h):
            if fused:
                ops.gemv_qkv(s.x, blk.c_attn, blk.c_attn_b, s.q, s.cache.k[i], s.cache.v[i], s.pos, ln=blk.ln_1,
                             eps=eps, **_scale(blk, "c_attn"))
            else:
                ops.gemv_qkv(s.a, blk.c_attn, blk.c_attn_b, s.q, s.cache.k[i], s.cache.v[i], s.pos, **v4,
                             **_scale(blk, "c_attn"))
            ops.decode_attention(s.q.reshape(B, H, D), s.cache.k[i], s.cache.v[i], s.lens,
                                 out=s.att.reshape(B, H, D), version=attention_version)
            if fused:
                ops.gemv(s.att, blk.c_proj, blk.c_proj_b, out=s.x, residual=True, **_scale(blk, "c_proj"))
                ops.gemv(s.x, blk.c_fc, blk.c_fc_b, out=s.h, gelu=True, ln=blk.ln_2, eps=eps, **_scale(blk, "c_fc"))
                ops.gemv(s.h, blk.mlp_proj, blk.mlp_proj_b, out=s.x, residual=True, **_scale(blk, "mlp_proj"))
            else:
                ops.gemv(s.att, blk.c_proj, out=s.y, **v4, **_scale(blk, "c_proj"))
                ops.residual_layernorm(s.x, s.y, blk.c_proj_b, *blk.ln_2, eps=eps, out_residual=s.x, out_ln=s.a)
                ops.gemv(s.a, blk.c_fc, blk.c_fc_b, out=s.h, gelu=True, **v4, **_scale(blk, "c_fc"))
                ops.gemv(s.h, blk.mlp_proj, out=s.y, **v4, **_scale(blk, "mlp_proj"))
                ops.residual_layernorm(s.x, s.y, blk.mlp_proj_b, *self._ln_after(i), eps=eps,
                                       out_residual=s.x, out_ln=s.a)
        if fused:
            ops.gemv(s.x, lm_head, out=s.logits, ln=self.ln_f, eps=eps, **_scale(self, "lm_head"))
        else:                      # a = ln_f(x) already; v5 beats v4 on the LM head at batch 8
            ops.gemv(s.a, lm_head, out=s.logits, **_scale(self, "lm_head"))
        if greedy:
            ops.argmax(s.logits, s.tokens, s.pos, s.lens)
        return s.logits


__all__ = ["GPTConfig", "GPT", "Block", "KVCache", "DecodeState", "plan_for", "PLANS", "PRECISIONS", "BYTES_PER_WEIGHT",
           "weight_bytes_per_token", "lm_head_precision", "convert", "as_float32"]
