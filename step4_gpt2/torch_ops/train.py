"""Train the torch GPT of model.py on Shakespeare the way lesson 4b trains its own: the same plays, batches,
AdamW hyper-parameters (TrainConfig), warm-up and cosine schedule and gradient clipping.

    model = GPT(shakespeare_char(shakespeare().vocab_size), course_ops=True).cuda()    # model.py
    losses = train(model, steps=200, batch=64, block=256, seed=0)              # eager
    losses = train(model, steps=200, batch=64, block=256, seed=0, compile=True)  # torch.compile(model)
    losses = train(model, steps=200, batch=64, block=256, seed=0, graph=True)    # each step one CUDA graph

A step is the forward pass and loss, backward, clipping and one AdamW update. Nothing in it waits for the GPU:
the batch is copied from pinned memory and the losses are read once at the end. graph=True records the whole
step with torch.cuda.graph and replays it. A graph keeps the addresses it was recorded with and the values it
read from the host: so each batch is copied into the same input buffers, and AdamW gets capturable=True, which
keeps the learning rate in a tensor on the GPU (each step's rate is written there) and its bias corrections on
the GPU too.
"""
from __future__ import annotations

import functools

import torch

from common import expect_int
from step4_gpt2.train.torch_gpt import adamw  # noqa: F401  (4b's AdamW groups; capturable for a CUDA graph)
from step4_gpt2.train.train import Data, TrainConfig  # noqa: F401  (the lesson's names, here too)

WARMUP_STEPS = 3        # eager steps before graph=True records one: AdamW's state and cuBLAS's handles exist by then


@functools.lru_cache(maxsize=2)
def shakespeare(tokenizer: str = "char") -> Data:
    """Lesson 4b's data (Data.shakespeare), made once per process."""
    return Data.shakespeare(tokenizer)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """The rate of the next step; with a capturable AdamW written into its tensor on the GPU (no wait: a CUDA
    graph reads it there)."""
    for g in opt.param_groups:
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(lr)
        else:
            g["lr"] = lr


def train_step(forward, model, opt, config: TrainConfig, idx, targets):
    """One step (the rate set before with set_lr): loss, backward, clipping, AdamW; the loss, detached.
    forward is the model or torch.compile(model); model gives the parameters."""
    opt.zero_grad(set_to_none=True)
    _, loss = forward(idx, targets)
    loss.backward()
    if config.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    opt.step()
    return loss.detach()


class GraphStep:
    """train_step recorded once as a CUDA graph (torch.cuda.graph) and replayed for every later batch of the same
    shape. The first WARMUP_STEPS steps run eagerly on a side stream, as PyTorch's recipe asks, so that everything
    made on first use (AdamW's moments and step counts, cuBLAS's workspaces, a compiled model's kernels) exists
    before the capture: nothing is allocated outside the graph's own memory pool while it records. The capture
    itself runs nothing, so the step it records is replayed at once."""

    def __init__(self, forward, model, opt, config: TrainConfig):
        self.forward, self.model, self.opt, self.config = forward, model, opt, config
        self.warm, self.graph = 0, None
        self.side = torch.cuda.Stream()

    def __call__(self, idx, targets):
        if self.graph is None and self.warm < WARMUP_STEPS:
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                loss = train_step(self.forward, self.model, self.opt, self.config, idx, targets)
            torch.cuda.current_stream().wait_stream(self.side)
            self.warm += 1
            return loss
        if self.graph is None:
            self.idx, self.targets = idx.clone(), targets.clone()     # the graph's input buffers
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.loss = train_step(self.forward, self.model, self.opt, self.config, self.idx, self.targets)
            self.graph = graph                                      # only a finished capture is replayed
        else:
            if idx.shape != self.idx.shape or targets.shape != self.targets.shape:
                raise ValueError(f"idx: the CUDA graph was recorded for batches of shape {tuple(self.idx.shape)}, "
                                 f"got {tuple(idx.shape)} (targets {tuple(targets.shape)})")
            self.idx.copy_(idx)
            self.targets.copy_(targets)
        self.graph.replay()
        return self.loss.clone()                                    # the next replay overwrites self.loss


def stepper(model: torch.nn.Module, config: TrainConfig, compile: bool = False, graph: bool = False):
    """(optimiser, step(s, idx, targets) -> loss): step number s sets the scheduled rate, then one training step
    in the chosen mode; the loss is a 0-d tensor on the model's device, the batch's loss before the update."""
    device = next(model.parameters()).device
    if graph and device.type != "cuda":
        raise ValueError(f"graph: a CUDA graph needs the model on a CUDA device; it is on {device}")
    opt = adamw(model, config, capturable=graph)
    forward = torch.compile(model) if compile else model
    run = (GraphStep(forward, model, opt, config) if graph
           else functools.partial(train_step, forward, model, opt, config))

    def step(s: int, idx, targets):
        set_lr(opt, config.lr_at(s))
        return run(idx, targets)
    return opt, step


def to_device(a, device: torch.device) -> torch.Tensor:
    """A NumPy batch as int64 on `device`; to a GPU through pinned memory, so the copy does not wait for it."""
    t = torch.from_numpy(a).long()
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def train(model: torch.nn.Module, steps: int, batch: int = 64, block: int = 256, seed: int = 0,
          compile: bool = False, graph: bool = False, data: Data | None = None,
          config: TrainConfig | None = None) -> list[float]:
    """Train `model` for `steps` steps on Shakespeare's training plays (4b's Data: batches fixed by seed and step
    number) and return each step's loss, on its batch before the update. config: 4b's TrainConfig, by default
    its hyper-parameters with the cosine ending at `steps` and a warm-up of a tenth of them (at most 100).
    compile: the forward pass through torch.compile(model). graph: each step replayed as one CUDA graph."""
    for name, v in (("steps", steps), ("batch", batch), ("block", block)):
        expect_int(v, name)
    if block > model.config.block_size:
        raise ValueError(f"block: {block} tokens per sequence, longer than the model's block_size="
                         f"{model.config.block_size}")
    data = data or shakespeare()
    if data.vocab_size > model.config.vocab_size:
        raise ValueError(f"data: {data.vocab_size} tokens in its vocabulary, more than the model's vocab_size="
                         f"{model.config.vocab_size}")
    config = config or TrainConfig(batch_size=batch, max_steps=steps, warmup=min(100, steps // 10), seed=seed)
    device = next(model.parameters()).device
    _, step = stepper(model, config, compile=compile, graph=graph)
    losses = []
    for s in range(steps):
        x, y = data.batch("train", batch, block, step=s, seed=seed)
        losses.append(step(s, to_device(x, device), to_device(y, device)))
    return torch.stack(losses).tolist()
