"""float64 references for the course's building blocks (elementwise, reductions, softmax, matmul,
attention, LayerNorm). Names follow the kernels they check."""
from __future__ import annotations

import numpy as np

__all__ = [
    "f64", "ids", "axpb", "gelu", "gelu_grad", "relu", "relu_backward", "sigmoid", "ZOO",
    "sum", "softmax", "matmul", "attention_scores", "logsumexp", "attention_lse", "attention", "decode_attention",
    "layernorm", "residual_layernorm", "cross_entropy",
]

_SQRT_2_OVER_PI = np.sqrt(2.0 / np.pi)


def f64(a) -> np.ndarray:
    """Any array (NumPy, CuPy, fp16/bf16) as a float64 NumPy array."""
    if hasattr(a, "get"):
        a = a.get()
    return np.asarray(a).astype(np.float64)


# ---------------------------------------------------------------- step 1: elementwise and reductions
def ids(a) -> np.ndarray:
    """Token ids (NumPy or CuPy, any integer dtype) as an int64 NumPy array, for indexing."""
    return np.asarray(a.get() if hasattr(a, "get") else a).astype(np.int64)


def axpb(x, a: float, b: float) -> np.ndarray:
    return float(a) * f64(x) + float(b)


def gelu(x) -> np.ndarray:
    """GELU, tanh approximation (GPT-2's "gelu_new")."""
    x = f64(x)
    return 0.5 * x * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)))


def gelu_grad(x) -> np.ndarray:
    """d gelu(x) / dx for the tanh approximation."""
    x = f64(x)
    u = _SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)
    t = np.tanh(u)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)


def relu(x) -> np.ndarray:
    return np.maximum(f64(x), 0.0)


def relu_backward(grad, x) -> np.ndarray:
    """Gradient through ReLU: passes where the input was > 0."""
    return np.where(f64(x) > 0.0, f64(grad), 0.0)


def sigmoid(x) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-f64(x)))


# The kernel zoo of step 1: name -> (number of array inputs, scalar or None, float64 function).
ZOO = {
    "add":        (2, None, lambda a, b: f64(a) + f64(b)),
    "sub":        (2, None, lambda a, b: f64(a) - f64(b)),
    "mul":        (2, None, lambda a, b: f64(a) * f64(b)),
    "div":        (2, None, lambda a, b: f64(a) / f64(b)),
    "pow":        (2, None, lambda a, b: np.power(f64(a), f64(b))),
    "relu":       (1, None, relu),
    "relu_backward": (2, None, relu_backward),
    "sigmoid":    (1, None, sigmoid),
    "tanh":       (1, None, lambda a: np.tanh(f64(a))),
    "gelu":       (1, None, gelu),
    "exp":        (1, None, lambda a: np.exp(f64(a))),
    "log":        (1, None, lambda a: np.log(f64(a))),
    "add_scalar": (1, 0.75, lambda a, s: f64(a) + s),
    "mul_scalar": (1, -1.5, lambda a, s: f64(a) * s),
    "copy":       (1, None, lambda a: f64(a)),
    "fill":       (0, 3.25, None),   # shape-only: handled by the caller
}


def sum(x) -> float:  # noqa: A001 - named after the kernel it checks
    return float(np.sum(f64(x)))


# ---------------------------------------------------------------- step 2: softmax, matmul, attention
def softmax(x, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax. A row that is all -inf (fully masked) gives all zeros, by convention."""
    x = f64(x)
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(x - m)
    s = np.sum(e, axis=axis, keepdims=True)
    return np.divide(e, s, out=np.zeros_like(e), where=s > 0)


def matmul(a, b) -> np.ndarray:
    return f64(a) @ f64(b)


def attention_scores(q, k, causal: bool = True, scale: float | None = None) -> np.ndarray:
    """The scaled scores q k^T * scale (..., Tq, Tk), -inf where a causal mask hides a key. q: (..., Tq, D),
    k: (..., Tk, D). With causal=True, query i (counted from the end when Tq < Tk) sees keys 0 .. i + (Tk - Tq).
    """
    q, k = f64(q), f64(k)
    tq, tk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    if causal:
        mask = np.arange(tk)[None, :] > (np.arange(tq)[:, None] + (tk - tq))
        s = np.where(mask, -np.inf, s)
    return s


def logsumexp(s) -> np.ndarray:
    """log sum exp over the last axis, shifted by the row's max (rows of scores with -inf where masked)."""
    s = f64(s)
    m = s.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True)))[..., 0]


def attention_lse(q, k, causal: bool = True, scale: float | None = None) -> np.ndarray:
    """Each query row's log-sum-exp of its scores (..., Tq): what a flash kernel keeps for the backward pass."""
    return logsumexp(attention_scores(q, k, causal, scale))


def attention(q, k, v, causal: bool = True, scale: float | None = None) -> np.ndarray:
    """Multi-head scaled dot-product attention. q: (..., Tq, D), k and v: (..., Tk, D); the causal mask of
    attention_scores."""
    return softmax(attention_scores(q, k, causal, scale)) @ f64(v)


def decode_attention(q, k_cache, v_cache, lengths, scale: float | None = None) -> np.ndarray:
    """One new query per sequence against a KV cache. q: (B, H, D); caches: (B, H, L, D);
    lengths: (B,) how many cache rows are valid for each sequence (the new token's own k/v included)."""
    q, kc, vc = f64(q), f64(k_cache), f64(v_cache)
    out = np.zeros_like(q)
    for b, n in enumerate(np.asarray(lengths).astype(int)):
        out[b] = attention(q[b][:, None, :], kc[b, :, :n], vc[b, :, :n], causal=False, scale=scale)[:, 0, :]
    return out


# ---------------------------------------------------------------- step 3: LayerNorm and friends
def layernorm(x, weight, bias, eps: float = 1e-5) -> np.ndarray:
    """LayerNorm over the last axis (biased variance, as PyTorch and GPT-2)."""
    x = f64(x)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * f64(weight) + f64(bias)


def residual_layernorm(x, proj, proj_bias, weight, bias, eps: float = 1e-5):
    """Pre-LN block tail: r = x + proj + proj_bias; returns (r, layernorm(r))."""
    r = f64(x) + f64(proj) + (0.0 if proj_bias is None else f64(proj_bias))
    return r, layernorm(r, weight, bias, eps)


def cross_entropy(logits, targets) -> np.ndarray:
    """Per-row loss -log softmax(logits)[target]; logits (N, V), targets (N,) ints."""
    z = f64(logits)
    logp = z - logsumexp(z)[..., None]
    t = ids(targets)
    return -logp[np.arange(len(t)), t]
