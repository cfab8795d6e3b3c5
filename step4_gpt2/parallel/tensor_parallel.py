"""Step 4e: tensor parallelism (Megatron-LM, Shoeybi et al. 2019) of 4b's GPT - one layer's matrices split over
the GPUs, the activations summed between them.

    shard = shard_params(params, cfg, rank, world)              # this rank's columns / rows (NumPy, no GPU)
    model = TensorParallelGPT(cfg, shard, comm, rank, world)     # 4b's kernels on this rank's GPU (comm.Comm)
    loss = model.loss_and_grads(idx, targets)                    # the same batch on every rank
    grads = gather_grads([g0, g1, ...], cfg)                     # the full gradients (for a check)

Each block is split as Megatron splits it. Attention: c_attn's columns by heads (each rank computes H / world
whole heads: q, k and v of its heads, then their attention), c_proj's rows to match, so each rank's product is a
partial sum of the sublayer's output. MLP: c_fc's columns (GELU is elementwise, so it needs no communication),
c_proj's rows. Megatron's two operators place the communication:

    g: forward, an all-reduce (sum) of the partial sums; backward, nothing (the gradient is already whole).
    f: forward, nothing (every rank holds the whole input); backward, an all-reduce of the input's gradient.

So 2 all-reduces of a (B*T, C) activation per layer forward (g after attention and after the MLP) and 2 backward
(f before c_attn and before c_fc): 4 L per step, each on the critical path. Everything else (embeddings,
LayerNorms, the c_proj biases, the LM head) is replicated: every rank computes the same values from the same
inputs, so its gradients are the same on every rank and need no communication.

The model runs on an `ops` backend: DeviceOps (4b's kernels, CuPy) or HostOps (common.reference.train_gpt2,
float64 NumPy), so the same code is checked on the CPU with `simulate(fn, world)`: the ranks in one process, the
all-reduce a NumPy sum in rank order. predict_comm_seconds is the napkin math of its communication;
measure_tensor_parallel times it on the GPUs, each all-reduce's transfer apart from the wait for the slower rank
(transfer_and_wait).
"""
from __future__ import annotations

import math
import statistics
import threading
import time
from dataclasses import asdict

import numpy as np

from common import expect_choice, expect_int, require_gpu
from common.reference import train_gpt2 as R
from common.reference.ops import f64
from step4_gpt2.parallel.data_parallel import BUCKET_MB
from step4_gpt2.weights import GPTConfig, expected_shapes

COLUMN_SPLIT = ("attn.c_attn.weight", "attn.c_attn.bias", "mlp.c_fc.weight", "mlp.c_fc.bias")
ROW_SPLIT = ("attn.c_proj.weight", "mlp.c_proj.weight")
ALL_REDUCES_PER_LAYER = 4        # g twice forward, f twice backward
REDUCE_OPS = ("sum", "avg")
COMM_STEPS = 10                  # timed steps, each with its all-reduces timed one by one (medians reported)


# ============================================================================ sharding (NumPy, no GPU)
def check_world(cfg: GPTConfig, world) -> int:
    """world as an int, if it splits the model: n_head heads into equal groups (then 4C splits too)."""
    expect_int(world, "world", expected="a positive number of ranks")
    if cfg.n_head % world:
        raise ValueError(f"world: {world} ranks do not split n_head={cfg.n_head} heads evenly (tensor parallelism "
                         f"gives each rank whole heads)")
    return int(world)


def shard_index(cfg: GPTConfig, name: str, rank: int, world: int):
    """(axis, indices) of the full tensor `name` that rank holds, or None for a replicated tensor.
    c_attn's 3C columns are q | k | v, heads contiguous in each: the rank takes its heads' slice of all three, so
    its own columns are again q | k | v of H / world heads, the layout 4b's attention kernels read."""
    key = name.split(".", 2)[-1] if name.startswith("h.") else name
    C, Cl = cfg.n_embd, cfg.n_embd // world
    if key in ("attn.c_attn.weight", "attn.c_attn.bias"):
        cols = np.concatenate([j * C + np.arange(rank * Cl, (rank + 1) * Cl) for j in range(3)])
        return (1 if key.endswith("weight") else 0), cols
    if key in ("mlp.c_fc.weight", "mlp.c_fc.bias"):
        return (1 if key.endswith("weight") else 0), np.arange(rank * 4 * Cl, (rank + 1) * 4 * Cl)
    if key == "attn.c_proj.weight":
        return 0, np.arange(rank * Cl, (rank + 1) * Cl)
    if key == "mlp.c_proj.weight":
        return 0, np.arange(rank * 4 * Cl, (rank + 1) * 4 * Cl)
    return None


