"""Step 4e's data parallel trainer (step4_gpt2/parallel/data_parallel.py).

On the CPU, the trainer's own code (the batch split, the bucket plan, the buckets reduced as the backward finishes
them, ZeRO-1's shards, the norm's all-reduce and the all-gather, the config check, checkpoints resumed on another
number of ranks) runs with 4b's model replaced by its float64 reference (common.reference.train_gpt2, the same
access order to the gradient buffers as TrainGPT.backward) and the collectives by NumPy between threads, one per
rank; it must train exactly like one process on the global batch. On the GPU: the real TrainGPT's access order,
and on 2 and 4 GPUs (NCCL) 20 steps equal to one GPU within 1e-5 relative and ZeRO-1's optimizer memory 1/N; the
step recorded as a CUDA graph (graph=True, collectives included) equal to the eager step, on one GPU and on 2 or 4;
and in graph mode a stalled peer ending a replay in a CommError, the communicator releasing the graph first."""
import threading

import numpy as np
import pytest

from common.reference import train_gpt2 as R
from step4_gpt2.parallel import data_parallel as DP
from step4_gpt2.train.model import init_params
from step4_gpt2.train.train import CheckpointError, TrainConfig
from step4_gpt2.weights import GPTConfig, expected_shapes

gpu = pytest.mark.gpu
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=29, block_size=8)
BUCKET_MB = 0.01                 # 2621 floats: several buckets in CFG's 26k parameters


# ============================================================================ CPU stand-ins
class ThreadComm:
    """The Comm interface in NumPy for ranks that are threads of one process: each collective deposits a copy of
    x, meets the others at a barrier (bounded), and computes the result from all copies in rank order."""

    class Hub:
        def __init__(self, world, timeout_s=20):
            self.world, self.slots = world, [None] * world
            self.barrier = threading.Barrier(world, timeout=timeout_s)

    def __init__(self, hub, rank):
        self.hub, self.rank, self.world, self.log, self.releases = hub, rank, hub.world, [], []

    def on_abort(self, release):
        self.releases.append(release)

    def _exchange(self, what, x):
        self.log.append((what, int(x.size)))
        self.hub.slots[self.rank] = np.array(x, copy=True)
        self.hub.barrier.wait()
        got = list(self.hub.slots)
        self.hub.barrier.wait()
        return got

    def _reduce(self, got, op):
        s = got[0].astype(np.float64)
        for g in got[1:]:
            s = s + g                    # rank 0 + rank 1 + ...: the order NCCL_ALGO=Ring would not promise
        return s / self.world if op == "avg" else s

    def all_reduce(self, x, out=None, op="sum", stream=None):
        out = x if out is None else out
        out[...] = self._reduce(self._exchange("all_reduce", x), op).reshape(out.shape)
        return out

    def reduce_scatter(self, x, out, op="sum", stream=None):
        assert x.size == self.world * out.size
        s = self._reduce(self._exchange("reduce_scatter", x), op)
        out[...] = s[self.rank * out.size:(self.rank + 1) * out.size]
        return out

    def all_gather(self, x, out, stream=None):
        assert out.size == self.world * x.size
        out[...] = np.concatenate(self._exchange("all_gather", x))
        return out

    def broadcast(self, x, root=0, stream=None):
        x[...] = self._exchange("broadcast", x)[root]
        return x

    def wait(self, stream=None, what="collective"):
        pass


def backward_order(n_layer):
    """The order in which TrainGPT.backward takes model.grads[name] (test_access_order_is_traingpts checks it)."""
    out = ["wte.weight", "ln_f.weight", "ln_f.bias"]
    for i in reversed(range(n_layer)):
        out += [f"h.{i}.{n}" for n in ("mlp.c_proj.weight", "mlp.c_proj.bias", "mlp.c_fc.bias", "mlp.c_fc.weight",
                                       "ln_2.weight", "ln_2.bias", "attn.c_proj.weight", "attn.c_proj.bias",
                                       "attn.c_attn.weight", "attn.c_attn.bias", "ln_1.weight", "ln_1.bias")]
    return out + ["wte.weight", "wpe.weight"]


