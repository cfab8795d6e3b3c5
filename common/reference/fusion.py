"""float64 references for step 3 (fusion): the whole GPT-2 attention sublayer, its decode-step tail,
conv2d + bias + ReLU, and LayerNorm followed by a linear layer. Built from common.reference's pieces."""
from __future__ import annotations

import numpy as np

from common.reference.ops import attention, decode_attention, f64, layernorm, residual_layernorm

__all__ = ["split_heads", "merge_heads", "attention_sublayer", "decode_sublayer", "conv2d", "conv2d_bias_relu",
           "ln_linear"]


def split_heads(qkv, n_head: int):
    """(B, T, 3C) -> q, k, v each (B, H, T, D), GPT-2's layout (q | k | v, heads contiguous in each)."""
    qkv = f64(qkv)
    B, T, C3 = qkv.shape
    C = C3 // 3
    D = C // n_head
    parts = qkv.reshape(B, T, 3, n_head, D).transpose(2, 0, 3, 1, 4)
    return parts[0], parts[1], parts[2]


def merge_heads(o):
    """(B, H, T, D) -> (B, T, H*D)."""
    o = f64(o)
    B, H, T, D = o.shape
    return o.transpose(0, 2, 1, 3).reshape(B, T, H * D)


def attention_sublayer(x, p: dict, n_head: int, eps: float = 1e-5):
    """Pre-LN GPT-2 attention sublayer plus the next LayerNorm. x: (B, T, C); p holds ln1_w, ln1_b,
    w_qkv (C, 3C), b_qkv (3C,), w_proj (C, C), b_proj (C,), ln2_w, ln2_b (weights as x @ W, GPT-2's Conv1D).
    Returns (residual r = x + attn(ln_1(x)) @ W_proj + b_proj, ln_2(r))."""
    x = f64(x)
    h = layernorm(x, p["ln1_w"], p["ln1_b"], eps)
    qkv = h @ f64(p["w_qkv"]) + f64(p["b_qkv"])
    q, k, v = split_heads(qkv, n_head)
    o = merge_heads(attention(q, k, v, causal=True))
    return residual_layernorm(x, o @ f64(p["w_proj"]), p["b_proj"], p["ln2_w"], p["ln2_b"], eps)


def decode_sublayer(x, q, k_cache, v_cache, lengths, w_proj, b_proj, ln_w, ln_b, eps: float = 1e-5):
    """The decode step after the QKV projection: x (B, C) residual stream, q (B, H, D), caches (B, H, L, D).
    Returns (r = x + attention @ w_proj + b_proj, LayerNorm(r))."""
    o = decode_attention(q, k_cache, v_cache, lengths)
    B = o.shape[0]
    return residual_layernorm(x, o.reshape(B, -1) @ f64(w_proj), b_proj, ln_w, ln_b, eps)


def conv2d(x, w):
    """NCHW cross-correlation, stride 1, zero padding K // 2 ("same" for odd K). x (N, Cin, H, W), w (Cout, Cin, K, K)."""
    x, w = f64(x), f64(w)
    K = w.shape[-1]
    p = K // 2
    N, Cin, H, W = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
    y = np.zeros((N, w.shape[0], H, W))
    for ky in range(K):
        for kx in range(K):
            y += np.einsum("nchw,oc->nohw", xp[:, :, ky:ky + H, kx:kx + W], w[:, :, ky, kx])
    return y


def conv2d_bias_relu(x, w, bias):
    return np.maximum(conv2d(x, w) + f64(bias)[None, :, None, None], 0.0)


def ln_linear(x, ln_w, ln_b, w, bias, eps: float = 1e-5):
    """LayerNorm(x) @ w + bias; x (N, C), w (C, M)."""
    return layernorm(x, ln_w, ln_b, eps) @ f64(w) + f64(bias)
