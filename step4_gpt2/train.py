"""Step 4b: train a GPT-2 on Shakespeare with the course's own kernels, fp32 - llm.c in Python.

    data = Data.shakespeare("char")                      # the plays, split by play; a character vocabulary
    model = TrainGPT(shakespeare_char(data.vocab_size))  # nanoGPT's shakespeare_char: 6 layers, 6 heads, C=384
    trainer = Trainer(model, TrainConfig(max_steps=2000))
    hist = trainer.fit(data, steps=2000)                 # tqdm bar: loss, tokens/s; val loss every eval_every
    trainer.save("my_model", data.tokenizer)             # model.safetensors + config.json (+ char_vocab.json)
    print(generate(model, data.tokenizer, "ROMEO:\n"))   # or: python -m step4_gpt2 --weights my_model "ROMEO:"

A step is: encoder -> L x (LayerNorm, qkv GEMM, step 2's flash attention saving lse, proj GEMM, residual+LayerNorm,
fc GEMM, bias+GELU, proj GEMM, residual+LayerNorm) -> LM-head GEMM (tied to wte) -> fused classifier, then
the same backwards (train_gpt2.cu + cuBLAS; the weight gradients on a second stream, beside the rest of the
pass), global grad-norm clipping, and one AdamW launch for all parameters (step 3's train_update.cu).
Parameters and gradients each live in ONE flat buffer, so the norm is a single pass (AdamW applies the clipping
factor to each gradient as it reads it).
Everything is deterministic: a run resumed from a checkpoint reproduces the uninterrupted run bit for bit.
`Trainer(..., graph=True)` replays the whole step as one CUDA graph (the GEMMs go through common.cublas, which
a capture can record; the learning rate is computed on the GPU).
"""
from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import asdict, astuple, dataclass, fields
from pathlib import Path

import numpy as np

from common import expect_choice, require_gpu
from common.cublas import gemm, own_workspace
from common.reference.train_gpt2 import is_decayed, lr_at
from step3_fused.training import History, check_ids
from step4_gpt2 import train_ops as ops
from step4_gpt2.weights import GPTConfig, expected_shapes

OPTIMIZER_FILE, STATE_FILE = "optimizer.safetensors", "trainer_state.json"
TOKENIZERS = ("char", "gpt2")
EVAL_SEED = 12345        # added to the training seed: the evaluation batches, the same for every evaluation


class CheckpointError(ValueError):
    """A checkpoint that does not fit this model or trainer (another config, missing optimizer state)."""


def shakespeare_char(vocab_size: int, block_size: int = 256) -> GPTConfig:
    """nanoGPT's shakespeare_char size: 6 layers, 6 heads, C = 384, context 256 (10.7M parameters)."""
    return GPTConfig(n_layer=6, n_head=6, n_embd=384, vocab_size=vocab_size, block_size=block_size)


