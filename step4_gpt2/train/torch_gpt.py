"""The same GPT-2 in PyTorch (nanoGPT's shape, the Hugging Face names and Conv1D layout), the anchor the
course's training step is checked and timed against: same weights, same batches, same AdamW, same schedule.
Lesson 4b compares its gradients and its step time with ours (04b_train_gpt.ipynb, sections 3 and 7).

    model = build(cfg).load(params)                               # params: {HF name: NumPy array}, on the GPU
    loss = model(idx, targets); loss.backward()
    opt = adamw(model, TrainConfig())                             # decay on the same tensors as ours
"""
from __future__ import annotations

import numpy as np

from common.reference.train_gpt2 import is_decayed


def _torch():
    import torch
    return torch


def build(cfg, device="cuda", dtype=None):
    """TorchGPT for a step4_gpt2.weights.GPTConfig (imports torch lazily: the course runs without it)."""
    torch = _torch()
    nn, F = torch.nn, torch.nn.functional

    class Conv1D(nn.Module):
        """y = x @ W + b with W (in, out): GPT-2's layout, so the weights need no transpose."""

        def __init__(self, n_in, n_out):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(n_in, n_out))
            self.bias = nn.Parameter(torch.zeros(n_out))

        def forward(self, x):
            return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], -1)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn, self.c_proj = Conv1D(cfg.n_embd, 3 * cfg.n_embd), Conv1D(cfg.n_embd, cfg.n_embd)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.c_attn(x).split(C, dim=2)
            q, k, v = (t.view(B, T, cfg.n_head, C // cfg.n_head).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc, self.c_proj = Conv1D(cfg.n_embd, 4 * cfg.n_embd), Conv1D(4 * cfg.n_embd, cfg.n_embd)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.eps), nn.LayerNorm(cfg.n_embd, eps=cfg.eps)
            self.attn, self.mlp = Attention(), MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class TorchGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(cfg.vocab_size, cfg.n_embd), nn.Embedding(cfg.block_size, cfg.n_embd)
            self.h = nn.ModuleList(Block() for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.eps)

        def forward(self, idx, targets=None):
            T = idx.shape[1]
            x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
            for blk in self.h:
                x = blk(x)
            logits = self.ln_f(x) @ self.wte.weight.T                    # tied LM head
            if targets is None:
                return logits
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

        def load(self, params: dict):
            """Copy {HF name: NumPy array} into the parameters (names are the same)."""
            with torch.no_grad():
                for name, p in self.named_parameters():
                    p.copy_(torch.as_tensor(np.asarray(params[name])))
            return self

        def grads(self) -> dict:
            return {name: p.grad.detach().cpu().numpy() for name, p in self.named_parameters()}

    return TorchGPT().to(device=device, dtype=dtype)


def adamw(model, config, capturable: bool = False):
    """torch.optim.AdamW with weight decay on the same tensors as ours (fused=False, foreach: the default).
    capturable: for a CUDA graph, the learning rate a tensor on the GPU and every step's arithmetic there (its
    bias corrections in float32 on the GPU rather than in double on the host: the updates differ in rounding)."""
    torch = _torch()
    decay = [p for n, p in model.named_parameters() if is_decayed(n)]
    rest = [p for n, p in model.named_parameters() if not is_decayed(n)]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    if not capturable:
        return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps)
    lr = torch.tensor(config.lr, dtype=torch.float32, device=next(model.parameters()).device)
    return torch.optim.AdamW(groups, lr=lr, betas=(config.beta1, config.beta2), eps=config.eps, capturable=True)


def step(model, opt, config, step_index: int, idx, targets):
    """One PyTorch training step exactly like Trainer.step: loss, backward, clip, schedule, AdamW."""
    torch = _torch()
    opt.zero_grad(set_to_none=True)
    loss = model(idx, targets)
    loss.backward()
    if config.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    for g in opt.param_groups:
        g["lr"] = config.lr_at(step_index)
    opt.step()
    return loss.detach()


def loss_and_grads(cfg, params, idx, targets, dtype=None, device="cuda") -> tuple[float, dict]:
    """(loss, {HF name: NumPy gradient}) of one batch through the PyTorch model on `device`, built in `dtype`
    (default float32) from `params`: the autograd side of a gradient check."""
    torch = _torch()
    model = build(cfg, device=device, dtype=dtype).load(params)
    loss = model(torch.as_tensor(idx, device=device).long(), torch.as_tensor(targets, device=device).long())
    loss.backward()
    return loss.item(), model.grads()


__all__ = ["build", "adamw", "step", "loss_and_grads"]