def shard_params(params: dict, cfg: GPTConfig, rank: int, world: int) -> dict:
    """{name: this rank's part} of a full parameter dict (NumPy float32): split tensors cut, the rest copied."""
    world = check_world(cfg, world)
    if not 0 <= rank < world:
        raise ValueError(f"rank: expected 0 <= rank < world={world}, got {rank}")
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if name not in params:
            raise ValueError(f"params: missing {name!r}")
        a = np.asarray(params[name])
        if a.shape != tuple(shape):
            raise ValueError(f"params: {name} has shape {a.shape}, expected {tuple(shape)}")
        where = shard_index(cfg, name, rank, world)
        out[name] = np.ascontiguousarray(a if where is None else np.take(a, where[1], axis=where[0]))
    return out


def shard_params_shapes(cfg: GPTConfig, world: int) -> dict:
    """{name: shape of one rank's shard} (the same on every rank)."""
    out = {}
    for name, shape in expected_shapes(cfg).items():
        shape = list(shape)
        where = shard_index(cfg, name, 0, world)
        if where is not None:
            shape[where[0]] = len(where[1])
        out[name] = tuple(shape)
    return out


def gather_grads(per_rank: list, cfg: GPTConfig) -> dict:
    """The full gradients from each rank's {name: gradient} (NumPy): split tensors put back in place, replicated
    ones taken from rank 0 (equal on every rank; tests check it)."""
    world = check_world(cfg, len(per_rank))
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if shard_index(cfg, name, 0, world) is None:
            out[name] = f64(per_rank[0][name])
            continue
        full = np.zeros(shape)
        for rank, g in enumerate(per_rank):
            axis, index = shard_index(cfg, name, rank, world)
            sl = [slice(None)] * len(shape)
            sl[axis] = index
            full[tuple(sl)] = f64(g[name])
        out[name] = full
    return out


# ============================================================================ two backends, one model
class HostOps:
    """float64 NumPy, the layers of common.reference.train_gpt2 (what 4b's kernels are checked against)."""

    def param(self, a):
        return f64(a)

    def embed(self, idx, wte, wpe):
        return R.encoder_forward(wte, wpe, idx).reshape(-1, wte.shape[1])

    def layernorm(self, x, w, b, eps):                          # (out, mean, rstd)
        return R.layernorm_forward(x, w, b, eps)

    def add_layernorm(self, x, y, ybias, w, b, eps):            # (resid = x + y + ybias, out, mean, rstd)
        r = x + y + ybias
        return (r, *R.layernorm_forward(r, w, b, eps))

    def matmul(self, a, b):
        return a @ b

    def attention(self, qkv, bias, n_head):                      # (out (B, T, C_rank), lse)
        return R.attention_forward(qkv, bias, n_head)

    def gelu_bias(self, pre, bias):
        return R.gelu_bias_forward(pre, bias)[1]

    def loss(self, logits, targets):                             # (mean loss, dlogits of the mean)
        losses, dlogits = R.classifier(logits, targets)
        return float(losses.mean()), dlogits

    def matmul_backward(self, dy, x, w, bias=True):              # (dx, dW, db or None)
        dx, dw, db = R.matmul_backward(dy, x, w)
        return dx, dw, (db if bias else None)

    def gelu_bias_backward(self, dh, pre, bias):                 # (dpre, dbias); pre: before the bias
        return R.gelu_bias_backward(dh, pre + bias)

    def layernorm_backward(self, dy, x, w, mean, rstd):          # (dx, dweight, dbias)
        return R.layernorm_backward(dy, x, w, mean, rstd)

    def attention_backward(self, dout, qkv, bias, out, lse, n_head):
        return R.attention_backward(dout, qkv, bias, n_head)

    def encoder_backward(self, dx, idx, dwte, block):            # (dwte + the embedding's share, dwpe)
        B, T = idx.shape
        d, dwpe = R.encoder_backward(dx.reshape(B, T, -1), idx, dwte.shape[0], block)
        return dwte + d, dwpe


