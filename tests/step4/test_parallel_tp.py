"""Step 4e's tensor parallelism (step4_gpt2/parallel/tensor_parallel.py): on the CPU the sharding, the Megatron
forward/backward of one block and of the whole model with world = 1, 2, 4 ranks simulated in one process against
4b's float64 reference (common.reference.train_gpt2), the simulated communicator's bounded waits, the napkin
math, the all-reduces' transfer told apart from the wait for the slower rank, and the named errors; on one GPU the model on 4b's kernels against 4b's TrainGPT; on 2 and 4 GPUs (one
process per GPU, NCCL) the same, its gradients gathered from the ranks, and the measuring workers."""
import time

import numpy as np
import pytest

from common import assert_close, max_rel_error
from common.reference import train_gpt2 as R
from step4_gpt2.parallel import measure, tensor_parallel as tp
from step4_gpt2.train.model import init_params
from step4_gpt2.weights import GPTConfig, expected_shapes

gpu = pytest.mark.gpu
SMALL = GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=13, block_size=8)


def params_with_biases(cfg, seed=0):
    """GPT-2's initialisation with every bias and LayerNorm moved off 0 and 1, so a misplaced one shows."""
    rng = np.random.default_rng(seed + 100)
    return {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in init_params(cfg, seed).items()}


def batch(cfg, B, T, seed=0):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    idx[0, :3] = idx[0, 0]                      # a repeated token: the embedding's scatter adds them
    return idx, rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)


def host_run(cfg, params, idx, targets, world):
    """[(loss, grads, all-reduce count)] of each simulated rank on HostOps."""
    def rank_fn(rank, comm):
        model = tp.TensorParallelGPT(cfg, tp.shard_params(params, cfg, rank, world), comm, rank, world, ops=tp.HostOps())
        loss = model.loss_and_grads(idx, targets)
        return loss, model.grads, model.all_reduces
    return tp.simulate(rank_fn, world, timeout_s=60)


# ============================================================================ CPU: sharding
@pytest.mark.parametrize("world", [1, 2, 4])
def test_shards_cover_every_parameter_once(world):
    cfg, P = SMALL, params_with_biases(SMALL)
    shards = [tp.shard_params(P, cfg, r, world) for r in range(world)]
    for s in shards:
        assert {k: v.shape for k, v in s.items()} == tp.shard_params_shapes(cfg, world)
    back = tp.gather_grads(shards, cfg)
    for k in P:
        assert np.array_equal(back[k], P[k]), k
    split = sum(int(np.prod(s)) for k, s in expected_shapes(cfg).items() if tp.shard_index(cfg, k, 0, world))
    held = sum(v.size for v in shards[0].values())
    assert held == cfg.n_params() - split + split // world          # split tensors: 1/world each


def test_a_ranks_c_attn_columns_are_q_k_v_of_its_heads():
    cfg = SMALL
    W = np.arange(cfg.n_embd * 3 * cfg.n_embd, dtype=np.float32).reshape(cfg.n_embd, 3 * cfg.n_embd)
    P = dict(params_with_biases(cfg), **{"h.0.attn.c_attn.weight": W})
    Cl = cfg.n_embd // 2
    got = tp.shard_params(P, cfg, 1, 2)["h.0.attn.c_attn.weight"]
    C = cfg.n_embd
    want = np.concatenate([W[:, Cl:C], W[:, C + Cl:2 * C], W[:, 2 * C + Cl:3 * C]], axis=1)
    assert np.array_equal(got, want)


