"""float64 NumPy references for training a GPT-2: every layer's forward AND backward, the fused classifier,
AdamW, gradient clipping, the learning-rate schedule, and the whole model's loss + gradients.

The kernels of step4_gpt2/train/ (lesson 4b) are checked against these; these are checked against torch autograd
on the CPU (tests/step4/test_step4_train.py). Layouts are the GPU's: activations are (N, C) rows with N = B * T,
qkv is GPT-2's fused (B, T, 3C) buffer WITHOUT its bias (the attention kernels add it while loading),
parameters use the Hugging Face names of step4_gpt2.weights (Conv1D weights are (in, out): y = x @ W + b).
"""
from __future__ import annotations

import math

import numpy as np

from common.reference import mlp
from common.reference.fusion import merge_heads, split_heads
from common.reference.mlp import adamw_init  # noqa: F401  (the same state layout as step 3b's AdamW)
from common.reference.ops import attention_scores, cross_entropy, f64, gelu, gelu_grad, ids, logsumexp, softmax

__all__ = ["encoder_forward", "encoder_backward", "layernorm_forward", "layernorm_backward",
           "attention_forward", "attention_backward", "gelu_bias_forward", "gelu_bias_backward",
           "matmul_backward", "bias_grad", "classifier", "adamw_init", "adamw_step", "is_decayed",
           "clip_grad_norm", "lr_at", "forward_backward", "tf32"]


# ---------------------------------------------------------------- embeddings
def encoder_forward(wte, wpe, idx) -> np.ndarray:
    """x[b, t] = wte[idx[b, t]] + wpe[t]; idx (B, T) -> (B, T, C)."""
    idx = ids(idx)
    return f64(wte)[idx] + f64(wpe)[np.arange(idx.shape[1])][None]


def encoder_backward(dx, idx, vocab: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(dwte (V, C), dwpe (block, C)) from dx (B, T, C): a scatter-add over repeated tokens, a sum over B."""
    idx = ids(idx)
    dx = f64(dx).reshape(idx.shape + (-1,))
    dwte = np.zeros((vocab, dx.shape[-1]))
    np.add.at(dwte, idx.ravel(), dx.reshape(-1, dx.shape[-1]))
    dwpe = np.zeros((block, dx.shape[-1]))
    dwpe[:idx.shape[1]] = dx.sum(axis=0)
    return dwte, dwpe


# ---------------------------------------------------------------- LayerNorm
def layernorm_forward(x, weight, bias, eps: float = 1e-5):
    """(y, mean, rstd) over the last axis; mean and rstd are what the backward pass needs."""
    x = f64(x)
    mean = x.mean(axis=-1)
    rstd = 1.0 / np.sqrt(((x - mean[..., None]) ** 2).mean(axis=-1) + eps)
    return (x - mean[..., None]) * rstd[..., None] * f64(weight) + f64(bias), mean, rstd


def layernorm_backward(dy, x, weight, mean, rstd):
    """(dx, dweight, dbias). With xhat = (x - mean) * rstd and g = dy * weight:
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)); dweight = sum_rows dy * xhat; dbias = sum_rows dy."""
    dy, x = f64(dy), f64(x)
    xhat = (x - f64(mean)[..., None]) * f64(rstd)[..., None]
    g = dy * f64(weight)
    dx = f64(rstd)[..., None] * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    C = x.shape[-1]
    return dx, (dy * xhat).reshape(-1, C).sum(0), dy.reshape(-1, C).sum(0)


# ---------------------------------------------------------------- attention on the fused qkv buffer
def _heads(qkv, bias, n_head: int):
    """q, k, v (B, H, T, D) of the fused buffer with its bias added, and the causal, scaled scores q k^T."""
    q, k, v = split_heads(f64(qkv) + (0.0 if bias is None else f64(bias)), n_head)
    return q, k, v, attention_scores(q, k, causal=True)


def attention_forward(qkv, bias, n_head: int):
    """Causal attention. qkv (B, T, 3C) without bias, bias (3C,) -> (out (B, T, C), lse (B, H, T)),
    lse[b, h, i] = log sum_j<=i exp(q_i . k_j / sqrt(D)): all the backward pass needs of the softmax."""
    q, k, v, s = _heads(qkv, bias, n_head)
    lse = logsumexp(s)
    return merge_heads(np.exp(s - lse[..., None]) @ v), lse


def attention_backward(dout, qkv, bias, n_head: int):
    """dqkv (B, T, 3C) of causal attention (also the gradient of the qkv bias, summed over B and T).
    With P = softmax(S): dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)), dQ = dS K / sqrt(D),
    dK = dS^T Q / sqrt(D)."""
    q, k, v, s = _heads(qkv, bias, n_head)
    B, H, T, D = q.shape
    p = softmax(s)
    do = f64(dout).reshape(B, T, H, D).transpose(0, 2, 1, 3)
    o = p @ v
    dv = p.transpose(0, 1, 3, 2) @ do
    dp = do @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - (do * o).sum(-1, keepdims=True))
    dq = ds @ k / math.sqrt(D)
    dk = ds.transpose(0, 1, 3, 2) @ q / math.sqrt(D)
    return np.concatenate([merge_heads(dq), merge_heads(dk), merge_heads(dv)], axis=-1)


def tf32(x) -> np.ndarray:
    """float32 x rounded to TF32 (10 mantissa bits), to nearest with ties away from zero, as PTX's
    cvt.rna.tf32.f32 does (step4_gpt2/train/attention_tc.cu): the result is a float32 whose low 13 mantissa bits are zero.
    Adding half of the dropped range to the magnitude bits carries into the kept ones exactly when the dropped
    part is at least half (a carry out of the mantissa bumps the exponent, as rounding up should); NaN and
    infinity are not handled (the kernels never see them)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