class DeviceOps:
    """CuPy float32 on the current GPU: 4b's kernels (step4_gpt2.train.ops) and cuBLAS (common.cublas.gemm)."""

    def __init__(self, attention_version: int | None = None):
        from step4_gpt2.train import ops
        require_gpu()
        self.ops, self.version = ops, attention_version or ops.default_attention_version()

    def param(self, a):
        import cupy as cp
        return cp.asarray(np.asarray(a, dtype=np.float32))

    def embed(self, idx, wte, wpe):
        return self.ops.encoder_forward(idx, wte, wpe)

    def layernorm(self, x, w, b, eps):
        return self.ops.layernorm_forward(x, w, b, eps)

    def add_layernorm(self, x, y, ybias, w, b, eps):             # the residual add fused into the LayerNorm
        return self.ops.layernorm_forward(x, w, b, eps, y=y, ybias=ybias)

    def matmul(self, a, b):
        from common.cublas import gemm
        return gemm(a, b)

    def attention(self, qkv, bias, n_head):
        return self.ops.attention_forward(qkv, bias, n_head, version=self.version)

    def gelu_bias(self, pre, bias):
        return self.ops.gelu_bias_forward(pre, bias)

    def loss(self, logits, targets):                             # logits overwritten with dlogits
        losses = self.ops.classifier(logits, targets.reshape(-1))
        return losses.mean(), logits

    def matmul_backward(self, dy, x, w, bias=True):
        return self.ops.matmul_backward(dy, x, w, dbias=None if bias else False)

    def gelu_bias_backward(self, dh, pre, bias):
        return self.ops.gelu_bias_backward(dh, pre, bias)

    def layernorm_backward(self, dy, x, w, mean, rstd):
        return self.ops.layernorm_backward(dy, x, w, mean, rstd)

    def attention_backward(self, dout, qkv, bias, out, lse, n_head):
        return self.ops.attention_backward(dout, qkv, bias, out, lse, n_head, version=self.version)

    def encoder_backward(self, dx, idx, dwte, block):
        import cupy as cp
        dwpe = cp.empty((block, dwte.shape[1]), cp.float32)
        return self.ops.encoder_backward(dx, idx, dwte, dwpe)