def init_params(cfg: GPTConfig, seed: int = 0) -> dict:
    """GPT-2's initialisation (as nanoGPT): N(0, 0.02) matrices and embeddings, the residual projections
    scaled by 1/sqrt(2 n_layer), zero biases, LayerNorm weights 1. NumPy float32, HF names."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if ".ln_" in name or name.startswith("ln_"):
            t = np.ones(shape) if name.endswith("weight") else np.zeros(shape)
        elif name.endswith("bias"):
            t = np.zeros(shape)
        else:
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
            t = std * rng.standard_normal(shape)
        out[name] = t.astype(np.float32)
    return out


# ============================================================================ data
class Data:
    """Token streams of the training and validation plays (whole plays: no line is in both) and their
    tokenizer. Batches are a pure function of (split, step, seed), so a resumed run sees the same ones."""

    def __init__(self, train_ids: np.ndarray, val_ids: np.ndarray, tokenizer):
        self.train, self.val = (np.ascontiguousarray(a, dtype=np.int32) for a in (train_ids, val_ids))
        self.tokenizer = tokenizer
        self.vocab_size = int(tokenizer.n_vocab)

    @classmethod
    def shakespeare(cls, tokenizer: str = "char", every: int = 10) -> "Data":
        """The course's Shakespeare (step 3's loader): every `every`-th play is validation. tokenizer "char"
        (one token per character, the vocabulary of the whole corpus) or "gpt2" (GPT-2's BPE, 50257)."""
        from step3_fused.shakespeare import train_val_text
        from step4_gpt2.tokenizer import BPETokenizer, CharTokenizer
        expect_choice(tokenizer, "tokenizer", TOKENIZERS)
        train_text, val_text = train_val_text(every)
        tok = CharTokenizer.from_text(train_text + val_text) if tokenizer == "char" else BPETokenizer()
        return cls(np.array(tok.encode(train_text)), np.array(tok.encode(val_text)), tok)

    def batch(self, split: str, batch: int, T: int, step: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(idx, targets), each (batch, T) int32: random windows of the split, targets shifted by one."""
        expect_choice(split, "split", ("train", "val"))
        ids = self.train if split == "train" else self.val
        if len(ids) <= T + 1:
            raise ValueError(f"T: {T} tokens per sequence, but the {split} split has only {len(ids)}")
        rng = np.random.default_rng([seed, step, 0 if split == "train" else 1])
        starts = rng.integers(0, len(ids) - T - 1, size=batch)
        rows = np.lib.stride_tricks.sliding_window_view(ids, T + 1)[starts]
        return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])


# ============================================================================ the model
@functools.lru_cache(maxsize=None)
def weight_grad_stream(device_id: int):
    """The stream TrainGPT.backward runs its weight gradients on, one per device and shared by every model:
    its cuBLAS workspace (common.cublas.own_workspace, 32 MB) lives as long as the process, so a stream per
    model would keep one per model ever built. Models run their backward passes one after another, and the
    events of each pass order its work on the shared stream.

    It has the GPU's highest stream priority (the pass runs at the default, the lowest): where both have blocks
    waiting for an SM, a weight gradient's go first. They have the least of the pass left beside them to hide
    in if they start late (docs/training.md measured the three choices). Inside the step's CUDA graph the
    priorities hold because the graph is instantiated with node priorities (common.capture_graph)."""
    import cupy as cp
    from common import stream_priorities
    with cp.cuda.Device(device_id):
        stream = cp.cuda.Stream(non_blocking=True, priority=stream_priorities()[1])
        own_workspace(stream)
    return stream


class _Activations:
    """Everything the backward pass reads, for one (B, T): per layer the residual streams, LayerNorm
    outputs and statistics, qkv, attention output and lse, the MLP pre-activation and GELU output."""

    def __init__(self, cfg: GPTConfig, B: int, T: int):
        import cupy as cp
        N, C, L, H = B * T, cfg.n_embd, cfg.n_layer, cfg.n_head
        e = lambda *s: cp.empty(s, cp.float32)  # noqa: E731
        self.B, self.T, self.N = B, T, N
        self.resid = [e(N, C) for _ in range(L + 1)]       # block inputs; resid[L] feeds ln_f
        self.ln1 = [e(N, C) for _ in range(L)]
        self.lnf = e(N, C)
        self.m1, self.r1 = [e(N) for _ in range(L + 1)], [e(N) for _ in range(L + 1)]   # [L]: ln_f
        self.qkv = [e(N, 3 * C) for _ in range(L)]
        self.atty = [e(B, T, C) for _ in range(L)]
        self.lse = [e(B, H, T) for _ in range(L)]
        self.resid2 = [e(N, C) for _ in range(L)]
        self.ln2 = [e(N, C) for _ in range(L)]
        self.m2, self.r2 = [e(N) for _ in range(L)], [e(N) for _ in range(L)]
        self.pre = [e(N, 4 * C) for _ in range(L)]             # c_fc output, before its bias
        self.h = [e(N, 4 * C) for _ in range(L)]
        self.tmp, self.dres, self.dln, self.datty = e(N, C), e(N, C), e(N, C), e(B, T, C)
        self.dh, self.dqkv = e(N, 4 * C), e(B, T, 3 * C)
        self.logits, self.losses = e(N, cfg.vocab_size), e(N)
        self.idx = None


class TrainGPT:
    """GPT-2 (HF layout and names) with a forward and a backward pass on the course's kernels.

    params / grads: {name: CuPy float32 view} into one flat buffer each (flat, gflat).
    attention_version: the attention, train_ops.ATTENTION_VERSIONS: 1 (the backward materialises P), 2 (flash-style
    on the FMA units), 3 (flash-style on tensor cores at fp32 accuracy; the default on sm_80+, else 2);
    embedding_version: the token-embedding backward, 1 (atomics) or 2 (deterministic, default)."""

    def __init__(self, config: GPTConfig, params: dict | None = None, seed: int = 0):
        import cupy as cp
        require_gpu()
        if config.head_dim not in ops.HEAD_DIMS:
            raise ValueError(f"config: head_dim = n_embd / n_head = {config.head_dim}; the attention kernels "
                             f"support {ops.HEAD_DIMS}")
        self.config = config
        self.shapes = expected_shapes(config)
        params = init_params(config, seed) if params is None else params
        from step4_gpt2.weights import validate
        validate(params, config)
        total = sum(int(np.prod(s)) for s in self.shapes.values())
        self.flat, self.gflat = cp.empty(total, cp.float32), cp.zeros(total, cp.float32)
        self.params, self.grads, off = {}, {}, 0
        for k, s in self.shapes.items():
            n = int(np.prod(s))
            self.params[k] = self.flat[off:off + n].reshape(s)
            self.grads[k] = self.gflat[off:off + n].reshape(s)
            self.params[k][...] = cp.asarray(np.asarray(params[k], dtype=np.float32))
            off += n
        self.attention_version, self.embedding_version = ops.default_attention_version(), 2
        self.overlap_weight_grads = True
        self._acts: dict = {}
        self._a = None
        self._side = None

    @property
    def n_params(self) -> int:
        return int(self.flat.size)

    def host_params(self) -> dict:
        """{name: NumPy float32 copy}, e.g. to save or to load into PyTorch."""
        return {k: v.get() for k, v in self.params.items()}

    def check_batch(self, idx, targets=None):
        """idx (and targets) (B, T) int32 on the GPU, T <= block_size, every id in [0, vocab_size)."""
        import cupy as cp
        cfg = self.config
        out = []
        for name, a in (("idx", idx), ("targets", targets)):
            if a is None:
                out.append(None)
                continue
            a = check_ids(cp.asarray(a) if isinstance(a, np.ndarray) else a, name, cfg.vocab_size, 2)
            if a.shape[1] > cfg.block_size:
                raise ValueError(f"{name}: a batch of T={a.shape[1]} tokens per sequence is longer than the "
                                 f"model's block_size={cfg.block_size}")
            if a.shape[0] < 1 or a.shape[1] < 1:
                raise ValueError(f"{name}: expected shape (B >= 1, T >= 1), got {a.shape}")
            out.append(a)
        if targets is not None and out[1].shape != out[0].shape:
            raise ValueError(f"targets: expected shape {out[0].shape} like idx, got {out[1].shape}")
        return out

    def _activations(self, B: int, T: int) -> _Activations:
        if (B, T) not in self._acts:
            if len(self._acts) >= 2:                 # training and evaluation shapes; drop the oldest
                self._acts.pop(next(iter(self._acts)))
            self._acts[(B, T)] = _Activations(self.config, B, T)
        return self._acts[(B, T)]

    def forward(self, idx, targets=None, grad: bool = True, check: bool = True):
        """With targets: the mean loss (a CuPy scalar, no sync); grad=True also leaves dlogits for backward().
        Without targets: the logits (B, T, V)."""
        if check:
            idx, targets = self.check_batch(idx, targets)
        cfg, P = self.config, self.params
        B, T = idx.shape
        a = self._activations(B, T)
        a.idx, N, C, L, H = idx, B * T, cfg.n_embd, cfg.n_layer, cfg.n_head
        p = lambda i, n: P[f"h.{i}.{n}"]  # noqa: E731
        x = ops.encoder_forward(idx, P["wte.weight"], P["wpe.weight"], out=a.resid[0])
        ops.layernorm_forward(x, p(0, "ln_1.weight"), p(0, "ln_1.bias"), cfg.eps, out=a.ln1[0], mean=a.m1[0], rstd=a.r1[0])
        for i in range(L):
            gemm(a.ln1[i], p(i, "attn.c_attn.weight"), a.qkv[i])
            ops.attention_forward(a.qkv[i].reshape(B, T, 3 * C), p(i, "attn.c_attn.bias"), H, out=a.atty[i], lse=a.lse[i],
                                  version=self.attention_version)
            gemm(a.atty[i].reshape(N, C), p(i, "attn.c_proj.weight"), a.tmp)
            ops.layernorm_forward(a.resid[i], p(i, "ln_2.weight"), p(i, "ln_2.bias"), cfg.eps, y=a.tmp,
                                  ybias=p(i, "attn.c_proj.bias"), resid=a.resid2[i], out=a.ln2[i], mean=a.m2[i], rstd=a.r2[i])
            gemm(a.ln2[i], p(i, "mlp.c_fc.weight"), a.pre[i])
            ops.gelu_bias_forward(a.pre[i], p(i, "mlp.c_fc.bias"), out=a.h[i])
            gemm(a.h[i], p(i, "mlp.c_proj.weight"), a.tmp)
            last = i + 1 == L
            w, b = (P["ln_f.weight"], P["ln_f.bias"]) if last else (p(i + 1, "ln_1.weight"), p(i + 1, "ln_1.bias"))
            ops.layernorm_forward(a.resid2[i], w, b, cfg.eps, y=a.tmp, ybias=p(i, "mlp.c_proj.bias"),
                                  resid=a.resid[i + 1], out=a.lnf if last else a.ln1[i + 1], mean=a.m1[i + 1], rstd=a.r1[i + 1])
        gemm(a.lnf, P["wte.weight"].T, a.logits)
        if targets is None:
            return a.logits.reshape(B, T, cfg.vocab_size)
        losses = ops.classifier(a.logits, targets.reshape(N), losses=a.losses, grad=grad)
        self._a = a if grad else None
        return losses.mean()

    def backward(self):
        """Gradients of the last forward(grad=True) into self.grads (overwritten).

        Each linear layer's weight gradient dW = x^T dy (and its bias's column sums) is needed only by the
        optimiser; the pass goes on with dx = dy W^T alone. So with overlap_weight_grads they run on a second
        stream, beside the rest of the pass (those GEMMs reduce over all N = B*T rows into a few output tiles,
        and leave SMs idle that the other stream's kernels can use). An event after each of them makes the
        pass wait before it overwrites what they read (dres, dh, dqkv); the last one before the embedding's
        gradient, which adds into wte's, and before returning. The same kernels and bits either way."""
        import cupy as cp
        a, cfg, P, G = self._a, self.config, self.params, self.grads
        if a is None:
            raise RuntimeError("backward: call forward(idx, targets, grad=True) first (once per backward)")
        self._a = None
        B, T, N, C, L, H = a.B, a.T, a.N, cfg.n_embd, cfg.n_layer, cfg.n_head
        p = lambda i, n: P[f"h.{i}.{n}"]  # noqa: E731
        g = lambda i, n: G[f"h.{i}.{n}"]  # noqa: E731
        side = self._weight_grad_stream() if self.overlap_weight_grads else None
        main = cp.cuda.get_current_stream()

        def done():                     # an event after the weight-gradient stream's work so far
            return side.record(cp.cuda.Event(disable_timing=True)) if side is not None else None

        def wait(event):                # the pass goes on only once that work has read its inputs
            if event is not None:
                main.wait_event(event)

        gemm(a.logits, P["wte.weight"], a.dln)                          # a.logits now holds dlogits
        with ops.beside(side):
            ops.weight_grad(a.logits, a.lnf, out=G["wte.weight"])        # the LM head's share of dwte
        ops.layernorm_backward(a.dln, a.resid[L], P["ln_f.weight"], a.m1[L], a.r1[L], dx=a.dres,
                               dweight=G["ln_f.weight"], dbias=G["ln_f.bias"])
        dqkv = a.dqkv.reshape(N, 3 * C)
        dh_read = dqkv_read = None
        for i in reversed(range(L)):
            # MLP: the residual's gradient a.dres is also the gradient of c_proj's output (and bias)
            wait(dh_read)
            ops.matmul_backward(a.dres, a.h[i], p(i, "mlp.c_proj.weight"), dx=a.dh, dweight=g(i, "mlp.c_proj.weight"),
                                dbias=g(i, "mlp.c_proj.bias"), stream=side)
            dres_read = done()
            ops.gelu_bias_backward(a.dh, a.pre[i], p(i, "mlp.c_fc.bias"), dpre=a.dh, dbias=g(i, "mlp.c_fc.bias"))
            ops.matmul_backward(a.dh, a.ln2[i], p(i, "mlp.c_fc.weight"), dx=a.dln, dweight=g(i, "mlp.c_fc.weight"),
                                dbias=False, stream=side)        # c_fc's bias gradient came with the GELU's
            dh_read = done()
            wait(dres_read)
            ops.layernorm_backward(a.dln, a.resid2[i], p(i, "ln_2.weight"), a.m2[i], a.r2[i], dx=a.dres,
                                   dweight=g(i, "ln_2.weight"), dbias=g(i, "ln_2.bias"), accumulate=True)
            # attention
            ops.matmul_backward(a.dres, a.atty[i].reshape(N, C), p(i, "attn.c_proj.weight"), dx=a.datty.reshape(N, C),
                                dweight=g(i, "attn.c_proj.weight"), dbias=g(i, "attn.c_proj.bias"), stream=side)
            dres_read = done()
            wait(dqkv_read)
            ops.attention_backward(a.datty, a.qkv[i].reshape(B, T, 3 * C), p(i, "attn.c_attn.bias"), a.atty[i],
                                   a.lse[i], H, dqkv=a.dqkv, version=self.attention_version)
            ops.matmul_backward(dqkv, a.ln1[i], p(i, "attn.c_attn.weight"), dx=a.dln, dweight=g(i, "attn.c_attn.weight"),
                                dbias=g(i, "attn.c_attn.bias"), stream=side)
            dqkv_read = done()
            wait(dres_read)
            ops.layernorm_backward(a.dln, a.resid[i], p(i, "ln_1.weight"), a.m1[i], a.r1[i], dx=a.dres,
                                   dweight=g(i, "ln_1.weight"), dbias=g(i, "ln_1.bias"), accumulate=True)
        wait(done())                    # all of it: the embedding adds into dwte, the optimiser reads every dW
        ops.encoder_backward(a.dres, a.idx, G["wte.weight"], G["wpe.weight"], version=self.embedding_version)
        return G

    def _weight_grad_stream(self):
        """The second stream of backward(): the device's (weight_grad_stream), taken on first use."""
        import cupy as cp
        if self._side is None:
            self._side = weight_grad_stream(cp.cuda.Device().id)
        return self._side

    def loss_and_grads(self, idx, targets, check: bool = True):
        loss = self.forward(idx, targets, grad=True, check=check)
        self.backward()
        return loss


class _StepGraph:
    """One training step recorded as a CUDA graph (common.capture_graph) and replayed for each later batch of
    the same shape, on the caller's stream. No memory may be allocated while a stream is captured, and the
    step allocates temporaries (partial sums, the loss, the norm): so the first step runs without a graph on
    the trainer's own stream, with a memory pool of its own that then holds every temporary the step needs,
    and the capture takes the same buffers again from it. The pool lives as long as the trainer and lends
    them to no one else; what outlives a step (the optimiser's pointer table, the loss handed back) is made
    outside it. The batch is copied into the graph's input buffers before each replay."""

    def __init__(self, trainer: "Trainer", idx, targets, key):
        import cupy as cp
        m, opt = trainer.model, trainer.opt
        if m.attention_version == 1:
            raise ValueError("graph=True: attention_version must be 2 or 3 (version 1's batched GEMMs go through "
                             "cupy.matmul, which CuPy refuses inside a graph capture)")
        self.key = key
        # Made in the model's memory, and held here too: the model may drop them for other shapes (it keeps
        # two), and the graph writes to these very addresses.
        self.acts = m._activations(*idx.shape)
        opt.prepare(m.grads)                               # AdamW's pointer table, in the optimiser's memory
        self.idx, self.targets = idx.copy(), targets.copy()
        if trainer._graph_memory is None:
            trainer._graph_memory = (cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool())
        self.stream, self.pool = trainer._graph_memory
        caller = cp.cuda.get_current_stream()
        self.stream.wait_event(caller.record())
        with cp.cuda.using_allocator(self.pool.malloc), self.stream:
            loss = trainer._step_body(self.idx, self.targets)
        caller.wait_event(self.stream.record())
        self.first_loss = loss.copy()                      # in the caller's memory, on the caller's stream

    def capture(self, trainer: "Trainer"):
        """Record the step (it does not run: the optimiser's host-side count is put back)."""
        import cupy as cp
        from common import capture_graph
        t, norm = trainer.opt.t, trainer._last_norm
        try:
            with cp.cuda.using_allocator(self.pool.malloc):
                self.graph = capture_graph(
                    lambda: setattr(self, "loss", trainer._step_body(self.idx, self.targets)), self.stream,
                    node_priority=True, hoist_memsets=trainer.hoist_memsets)
        except Exception as e:
            trainer.graph = False
            raise RuntimeError(f"graph=True: capturing the training step failed ({type(e).__name__}: {e}); this "
                               f"step ran without a graph, and the trainer now launches the kernels one by one "
                               f"(graph=False)") from e
        finally:
            self.norm, trainer._last_norm = trainer._last_norm, norm    # the graph's buffer; the step's value
            trainer.opt.t = t

    def replay(self, idx, targets):
        self.idx[...] = idx
        self.targets[...] = targets
        self.graph.launch()                                # on the current stream, after the copies
        return self.loss.copy()                            # the next replay overwrites self.loss


# ============================================================================ optimiser, schedule, training
@dataclass
class TrainConfig:
    """Hyper-parameters (nanoGPT's shakespeare_char values, without dropout)."""
    batch_size: int = 64
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 100
    max_steps: int = 5000            # where the cosine reaches min_lr
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-8
    grad_clip: float = 1.0           # 0: no clipping
    eval_every: int = 250
    eval_batches: int = 20
    seed: int = 0

    def __post_init__(self):
        for k in ("lr", "min_lr"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{k}: the learning rate must be a positive number, got {v!r}")
        for k in ("batch_size", "max_steps", "eval_every", "eval_batches"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{k}: expected a positive integer, got {v!r}")
        if not 0 <= self.warmup <= self.max_steps:
            raise ValueError(f"warmup: expected 0 <= warmup <= max_steps={self.max_steps}, got {self.warmup}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError(f"grad_clip / weight_decay: expected >= 0, got {self.grad_clip} / {self.weight_decay}")

    def lr_at(self, step: int) -> float:
        return lr_at(step, self.lr, self.warmup, self.max_steps, self.min_lr)


class Trainer:
    """AdamW (step 3's one-launch multi-tensor kernel) + warm-up/cosine schedule + clipping around a TrainGPT.

    graph=True: the whole step (forward, backward, clipping, schedule, AdamW: several hundred launches) is
    recorded once as a CUDA graph and replayed for every later step of the same batch shape: one launch per
    step, so the host's Python no longer sets the pace. The same kernels and the same bits as graph=False."""

    def __init__(self, model: TrainGPT, config: TrainConfig | None = None, graph: bool = False):
        import cupy as cp
        from step3_fused.training import AdamW
        self.model, self.config, self.graph = model, config or TrainConfig(), bool(graph)
        c = self.config
        decayed = [k for k in model.params if is_decayed(k)]
        self.opt = AdamW(model.params, lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps, weight_decay=c.weight_decay,
                         decayed=decayed)
        self.step_count = 0
        self._last_norm = None
        # The step counter and AdamW's t also live on the GPU, where the schedule kernel reads them.
        self._counters, self._sched = cp.zeros(2, cp.int64), cp.zeros(4, cp.float32)
        self._gpu_counters = (0, 0)        # what the host knows the GPU's counters hold (None: not known)
        self._step_graph = None
        self._graph_memory = None          # (stream, memory pool) of this trainer's graphs, made on first use
        self.hoist_memsets = True          # common.capture_graph's: cuBLAS's memsets off the graph's critical path

    @property
    def last_norm(self):
        """The global gradient norm of the last step, before clipping (a CuPy scalar, a copy: with graph=True the
        step writes it into a buffer of its own; None before the first step)."""
        return None if self._last_norm is None else self._last_norm.copy()

    def _sync_counters(self):
        """The GPU's counters follow the host's: after a resume, a step_count set by hand, or a failed step."""
        if self._gpu_counters != (self.step_count, self.opt.t):
            self._counters.set(np.array([self.step_count, self.opt.t], np.int64))
            self._gpu_counters = (self.step_count, self.opt.t)

    def _update(self):
        """Everything after the backward pass; reads nothing from the host that changes from step to step."""
        c = self.config
        self._last_norm = ops.grad_norm(self.model.gflat)
        ops.adamw_schedule(self._counters, self._sched, c.lr, c.min_lr, c.warmup, c.max_steps, self.opt.betas,
                           self._last_norm, c.grad_clip)
        self.opt.step(self.model.grads, sched=self._sched)         # clips each gradient as it reads it

    def _step_body(self, idx, targets):
        loss = self.model.loss_and_grads(idx, targets, check=False)
        self._update()
        return loss

    def step(self, idx, targets, check: bool = True):
        """One training step (forward, backward, clip, AdamW); the batch's loss before the update (CuPy scalar)."""
        from common.cublas import tf32_enabled
        if check:
            idx, targets = self.model.check_batch(idx, targets)
        self._sync_counters()
        self.opt.lr = self.config.lr_at(self.step_count)          # the host's copy, for whoever prints it
        self._gpu_counters = None                                 # until this step has run
        new_graph = None
        if not self.graph:
            loss = self._step_body(idx, targets)                  # AdamW counts opt.t itself
        else:
            # everything the graph bakes in: shapes, code paths, precision, hyper-parameters, the objects it uses
            o = self.opt
            key = (tuple(idx.shape), tuple(targets.shape), self.model.attention_version,
                   self.model.embedding_version, tf32_enabled(), astuple(self.config), o.betas, o.eps, o.wd,
                   tuple(o.decayed), id(self.model), id(o))
            if self._step_graph is not None and self._step_graph.key == key:
                loss = self._step_graph.replay(idx, targets)
                self._last_norm = self._step_graph.norm
                o.t += 1
            else:
                self._step_graph = None                           # its buffers go back to the pool first
                new_graph = _StepGraph(self, idx, targets, key)   # runs this step without a graph
                loss = new_graph.first_loss
        self.step_count += 1
        self._gpu_counters = (self.step_count, self.opt.t)
        if new_graph is not None:                                 # the step is counted even if recording fails
            new_graph.capture(self)                               # records the next steps
            self._step_graph = new_graph
        return loss

    def evaluate(self, data: Data, split: str = "val", batches: int | None = None, T: int | None = None) -> float:
        """Mean loss over `batches` fixed batches of the split (the same ones every time: comparable)."""
        import cupy as cp
        c, T = self.config, T or self.model.config.block_size
        total = cp.zeros((), cp.float64)
        n = batches or c.eval_batches
        for i in range(n):
            x, y = data.batch(split, c.batch_size, T, step=i, seed=c.seed + EVAL_SEED)
            total += self.model.forward(cp.asarray(x), cp.asarray(y), grad=False, check=False)
        return float(total) / n

    def fit(self, data: Data, steps: int, time_budget_s: float | None = None, progress: bool = True,
            log_every: int = 10, T: int | None = None) -> History:
        """Train from self.step_count for `steps` steps (or until time_budget_s of training time has passed),
        validation loss every config.eval_every steps and at the end. Token ids are checked once here."""
        import cupy as cp
        from tqdm.auto import tqdm
        c, T = self.config, T or self.model.config.block_size
        V = self.model.config.vocab_size
        for name, ids in (("data.train", data.train), ("data.val", data.val)):
            if ids.size and (ids.min() < 0 or ids.max() >= V):
                raise ValueError(f"{name}: token ids must be in [0, {V}) (the model's vocab_size)")
        hist, acc, n_acc = History(), cp.zeros((), cp.float32), 0
        bar = tqdm(total=steps, disable=not progress, desc="training", unit="step")
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for k in range(steps):
            x, y = data.batch("train", c.batch_size, T, step=self.step_count, seed=c.seed)
            acc += self.step(cp.asarray(x), cp.asarray(y), check=False)
            n_acc += 1
            hist.tokens += x.size
            done = k + 1 == steps
            if (k + 1) % log_every == 0 or done or self.step_count % c.eval_every == 0:
                hist.steps.append(self.step_count)
                hist.train.append(float(acc) / n_acc)          # syncs
                hist.seconds += time.perf_counter() - t0
                acc, n_acc = cp.zeros((), cp.float32), 0
                out_of_time = time_budget_s is not None and hist.seconds >= time_budget_s
                if self.step_count % c.eval_every == 0 or done or out_of_time:
                    hist.val_steps.append(self.step_count)
                    hist.val.append(self.evaluate(data, T=T))
                bar.set_postfix(loss=f"{hist.train[-1]:.3f}", val=f"{hist.val[-1]:.3f}" if hist.val else "-",
                                tok_s=f"{hist.tokens / hist.seconds:,.0f}")
                bar.update((k + 1) - bar.n)
                cp.cuda.Device().synchronize()
                t0 = time.perf_counter()
                if out_of_time:
                    break
        bar.close()
        return hist

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory, tokenizer=None) -> Path:
        """model.safetensors + config.json (Hugging Face GPT2LMHeadModel layout), char_vocab.json for a
        character tokenizer, optimizer.safetensors (AdamW m, v) and trainer_state.json (step, configs)."""
        from safetensors.numpy import save_file
        from step4_gpt2 import weights
        directory = Path(directory)
        weights.save(self.model.host_params(), self.model.config, directory)
        if tokenizer is not None and getattr(tokenizer, "kind", None) == "char":
            tokenizer.save(directory)
        state = {f"m.{k}": v.get() for k, v in self.opt.m.items()}
        state.update({f"v.{k}": v.get() for k, v in self.opt.v.items()})
        save_file(state, str(directory / OPTIMIZER_FILE))
        (directory / STATE_FILE).write_text(json.dumps(
            {"step": self.step_count, "adam_t": self.opt.t, "train_config": asdict(self.config),
             "model_config": self.model.config.to_hf()}, indent=1))
        return directory

    def load(self, directory) -> "Trainer":
        """Continue from a checkpoint saved by save(): weights, AdamW state and step. CheckpointError if it
        was made for another model config (or has no optimizer state)."""
        import cupy as cp
        _, params, opt, state = _read_checkpoint(directory, self.model.config)
        for k in self.model.params:
            self.model.params[k][...] = cp.asarray(params[k])
        return self._resume(opt, state)

    def _resume(self, opt: dict, state: dict) -> "Trainer":
        """The AdamW moments and the step of a checkpoint (as _read_checkpoint returns them)."""
        import cupy as cp
        for k in self.model.params:
            self.opt.m[k][...] = cp.asarray(opt[f"m.{k}"])
            self.opt.v[k][...] = cp.asarray(opt[f"v.{k}"])
        self.step_count, self.opt.t = int(state["step"]), int(state["adam_t"])
        return self

    @classmethod
    def from_checkpoint(cls, directory, config: TrainConfig | None = None) -> "Trainer":
        """A Trainer (model built from config.json) resumed from `directory`; the saved TrainConfig unless
        `config` is given."""
        cfg, params, opt, state = _read_checkpoint(directory)
        if config is None:
            config = TrainConfig(**state["train_config"])
        return cls(TrainGPT(cfg, params), config)._resume(opt, state)


def _read_checkpoint(directory, model_config: GPTConfig | None = None) -> tuple[GPTConfig, dict, dict, dict]:
    """(model config, weights, AdamW state, trainer state) of a checkpoint saved by Trainer.save, each file read
    once. CheckpointError if it was made for another model config than model_config (None: any), or has no
    optimizer state."""
    from safetensors.numpy import load_file
    from step4_gpt2 import weights
    directory = Path(directory)
    cfg = GPTConfig.from_file(directory / weights.CONFIG_FILE)
    if model_config is not None:
        diff = [f"{f.name}={getattr(cfg, f.name)} (this model: {getattr(model_config, f.name)})"
                for f in fields(GPTConfig) if getattr(cfg, f.name) != getattr(model_config, f.name)]
        if diff:
            raise CheckpointError(f"directory: {directory} holds a checkpoint of another model config: {', '.join(diff)}")
    if not (directory / OPTIMIZER_FILE).is_file() or not (directory / STATE_FILE).is_file():
        raise CheckpointError(f"directory: {directory} has no {OPTIMIZER_FILE} / {STATE_FILE}: it holds weights "
                              f"only, not a training state to resume (load the weights with TrainGPT instead)")
    _, params = weights.load_file(directory, cfg)
    return cfg, params, load_file(str(directory / OPTIMIZER_FILE)), json.loads((directory / STATE_FILE).read_text())


# ============================================================================ text and plots
def generate(model: TrainGPT, tokenizer, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
             top_k: int | None = None, seed: int = 0) -> str:
    """Sample from the model being trained, on its own forward pass (the whole window each token; simple,
    and fast enough for a few hundred characters) with step 4's sampler. temperature 0 = greedy."""
    import cupy as cp
    from step4_gpt2.generate import check_sampling, sample
    check_sampling(temperature, top_k, None)
    rng = np.random.default_rng(seed)
    ids = list(tokenizer.encode(prompt)) or [0]
    T = model.config.block_size
    for _ in range(max_new_tokens):
        window = cp.asarray(np.array(ids[-T:], dtype=np.int32)[None])
        z = model.forward(window, check=False)[:, -1].get()          # (1, V): sampled on the host, in float64
        ids.append(int(sample(z, rng.random(1), temperature, top_k)[0]))
    return tokenizer.decode(ids)


def plot_losses(hists: dict, ax=None, title: str = "loss"):
    """Train (thin) and validation (markers) loss of one or several runs: {label: History}."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    for label, h in hists.items():
        line, = ax.plot(h.steps, h.train, lw=1, alpha=0.7, label=f"{label} train")
        if h.val:
            ax.plot(h.val_steps, h.val, "o-", color=line.get_color(), label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return ax