# ============================================================================ CPU: the model, simulated ranks
@pytest.mark.parametrize("n_layer", [1, 3], ids=["one block", "three blocks"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_tensor_parallel_matches_the_float64_reference(n_layer, world):
    cfg = GPTConfig(n_layer=n_layer, n_head=4, n_embd=32, vocab_size=13, block_size=8)
    P = params_with_biases(cfg, seed=n_layer)
    idx, targets = batch(cfg, 3, 7)
    ref_loss, ref = R.forward_backward(P, idx, targets, cfg.n_head)
    ranks = host_run(cfg, P, idx, targets, world)
    for loss, _, count in ranks:
        assert loss == pytest.approx(ref_loss, rel=1e-12)
        assert count == tp.ALL_REDUCES_PER_LAYER * n_layer          # 2 forward + 2 backward per layer
    full = tp.gather_grads([g for _, g, _ in ranks], cfg)
    for k in ref:
        assert_close(full[k], ref[k], rtol=1e-12, name=k)
    for k in P:                                      # replicated gradients: the same bits on every rank
        if tp.shard_index(cfg, k, 0, world) is None:
            assert all(np.array_equal(g[k], ranks[0][1][k]) for _, g, _ in ranks), k


def cpu_rank(rank, world, endpoint, params, idx, targets):
    """One process of test_two_processes_through_cpu_comm: the model on HostOps, all-reduces through CpuComm."""
    from step4_gpt2.parallel.comm import CpuComm
    comm = CpuComm(rank, world, endpoint, timeout_s=60)
    try:
        model = tp.TensorParallelGPT(SMALL, tp.shard_params(params, SMALL, rank, world), comm, rank, world,
                                     ops=tp.HostOps())
        return model.loss_and_grads(idx, targets), model.grads
    finally:
        comm.close()


def test_two_processes_through_cpu_comm():
    """The control flow of the GPU path: one process per rank (spawn), the all-reduces between processes."""
    from step4_gpt2.parallel.launch import spawn
    P = params_with_biases(SMALL, seed=9)
    idx, targets = batch(SMALL, 2, 8, seed=9)
    ref_loss, ref = R.forward_backward(P, idx, targets, SMALL.n_head)
    ranks = spawn(cpu_rank, 2, P, idx, targets, timeout_s=120, backend="cpu")
    assert all(loss == pytest.approx(ref_loss, rel=1e-12) for loss, _ in ranks)
    full = tp.gather_grads([g for _, g in ranks], SMALL)
    for k in ref:
        assert_close(full[k], ref[k], rtol=1e-12, name=k)


def test_simulated_all_reduce_sums_in_rank_order_and_averages():
    def fn(rank, comm):
        x = np.full(5, rank + 1.0)
        s = comm.all_reduce(x.copy())
        a = comm.all_reduce(x, out=x, op="avg")
        return s, a
    for s, a in tp.simulate(fn, 3):
        assert np.array_equal(s, np.full(5, 6.0)) and np.array_equal(a, np.full(5, 2.0))


def test_a_failing_rank_stops_the_others_at_once():
    def fn(rank, comm):
        if rank == 1:
            raise ValueError("rank 1 failed")
        comm.all_reduce(np.zeros(3))
    t = time.monotonic()
    with pytest.raises(ValueError, match="rank 1 failed"):
        tp.simulate(fn, 2, timeout_s=30)
    assert time.monotonic() - t < 5


def test_a_missing_rank_is_a_bounded_wait():
    def fn(rank, comm):
        if rank == 0:
            comm.all_reduce(np.zeros(3))              # rank 1 never comes
    t = time.monotonic()
    with pytest.raises(tp.CommTimeout, match="rank 0: all_reduce waited"):
        tp.simulate(fn, 2, timeout_s=0.5)
    assert time.monotonic() - t < 10


# ============================================================================ CPU: napkin math
def test_predicted_communication():
    cfg = GPTConfig(n_layer=6, n_head=6, n_embd=384, vocab_size=65, block_size=256)
    assert tp.predict_comm_seconds(cfg, 64, 256, 1, 300.0, 10.0) == 0.0
    nbytes = 64 * 256 * 384 * 4
    for world in (2, 3, 6):
        want = 4 * 6 * (10e-6 + 2 * (world - 1) / world * nbytes / 300e9)
        assert tp.predict_comm_seconds(cfg, 64, 256, world, 300.0, 10.0) == pytest.approx(want, rel=1e-12)
    # the lesson's claim at this size: data parallelism sends far less per step than tensor parallelism
    assert tp.dp_comm_seconds(cfg, 2, 300.0, 10.0) < tp.predict_comm_seconds(cfg, 64, 256, 2, 300.0, 10.0) / 5


def test_fit_all_reduce_recovers_bandwidth_and_latency():
    sizes = np.array([2**k for k in range(10, 30, 2)], dtype=float)
    t = [tp.ring_all_reduce_seconds(s, 4, 250.0, 12.0) for s in sizes]
    bw, lat = tp.fit_all_reduce(sizes, t, 4)
    assert bw == pytest.approx(250.0, rel=1e-6) and lat == pytest.approx(12.0, rel=1e-4)


def test_transfer_and_wait_take_each_all_reduce_from_the_rank_that_waited_least():
    """Two ranks, two timed steps of three all-reduces; the transfer of each is 1 ms. Rank 0 computes faster before
    the first and the third (it waits there for rank 1), rank 1 before the second."""
    ms = 1e-3
    per_rank = [[[3 * ms, 1 * ms, 2 * ms], [5 * ms, 1 * ms, 2 * ms]],       # rank 0: [step][all-reduce]
                [[1 * ms, 4 * ms, 1 * ms], [1 * ms, 2 * ms, 1 * ms]]]       # rank 1
    comm, transfer, wait = tp.transfer_and_wait(per_rank)
    # per step: the most one rank spent in all-reduces (6 and 8 ms), the shortest time of each all-reduce (3 ms)
    assert comm == pytest.approx(7 * ms) and transfer == pytest.approx(3 * ms) and wait == pytest.approx(4 * ms)
    assert tp.transfer_and_wait([[[], []]]) == (0.0, 0.0, 0.0)                # one rank: no all-reduce


def test_step_flops_is_6_per_parameter_per_token_plus_attention():
    cfg = SMALL
    blocks = 12 * cfg.n_layer * cfg.n_embd ** 2
    assert tp.step_flops(cfg, 2, 8) == 16 * (6 * (blocks + cfg.vocab_size * cfg.n_embd) + 6 * cfg.n_layer * 8 * cfg.n_embd)


# ============================================================================ CPU: named errors
def test_named_errors():
    P = params_with_biases(SMALL)
    with pytest.raises(ValueError, match="world: 3 ranks do not split n_head=4"):
        tp.shard_params(P, SMALL, 0, 3)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="world"):
            tp.check_world(SMALL, bad)
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < world=2"):
        tp.shard_params(P, SMALL, 2, 2)
    with pytest.raises(ValueError, match="params: missing 'wte.weight'"):
        tp.shard_params({k: v for k, v in P.items() if k != "wte.weight"}, SMALL, 0, 2)
    with pytest.raises(ValueError, match="params: h.0.attn.c_attn.weight has shape .* this rank's shard"):
        tp.TensorParallelGPT(SMALL, P, object(), 0, 2, ops=tp.HostOps())      # the full params, not a shard
    with pytest.raises(ValueError, match="comm: world=2"):
        tp.TensorParallelGPT(SMALL, tp.shard_params(P, SMALL, 0, 2), None, 0, 2, ops=tp.HostOps())
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < world=1"):
        tp.TensorParallelGPT(SMALL, P, None, 1, 1, ops=tp.HostOps())
    with pytest.raises(RuntimeError, match="backward: call forward"):
        tp.TensorParallelGPT(SMALL, P, None, 0, 1, ops=tp.HostOps()).backward()
    for name, args in (("B", (0, 8)), ("T", (2, 1.5))):
        with pytest.raises(ValueError, match=f"{name}: expected a positive integer"):
            tp.predict_comm_seconds(SMALL, *args, 2, 100.0, 5.0)
    with pytest.raises(ValueError, match="bandwidth_gbs"):
        tp.predict_comm_seconds(SMALL, 2, 8, 2, 0.0, 5.0)
    with pytest.raises(ValueError, match="latency_us"):
        tp.predict_comm_seconds(SMALL, 2, 8, 2, 100.0, float("nan"))
    with pytest.raises(ValueError, match="op: expected one of"):
        tp.simulate(lambda rank, comm: comm.all_reduce(np.zeros(1), op="max"), 1)


# ============================================================================ GPU
GPU_CFG = GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=65, block_size=64)     # head_dim 32