class TensorParallelGPT:
    """One rank of a Megatron-style tensor-parallel GPT-2 (4b's architecture and HF names).

    params: this rank's shard (shard_params), comm: anything with all_reduce(x, out=, op=) (step4_gpt2.parallel.comm's
    Comm on a GPU, simulate()'s on the CPU; None only for world = 1), ops: DeviceOps() (default) or HostOps().
    Every rank gets the same batch; grads (after backward) has this rank's shard of every gradient.
    timed=True (GPU) records CUDA events around each all-reduce: comm_times() reads them."""

    def __init__(self, config: GPTConfig, params: dict, comm, rank: int, world: int, ops=None, timed: bool = False):
        self.config, self.rank, self.world = config, rank, check_world(config, world)
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world:
            raise ValueError(f"rank: expected 0 <= rank < world={self.world}, got {rank!r}")
        if comm is None and self.world > 1:
            raise ValueError(f"comm: world={world} ranks need a communicator")
        want = shard_params_shapes(config, self.world)
        for name, shape in want.items():
            got = tuple(np.shape(params.get(name))) if name in params else None
            if got != shape:
                raise ValueError(f"params: {name} has shape {got}, expected this rank's shard {shape} "
                                 f"(shard_params(params, config, rank, world))")
        self.comm, self.ops = comm, ops if ops is not None else DeviceOps()
        self.params = {k: self.ops.param(params[k]) for k in want}
        self.grads: dict = {}
        self.n_head_local = config.n_head // self.world
        self.all_reduces = 0            # how many this model has run (2 per layer forward, 2 backward)
        self.timed, self._events = timed, []
        self._saved = None

    def _all_reduce(self, x):
        """The sum over the ranks of x, in place (Megatron's g forward, f backward)."""
        self.all_reduces += 1
        if self.world == 1:                 # one rank holds the whole sum already
            return x
        if not self.timed:
            return self.comm.all_reduce(x, out=x, op="sum")
        import cupy as cp
        start = cp.cuda.get_current_stream().record(cp.cuda.Event())
        out = self.comm.all_reduce(x, out=x, op="sum")
        self._events.append((start, cp.cuda.get_current_stream().record(cp.cuda.Event())))
        return out

    def comm_times(self) -> list[float]:
        """Seconds of each all-reduce since the last call, in order (timed=True), then forgets them. Call it after
        comm.wait (the bounded wait): the events are done then. Each time includes this rank's wait for the slower
        ranks to arrive, which transfer_and_wait separates from the transfer."""
        import cupy as cp
        if self._events:
            self._events[-1][1].synchronize()
        times = [cp.cuda.get_elapsed_time(a, b) / 1e3 for a, b in self._events]
        self._events = []
        return times

    def forward(self, idx, targets):
        """The mean loss of the batch (the same on every rank); keeps what backward() needs."""
        k, P, cfg, eps = self.ops, self.params, self.config, self.config.eps
        B, T = idx.shape
        N, L = B * T, cfg.n_layer
        x = k.embed(idx, P["wte.weight"], P["wpe.weight"])
        ln, m, r = k.layernorm(x, P["h.0.ln_1.weight"], P["h.0.ln_1.bias"], eps)
        saved = []
        for i in range(L):
            p = lambda n: P[f"h.{i}.{n}"]  # noqa: E731,B023
            s = {"x": x, "ln1": ln, "m1": m, "r1": r}
            # f (nothing to do forward): the whole ln1 is here. This rank's heads: q | k | v of H / world heads.
            s["qkv"] = k.matmul(ln, p("attn.c_attn.weight")).reshape(B, T, -1)
            s["att"], s["lse"] = k.attention(s["qkv"], p("attn.c_attn.bias"), self.n_head_local)
            # g: c_proj's rows of this rank's heads give a partial sum of the sublayer's output; sum it
            part = self._all_reduce(k.matmul(s["att"].reshape(N, -1), p("attn.c_proj.weight")))
            s["x2"], s["ln2"], s["m2"], s["r2"] = k.add_layernorm(x, part, p("attn.c_proj.bias"), p("ln_2.weight"),
                                                                  p("ln_2.bias"), eps)
            s["pre"] = k.matmul(s["ln2"], p("mlp.c_fc.weight"))          # this rank's 4C / world columns
            s["h"] = k.gelu_bias(s["pre"], p("mlp.c_fc.bias"))
            part = self._all_reduce(k.matmul(s["h"], p("mlp.c_proj.weight")))          # g again
            last = i + 1 == L
            w, b = (P["ln_f.weight"], P["ln_f.bias"]) if last else (P[f"h.{i + 1}.ln_1.weight"], P[f"h.{i + 1}.ln_1.bias"])
            x, ln, m, r = k.add_layernorm(s["x2"], part, p("mlp.c_proj.bias"), w, b, eps)
            saved.append(s)
        loss, dlogits = k.loss(k.matmul(ln, P["wte.weight"].T), targets)   # the LM head: replicated
        self._saved = (idx, saved, x, ln, m, r, dlogits)
        return loss

    def backward(self) -> dict:
        """This rank's gradients into self.grads (the same names and shapes as its params)."""
        if self._saved is None:
            raise RuntimeError("backward: call forward(idx, targets) first (once per backward)")
        (idx, saved, x, lnf, mf, rf, dlogits), self._saved = self._saved, None
        k, P, cfg, G = self.ops, self.params, self.config, {}
        B, T = idx.shape
        dln = k.matmul(dlogits, P["wte.weight"])
        G["wte.weight"] = k.matmul(dlogits.T, lnf)
        dres, G["ln_f.weight"], G["ln_f.bias"] = k.layernorm_backward(dln, x, P["ln_f.weight"], mf, rf)
        for i in reversed(range(cfg.n_layer)):
            s, n = saved[i], f"h.{i}."
            p = lambda name: P[n + name]  # noqa: E731,B023
            # MLP. g's backward is nothing: dres, the whole gradient of the summed output, is on every rank.
            dh, G[n + "mlp.c_proj.weight"], G[n + "mlp.c_proj.bias"] = k.matmul_backward(dres, s["h"], p("mlp.c_proj.weight"))
            dpre, G[n + "mlp.c_fc.bias"] = k.gelu_bias_backward(dh, s["pre"], p("mlp.c_fc.bias"))
            dln2, G[n + "mlp.c_fc.weight"], _ = k.matmul_backward(dpre, s["ln2"], p("mlp.c_fc.weight"), bias=False)
            # f's backward: each rank's columns give part of ln2's gradient; sum them
            dln2 = self._all_reduce(dln2)
            d, G[n + "ln_2.weight"], G[n + "ln_2.bias"] = k.layernorm_backward(dln2, s["x2"], p("ln_2.weight"),
                                                                               s["m2"], s["r2"])
            dres = dres + d
            # attention
            N = B * T
            datt, G[n + "attn.c_proj.weight"], G[n + "attn.c_proj.bias"] = k.matmul_backward(
                dres, s["att"].reshape(N, -1), p("attn.c_proj.weight"))
            dqkv = k.attention_backward(datt.reshape(s["att"].shape), s["qkv"], p("attn.c_attn.bias"), s["att"],
                                        s["lse"], self.n_head_local).reshape(N, -1)
            dln1, G[n + "attn.c_attn.weight"], G[n + "attn.c_attn.bias"] = k.matmul_backward(dqkv, s["ln1"],
                                                                                             p("attn.c_attn.weight"))
            dln1 = self._all_reduce(dln1)                                                # f's backward
            d, G[n + "ln_1.weight"], G[n + "ln_1.bias"] = k.layernorm_backward(dln1, s["x"], p("ln_1.weight"),
                                                                               s["m1"], s["r1"])
            dres = dres + d
        G["wte.weight"], G["wpe.weight"] = k.encoder_backward(dres, idx, G["wte.weight"], P["wpe.weight"].shape[0])
        self.grads = G
        return G

    def loss_and_grads(self, idx, targets):
        loss = self.forward(idx, targets)
        self.backward()
        return loss