class RefGPT:
    """TrainGPT's interface in float64 NumPy: params/grads views into flat/gflat, the reference forward and
    backward, the gradients written in TrainGPT.backward's order (wte's LM-head half first, its total last)."""

    def __init__(self, cfg, seed=0):
        self.config, self.shapes = cfg, expected_shapes(cfg)
        P = init_params(cfg, seed)
        total = sum(int(np.prod(s)) for s in self.shapes.values())
        self.flat, self.gflat = np.zeros(total), np.zeros(total)
        self.params, self.grads = {}, {}
        for k, (lo, hi) in DP.tensor_ranges(self.shapes).items():
            self.params[k] = self.flat[lo:hi].reshape(self.shapes[k])
            self.grads[k] = self.gflat[lo:hi].reshape(self.shapes[k])
            self.params[k][...] = P[k]
        self.in_backward = False

    def check_batch(self, idx, targets):
        return idx, targets

    def forward(self, idx, targets, grad=True, check=True):
        loss, self._G = R.forward_backward(self.params, idx, targets, self.config.n_head)
        return np.array(loss)

    def backward(self):
        self.in_backward = True
        seen = set()
        for k in backward_order(self.config.n_layer):
            g = self.grads[k]
            g[...] = self._G[k] * (0.5 if k == "wte.weight" and k not in seen else 1.0)
            seen.add(k)
        self.in_backward = False

    def host_params(self):
        return {k: v.astype(np.float32) for k, v in self.params.items()}


class CpuDP(DP.DataParallelTrainer):
    """The trainer with its three arithmetic methods in float64 NumPy (4b's kernels need a GPU)."""

    def _make_optimizer(self):
        class State:
            pass
        o = State()
        o.m = {p: np.zeros_like(a) for p, a in self._opt_params.items()}
        o.v = {p: np.zeros_like(a) for p, a in self._opt_params.items()}
        o.t, o.lr, o.betas = 0, self.config.lr, (self.config.beta1, self.config.beta2)
        o.decayed = set(self.decayed)
        self.reduced = []
        return o

    def _reduce(self, i):
        self.reduced.append((i, self.model.in_backward))
        super()._reduce(i)

    def _norm(self, gflat):
        return np.sqrt(np.dot(gflat, gflat))

    def _sum_of_squares(self, parts):
        return np.array([sum(float(np.dot(g, g)) for g in parts)])

    def _adamw(self, norm):
        c, o = self.config, self.opt
        coef = min(1.0, c.grad_clip / (float(norm) + 1e-6)) if c.grad_clip else 1.0
        o.t += 1
        b1, b2 = o.betas
        bc1, bc2 = 1 - b1 ** o.t, 1 - b2 ** o.t
        lr = c.lr_at(self.step_count)
        for p, g in self._opt_grads.items():
            x, g = self._opt_params[p], g * coef
            wd = c.weight_decay if p in o.decayed else 0.0
            o.m[p][...] = b1 * o.m[p] + (1 - b1) * g
            o.v[p][...] = b2 * o.v[p] + (1 - b2) * g * g
            x[...] = x - lr * (wd * x + (o.m[p] / bc1) / (np.sqrt(o.v[p] / bc2) + c.eps))


def global_batch(step, B, T=CFG.block_size):
    rng = np.random.default_rng([7, step])
    return (rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32),
            rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32))


def reference_run(tc, steps):
    """One process on the global batch: the float64 references of 4b's step (clip, AdamW, schedule)."""
    P = {k: v.astype(np.float64) for k, v in init_params(CFG).items()}
    state = {"t": 0, "m": {k: np.zeros_like(v) for k, v in P.items()}, "v": {k: np.zeros_like(v) for k, v in P.items()}}
    losses = []
    for s in range(steps):
        loss, G = R.forward_backward(P, *global_batch(s, tc.batch_size), CFG.n_head)
        if tc.grad_clip:
            G, _ = R.clip_grad_norm(G, tc.grad_clip)
        P, state = R.adamw_step(P, G, state, tc.lr_at(s), (tc.beta1, tc.beta2), tc.eps, tc.weight_decay)
        losses.append(loss)
    return np.array(losses), P


