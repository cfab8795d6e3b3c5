"""Step 4e: data parallel training of 4b's GPT, one process per GPU, NCCL through CuPy (comm.py) - and ZeRO-1.

    comm = Comm(rank, world, unique_id)                       # one rank's communicator (launch.py starts the ranks)
    model = TrainGPT(shakespeare_char(data.vocab_size))       # the same seed on every rank (and rank 0's weights
    dp = DataParallelTrainer(model, TrainConfig(batch_size=64), comm, zero1=True)   #  broadcast to be sure)
    hist = dp.fit(data, steps=2000)                           # 4b's loop: each rank trains on its rows of the batch

Every rank draws the same global batch of `batch_size` rows (4b's Data is a pure function of the step) and keeps
rows [rank * b, (rank + 1) * b), b = batch_size / world. Its gradient is the mean over its own rows, so the mean
over ranks ("avg") is the gradient of the global batch's mean loss: the same step as one GPU, up to rounding.

The gradients are reduced while the backward pass still runs (llm.c, PyTorch DDP). gflat is cut into buckets of
about `bucket_mb`; the backward produces the layers from the last to the first (h.{L-1} first, wte last, as the
tied embedding's gradient is finished by the encoder's backward), and a bucket is all-reduced on a stream of its
own as soon as every tensor it touches is finished, beside the backward of the layers below it. Every rank sees
the same access order, so every rank issues the same collectives in the same order (NCCL needs that).

The reduction order: each gradient element is (sum over ranks of the rank's mean gradient) / world, the sum in
the order NCCL's algorithm picks (ring or tree; NCCL_ALGO=Ring fixes it), the same result on every rank. With
accumulate = A micro-batches per step, a rank first adds its A gradients in micro-batch order, divides by A, then
reduces. One GPU sums its B rows inside each GEMM instead: the runs agree to rounding (float32: about 1e-6).

ZeRO-1 (Rajbhandari et al., "ZeRO: memory optimizations toward training trillion parameter models", stage 1):
each bucket is reduce-scattered instead (rank r receives the mean gradient of the bucket's r-th 1/world), AdamW
runs on those slices of flat only (its m and v: 1/world of one GPU's), and an all-gather of each bucket hands every
rank the updated weights. reduce-scatter + all-gather move the same bytes as one all-reduce: no extra traffic.
The gradient norm for clipping is then one more all-reduce, of this rank's sum of squares (a single float).

graph=True records the whole step as one CUDA graph, as 4b's Trainer does, the collectives included: NCCL enqueues
a collective on a stream like a kernel, so a capture records it as a node of the graph. The reduction stream joins
the capture through events (it waits on an event of the captured stream, and the captured stream waits on it
before the update), so the buckets' collectives are recorded beside the backward's kernels. Every rank records the
same collectives in the same order (the same buckets, the same access order) and replays them together, one graph
launch per step. Inside the capture nothing waits on the host: the bounded wait (comm.wait) comes after each
replay, as after an eager step. NCCL keeps a communicator alive while a graph that recorded its collectives
exists (its destroy and abort wait for those graphs), so the trainer registers close() with comm.on_abort: the
communicator drops the graph first when it ends, closed or aborted (a peer lost in the middle of a replay: NCCL's
abort ends the replay's collectives, and the graph, destroyed already, is freed as that replay finishes).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
from dataclasses import asdict, astuple
from pathlib import Path

import numpy as np

from common import expect_int
from step4_gpt2.train.train import OPTIMIZER_FILE, STATE_FILE, CheckpointError, Trainer, TrainConfig, _StepGraph

BUCKET_MB = 25.0        # gradients per bucket, in MB: the trainer's default (04e and the benchmark sweep it)

SHARD_FILE = "optimizer.rank{rank:03d}-of-{world:03d}.safetensors"   # ZeRO-1: each rank's m and v
DP_KEY = "data_parallel"                                              # its entry in trainer_state.json
ALIGN = 64                # floats: bucket and slice boundaries fall on multiples of 256 bytes


class ConfigMismatchError(ValueError):
    """The ranks were started with different configurations (they would train different models, or deadlock)."""


# ============================================================================ the plan (pure: CPU-tested)
def tensor_ranges(shapes: dict) -> dict:
    """{name: (lo, hi)}: where each tensor lives in the flat buffer (TrainGPT's order: the dict's)."""
    out, off = {}, 0
    for k, s in shapes.items():
        n = int(np.prod(s))
        out[k] = (off, off + n)
        off += n
    return out


def local_batch(batch_size: int, world: int, accumulate: int = 1) -> int:
    """Rows per rank and micro-batch: batch_size / (world * accumulate), a named error if it does not divide."""
    for name, v in (("world", world), ("accumulate", accumulate)):
        expect_int(v, name)
    if batch_size % (world * accumulate):
        raise ValueError(f"batch_size: {batch_size} rows do not split into {world} ranks x {accumulate} micro-batches "
                         f"(choose a multiple of {world * accumulate})")
    return batch_size // (world * accumulate)


def plan_buckets(shapes: dict, world: int, bucket_elems: int) -> list[tuple[int, int]]:
    """Bucket boundaries [(lo, hi), ...] over the flat buffer, in address order, covering it padded to a multiple
    of world * ALIGN. A bucket ends where a tensor ends once it holds >= bucket_elems (so one large tensor is one
    bucket), rounded down to a multiple of world * ALIGN: ZeRO-1 splits every bucket into `world` equal slices,
    each starting on a 256-byte boundary (NCCL moves aligned buffers fastest)."""
    if bucket_elems < 1:
        raise ValueError(f"bucket_elems: expected a positive size, got {bucket_elems}")
    unit = world * ALIGN
    ranges = tensor_ranges(shapes)
    total = max((hi for _, hi in ranges.values()), default=0)
    cuts, lo = [], 0
    for _, hi in ranges.values():
        cut = hi // unit * unit
        if cut - lo >= bucket_elems and hi < total:
            cuts.append((lo, cut))
            lo = cut
    padded = -(-total // unit) * unit
    if padded > lo:
        cuts.append((lo, padded))
    return cuts


def layer_of(name: str, n_layer: int) -> int:
    """The order in which the backward finishes a tensor's gradient: ln_f first (n_layer), then h.{L-1} ...
    h.0, then wte and wpe (-1: the encoder's backward adds into wte after everything else)."""
    if name.startswith("h."):
        return int(name.split(".")[1])
    return n_layer if name.startswith("ln_f") else -1


class ReadyTracker:
    """Which buckets the backward pass has finished, from the order it takes the gradient buffers.

    TrainGPT.backward takes each gradient (model.grads[name]) just before the kernel that writes it. When it takes
    a tensor of layer j (layer_of), every layer it took before that comes later in layer_of's order has had all
    its kernels enqueued. (wte is taken first too, by the LM head, but belongs to -1: finished last.) A bucket is
    ready once every layer it overlaps is finished; touch() returns the newly ready ones, highest address first."""

    def __init__(self, buckets: list, ranges: dict, n_layer: int):
        self.n_layer = n_layer
        self.layers = [{layer_of(k, n_layer) for k, (a, b) in ranges.items() if a < hi and b > lo}
                       for lo, hi in buckets]
        self.reset()

    def reset(self):
        self.taken, self.finished = set(), set()
        self.issued = [False] * len(self.layers)

    def _ready(self) -> list[int]:
        out = [i for i in reversed(range(len(self.layers))) if not self.issued[i] and self.layers[i] <= self.finished]
        for i in out:
            self.issued[i] = True
        return out

    def touch(self, name: str) -> list[int]:
        j = layer_of(name, self.n_layer)
        self.finished |= {t for t in self.taken if t > j}
        self.taken.add(j)
        return self._ready()

    def finish(self) -> list[int]:
        self.finished |= set().union(*self.layers)
        return self._ready()


class _WatchedGrads(dict):
    """model.grads, telling `on_take` which gradient the backward takes (only while `on_take` is set)."""
    on_take = None

    def __getitem__(self, k):
        if self.on_take is not None:
            self.on_take(k)
        return dict.__getitem__(self, k)


def shard_slices(buckets: list, rank: int, world: int) -> list[tuple[int, int]]:
    """This rank's slice of every bucket: [(lo, hi), ...] in flat offsets (what reduce-scatter hands it)."""
    out = []
    for lo, hi in buckets:
        n = (hi - lo) // world
        out.append((lo + rank * n, lo + (rank + 1) * n))
    return out


def shard_pieces(slices: list, ranges: dict) -> list[tuple[str, int, int]]:
    """[(tensor name, lo, hi)]: the slices cut at tensor boundaries (AdamW decays per tensor); padding dropped."""
    out = []
    for s_lo, s_hi in slices:
        for k, (a, b) in ranges.items():
            lo, hi = max(a, s_lo), min(b, s_hi)
            if lo < hi:
                out.append((k, lo, hi))
    return out


def piece_name(k: str, lo: int) -> str:
    """A piece's key in AdamW's dicts: the tensor's name and where the piece starts in flat."""
    return f"{k}@{lo}"


def config_digest(*parts) -> np.ndarray:
    """48 bits of a SHA-256 of the parts' JSON, as three float32 (each < 2^16: exact), to all-gather."""
    h = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).digest()
    return np.array([int.from_bytes(h[i:i + 2], "little") for i in (0, 2, 4)], np.float32)