# ============================================================================ world ranks in one process (CPU)
class CommTimeout(RuntimeError):
    """A simulated rank waited longer than timeout_s for the others (one of them failed or never came)."""


class _SimulatedComm:
    """One rank's view of simulate()'s group: all_reduce of NumPy arrays, summed in rank order (so every rank
    gets the same bits, as NCCL's ring gives every rank the same result)."""

    def __init__(self, group, rank: int):
        self.group, self.rank, self.world = group, rank, group["world"]

    def _wait(self, what: str):
        try:
            self.group["barrier"].wait(self.group["timeout_s"])
        except threading.BrokenBarrierError:
            raise CommTimeout(f"rank {self.rank}: {what} waited over {self.group['timeout_s']} s for the other "
                              f"ranks (one failed or never came)") from None

    def all_reduce(self, x, out=None, op: str = "sum", stream=None):
        expect_choice(op, "op", REDUCE_OPS)
        slots = self.group["slots"]
        slots[self.rank] = np.array(x, copy=True)
        self._wait("all_reduce")                  # every rank's part is in
        total = slots[0].copy()
        for part in slots[1:]:
            total += part
        if op == "avg":
            total /= self.world
        self._wait("all_reduce")                  # every rank has read the parts before any is overwritten
        if out is None:
            return total
        out[...] = total
        return out