def run_ranks(world, body, timeout_s=120):
    """body(rank, comm) in one thread per rank; their return values (a rank's exception is raised here)."""
    hub, results, errors = ThreadComm.Hub(world), [None] * world, [None] * world

    def go(r):
        try:
            results[r] = body(r, ThreadComm(hub, r))
        except BaseException as e:  # noqa: BLE001  (re-raised below, in the test's thread)
            errors[r] = e
            hub.barrier.abort()      # the other ranks stop waiting at once

    threads = [threading.Thread(target=go, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive(), f"a rank still runs after {timeout_s} s"
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    if first is not None or any(errors):
        raise first or next(e for e in errors if e is not None)
    return results


def train(world, tc, steps, zero1=False, accumulate=1, start=None, save=None, save_at=None):
    """`steps` steps on `world` ranks; each rank returns (losses, flat, trainer)."""
    def body(rank, comm):
        t = CpuDP(RefGPT(CFG), tc, comm, zero1=zero1, bucket_mb=BUCKET_MB, accumulate=accumulate)
        if start is not None:
            t.load(start)
        losses = []
        while t.step_count < steps:
            t.step(*global_batch(t.step_count, tc.batch_size))
            losses.append(float(t.last_loss))
            if save is not None and t.step_count == save_at:
                t.save(save)
        return np.array(losses), t.model.flat.copy(), t
    return run_ranks(world, body)


TC = TrainConfig(batch_size=24, lr=3e-3, min_lr=3e-4, warmup=2, max_steps=6, grad_clip=0.5)   # clips: norms ~0.8


# ============================================================================ CPU: the plan
def test_batch_split_and_named_errors():
    assert DP.local_batch(64, 4, 2) == 8
    with pytest.raises(ValueError, match="batch_size"):
        DP.local_batch(10, 4)
    with pytest.raises(ValueError, match="accumulate"):
        DP.local_batch(8, 2, 0)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_buckets_cover_the_padded_buffer_in_equal_slices(world):
    shapes = expected_shapes(CFG)
    total = sum(int(np.prod(s)) for s in shapes.values())
    buckets = DP.plan_buckets(shapes, world, 2621)
    unit = world * DP.ALIGN
    assert buckets[0][0] == 0 and buckets[-1][1] == -(-total // unit) * unit
    assert all(a[1] == b[0] for a, b in zip(buckets, buckets[1:]))
    assert all((hi - lo) % unit == 0 and hi > lo for lo, hi in buckets)     # equal slices, 256-byte aligned
    assert len(buckets) > 3
    # one bucket per buffer when the bucket is larger than the model
    assert len(DP.plan_buckets(shapes, world, 10**9)) == 1
    # ZeRO-1: every element of every tensor belongs to exactly one rank's pieces, and the ranks hold equal shares
    ranges = DP.tensor_ranges(shapes)
    owner = np.zeros(total, int)
    shares = []
    for r in range(world):
        pieces = DP.shard_pieces(DP.shard_slices(buckets, r, world), ranges)
        for k, lo, hi in pieces:
            assert ranges[k][0] <= lo < hi <= ranges[k][1]
            owner[lo:hi] += 1
        shares.append(sum(hi - lo for _, lo, hi in pieces))
    assert (owner == 1).all()
    assert max(shares) - min(shares) < unit


def test_buckets_are_ready_as_the_backward_finishes_them():
    shapes = expected_shapes(CFG)
    ranges = DP.tensor_ranges(shapes)
    buckets = DP.plan_buckets(shapes, 2, 2621)
    tr = DP.ReadyTracker(buckets, ranges, CFG.n_layer)
    order, finished_names = [], set()
    names = backward_order(CFG.n_layer)
    for j, k in enumerate(names):
        for i in tr.touch(k):
            order.append(i)
            # every tensor the bucket touches has had its last write already (the writes come after the touch)
            for name, (a, b) in ranges.items():
                if a < buckets[i][1] and b > buckets[i][0]:
                    assert name in finished_names, (i, name)
        finished_names = {n for n in names[:j + 1] if n not in names[j + 1:]}
    early = len(order)
    order += tr.finish()
    assert sorted(order) == list(range(len(buckets)))
    assert order == sorted(order, reverse=True)       # the top of flat first: h.{L-1} is finished first
    assert early >= len(buckets) - 2                  # all but wte's and h.0's go out during the backward


def test_config_digest_differs_for_any_field():
    a = DP.config_digest({"lr": 1e-3}, 2)
    assert np.array_equal(a, DP.config_digest({"lr": 1e-3}, 2))
    assert not np.array_equal(a, DP.config_digest({"lr": 2e-3}, 2))
    assert (a < 2**16).all() and a.dtype == np.float32


def test_the_trainer_lets_its_communicator_release_its_graph():
    """DataParallelTrainer registers close() with comm.on_abort: ending the communicator drops the step's graph
    (NCCL would wait for it), and a trainer that is gone is not kept alive by its communicator."""
    import gc
    import weakref
    from step4_gpt2.parallel.comm import LocalComm
    comm = LocalComm()
    t = CpuDP(RefGPT(CFG), TC, comm)
    t._step_graph = "a recorded step"
    comm.abort()
    assert t._step_graph is None
    comm = LocalComm()
    gone = weakref.ref(CpuDP(RefGPT(CFG), TC, comm))
    gc.collect()
    assert gone() is None
    comm.close()


# ============================================================================ CPU: training equals one process
@pytest.mark.parametrize("world,zero1,accumulate", [(1, False, 1), (2, False, 1), (2, True, 1), (2, False, 2),
                                                    (4, True, 2), (3, True, 1)])
def test_training_equals_one_process_on_the_global_batch(world, zero1, accumulate):
    ref_losses, ref_P = reference_run(TC, 5)
    out = train(world, TC, 5, zero1=zero1, accumulate=accumulate)
    for losses, flat, t in out:
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-12)
        for k, (lo, hi) in t.ranges.items():
            np.testing.assert_allclose(flat[lo:hi], ref_P[k].reshape(-1), rtol=1e-9, atol=1e-12, err_msg=k)
        assert any(during for _, during in t.reduced) == (len(t.buckets) > 1)   # reduced during the backward
    logs = [t.comm.log for _, _, t in out]
    assert all(log == logs[0] for log in logs)           # every rank: the same collectives in the same order
    kinds = {w for w, _ in logs[0]}
    assert ("reduce_scatter" in kinds and "all_gather" in kinds) == zero1 or world == 1


def test_zero1_optimizer_state_is_one_nth():
    one = train(1, TC, 1)[0][2].optimizer_bytes
    for world in (2, 4):
        for _, _, t in train(world, TC, 1, zero1=True):
            assert abs(t.optimizer_bytes - one / world) <= 2 * 8 * DP.ALIGN * world, (world, t.optimizer_bytes, one)


def test_config_mismatch_is_a_named_error_on_every_rank():
    def body(rank, comm):
        tc = TrainConfig(**{**TC.__dict__, "lr": TC.lr * (1 + rank)})
        with pytest.raises(DP.ConfigMismatchError, match=r"config: ranks \[1\]"):
            CpuDP(RefGPT(CFG), tc, comm)
        return True
    assert run_ranks(2, body) == [True, True]


@pytest.mark.parametrize("kwargs,name", [({"accumulate": 4}, "batch_size"), ({"bucket_mb": 0}, "bucket_mb"),
                                         ({"comm": None}, "comm"), ({"accumulate": 0}, "accumulate"),
                                         ({"graph": True}, "graph")])      # NumPy arrays: nothing to capture
def test_bad_arguments_are_named_errors(kwargs, name):
    def body(rank, comm):
        args = {"comm": comm, **kwargs}
        CpuDP(RefGPT(CFG), TrainConfig(batch_size=6), args.pop("comm"), **args)
    with pytest.raises(ValueError, match=f"^{name}:"):
        run_ranks(1, body)
    with pytest.raises(ValueError, match="^idx:"):
        run_ranks(1, lambda r, c: CpuDP(RefGPT(CFG), TC, c).step(*global_batch(0, TC.batch_size - 1)))


@pytest.mark.parametrize("n,zero1_n,m,zero1_m", [(2, True, 3, True), (2, True, 1, False), (2, False, 4, True),
                                                 (4, True, 2, True)])
def test_checkpoint_resumes_on_another_number_of_ranks(tmp_path, n, zero1_n, m, zero1_m):
    steps, at = 5, 3
    whole = train(n, TC, steps, zero1=zero1_n, save=tmp_path, save_at=at)[0][0]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert any(f.startswith("optimizer.rank") for f in files) == zero1_n, files
    resumed = train(m, TC, steps, zero1=zero1_m, start=tmp_path)
    for losses, _, t in resumed:
        assert t.step_count == steps and len(losses) == steps - at
        # the checkpoint holds float32 weights and moments: equal to that rounding
        np.testing.assert_allclose(losses, whole[at:], rtol=1e-5)


def test_checkpoint_reads_the_shards_of_its_own_save(tmp_path):
    """A folder saved again by fewer ranks still holds the older shards: trainer_state.json says which count."""
    train(4, TC, 1, zero1=True, save=tmp_path, save_at=1)
    train(2, TC, 2, zero1=True, save=tmp_path, save_at=2)
    resumed = train(3, TC, 3, zero1=True, start=tmp_path)
    whole = train(2, TC, 3, zero1=True)
    for losses, _, _ in resumed:
        np.testing.assert_allclose(losses, whole[0][0][2:], rtol=1e-5)


def test_checkpoint_errors_name_the_directory(tmp_path):
    train(2, TC, 1, zero1=True, save=tmp_path, save_at=1)
    (tmp_path / DP.SHARD_FILE.format(rank=1, world=2)).unlink()
    with pytest.raises(CheckpointError, match="directory: .* lacks the ZeRO-1 shards"):
        DP.flat_state(tmp_path, expected_shapes(CFG))


def _cpu_rank(rank, world, endpoint, zero1):
    """One process of test_two_processes_over_cpu_comm: the trainer over comm.py's CpuComm (pipes)."""
    from step4_gpt2.parallel.comm import CpuComm
    comm = CpuComm(rank, world, endpoint, timeout_s=60)
    t = CpuDP(RefGPT(CFG), TC, comm, zero1=zero1, bucket_mb=BUCKET_MB)
    losses = []
    for s in range(3):
        t.step(*global_batch(s, TC.batch_size))
        losses.append(float(t.last_loss))
    return losses


@pytest.mark.parametrize("zero1", [False, True])
def test_two_processes_over_cpu_comm(zero1):
    """The same control flow in two spawned processes (launch.spawn, backend "cpu"), as the GPUs will run it."""
    from step4_gpt2.parallel.launch import spawn
    ref, _ = reference_run(TC, 3)
    for losses in spawn(_cpu_rank, 2, zero1, timeout_s=120, backend="cpu"):
        np.testing.assert_allclose(losses, ref, rtol=1e-12)


# ============================================================================ GPU
@gpu
def test_access_order_is_traingpts():
    """TrainGPT.backward takes the gradient buffers in backward_order's order (what the CPU tests assume)."""
    import cupy as cp
    from step4_gpt2.train.model import TrainGPT
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=37, block_size=16)
    m = TrainGPT(cfg)
    taken = []
    m.grads = DP._WatchedGrads(m.grads)
    idx = cp.asarray(global_batch(0, 2, 16)[0] % 37)
    m.forward(idx, idx, grad=True)
    m.grads.on_take = taken.append
    m.backward()
    m.grads.on_take = None
    assert taken == backward_order(cfg.n_layer)


def _gpu_rank(rank, world, unique_id, steps, batch, zero1):
    """One GPU rank of test_gpus_equal_one: its losses and AdamW's bytes (CuPy's memory pool, measured)."""
    import cupy as cp
    from step4_gpt2.parallel.comm import Comm
    from step4_gpt2.train.model import TrainGPT, shakespeare_char
    comm = Comm(rank, world, unique_id)
    model = TrainGPT(shakespeare_char(65, block_size=64))
    pool = cp.get_default_memory_pool()
    cp.cuda.Device().synchronize()
    before = pool.used_bytes()
    t = DP.DataParallelTrainer(model, TrainConfig(batch_size=batch, warmup=5, max_steps=steps), comm, zero1=zero1)
    cp.cuda.Device().synchronize()
    opt_measured = pool.used_bytes() - before          # AdamW's m, v (+ the trainer's few small buffers)
    losses = []
    for s in range(steps):
        x, y = global_batch_gpu(s, batch)
        t.step(cp.asarray(x), cp.asarray(y))
        losses.append(float(t.last_loss))
    comm.close()
    return losses, opt_measured, t.optimizer_bytes


def global_batch_gpu(step, B, T=64, V=65):
    rng = np.random.default_rng([11, step])
    return rng.integers(0, V, (B, T)).astype(np.int32), rng.integers(0, V, (B, T)).astype(np.int32)


def _gpus():
    import cupy as cp
    return cp.cuda.runtime.getDeviceCount()


@gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("zero1", [False, True])
def test_gpus_equal_one(world, zero1):
    """20 steps on 2 or 4 GPUs (NCCL) = 20 steps of 4b's Trainer on one GPU with the same global batch, 1e-5
    relative; with ZeRO-1 AdamW's state per GPU is 1/world of one GPU's, measured with CuPy's memory pool."""
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {_gpus()}")
    import cupy as cp
    from step4_gpt2.parallel.launch import spawn
    from step4_gpt2.train.model import TrainGPT, shakespeare_char
    from step4_gpt2.train.train import Trainer
    steps, batch = 20, 16
    one = Trainer(TrainGPT(shakespeare_char(65, block_size=64)), TrainConfig(batch_size=batch, warmup=5, max_steps=steps))
    ref = []
    for s in range(steps):
        x, y = global_batch_gpu(s, batch)
        one.step(cp.asarray(x), cp.asarray(y))
        ref.append(float(one.last_loss))
    one_bytes = sum(int(a.nbytes) for d in (one.opt.m, one.opt.v) for a in d.values())
    out = spawn(_gpu_rank, world, steps, batch, zero1, timeout_s=300)
    for losses, measured, counted in out:
        np.testing.assert_allclose(losses, ref, rtol=1e-5)
        if zero1:
            assert abs(counted - one_bytes / world) <= 2 * 4 * DP.ALIGN * world, (counted, one_bytes)
            assert measured < one_bytes / world + 4 * 2**20, (measured, one_bytes)


def test_cli_graph_is_opt_in_and_data_parallel_only():
    from step4_gpt2.parallel import __main__ as cli
    assert not cli.parser().parse_args([]).graph
    args = cli.parser().parse_args(["--gpus", "2", "--graph"])
    assert args.graph and cli.check_args(args, gpus_here=2) == 2
    with pytest.raises(ValueError, match="^--tp:.*--graph"):
        cli.check_args(cli.parser().parse_args(["--tp", "--graph"]))


# ============================================================================ GPU: the step as one CUDA graph
GRAPH_VARIANTS = [(False, 1), (True, 1), (False, 2), (True, 2)]      # (zero1, accumulate)


def eager_and_graph(comm, steps, batch, zero1, accumulate):
    """{graph: (rows, captured)}: `steps` steps of a fresh trainer with graph=False, then with graph=True (the same
    model, seed and batches); rows[s] = (loss, grad norm, learning rate, clipping factor) of step s, the last two as
    the GPU read them (_sched); captured: the graph trainer replayed a recorded graph (not a fallback)."""
    import cupy as cp
    from step4_gpt2.train.model import TrainGPT, shakespeare_char
    out = {}
    for graph in (False, True):
        t = DP.DataParallelTrainer(TrainGPT(shakespeare_char(65, block_size=64)),
                                   TrainConfig(batch_size=batch, warmup=2, max_steps=steps, grad_clip=0.1), comm,
                                   zero1=zero1, bucket_mb=1, accumulate=accumulate, graph=graph)
        try:
            rows = []
            for s in range(steps):
                x, y = global_batch_gpu(s, batch)
                t.step(cp.asarray(x), cp.asarray(y))
                sched = t._sched.get()
                rows.append((float(t.last_loss), float(t.last_norm), float(sched[0]), float(sched[3])))
            out[graph] = (np.array(rows), t.graph and t._step_graph is not None)
        finally:
            t.close()                 # the graph before the communicator (NCCL waits for it)
    return out


def assert_graph_equals_eager(out, what):
    (eager, _), (graph, captured) = out[False], out[True]
    assert captured, f"{what}: graph=True did not replay a recorded graph"
    assert (eager[:, 3] < 1).any(), f"{what}: no step clipped (the test would not see the norm's path)"
    np.testing.assert_allclose(graph, eager, rtol=1e-6, atol=0, err_msg=f"{what}: (loss, norm, lr, clip) per step")


@gpu
@pytest.mark.parametrize("zero1,accumulate", GRAPH_VARIANTS)
def test_graph_step_equals_eager_on_one_gpu(zero1, accumulate):
    """LocalComm (world = 1): its collectives are copy kernels, recorded like any kernel."""
    from step4_gpt2.parallel.comm import LocalComm
    out = eager_and_graph(LocalComm(gpu=True), 6, 8, zero1, accumulate)
    assert_graph_equals_eager(out, f"zero1={zero1}, accumulate={accumulate}")


def _graph_rank(rank, world, unique_id, steps, batch, variants):
    """One rank of test_graph_step_equals_eager_on_gpus: eager_and_graph of each variant, on one communicator."""
    from step4_gpt2.parallel.comm import Comm
    comm = Comm(rank, world, unique_id, timeout_s=120)
    try:
        return {v: eager_and_graph(comm, steps, batch, *v) for v in variants}
    finally:
        comm.close()


@gpu
@pytest.mark.parametrize("world", [2, 4])
def test_graph_step_equals_eager_on_gpus(world):
    """NCCL's collectives recorded in the step's graph (the buckets on the reduction stream, beside the backward):
    6 steps with graph=True equal 6 eager steps (loss, norm, learning rate, clipping) within 1e-6 relative, on
    every rank, for data parallel and ZeRO-1, with and without accumulation."""
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {_gpus()}")
    from step4_gpt2.parallel.launch import spawn
    out = spawn(_graph_rank, world, 6, 16, GRAPH_VARIANTS, timeout_s=480)
    for rank, per_variant in enumerate(out):
        for v in GRAPH_VARIANTS:
            assert_graph_equals_eager(per_variant[v], f"rank {rank}, (zero1, accumulate) = {v}")
            np.testing.assert_array_equal(per_variant[v][True][0], out[0][v][True][0])   # every rank: the same


def _graph_stalled_rank(rank, world, unique_id):
    """Two graph steps on both ranks (the second a replay); then rank 1 stalls and rank 0's third step (a replay)
    never ends: its bounded wait must raise CommError, which aborts the communicator, the trainer's graph released
    first (comm.on_abort) while its replay is still stuck. Rank 1 then aborts too, its graph released the same way.
    Were the abort to wait for a graph anyway, the watchdog would end the rank (exit status 3) and spawn say so."""
    import time

    import cupy as cp
    from step4_gpt2.parallel.comm import Comm, CommError
    from step4_gpt2.train.model import TrainGPT, shakespeare_char
    comm = Comm(rank, world, unique_id, timeout_s=5)
    t = DP.DataParallelTrainer(TrainGPT(shakespeare_char(65, block_size=64)), TrainConfig(batch_size=8), comm,
                               graph=True)
    for s in range(2):
        t.step(*(cp.asarray(a) for a in global_batch_gpu(s, 8)))
    replaying = t._step_graph is not None
    if rank == 1:
        time.sleep(15)
        comm.abort()                        # no t.close(): the communicator releases the graph itself
        return "stalled", replaying and t._step_graph is None
    t0 = time.monotonic()
    try:
        t.step(*(cp.asarray(a) for a in global_batch_gpu(2, 8)))
    except CommError as e:
        return str(e), time.monotonic() - t0, replaying and t._step_graph is None
    return "no error", time.monotonic() - t0, False


@gpu
def test_graph_step_stalled_peer_is_a_comm_error_not_a_hang():
    """With graph=True, a peer that stalls still ends a rank's step with a CommError within its time-out: NCCL
    (2.26 and later) aborts a communicator only once the graphs that recorded it are destroyed, so Comm.abort
    releases them first (comm.on_abort), and the abort's own wait for the stuck replay ends with the abort."""
    if _gpus() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {_gpus()}")
    from step4_gpt2.parallel.launch import spawn
    (message, seconds, released), (stalled, released_1) = spawn(_graph_stalled_rank, 2, timeout_s=90)
    assert message.startswith("rank 0: step 3 did not complete after 5."), message
    assert 5 <= seconds < 30 and stalled == "stalled"
    assert released and released_1, "a rank ended its communicator without releasing its replayed graph"
