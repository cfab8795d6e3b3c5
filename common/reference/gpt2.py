"""float64 NumPy GPT-2 forward pass, the reference the course's GPU model is checked against.

`params` is the weight dict in the Hugging Face layout (names without the `transformer.` prefix):
wte.weight (V, C), wpe.weight (T, C), h.{i}.ln_1.weight/bias, h.{i}.attn.c_attn.weight (C, 3C) + bias,
h.{i}.attn.c_proj.weight (C, C) + bias, h.{i}.ln_2.*, h.{i}.mlp.c_fc.weight (C, 4C) + bias,
h.{i}.mlp.c_proj.weight (4C, C) + bias, ln_f.weight/bias. Conv1D weights are (in, out): y = x @ W + b.
The LM head is tied to wte. CI checks this module against transformers.GPT2LMHeadModel on the CPU.
"""
from __future__ import annotations

import numpy as np

from common.reference.ops import attention, f64, gelu, layernorm

__all__ = ["forward", "block"]


def block(x: np.ndarray, params: dict, i: int, n_head: int, eps: float = 1e-5) -> np.ndarray:
    """One transformer block (pre-LN): x + attn(ln_1(x)), then + mlp(ln_2(.)). x: (B, T, C) float64."""
    p = lambda name: f64(params[f"h.{i}.{name}"])  # noqa: E731
    B, T, C = x.shape
    h = layernorm(x, p("ln_1.weight"), p("ln_1.bias"), eps)
    qkv = h @ p("attn.c_attn.weight") + p("attn.c_attn.bias")                   # (B, T, 3C)
    q, k, v = (qkv[..., j * C:(j + 1) * C].reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)
               for j in range(3))                                               # (B, H, T, D)
    y = attention(q, k, v, causal=True).transpose(0, 2, 1, 3).reshape(B, T, C)
    x = x + y @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
    h = layernorm(x, p("ln_2.weight"), p("ln_2.bias"), eps)
    h = gelu(h @ p("mlp.c_fc.weight") + p("mlp.c_fc.bias"))
    return x + h @ p("mlp.c_proj.weight") + p("mlp.c_proj.bias")


def forward(params: dict, idx, n_layer: int, n_head: int, eps: float = 1e-5) -> np.ndarray:
    """Logits (B, T, V) in float64 for token ids idx (B, T)."""
    idx = np.asarray(idx)
    if idx.ndim == 1:
        idx = idx[None]
    T = idx.shape[1]
    x = f64(params["wte.weight"])[idx] + f64(params["wpe.weight"])[np.arange(T)][None]
    for i in range(n_layer):
        x = block(x, params, i, n_head, eps)
    x = layernorm(x, f64(params["ln_f.weight"]), f64(params["ln_f.bias"]), eps)
    return x @ f64(params["wte.weight"]).T