def simulate(fn, world: int, timeout_s: float = 60.0) -> list:
    """[fn(rank, comm) for each rank], the ranks run in threads of this process and meet at each all-reduce;
    a rank's exception is raised here (the others stop at their next all-reduce instead of waiting)."""
    expect_int(world, "world", expected="a positive number of ranks")
    group = {"world": world, "barrier": threading.Barrier(world), "slots": [None] * world, "timeout_s": timeout_s}
    results, errors = [None] * world, [None] * world

    def run(rank):
        try:
            results[rank] = fn(rank, _SimulatedComm(group, rank))
        except BaseException as e:           # noqa: BLE001  (handed to the caller below)
            errors[rank] = e
            group["barrier"].abort()         # the others' next wait fails at once instead of timing out

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s + 1.0    # a second more: a rank's own bounded wait reports first
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        group["barrier"].abort()
        raise CommTimeout(f"simulate: the ranks did not finish within timeout_s={timeout_s} s")
    first = next((e for e in errors if e is not None and not isinstance(e, CommTimeout)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


# ============================================================================ napkin math
def ring_all_reduce_seconds(nbytes: float, world: int, bandwidth_gbs: float, latency_us: float) -> float:
    """A ring all-reduce of nbytes: each rank sends (and receives) 2 (world - 1) / world of the message (a
    reduce-scatter, then an all-gather), at the bus bandwidth (as nccl-tests reports it), plus a fixed latency.
    0 for one rank."""
    if world == 1:
        return 0.0
    return latency_us * 1e-6 + 2 * (world - 1) / world * nbytes / (bandwidth_gbs * 1e9)


def predict_comm_seconds(cfg: GPTConfig, B: int, T: int, world: int, bandwidth_gbs: float, latency_us: float) -> float:
    """Tensor parallelism's communication per training step (forward + backward): 4 all-reduces per layer of a
    (B*T, C) float32 activation, none of it hidden behind compute (each is on the critical path)."""
    for name, v in (("B", B), ("T", T)):
        expect_int(v, name)
    world = check_world(cfg, world)
    for name, v in (("bandwidth_gbs", bandwidth_gbs), ("latency_us", latency_us)):
        if not (isinstance(v, (int, float)) and math.isfinite(v)) or v < 0 or (name == "bandwidth_gbs" and v == 0):
            raise ValueError(f"{name}: expected a finite number > 0 (latency may be 0), got {v!r}")
    per = ring_all_reduce_seconds(B * T * cfg.n_embd * 4, world, bandwidth_gbs, latency_us)
    return ALL_REDUCES_PER_LAYER * cfg.n_layer * per


def dp_comm_seconds(cfg: GPTConfig, world: int, bandwidth_gbs: float, latency_us: float,
                    bucket_mb: float = BUCKET_MB) -> float:
    """Data parallelism's communication per step: every gradient once (n_params floats), in buckets of bucket_mb
    (one latency each); ZeRO-1's reduce-scatter + all-gather move the same bytes. Much of it can hide behind the
    backward pass; tensor parallelism's cannot."""
    nbytes = 4 * cfg.n_params()
    buckets = max(1, math.ceil(nbytes / (bucket_mb * 2**20)))
    return buckets * ring_all_reduce_seconds(nbytes / buckets, world, bandwidth_gbs, latency_us)


def step_flops(cfg: GPTConfig, B: int, T: int) -> float:
    """FLOPs of one training step (4b's napkin): 6 per parameter per token in the GEMMs (the LM head included)
    plus the attention's 6 L T C per token."""
    C, L = cfg.n_embd, cfg.n_layer
    return B * T * (6 * (12 * L * C * C + cfg.vocab_size * C) + 6 * L * T * C)


def transfer_and_wait(per_rank) -> tuple[float, float, float]:
    """(comm, transfer, wait) seconds of a step's all-reduces from per_rank[rank][step][i], the CUDA-event time of
    all-reduce i of a timed step on each rank: medians over the steps. An all-reduce ends on every rank at about
    the same moment, once the last rank has arrived; so a rank's events count its wait for the others too, and the
    rank that arrived last, which waits least, times the transfer alone. transfer: the sum over the all-reduces of
    the shortest of the ranks' times; comm: the most time one rank spent inside them; wait = comm - transfer."""
    per_step = list(zip(*per_rank))                 # [step] -> every rank's times of that step
    if not per_step or not per_step[0][0]:
        return 0.0, 0.0, 0.0                         # one rank: nothing was reduced
    comm = statistics.median(max(sum(t) for t in ranks) for ranks in per_step)
    transfer = statistics.median(sum(min(ts) for ts in zip(*ranks)) for ranks in per_step)
    return comm, transfer, comm - transfer          # each step's comm >= its transfer: so are the medians


def fit_all_reduce(nbytes, seconds, world: int) -> tuple[float, float]:
    """(bus bandwidth GB/s, latency us) of t = latency + 2 (world-1)/world * nbytes / bandwidth, fitted to measured
    (nbytes, seconds) by least squares on the relative errors (weights 1/t), so that the small messages, which
    decide the latency, count as much as the large ones, which decide the bandwidth."""
    x = 2 * (world - 1) / world * np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    slope, intercept = np.polyfit(x, t, 1, w=1 / t)
    return 1e-9 / slope, max(0.0, intercept * 1e6)


# ============================================================================ measured (one process per GPU)
def rank_comm(rank: int, world: int, unique_id):
    """Comm on this rank's GPU, or LocalComm for one rank (no NCCL needed)."""
    from step4_gpt2.parallel.comm import Comm, LocalComm
    return LocalComm(gpu=True) if world == 1 else Comm(rank, world, unique_id)


def times_cuda(fn, repeat: int, wait, warmup: int = 2, after=None) -> list[float]:
    """Seconds of each of `repeat` runs of fn() between CUDA events on the current stream, after `warmup` runs;
    wait() is the communicator's bounded wait (never an unbounded synchronize: a peer that died must not hang
    this rank), and after(), if given, runs after each timed run's wait. All ranks call it together, so each
    timed collective also includes the wait for the slowest rank."""
    import cupy as cp
    for _ in range(warmup):
        fn()
    wait()
    times = []
    for _ in range(repeat):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        wait()
        times.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
        if after is not None:
            after()
    return times


def time_cuda(fn, repeat: int, wait) -> float:
    """The median of times_cuda's runs."""
    return statistics.median(times_cuda(fn, repeat, wait))


def random_batch(cfg: GPTConfig, B: int, T: int, seed: int):
    """(idx, targets) (B, T) int32 on the GPU: random tokens, the same on every rank for the same seed."""
    import cupy as cp
    rng = np.random.default_rng(seed)
    return tuple(cp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), dtype=cp.int32) for _ in range(2))


