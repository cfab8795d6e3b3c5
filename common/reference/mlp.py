"""float64 reference of step 3's next-token MLP: forward loss, every gradient, SGD/AdamW steps, a training loop.

Model (B samples, K context ids each, vocabulary V, embedding E, hidden H), loss = mean over the batch:

    x = mean_j emb[ctx[:, j]]     h = relu(x @ W1 + b1)     z = h @ W2 + b2
    loss = mean_b (logsumexp(z_b) - z_b[target_b])

Parameters are a dict with keys PARAMS; the GPU code (step3_fused/training.py) uses the same names and
layouts, so the two can start from the same weights and be compared step by step.
"""
from __future__ import annotations

import numpy as np

from common.reference.ops import cross_entropy, f64, ids, relu, relu_backward, softmax

__all__ = ["PARAMS", "DECAYED", "init_params", "forward", "backward", "loss_and_grads", "sgd_step",
           "adamw_init", "adamw_step", "train"]

PARAMS = ("emb", "W1", "b1", "W2", "b2")
DECAYED = ("emb", "W1", "W2")          # weight decay applies to the matrices, not to the biases


def init_params(vocab: int, embed: int, hidden: int, seed: int = 0, dtype=np.float32) -> dict:
    """Xavier/Glorot uniform: U(-a, a) with a = sqrt(6 / (fan_in + fan_out)), keeping the variance of
    activations and gradients about constant through a layer. The embedding is a lookup, not a layer
    fed by V inputs, so it uses fan_in = fan_out = E (a = sqrt(3 / E)). Biases start at zero."""
    rng = np.random.default_rng(seed)

    def glorot(fan_in, fan_out, shape):
        a = np.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-a, a, size=shape).astype(dtype)

    return {"emb": glorot(embed, embed, (vocab, embed)), "W1": glorot(embed, hidden, (embed, hidden)),
            "b1": np.zeros(hidden, dtype), "W2": glorot(hidden, vocab, (hidden, vocab)), "b2": np.zeros(vocab, dtype)}


def forward(params: dict, ctx, targets=None) -> dict:
    """All intermediates (float64). ctx: (B, K) ids; targets: (B,) ids or None. 'losses' is per sample."""
    p = {k: f64(v) for k, v in params.items()}
    ctx = ids(ctx)
    x = p["emb"][ctx].mean(axis=1)
    hpre = x @ p["W1"] + p["b1"]
    h = relu(hpre)
    z = h @ p["W2"] + p["b2"]
    out = {"ctx": ctx, "x": x, "hpre": hpre, "h": h, "z": z, "probs": softmax(z)}
    if targets is not None:
        t = ids(targets)
        out["targets"] = t
        out["losses"] = cross_entropy(z, t)
        out["loss"] = float(out["losses"].mean())
    return out


def backward(params: dict, cache: dict) -> dict:
    """Gradients of the mean loss w.r.t. every parameter, plus the intermediates' gradients
    ('dz', 'dh', 'dhpre', 'dx') that the GPU kernels produce along the way."""
    p = {k: f64(v) for k, v in params.items()}
    ctx, t, h, x = cache["ctx"], cache["targets"], cache["h"], cache["x"]
    B, K = ctx.shape
    dz = cache["probs"].copy()
    dz[np.arange(B), t] -= 1.0
    dz /= B
    dh = dz @ p["W2"].T
    dhpre = relu_backward(dh, cache["hpre"])
    dx = dhpre @ p["W1"].T
    demb = np.zeros_like(p["emb"])
    np.add.at(demb, ctx.reshape(-1), np.repeat(dx / K, K, axis=0))
    return {"emb": demb, "W1": x.T @ dhpre, "b1": dhpre.sum(axis=0), "W2": h.T @ dz, "b2": dz.sum(axis=0),
            "dz": dz, "dh": dh, "dhpre": dhpre, "dx": dx}


def loss_and_grads(params: dict, ctx, targets) -> tuple[float, dict]:
    cache = forward(params, ctx, targets)
    return cache["loss"], backward(params, cache)


def sgd_step(params: dict, grads: dict, lr: float, weight_decay: float = 0.0) -> dict:
    """p - lr * (g + wd * p) (decay on DECAYED only); returns new float64 parameters."""
    return {k: f64(v) - lr * (f64(grads[k]) + (weight_decay * f64(v) if k in DECAYED else 0.0))
            for k, v in params.items()}


def adamw_init(params: dict) -> dict:
    return {"t": 0, "m": {k: np.zeros(np.shape(v)) for k, v in params.items()},
            "v": {k: np.zeros(np.shape(v)) for k, v in params.items()}}


def adamw_step(params: dict, grads: dict, state: dict, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 0.01, decayed=lambda name: name in DECAYED) -> tuple[dict, dict]:
    """One AdamW step (PyTorch's torch.optim.AdamW formula and defaults, as step3_fused.training.AdamW), weight
    decay on the tensors `decayed(name)` picks; returns (new params, new state)."""
    b1, b2 = betas
    t = state["t"] + 1
    bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
    new_p, m_new, v_new = {}, {}, {}
    for k, v in params.items():
        p, g = f64(v), f64(grads[k])
        m = b1 * state["m"][k] + (1.0 - b1) * g
        s = b2 * state["v"][k] + (1.0 - b2) * g * g
        wd = weight_decay if decayed(k) else 0.0
        new_p[k] = p - lr * (wd * p + (m / bc1) / (np.sqrt(s / bc2) + eps))
        m_new[k], v_new[k] = m, s
    return new_p, {"t": t, "m": m_new, "v": v_new}


def train(params: dict, batches, optimizer: str = "adamw", lr: float = 1e-3, weight_decay: float | None = None,
          betas=(0.9, 0.999), eps: float = 1e-8) -> list[float]:
    """Full float64 training loop over `batches` (an iterable of (ctx, targets)); returns the loss of
    every step, measured before that step's update (as the GPU loop reports it). weight_decay None: the
    optimiser's own default, as step3_fused.training has it (SGD 0, AdamW 0.01)."""
    if optimizer not in ("sgd", "adamw"):
        raise ValueError(f"optimizer: expected 'sgd' or 'adamw', got {optimizer!r}")
    if weight_decay is None:
        weight_decay = 0.01 if optimizer == "adamw" else 0.0
    p = {k: f64(v) for k, v in params.items()}
    state = adamw_init(p)
    losses = []
    for ctx, targets in batches:
        loss, g = loss_and_grads(p, ctx, targets)
        losses.append(loss)
        if optimizer == "sgd":
            p = sgd_step(p, g, lr, weight_decay)
        else:
            p, state = adamw_step(p, g, state, lr, betas, eps, weight_decay)
    return losses