# ---------------------------------------------------------------- MLP pieces
def gelu_bias_forward(h, bias):
    """(pre, out): pre = h + bias (kept for the backward pass), out = gelu(pre)."""
    pre = f64(h) + f64(bias)
    return pre, gelu(pre)


def gelu_bias_backward(dout, pre):
    """(dpre, dbias): dpre = dout * gelu'(pre), dbias = its column sums."""
    d = f64(dout) * gelu_grad(pre)
    return d, d.reshape(-1, d.shape[-1]).sum(0)


def bias_grad(dy) -> np.ndarray:
    """Gradient of a broadcast bias: the column sums of dy (rows, cols)."""
    dy = f64(dy)
    return dy.reshape(-1, dy.shape[-1]).sum(0)


def matmul_backward(dy, x, weight):
    """y = x @ W (+ b): (dx = dy W^T, dW = x^T dy, db = column sums of dy)."""
    dy, x, w = f64(dy), f64(x), f64(weight)
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    return dy @ w.T, x2.T @ dy2, dy2.sum(0)


# ---------------------------------------------------------------- the classifier
def classifier(logits, targets, scale: float | None = None):
    """(losses (N,), dlogits (N, V)): softmax + cross-entropy, dlogits = (softmax - onehot) * scale
    (scale defaults to 1/N: the gradient of the mean loss)."""
    t = ids(targets).ravel()
    losses, d = cross_entropy(logits, t), softmax(logits)
    d[np.arange(len(t)), t] -= 1.0
    return losses, d * (1.0 / len(t) if scale is None else scale)


# ---------------------------------------------------------------- optimiser and schedule
def is_decayed(name: str) -> bool:
    """Weight decay on the matrices (and the embeddings), not on biases and LayerNorm (nanoGPT's rule: dim >= 2)."""
    return name.endswith("weight") and not (".ln_" in name or name.startswith("ln_"))


def adamw_step(params: dict, grads: dict, state: dict, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
               weight_decay: float = 0.1) -> tuple[dict, dict]:
    """One AdamW step (torch.optim.AdamW's formula), decay on is_decayed(name) tensors only."""
    return mlp.adamw_step(params, grads, state, lr, betas, eps, weight_decay, decayed=is_decayed)


def clip_grad_norm(grads: dict, max_norm: float) -> tuple[dict, float]:
    """(clipped grads, total norm) as torch.nn.utils.clip_grad_norm_: g *= min(1, max_norm / (norm + 1e-6))."""
    norm = math.sqrt(sum(float((f64(g) ** 2).sum()) for g in grads.values()))
    coef = min(1.0, max_norm / (norm + 1e-6))
    return {k: f64(g) * coef for k, g in grads.items()}, norm