def spawn_ranks(fn, world: int, *args, timeout_s: float) -> list:
    """[fn(rank, world, unique_id, *args) of each rank]: launch.spawn's processes, or this process for one rank."""
    if world == 1:
        return [fn(0, 1, None, *args)]
    from step4_gpt2.parallel.launch import spawn
    return spawn(fn, world, *args, timeout_s=timeout_s)


def tensor_parallel_worker(rank, world, unique_id, config: dict, B: int, T: int, repeat: int = COMM_STEPS):
    """{step_s, comm_s, step_each, comm_each} of TensorParallelGPT.loss_and_grads on a random batch (GPT-2's
    initialisation, seed 0): after two warm-up steps, `repeat` steps, each timed between CUDA events on the current
    stream (step_each[step]) and with each of its all-reduces timed too (comm_each[step][i]); step_s and comm_s are
    this rank's medians. The all-reduces are timed in the steps they belong to, so a step's are never longer than
    it, however busy the machine."""
    from step4_gpt2.train.model import init_params
    cfg = GPTConfig(**config)
    comm = rank_comm(rank, world, unique_id)
    try:
        model = TensorParallelGPT(cfg, shard_params(init_params(cfg), cfg, rank, world), comm, rank, world, timed=True)
        idx, targets = random_batch(cfg, B, T, seed=0)
        step = lambda: model.loss_and_grads(idx, targets)  # noqa: E731
        wait = lambda: comm.wait(what="timed tensor-parallel step")  # noqa: E731
        for _ in range(2):
            step()
        wait()
        model.comm_times()                               # forget the warm-up's events
        each = []
        steps = times_cuda(step, repeat, wait, warmup=0, after=lambda: each.append(model.comm_times()))
        return {"step_s": statistics.median(steps), "comm_s": statistics.median(sum(t) for t in each),
                "step_each": steps, "comm_each": each}
    finally:
        comm.close()


def measure_tensor_parallel(cfg: GPTConfig, B: int, T: int, world: int, timeout_s: float = 300) -> dict:
    """{step_s, comm_s, transfer_s, wait_s} of one tensor-parallel training step (forward + backward) on `world`
    GPUs: the slowest rank's step; the time in all-reduces, its transfer and the wait for the slower rank
    (transfer_and_wait). world = 1 is 4b's model through the same code, with no communication (all 0)."""
    check_world(cfg, world)
    rows = spawn_ranks(tensor_parallel_worker, world, asdict(cfg), B, T, timeout_s=timeout_s)
    comm, transfer, wait = transfer_and_wait([r["comm_each"] for r in rows])
    step = statistics.median(max(ts) for ts in zip(*(r["step_each"] for r in rows)))   # the slowest rank's
    return {"step_s": step, "comm_s": comm, "transfer_s": transfer, "wait_s": wait}