def gpu_count() -> int:
    import cupy as cp
    return cp.cuda.runtime.getDeviceCount()


def need_gpus(n: int):
    if gpu_count() < n:
        pytest.skip(f"needs {n} GPUs, this machine has {gpu_count()}")


def device_grads(model) -> dict:
    return {k: v.get() for k, v in model.grads.items()}


@gpu
def test_one_rank_on_the_gpu_matches_4b():
    import cupy as cp
    from step4_gpt2.train.model import TrainGPT
    cfg, P = GPU_CFG, params_with_biases(GPU_CFG, seed=4)
    idx, targets = batch(cfg, 3, 50, seed=5)
    ref = TrainGPT(cfg, P)
    ref_loss = float(ref.loss_and_grads(cp.asarray(idx), cp.asarray(targets)))
    model = tp.TensorParallelGPT(cfg, tp.shard_params(P, cfg, 0, 1), None, 0, 1)
    loss = float(model.loss_and_grads(cp.asarray(idx), cp.asarray(targets)))
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    ours = device_grads(model)
    bad = {k: e for k in ours if not (e := max_rel_error(ours[k], ref.grads[k].get())) <= 1e-5}
    assert not bad, f"max relative error > 1e-5 against TrainGPT: {bad}"


def ranks_worker(rank, world, unique_id, params, idx, targets):
    """One rank of test_ranks_on_gpus_match_the_reference: (loss, {name: host gradient})."""
    import cupy as cp
    from step4_gpt2.parallel.comm import Comm
    comm = Comm(rank, world, unique_id)                 # on this rank's GPU
    try:
        model = tp.TensorParallelGPT(GPU_CFG, tp.shard_params(params, GPU_CFG, rank, world), comm, rank, world)
        loss = float(model.loss_and_grads(cp.asarray(idx), cp.asarray(targets)))
        comm.wait(what="the tensor-parallel step")
        return loss, device_grads(model)
    finally:
        comm.close()