def lr_at(step: int, lr: float, warmup: int, max_steps: int, min_lr: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to min_lr at max_steps (nanoGPT's schedule);
    `step` counts from 0."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= max_steps:
        return min_lr
    ratio = (step - warmup) / max(1, max_steps - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


# ---------------------------------------------------------------- the whole model
def forward_backward(params: dict, idx, targets, n_head: int, eps: float = 1e-5, grads: bool = True):
    """(mean loss, {name: gradient}) of GPT-2 (HF names, tied LM head) on one batch, all in float64,
    composed of the layer references above exactly as the GPU model composes its kernels."""
    idx = ids(idx)
    P = {k: f64(v) for k, v in params.items()}
    B, T = idx.shape
    V, C = P["wte.weight"].shape
    L = 1 + max(int(k.split(".")[1]) for k in P if k.startswith("h."))
    x = encoder_forward(P["wte.weight"], P["wpe.weight"], idx).reshape(B * T, C)
    saved = []
    for i in range(L):
        p = lambda n: P[f"h.{i}.{n}"]  # noqa: E731,B023
        s = {"x": x}
        s["ln1"], s["m1"], s["r1"] = layernorm_forward(x, p("ln_1.weight"), p("ln_1.bias"), eps)
        s["qkv"] = (s["ln1"] @ p("attn.c_attn.weight")).reshape(B, T, 3 * C)
        y, _ = attention_forward(s["qkv"], p("attn.c_attn.bias"), n_head)
        s["y"] = y.reshape(B * T, C)
        s["x2"] = x + s["y"] @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
        s["ln2"], s["m2"], s["r2"] = layernorm_forward(s["x2"], p("ln_2.weight"), p("ln_2.bias"), eps)
        s["pre"], s["h"] = gelu_bias_forward(s["ln2"] @ p("mlp.c_fc.weight"), p("mlp.c_fc.bias"))
        x = s["x2"] + s["h"] @ p("mlp.c_proj.weight") + p("mlp.c_proj.bias")
        saved.append(s)
    lnf, mf, rf = layernorm_forward(x, P["ln_f.weight"], P["ln_f.bias"], eps)
    losses, dlogits = classifier(lnf @ P["wte.weight"].T, targets)
    if not grads:
        return float(losses.mean()), None
    G = {}
    dlnf = dlogits @ P["wte.weight"]
    G["wte.weight"] = dlogits.T @ lnf
    dx, G["ln_f.weight"], G["ln_f.bias"] = layernorm_backward(dlnf, x, P["ln_f.weight"], mf, rf)
    for i in reversed(range(L)):
        s, p, n = saved[i], (lambda n, i=i: P[f"h.{i}.{n}"]), f"h.{i}."
        dh, G[n + "mlp.c_proj.weight"], G[n + "mlp.c_proj.bias"] = matmul_backward(dx, s["h"], p("mlp.c_proj.weight"))
        dpre, G[n + "mlp.c_fc.bias"] = gelu_bias_backward(dh, s["pre"])
        dln2, G[n + "mlp.c_fc.weight"], _ = matmul_backward(dpre, s["ln2"], p("mlp.c_fc.weight"))
        d, G[n + "ln_2.weight"], G[n + "ln_2.bias"] = layernorm_backward(dln2, s["x2"], p("ln_2.weight"), s["m2"], s["r2"])
        dx = dx + d
        dy, G[n + "attn.c_proj.weight"], G[n + "attn.c_proj.bias"] = matmul_backward(dx, s["y"], p("attn.c_proj.weight"))
        dqkv = attention_backward(dy.reshape(B, T, C), s["qkv"], p("attn.c_attn.bias"), n_head).reshape(B * T, 3 * C)
        dln1, G[n + "attn.c_attn.weight"], G[n + "attn.c_attn.bias"] = matmul_backward(dqkv, s["ln1"], p("attn.c_attn.weight"))
        d, G[n + "ln_1.weight"], G[n + "ln_1.bias"] = layernorm_backward(dln1, s["x"], p("ln_1.weight"), s["m1"], s["r1"])
        dx = dx + d
    dwte, G["wpe.weight"] = encoder_backward(dx.reshape(B, T, C), idx, V, P["wpe.weight"].shape[0])
    G["wte.weight"] = G["wte.weight"] + dwte
    return float(losses.mean()), {k: G[k] for k in params}

