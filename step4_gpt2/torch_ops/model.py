"""GPT-2 in PyTorch in nanoGPT's shape (Block, CausalSelfAttention, MLP), on PyTorch's own ops or on the course's
fused kernels as torch custom ops (step4_gpt2.torch_ops.ops):

    model = GPT(shakespeare_char(vocab_size), course_ops=True).cuda()   # 4b's size and initialisation
    logits, loss = model(idx, targets)                                  # idx, targets (B, T) int64 on the GPU
    loss.backward()                                                     # the kernels' own backward passes

course_ops=False is plain PyTorch: F.layer_norm, F.gelu(approximate="tanh"), F.scaled_dot_product_attention and
F.cross_entropy. course_ops=True runs the course's kernels fused as lesson 4b fuses them: each residual add, with
the bias of the projection before it, goes into the LayerNorm that follows (ln_2, the next block's ln_1, ln_f);
c_fc's bias into the GELU; the loss and its gradient into the fused classifier; attention is flash attention
saving the log-sum-exp. The matrix products stay PyTorch's (cuBLAS, the same calls on both sides). Both variants
have the same modules, parameter names (GPT-2's: wte, h.0.attn.c_attn, ...) and initialisation (4b's
init_params), so one state_dict loads into either.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from step4_gpt2.train.model import init_params, shakespeare_char  # noqa: F401  (the lesson's names, here too)
from step4_gpt2.weights import GPTConfig  # noqa: F401

K = None            # step4_gpt2.torch_ops.ops, once a GPT(course_ops=True) is made


def course_kernels():
    """The course's ops module, imported by the first model that uses it: the pure-torch model needs neither
    CuPy nor a GPU. Imported outside forward(), so torch.compile never traces an import."""
    global K
    if K is None:
        from step4_gpt2.torch_ops import ops
        K = ops
    return K


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x, course: bool = False):
        B, T, C = x.size()
        qkv = self.c_attn(x)
        if course:           # c_proj's bias is added by the residual + LayerNorm kernel that follows
            return F.linear(K.attention(qkv, self.n_head), self.c_proj.weight)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in qkv.split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x, course: bool = False):
        if course:           # c_fc's bias goes into the GELU kernel, c_proj's into the next LayerNorm's
            return F.linear(K.bias_gelu(F.linear(x, self.c_fc.weight), self.c_fc.bias), self.c_proj.weight)
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.eps)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def forward_fused(self, x, h, next_ln: nn.LayerNorm):
        """The same block on the course's kernels. h = ln_1(x) comes in, already made by the kernel that added
        the previous residual; out go the block's residual stream and next_ln of it, again in one kernel."""
        a = self.attn(h, course=True)
        x, h = K.residual_layernorm(x, a, self.attn.c_proj.bias, self.ln_2.weight, self.ln_2.bias, self.ln_2.eps)
        m = self.mlp(h, course=True)
        return K.residual_layernorm(x, m, self.mlp.c_proj.bias, next_ln.weight, next_ln.bias, next_ln.eps)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, course_ops: bool = False, seed: int = 0):
        super().__init__()
        self.config, self.course_ops = config, bool(course_ops)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)     # also the LM head (tied)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.eps)
        self.load_gpt2_params(init_params(config, seed))
        if self.course_ops:
            from step4_gpt2.train.ops import HEAD_DIMS
            if config.head_dim not in HEAD_DIMS:
                raise ValueError(f"config: head_dim = n_embd / n_head = {config.head_dim}; the course's attention "
                                 f"kernels support {HEAD_DIMS}")
            course_kernels()

    def forward(self, idx, targets=None):
        """(logits (B, T, V), mean loss or None without targets)."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"idx: T={T} tokens per sequence, longer than block_size={self.config.block_size}")
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        if not self.course_ops:
            for block in self.h:
                x = block(x)
            logits = F.linear(self.ln_f(x), self.wte.weight)
            loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
            return logits, loss
        # 4b's order: a block ends inside the LayerNorm that opens the next one (or ln_f)
        first = self.h[0].ln_1
        h = K.layernorm(x, first.weight, first.bias, first.eps)
        for i, block in enumerate(self.h):
            x, h = block.forward_fused(x, h, self.h[i + 1].ln_1 if i + 1 < len(self.h) else self.ln_f)
        logits = F.linear(h, self.wte.weight)
        return logits, None if targets is None else K.cross_entropy(logits, targets)

    def load_gpt2_params(self, params: dict) -> "GPT":
        """Copy {GPT-2 name: array} into the model: 4b's init_params, or the course's weight files
        (step4_gpt2.weights). GPT-2 keeps its matrices as (in, out) (Conv1D), nn.Linear as (out, in)."""
        linear = {f"{n}.weight" for n, m in self.named_modules() if isinstance(m, nn.Linear)}
        missing = [n for n, _ in self.named_parameters() if n not in params]
        if missing:
            raise ValueError(f"params: no {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} "
                             f"(expected GPT-2's names for this config)")
        with torch.no_grad():
            for name, p in self.named_parameters():
                t = torch.as_tensor(np.asarray(params[name]))
                t = t.T if name in linear else t
                if t.shape != p.shape:
                    raise ValueError(f"params: {name} has shape {tuple(np.shape(params[name]))}; this config "
                                     f"expects {tuple(p.shape if name not in linear else p.T.shape)}")
                p.copy_(t)
        return self

    def gpt2_params(self) -> dict:
        """{GPT-2 name: NumPy float32 copy}, the layout load_gpt2_params reads (and lesson 4b's TrainGPT)."""
        linear = {f"{n}.weight" for n, m in self.named_modules() if isinstance(m, nn.Linear)}
        return {n: (p.T if n in linear else p).detach().float().cpu().numpy().copy()
                for n, p in self.named_parameters()}
