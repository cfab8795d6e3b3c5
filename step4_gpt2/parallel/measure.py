"""Step 4e's measurements, one process per GPU (launch.spawn): the all-reduce over message sizes, data
parallelism and ZeRO-1 (tensor parallelism's: tensor_parallel.measure_tensor_parallel). Each `*_worker` is one
rank's part; each `measure_*` starts the ranks and returns what the notebook prints and plots. world = 1 runs in
this process (LocalComm: no NCCL, no spawn), so a one-GPU machine measures its anchor the same way.

    ar = measure_all_reduce(2)                                 # {'nbytes': [...], 'seconds': [...]}
    dp = measure_data_parallel(cfg, B=64, T=256, world=2, zero1=True)   # B rows per GPU: {'tokens_s', ...}
    by = measure_buckets(cfg, 64, 256, 2, (1, 4, 25))          # {bucket MB: {'tokens_s', ...}}, one start
"""
from __future__ import annotations

import gc
import math
import statistics
from dataclasses import asdict

from common import expect_int
from step4_gpt2.parallel.data_parallel import BUCKET_MB
from step4_gpt2.parallel.tensor_parallel import random_batch, rank_comm, spawn_ranks, time_cuda, times_cuda
from step4_gpt2.weights import GPTConfig

# floats: 256 (1 KiB, where the latency shows) .. 268M (1 GiB, where the bandwidth does), a factor of 4 apart
ALL_REDUCE_SIZES = tuple(4**k for k in range(4, 15))


# ============================================================================ one rank's part
def all_reduce_worker(rank, world, unique_id, sizes, repeat=20):
    """[(nbytes, [seconds of each timed call])] of an all-reduce (sum) of each size in floats, its result checked
    first (a vector of ones sums to world)."""
    import cupy as cp
    comm = rank_comm(rank, world, unique_id)
    try:
        out = []
        for n in sizes:
            x = cp.ones(int(n), cp.float32)
            comm.all_reduce(x, out=x)
            comm.wait(what="all_reduce check")
            if not bool((x == world).all()):
                raise RuntimeError(f"rank {rank}: all_reduce of {n} floats gave a wrong sum")
            wait = lambda: comm.wait(what="timed all_reduce")  # noqa: E731
            out.append((4 * int(n), times_cuda(lambda x=x: comm.all_reduce(x, out=x), repeat, wait)))
            del x
        return out
    finally:
        comm.close()


def data_parallel_worker(rank, world, unique_id, config: dict, B: int, T: int, zero1: bool, buckets=(BUCKET_MB,),
                         repeat: int = 10):
    """[{tokens_s, step_s, optimizer_bytes} for each bucket size in MB] of DataParallelTrainer steps with B rows
    per GPU (a global batch of B * world rows), 4b's model at GPT-2's initialisation, each step one CUDA graph
    (recorded in the warm-up): one trainer per bucket size, one after the other on the same communicator."""
    from step4_gpt2.parallel.data_parallel import DataParallelTrainer
    from step4_gpt2.train.model import TrainGPT
    from step4_gpt2.train.train import TrainConfig
    cfg = GPTConfig(**config)
    comm = rank_comm(rank, world, unique_id)
    try:
        idx, targets = random_batch(cfg, B * world, T, seed=1)                 # the same global batch on every rank
        wait = lambda: comm.wait(what="timed data-parallel step")  # noqa: E731
        out = []
        for mb in buckets:
            trainer = DataParallelTrainer(TrainGPT(cfg, seed=0), TrainConfig(batch_size=B * world), comm,
                                          zero1=zero1, bucket_mb=mb, graph=True)
            step = time_cuda(lambda: trainer.step(idx, targets, check=False), repeat, wait)  # noqa: B023
            out.append({"tokens_s": B * world * T / step, "step_s": step, "optimizer_bytes": trainer.optimizer_bytes})
            trainer.close()          # its graph, before the next trainer's memory is taken
            del trainer
            gc.collect()
        return out
    finally:
        comm.close()                 # releases a graph still held (comm.on_abort) before destroying the communicator


# ============================================================================ all the ranks
def _megabytes(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def measure_all_reduce(world: int, sizes=ALL_REDUCE_SIZES, timeout_s: float = 300) -> dict:
    """{'nbytes': [...], 'seconds': [...]} of an all-reduce on `world` >= 2 GPUs: for each size, the median over
    the timed calls of the shortest of the ranks' times of a call. A call ends on every rank at about the same
    moment, once the last rank has arrived, so the others' events also count their wait for it; the last to
    arrive times the transfer alone (as tensor_parallel.transfer_and_wait does for a step's all-reduces)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ValueError(f"world: an all-reduce is measured on 2 or more GPUs, got {world!r}")
    ranks = spawn_ranks(all_reduce_worker, world, [int(s) for s in sizes], timeout_s=timeout_s)
    return {"nbytes": [n for n, _ in ranks[0]],
            "seconds": [statistics.median(min(call) for call in zip(*(r[i][1] for r in ranks)))
                        for i in range(len(ranks[0]))]}


def measure_data_parallel(cfg: GPTConfig, B: int, T: int, world: int, zero1: bool = False, bucket_mb: float = BUCKET_MB,
                          timeout_s: float = 300) -> dict:
    """{tokens_s, step_s, optimizer_bytes} of data parallelism (ZeRO-1 with zero1) on `world` GPUs, B rows per
    GPU, gradients reduced in buckets of bucket_mb: the slowest rank's step and tokens/s, rank 0's optimizer bytes."""
    if not _megabytes(bucket_mb):
        raise ValueError(f"bucket_mb: expected a bucket size in MB > 0, got {bucket_mb!r}")
    return measure_buckets(cfg, B, T, world, (bucket_mb,), zero1, timeout_s)[bucket_mb]


def measure_buckets(cfg: GPTConfig, B: int, T: int, world: int, buckets, zero1: bool = False,
                    timeout_s: float = 300) -> dict:
    """{bucket MB: measure_data_parallel's dict} for each bucket size, all measured by one start of the ranks.
    Smaller buckets start reducing earlier in the backward (less left exposed at its end) but pay a collective's
    latency more often."""
    expect_int(world, "world", expected="a positive number of GPUs")
    buckets = tuple(buckets)
    if not buckets or not all(_megabytes(b) for b in buckets):
        raise ValueError(f"buckets: expected bucket sizes in MB > 0, got {buckets!r}")
    rows = spawn_ranks(data_parallel_worker, world, asdict(cfg), B, T, bool(zero1), [float(b) for b in buckets],
                       timeout_s=timeout_s)
    return {b: {"tokens_s": min(r[i]["tokens_s"] for r in rows), "step_s": max(r[i]["step_s"] for r in rows),
                "optimizer_bytes": rows[0][i]["optimizer_bytes"]} for i, b in enumerate(buckets)}