def flat_state(directory, shapes: dict) -> tuple[np.ndarray, np.ndarray]:
    """AdamW's (m, v) of a checkpoint as flat NumPy arrays in TrainGPT's layout, from either form: 4b's
    optimizer.safetensors (one m and v per tensor) or the ZeRO-1 shard files of the N ranks that saved it (each
    its slices), as trainer_state.json says (older files of another run in the folder are not read)."""
    from safetensors.numpy import load_file
    directory = Path(directory)
    ranges = tensor_ranges(shapes)
    total = max(hi for _, hi in ranges.values())
    state = directory / STATE_FILE
    saved = json.loads(state.read_text()).get(DP_KEY, {}) if state.is_file() else {}
    if saved.get("zero1"):
        world = int(saved["world"])
        want = [directory / SHARD_FILE.format(rank=r, world=world) for r in range(world)]
        missing = [p.name for p in want if not p.is_file()]
        if missing:
            raise CheckpointError(f"directory: {directory} lacks the ZeRO-1 shards {missing} of {world} ranks")
        m, v = np.zeros(total, np.float32), np.zeros(total, np.float32)
        for p in want:
            t = load_file(str(p))
            at = 0
            for lo, hi in t["slices"]:
                m[lo:hi], v[lo:hi] = t["m"][at:at + hi - lo], t["v"][at:at + hi - lo]
                at += hi - lo
        return m, v
    if not (directory / OPTIMIZER_FILE).is_file():
        raise CheckpointError(f"directory: {directory} has no {OPTIMIZER_FILE}: weights only, no optimizer state")
    t = load_file(str(directory / OPTIMIZER_FILE))
    return tuple(np.concatenate([t[f"{s}.{k}"].reshape(-1) for k in shapes]).astype(np.float32) for s in "mv")


