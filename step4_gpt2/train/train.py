"""Step 4b: train a GPT-2 on Shakespeare with the course's own kernels, fp32 - llm.c in Python.

    data = Data.shakespeare("char")                      # the plays, split by play; a character vocabulary
    model = TrainGPT(shakespeare_char(data.vocab_size))  # nanoGPT's shakespeare_char: 6 layers, 6 heads, C=384
    batch = batch_that_fits(model.config)                # 64, or less where the GPU's memory is short
    trainer = Trainer(model, TrainConfig(batch_size=batch, max_steps=2000), graph=True)
    hist = trainer.fit(data, steps=2000)                 # tqdm bar: loss, tokens/s; val loss every eval_every
    trainer.save("my_model", data.tokenizer)             # model.safetensors + config.json (+ char_vocab.json)
    gen = generate(model.to_gpt(), [data.tokenizer.encode("ROMEO:\n")], 200, temperature=0.8, eos=None)
    # (step4_gpt2.generate.generate) or: python -m step4_gpt2 --weights my_model "ROMEO:"

A step is the model's forward and backward pass (model.py), global grad-norm clipping, and one AdamW launch for
all parameters (step 3's train_update.cu). Parameters and gradients each live in ONE flat buffer, so the norm
is a single pass (AdamW applies the clipping factor to each gradient as it reads it).
Everything is deterministic: a run resumed from a checkpoint reproduces the uninterrupted run bit for bit.
`Trainer(..., graph=True)` replays the whole step as one CUDA graph (the GEMMs go through common.cublas, which
a capture can record; the learning rate is computed on the GPU).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, astuple, dataclass, fields
from pathlib import Path

import numpy as np

from common import expect_choice, expect_token_ids, memory_left
from common.reference.train_gpt2 import is_decayed, lr_at
from step3_fused.training import History
from step4_gpt2.train import ops
from step4_gpt2.train.model import TrainGPT, init_params, shakespeare_char  # noqa: F401  (the lesson's names, here too)
from step4_gpt2.weights import GPTConfig

OPTIMIZER_FILE, STATE_FILE = "optimizer.safetensors", "trainer_state.json"
TOKENIZERS = ("char", "gpt2")
EVAL_SEED = 12345        # added to the training seed: the evaluation batches, the same for every evaluation


class CheckpointError(ValueError):
    """A checkpoint that does not fit this model or trainer (another config, missing optimizer state)."""


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



# ============================================================================ memory
def activation_bytes(cfg: GPTConfig, batch: int, T: int | None = None) -> int:
    """The bytes a TrainGPT keeps for one batch shape (model.py's _Activations): per token, 16 C floats per layer
    (residuals, LayerNorm outputs, qkv, attention output, the MLP's 4C twice), 13 C floats of buffers shared by
    the layers (the last residual, ln_f, the gradients in flight) and the logits (V floats)."""
    T = T or cfg.block_size
    C, L, V, H = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.n_head
    per_token = 16 * C * L + 13 * C + V + 4 * L + 3 + H * L     # + mean, rstd, lse and the loss
    return 4 * batch * T * per_token


def batch_that_fits(cfg: GPTConfig, T: int | None = None, max_batch: int = 64, share: float = 0.5) -> int:
    """The largest power of two <= max_batch whose activations (activation_bytes) take at most `share` of
    memory_left() (the rest: weights, gradients, AdamW's state, temporaries, a CUDA graph's pool); at least 1."""
    budget = share * memory_left()
    batch = 1 << max(0, int(max_batch).bit_length() - 1)
    while batch > 1 and activation_bytes(cfg, batch, T) > budget:
        batch //= 2
    return batch


class _StepGraph:
    """One training step recorded as a CUDA graph (common.capture_graph) and replayed for each later batch of
    the same shape, on the caller's stream. No memory may be allocated while a stream is captured, and the
    step allocates temporaries (partial sums, the loss, the norm): so the first step runs without a graph on
    the trainer's own stream, with a memory pool of its own that then holds every temporary the step needs,
    and the capture takes the same buffers again from it. The pool lives as long as the trainer and lends
    them to no one else; what outlives a step (the optimiser's pointer table, the loss handed back) is made
    outside it. The batch is copied into the graph's input buffers before each replay."""

    def __init__(self, trainer: "Trainer", idx, targets, key):
        m, opt = trainer.model, trainer.opt
        if m.attention_version == 1:
            raise ValueError("graph=True: attention_version must be 2 or 3 (version 1's batched GEMMs go through "
                             "cupy.matmul, which CuPy refuses inside a graph capture)")
        self.key = key
        # Made in the model's memory, and held here too: the model may drop them for other shapes (it keeps
        # two), and the graph writes to these very addresses.
        self.acts = m._activations(*idx.shape)
        opt.prepare(m.grads)                               # AdamW's pointer table, in the optimiser's memory
        self._first_step(trainer, idx, targets)

    def _first_step(self, trainer, idx, targets):
        """The step run once without a graph, on the graph's stream and in its memory pool (made on the trainer's
        first graph): it allocates every buffer the capture takes again. Keeps the graph's copies of the batch."""
        import cupy as cp
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
        t, norm = trainer.opt.t, trainer._last_norm
        try:
            with cp.cuda.using_allocator(self.pool.malloc):
                self.graph = trainer._capture(
                    lambda: setattr(self, "loss", trainer._step_body(self.idx, self.targets)), self.stream)
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
    """Hyper-parameters (nanoGPT's shakespeare_char values, without dropout).

    AdamW here is (beta1, beta2) = (0.9, 0.99) with weight decay 0.1, where step 3's AdamW defaults to PyTorch's
    (0.9, 0.999) and 0.01: nanoGPT's settings for a small model trained briefly. beta2 = 0.99 averages the squared
    gradients over about 100 steps instead of 1000, so the step size follows the gradients' scale as it changes
    in a run of a few thousand steps; decay 0.1 regularises a 10M-parameter model that sees the same 1M
    characters again and again. Decay applies to the matrices and embeddings only (is_decayed)."""
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
        self._loss = None

    @property
    def last_norm(self):
        """The global gradient norm of the last step, before clipping (a CuPy scalar, a copy: with graph=True the
        step writes it into a buffer of its own; None before the first step)."""
        return None if self._last_norm is None else self._last_norm.copy()

    @property
    def last_loss(self):
        """The mean loss of the last step's batch, before its update: a CuPy 0-d array on the GPU, this step's
        own (later steps do not overwrite it); float(trainer.last_loss) waits for the GPU. None before the first
        step. step() returns nothing, so that a training loop queues steps without waiting for the GPU."""
        return self._loss

    def _capture(self, fn, stream):
        """The step's CUDA graph: kernels keep their streams' priorities (the weight gradients' stream is the
        highest), cuBLAS's memsets off the critical path (common.capture_graph)."""
        from common import capture_graph
        return capture_graph(fn, stream, node_priority=True)

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
        """One training step (forward, backward, clip, AdamW), queued on the GPU; returns nothing (the batch's
        loss before the update is last_loss)."""
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
        self._loss = loss
        if new_graph is not None:                                 # the step is counted even if recording fails
            new_graph.capture(self)                               # records the next steps
            self._step_graph = new_graph

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
            expect_token_ids(ids, V, name)
        hist, acc, n_acc = History(), cp.zeros((), cp.float32), 0
        bar = tqdm(total=steps, disable=not progress, desc="training", unit="step")
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for k in range(steps):
            x, y = data.batch("train", c.batch_size, T, step=self.step_count, seed=c.seed)
            self.step(cp.asarray(x), cp.asarray(y), check=False)
            acc += self._loss
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
    def from_checkpoint(cls, directory, config: TrainConfig | None = None, precision: str = "fp32",
                        recompute: bool = False) -> "Trainer":
        """A Trainer (model built from config.json) resumed from `directory`; the saved TrainConfig unless
        `config` is given. precision="bf16" (and recompute=True) resume in mixed precision (mixed.make_model):
        the checkpoint holds the fp32 master weights and AdamW state either way."""
        cfg, params, opt, state = _read_checkpoint(directory)
        if config is None:
            config = TrainConfig(**state["train_config"])
        if precision == "fp32" and not recompute:
            return cls(TrainGPT(cfg, params), config)._resume(opt, state)
        from step4_gpt2.train.mixed import make_model
        return cls(make_model(cfg, params, precision=precision, recompute=recompute), config)._resume(opt, state)


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