@gpu
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_on_gpus_match_the_reference(world):
    need_gpus(world)
    from step4_gpt2.parallel.launch import spawn
    cfg, P = GPU_CFG, params_with_biases(GPU_CFG, seed=6)
    idx, targets = batch(cfg, 3, 50, seed=7)
    ref_loss, ref = R.forward_backward(P, idx, targets, cfg.n_head)
    ranks = spawn(ranks_worker, world, P, idx, targets, timeout_s=300)
    for loss, grads in ranks:
        assert loss == pytest.approx(ref_loss, rel=1e-5)
    full = tp.gather_grads([g for _, g in ranks], cfg)
    bad = {k: e for k in ref if not (e := max_rel_error(full[k], ref[k])) <= 1e-4}
    assert not bad, f"max relative error > 1e-4 against the float64 reference: {bad}"
    for k in P:                        # NCCL's all-reduce gives every rank the same bits: so do the replicas
        if tp.shard_index(cfg, k, 0, world) is None:
            assert all(np.array_equal(g[k], ranks[0][1][k]) for _, g in ranks), k


@gpu
def test_measuring_on_one_gpu_runs_in_this_process():
    tpm = tp.measure_tensor_parallel(GPU_CFG, 4, 64, 1)
    assert tpm["step_s"] > 0 and tpm["comm_s"] == tpm["transfer_s"] == tpm["wait_s"] == 0
    for zero1 in (False, True):
        dp = measure.measure_data_parallel(GPU_CFG, 4, 64, 1, zero1=zero1)
        assert dp["tokens_s"] > 0
        assert dp["optimizer_bytes"] == pytest.approx(2 * 4 * GPU_CFG.n_params(), rel=1e-3)     # AdamW's m and v


@gpu
@pytest.mark.parametrize("world", [2, 4])
def test_measuring_on_several_gpus(world):
    need_gpus(world)
    ar = measure.measure_all_reduce(world, sizes=(256, 65536))
    assert ar["nbytes"] == [1024, 262144] and all(s > 0 for s in ar["seconds"])
    tpm = tp.measure_tensor_parallel(GPU_CFG, 4, 64, world)
    assert 0 < tpm["transfer_s"] <= tpm["comm_s"] < tpm["step_s"]
    assert tpm["wait_s"] == pytest.approx(tpm["comm_s"] - tpm["transfer_s"])
    one = measure.measure_data_parallel(GPU_CFG, 4, 64, 1, zero1=True)["optimizer_bytes"]
    dp = measure.measure_data_parallel(GPU_CFG, 4, 64, world, zero1=True)
    assert dp["tokens_s"] > 0 and dp["optimizer_bytes"] <= 1.01 * one / world      # 1/N (+ a little padding)
    by = measure.measure_buckets(GPU_CFG, 4, 64, world, (0.05, 25))                 # several buckets, one bucket
    assert list(by) == [0.05, 25] and all(m["tokens_s"] > 0 for m in by.values())


def test_all_reduce_time_is_the_last_arrivals(monkeypatch):
    """Each call's time is the shortest of the ranks' (the last to arrive waits least), then the median over calls:
    a rank that starts late does not count as latency."""
    ranks = [[(1024, [5e-6, 40e-6, 6e-6]), (4096, [9e-6, 9e-6, 9e-6])],       # rank 0 waited in call 2
             [(1024, [30e-6, 4e-6, 7e-6]), (4096, [8e-6, 10e-6, 50e-6])]]     # rank 1 in calls 1 and 3
    monkeypatch.setattr(measure, "spawn_ranks", lambda fn, world, sizes, timeout_s: ranks)
    got = measure.measure_all_reduce(2, sizes=(256, 1024))
    assert got == {"nbytes": [1024, 4096], "seconds": [5e-6, 9e-6]}      # medians of (5, 4, 6) and (8, 9, 9) us


def test_measure_names_bad_input():
    with pytest.raises(ValueError, match="world: an all-reduce is measured on 2 or more GPUs"):
        measure.measure_all_reduce(1)
    with pytest.raises(ValueError, match="world: 3 ranks"):
        tp.measure_tensor_parallel(SMALL, 2, 8, 3)
    with pytest.raises(ValueError, match="world: expected a positive number of GPUs"):
        measure.measure_data_parallel(SMALL, 2, 8, 0)
    for bad in (0, -1.0, float("nan"), True, "25"):
        with pytest.raises(ValueError, match="bucket_mb: expected a bucket size in MB > 0"):
            measure.measure_data_parallel(SMALL, 2, 8, 1, bucket_mb=bad)
    for bad in ((), (4, 0), [float("inf")]):
        with pytest.raises(ValueError, match="buckets: expected bucket sizes in MB > 0"):
            measure.measure_buckets(SMALL, 2, 8, 1, bad)