# ============================================================================ the trainer
class DataParallelTrainer(Trainer):
    """4b's Trainer on `comm.world` ranks: each rank steps on its rows of the global batch (config.batch_size
    rows per step over all ranks and micro-batches), the gradients reduced in buckets during the backward pass.

    zero1: AdamW's state sharded over the ranks (module docstring); bucket_mb: the bucket size in MB of gflat;
    accumulate: micro-batches per step and rank (gradient accumulation; reduced once, after the last).
    graph: the whole step, collectives included, as one CUDA graph (module docstring), recorded at the first step
    and replayed after; the same kernels, collectives and results as graph=False. Every step ends with comm.wait,
    a bounded wait, so a rank that dies or hangs ends every other rank's step with a CommError instead of a hang."""

    def __init__(self, model, config: TrainConfig | None = None, comm=None, zero1: bool = False,
                 bucket_mb: float = BUCKET_MB, accumulate: int = 1, graph: bool = False):
        if comm is None:
            raise ValueError("comm: a communicator is needed (Comm, LocalComm, or a CPU one for tests)")
        config = config or TrainConfig()
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb: expected a size in MB > 0, got {bucket_mb!r}")
        self._gpu = not isinstance(model.flat, np.ndarray)
        if graph and not self._gpu:
            raise ValueError("graph: a CUDA graph records GPU work; this model's arrays are NumPy (use graph=False)")
        if graph and getattr(model, "attention_version", None) == 1:
            raise ValueError("graph: attention_version must be 2 or 3 (version 1's batched GEMMs go through "
                             "cupy.matmul, which CuPy refuses inside a graph capture)")
        self.comm, self.rank, self.world = comm, int(comm.rank), int(comm.world)
        self.zero1, self.accumulate = bool(zero1), int(accumulate)
        self.micro_batch = local_batch(config.batch_size, self.world, accumulate)
        self.model, self.config, self.graph = model, config, bool(graph)
        self._check_same_config()
        self.ranges = tensor_ranges(model.shapes)
        self.buckets = plan_buckets(model.shapes, self.world, max(1, int(bucket_mb * 2**20) // 4))
        self.tracker = ReadyTracker(self.buckets, self.ranges, model.config.n_layer)
        self._flat, self._gflat = _pad_buffers(model, self.buckets[-1][1])
        model.grads = _WatchedGrads(model.grads)
        # every rank starts from rank 0's weights (the same seed gives the same ones; this makes it certain)
        comm.broadcast(self._flat, root=0)
        if self.zero1:
            self.slices = shard_slices(self.buckets, self.rank, self.world)
            pieces = shard_pieces(self.slices, self.ranges)
            self._opt_params = {piece_name(k, lo): self._flat[lo:hi] for k, lo, hi in pieces}
            self._opt_grads = {piece_name(k, lo): self._gflat[lo:hi] for k, lo, hi in pieces}
            self._tensor_of = {piece_name(k, lo): k for k, lo, hi in pieces}
            self._start = {piece_name(k, lo): lo for k, lo, hi in pieces}
        else:
            self._opt_params, self._opt_grads = model.params, model.grads
            self._tensor_of = {k: k for k in model.params}
            self._start = {k: lo for k, (lo, _) in self.ranges.items()}
        self.opt = self._make_optimizer()
        self._acc = None if self.accumulate == 1 else self._xp.zeros_like(self._gflat)
        self.step_count, self._last_norm, self._loss = 0, None, None
        self._step_graph = self._graph_memory = None
        if self._gpu:
            import cupy as cp
            self._counters, self._sched = cp.zeros(2, cp.int64), cp.zeros(4, cp.float32)
            self._gpu_counters = (0, 0)
            self._comm_stream = cp.cuda.Stream(non_blocking=True)   # the reductions, beside the backward pass
        else:
            self._comm_stream = None
        comm.on_abort(self.close)            # the communicator drops the step's graph before it ends (held weakly)

    # ------------------------------------------------------------------ set-up
    @property
    def _xp(self):
        if self._gpu:
            import cupy
            return cupy
        return np

    def _check_same_config(self):
        """All-gather a digest of everything the ranks must agree on; ConfigMismatchError on every rank if not."""
        # graph too: capturing may register buffers with the peers (NCCL), which every rank must then do
        mine = config_digest(asdict(self.config), self.model.config.to_hf(), self.zero1, self.accumulate,
                             self.world, int(self.model.flat.size), self.graph)
        xp = np if isinstance(self.model.flat, np.ndarray) else __import__("cupy")
        x, out = xp.asarray(mine), xp.zeros(3 * self.world, np.float32)
        self.comm.all_gather(x, out)
        self.comm.wait(what="the configuration check")
        got = (out.get() if hasattr(out, "get") else out).reshape(self.world, 3)
        odd = [r for r in range(self.world) if not np.array_equal(got[r], got[0])]
        if odd:
            raise ConfigMismatchError(f"config: ranks {odd} were started with another configuration than rank 0 "
                                      f"(TrainConfig, GPTConfig, zero1, accumulate, graph or the world size "
                                      f"differ)")

    def _make_optimizer(self):
        """4b's AdamW (step 3's one-launch kernel) on this rank's parameters: all of them, or its ZeRO-1 pieces."""
        from step3_fused.training import AdamW
        c = self.config
        return AdamW(self._opt_params, lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps, weight_decay=c.weight_decay,
                     decayed=self.decayed)

    @property
    def decayed(self) -> list:
        """The optimizer's tensors (or ZeRO-1 pieces) with weight decay: those of 4b's decayed tensors."""
        from common.reference.train_gpt2 import is_decayed
        return [p for p, k in self._tensor_of.items() if is_decayed(k)]

    @property
    def optimizer_bytes(self) -> int:
        """The bytes of AdamW's state on this rank (m and v): 1/world of one GPU's with zero1."""
        return sum(int(a.nbytes) for d in (self.opt.m, self.opt.v) for a in d.values())

    # ------------------------------------------------------------------ one step
    def local_rows(self, idx, targets):
        """This rank's rows of the global batch (B = config.batch_size rows)."""
        B = self.config.batch_size
        if idx.shape[0] != B:
            raise ValueError(f"idx: expected the global batch of batch_size={B} rows, got shape {idx.shape}")
        n = B // self.world
        return idx[self.rank * n:(self.rank + 1) * n], targets[self.rank * n:(self.rank + 1) * n]

    def step(self, idx, targets, check: bool = True):
        """One data-parallel step on the global batch (idx, targets), each (batch_size, T): this rank's rows,
        forward + backward per micro-batch, the gradients reduced, clipped, AdamW. Ends with a bounded wait."""
        idx, targets = self.local_rows(idx, targets)
        if self._gpu and isinstance(idx, np.ndarray):      # only this rank's rows go to its GPU
            import cupy as cp
            idx, targets = cp.asarray(idx), cp.asarray(targets)
        if check:
            idx, targets = self.model.check_batch(idx, targets)
        if self._gpu:
            self._sync_counters()
            self._gpu_counters = None
        self.opt.lr = self.config.lr_at(self.step_count)
        new_graph = None
        if not self.graph:
            self._loss = self._step_body(idx, targets)
        else:
            key = self._graph_key(idx, targets)
            if self._step_graph is not None and self._step_graph.key == key:
                self._loss = self._step_graph.replay(idx, targets)
                self._last_norm = self._step_graph.norm
                self.opt.t += 1
            else:
                self._step_graph = None                    # its buffers go back to the pool first
                new_graph = _DataParallelGraph(self, idx, targets, key)    # runs this step without a graph
                self._loss = new_graph.first_loss
        self.step_count += 1
        if self._gpu:
            self._gpu_counters = (self.step_count, self.opt.t)
        self.comm.wait(what=f"step {self.step_count}")
        if new_graph is not None:      # after the wait: a peer lost in this step is a CommError, not a capture
            new_graph.capture(self)    # records the next steps; every rank does it at the same step
            self._step_graph = new_graph

    def _graph_key(self, idx, targets) -> tuple:
        """Everything the step's graph bakes in: shapes, code paths, precision, hyper-parameters, its objects."""
        from common.cublas import tf32_enabled
        m, o = self.model, self.opt
        return (tuple(idx.shape), tuple(targets.shape), m.attention_version, m.embedding_version, tf32_enabled(),
                astuple(self.config), o.betas, o.eps, o.wd, tuple(o.decayed), id(m), id(o), id(self.comm))

    def close(self):
        """Drop the step's CUDA graph: NCCL ends a communicator only once every graph that recorded its collectives
        is gone (comm.close and comm.abort call this first). The graph's memory pool stays with the trainer: freeing
        GPU memory waits for the GPU, and a replay stuck on a lost peer ends only with the abort that follows."""
        self._step_graph = None

    def _step_body(self, idx, targets):
        xp, m, b, A = self._xp, self.model, self.micro_batch, self.accumulate
        loss = xp.zeros(1, np.float32 if self._gpu else m.flat.dtype)
        for a in range(A):
            loss += m.forward(idx[a * b:(a + 1) * b], targets[a * b:(a + 1) * b], grad=True, check=False)
            if a + 1 < A:
                m.backward()                  # no reduction yet: kept in _acc (the micro-batches in order)
                if a == 0:
                    self._acc[...] = self._gflat
                else:
                    self._acc += self._gflat
                continue
            self.tracker.reset()
            m.grads.on_take = self._on_take
            try:
                m.backward()
            finally:
                m.grads.on_take = None
            for i in self.tracker.finish():
                self._reduce(i)
        self._join()                          # the update reads the reduced gradients
        if A > 1:
            loss /= A
        self.comm.all_reduce(loss, op="avg")  # the global batch's mean loss, for the log
        self._update()
        return loss.reshape(())

    def _on_take(self, name):
        for i in self.tracker.touch(name):
            self._reduce(i)

    def _on_comm_stream(self):
        """Order the reduction after the backward's work so far (both its streams); run it on its own stream."""
        if not self._gpu:
            return contextlib.nullcontext()
        import cupy as cp
        event = lambda: cp.cuda.Event(disable_timing=True)  # noqa: E731  (in a capture: where the streams join)
        self._comm_stream.wait_event(cp.cuda.get_current_stream().record(event()))
        side = self.model._weight_grad_stream()
        if side is not None:
            self._comm_stream.wait_event(side.record(event()))
        return self._comm_stream

    def _join(self):
        if self._gpu:
            import cupy as cp
            cp.cuda.get_current_stream().wait_event(self._comm_stream.record(cp.cuda.Event(disable_timing=True)))

    def _reduce(self, i):
        lo, hi = self.buckets[i]
        g = self._gflat[lo:hi]
        with self._on_comm_stream():
            if self.accumulate > 1:
                g += self._acc[lo:hi]
                g *= 1.0 / self.accumulate
            if self.zero1:
                n = (hi - lo) // self.world
                self.comm.reduce_scatter(g, out=g[self.rank * n:(self.rank + 1) * n], op="avg",
                                         stream=self._comm_stream)
            else:
                self.comm.all_reduce(g, op="avg", stream=self._comm_stream)

    def _update(self):
        """Clip by the global norm, AdamW; with ZeRO-1 the norm from every rank's slices, then the all-gather."""
        if self.zero1:
            sq = self._sum_of_squares([self._gflat[lo:hi] for lo, hi in self.slices])
            self.comm.all_reduce(sq, op="sum")
            self._last_norm = self._xp.sqrt(sq).reshape(())
        else:
            self._last_norm = self._norm(self.model.gflat)
        self._adamw(self._last_norm)
        if self.zero1:
            for (lo, hi), (s_lo, s_hi) in zip(self.buckets, self.slices):
                self.comm.all_gather(self._flat[s_lo:s_hi], out=self._flat[lo:hi])

    # the arithmetic of the update, on the GPU (4b's kernels); a CPU test replaces these three in float64
    def _norm(self, gflat):
        from step4_gpt2.train import ops
        return ops.grad_norm(gflat)

    def _sum_of_squares(self, parts):
        import cupy as cp
        from step4_gpt2.train import ops
        sq = cp.zeros(1, cp.float32)
        for g in parts:
            n = ops.grad_norm(g)
            sq += n * n
        return sq

    def _adamw(self, norm):
        from step4_gpt2.train import ops
        c = self.config
        ops.adamw_schedule(self._counters, self._sched, c.lr, c.min_lr, c.warmup, c.max_steps, self.opt.betas,
                           norm, c.grad_clip)
        self.opt.step(self._opt_grads, sched=self._sched)

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory, tokenizer=None) -> Path:
        """Rank 0: 4b's files (weights, config, trainer state; optimizer.safetensors without zero1). With zero1
        every rank writes its own slices of m and v (SHARD_FILE). Returns once every rank's files are written."""
        from safetensors.numpy import save_file
        from step4_gpt2 import weights
        directory = Path(directory)
        self.comm.wait(what="save")
        directory.mkdir(parents=True, exist_ok=True)
        host = lambda a: a.get() if hasattr(a, "get") else np.asarray(a)  # noqa: E731
        if self.rank == 0:
            weights.save(self.model.host_params(), self.model.config, directory)
            if tokenizer is not None and getattr(tokenizer, "kind", None) == "char":
                tokenizer.save(directory)
            if not self.zero1:
                state = {f"m.{k}": host(v).astype(np.float32) for k, v in self.opt.m.items()}
                state.update({f"v.{k}": host(v).astype(np.float32) for k, v in self.opt.v.items()})
                save_file(state, str(directory / OPTIMIZER_FILE))
            (directory / STATE_FILE).write_text(json.dumps(
                {"step": self.step_count, "adam_t": self.opt.t, "train_config": asdict(self.config),
                 "model_config": self.model.config.to_hf(),
                 DP_KEY: {"world": self.world, "zero1": self.zero1, "buckets": self.buckets}}, indent=1))
        if self.zero1:
            names = list(self._opt_params)       # the pieces in flat order: the slices, padding left out
            m = np.concatenate([host(self.opt.m[p]).reshape(-1) for p in names] or [np.zeros(0)])
            v = np.concatenate([host(self.opt.v[p]).reshape(-1) for p in names] or [np.zeros(0)])
            spans = np.array([[lo, hi] for _, lo, hi in shard_pieces(self.slices, self.ranges)], np.int64)
            save_file({"m": m.astype(np.float32), "v": v.astype(np.float32), "slices": spans.reshape(-1, 2)},
                      str(directory / SHARD_FILE.format(rank=self.rank, world=self.world)))
        barrier = self._xp.zeros(1, np.float32)
        self.comm.all_reduce(barrier)            # no rank returns before every rank's files are there
        self.comm.wait(what="save")
        return directory

    def load(self, directory) -> "DataParallelTrainer":
        """Resume from a checkpoint of any number of ranks, with or without zero1 (or 4b's one-GPU Trainer)."""
        from step4_gpt2 import weights
        from step4_gpt2.weights import GPTConfig
        directory = Path(directory)
        cfg = GPTConfig.from_file(directory / weights.CONFIG_FILE)
        if cfg != self.model.config:
            raise CheckpointError(f"directory: {directory} holds a checkpoint of another model config: {cfg} "
                                  f"(this model: {self.model.config})")
        if not (directory / STATE_FILE).is_file():
            raise CheckpointError(f"directory: {directory} has no {STATE_FILE}: weights only, no training state")
        state = json.loads((directory / STATE_FILE).read_text())
        _, params = weights.load_file(directory, cfg)
        m, v = flat_state(directory, self.model.shapes)
        xp = self._xp
        for k, (lo, hi) in self.ranges.items():
            self._flat[lo:hi] = xp.asarray(params[k].reshape(-1))
        for p, a in self._opt_params.items():
            lo = self._start[p]
            self.opt.m[p][...] = xp.asarray(m[lo:lo + a.size].reshape(a.shape))
            self.opt.v[p][...] = xp.asarray(v[lo:lo + a.size].reshape(a.shape))
        self.step_count, self.opt.t = int(state["step"]), int(state["adam_t"])
        return self


class _DataParallelGraph(_StepGraph):
    """4b's step graph (train.py's _StepGraph: its own memory pool, the first step run without a graph, then the
    capture) for the data-parallel step: the model's activations of one micro-batch, AdamW's table of this rank's
    gradients (ZeRO-1: its pieces), the collectives recorded with the kernels. The reduction stream and the
    accumulation buffer are made before the capture and live as long as the trainer."""

    def __init__(self, trainer: DataParallelTrainer, idx, targets, key):
        self.key = key
        self.acts = trainer.model._activations(trainer.micro_batch, idx.shape[1])   # the addresses it writes
        trainer.opt.prepare(trainer._opt_grads)           # AdamW's pointer table, in the optimiser's memory
        self._first_step(trainer, idx, targets)           # 4b's: on the graph's stream, in its memory pool


def _pad_buffers(model, padded: int):
    """(flat, gflat) of length `padded` (the buckets' end), the model's params/grads made views into them: the
    buckets split into equal, aligned slices (what NCCL's reduce-scatter hands out). The padding floats past the
    last tensor are never read by the model and stay zero (no gradient, no decay: AdamW leaves them at 0)."""
    total = int(model.flat.size)
    if padded == total:
        return model.flat, model.gflat
    xp = np if isinstance(model.flat, np.ndarray) else __import__("cupy")
    flat, gflat = xp.zeros(padded, model.flat.dtype), xp.zeros(padded, model.gflat.dtype)
    flat[:total] = model.flat
    for k, (lo, hi) in tensor_ranges(model.shapes).items():
        model.params[k] = flat[lo:hi].reshape(model.shapes[k])
        model.grads[k] = gflat[lo:hi].reshape(model.shapes[k])
    model.flat, model.gflat = flat[:total], gflat[:total]
    return flat, gflat
