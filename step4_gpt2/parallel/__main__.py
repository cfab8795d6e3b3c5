"""Train 4b's GPT on several GPUs of this machine (or of several, under a launcher) through NCCL.

    python -m step4_gpt2.parallel --gpus 2                    data parallel, shakespeare_char, 20 steps
    python -m step4_gpt2.parallel --gpus 4 --zero1            ZeRO-1: AdamW's state sharded over the 4 ranks
    python -m step4_gpt2.parallel --gpus 2 --model gpt2       GPT-2 124M's size, T = 1024 (random init)
    python -m step4_gpt2.parallel --gpus 4 --tp --model gpt2  tensor parallel: one step's time and its comm time

--batch is the global batch (every rank's rows together); each rank takes batch / gpus of them. Without --gpus,
every GPU of this machine. Each rank prints nothing; rank 0's losses and every rank's speed come back here.

Several machines: a standard launcher starts one process per GPU and sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT; this command then runs one rank (no --gpus), rank 0 hands the NCCL id to the others
on MASTER_PORT + 1, and NCCL connects the machines over its own transports (InfiniBand, sockets). On each of two
machines with 4 GPUs (node-rank 0 on the first, 1 on the second; HOST0 = the first one's address):

    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 --master-addr HOST0 --master-port 29500 \\
        -m step4_gpt2.parallel --zero1 --batch 64

A rank that fails or hangs ends the run on every rank within --timeout-s, with an error naming it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MODELS = ("shakespeare_char", "gpt2")
PER_GPU_BATCH = {"shakespeare_char": 16, "gpt2": 4}        # the default batch: this many rows per GPU


def parser() -> argparse.ArgumentParser:
    from step4_gpt2.parallel.comm import EXIT_HUNG
    from step4_gpt2.parallel.data_parallel import BUCKET_MB
    p = argparse.ArgumentParser(prog="python -m step4_gpt2.parallel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="processes to start, one per GPU (default: every GPU here; not under a launcher)")
    p.add_argument("--model", default="shakespeare_char", choices=MODELS,
                   help="shakespeare_char (6 layers, C=384, T=256, characters) or gpt2 (124M's size, T=1024, BPE)")
    p.add_argument("--batch", type=int, default=None, metavar="B",
                   help="the global batch in sequences, divisible by the GPUs (default: "
                        + ", ".join(f"{v} per GPU for {k}" for k, v in PER_GPU_BATCH.items())
                        + "; with --tp, that many in all)")
    p.add_argument("--seq", type=int, default=None, metavar="T", help="tokens per sequence (default: the model's)")
    p.add_argument("--steps", type=int, default=20, help="training steps (the first is not timed)")
    p.add_argument("--zero1", action="store_true", help="ZeRO-1: shard AdamW's state over the ranks")
    p.add_argument("--tp", action="store_true",
                   help="tensor parallel (Megatron): time one forward + backward and its all-reduces instead")
    p.add_argument("--accumulate", type=int, default=1, metavar="K", help="micro-batches per step and rank")
    p.add_argument("--bucket-mb", type=float, default=BUCKET_MB, help="size of a gradient bucket reduced at once")
    p.add_argument("--graph", action="store_true",
                   help="replay each step, collectives included, as one CUDA graph: one launch per step, the same "
                        "numbers as eager steps (a failed peer still ends every rank: the graph is released before "
                        f"NCCL's abort, and a rank whose abort does not return exits with status {EXIT_HUNG})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="a rank that has not finished (or a collective that has not) after this long ends the run")
    return p


def under_launcher(env=None) -> bool:
    """Did a launcher (torchrun and the like) start this process as one rank of a run?"""
    env = os.environ if env is None else env
    return "RANK" in env and "WORLD_SIZE" in env


def launcher_world(env=None) -> int | None:
    """WORLD_SIZE under a launcher (a ValueError naming it when it is not a number), else None."""
    env = os.environ if env is None else env
    if not under_launcher(env):
        return None
    try:
        return int(env["WORLD_SIZE"])
    except ValueError:
        raise ValueError(f"WORLD_SIZE={env['WORLD_SIZE']!r}: expected the number of ranks the launcher started") \
            from None


def check_args(args, gpus_here: int | None = None, world: int | None = None) -> int | None:
    """The argument checks, each error naming its argument (ValueError). Those that need no GPU run first
    (gpus_here None); with gpus_here (this machine's GPUs) or world (a launcher's WORLD_SIZE) the rest, and the
    number of ranks is returned."""
    for name in ("gpus", "batch", "seq", "steps", "accumulate"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name}: expected an integer >= 1, got {v}")
    if not args.bucket_mb > 0 or not args.timeout_s > 0:
        raise ValueError(f"--bucket-mb / --timeout-s: expected numbers > 0, got {args.bucket_mb} / {args.timeout_s}")
    if args.tp and (args.zero1 or args.accumulate > 1 or getattr(args, "graph", False)):
        raise ValueError("--tp: tensor parallelism here times one step of the model split over the GPUs; "
                         "--zero1, --accumulate and --graph belong to data parallelism")
    if world is not None and args.gpus is not None:
        raise ValueError(f"--gpus: under a launcher (RANK, WORLD_SIZE set) it starts the processes, "
                         f"WORLD_SIZE={world}; leave --gpus out")
    n = world if world is not None else args.gpus
    if gpus_here is not None and world is None:
        if n is not None and n > gpus_here:
            raise ValueError(f"--gpus {n}: this machine has {gpus_here} GPU{'s' * (gpus_here != 1)}")
        n = n or gpus_here
    if n is None:
        return None
    heads = model_config(args.model, 65, None).n_head   # what tensor parallelism splits (the vocabulary: any)
    if args.tp and heads % n:
        raise ValueError(f"--tp on {n} GPUs: {args.model}'s {heads} heads do not split into {n} equal "
                         f"groups (each rank computes whole heads)")
    if args.batch is not None:
        batch = args.batch
    else:                                   # tensor parallelism splits the model, not the batch
        batch = PER_GPU_BATCH[args.model] * (1 if args.tp else n * args.accumulate)
    if not args.tp and batch % (n * args.accumulate):
        raise ValueError(f"--batch {batch}: not divisible by {n} GPUs x --accumulate {args.accumulate} (each rank "
                         f"takes batch / gpus rows, in micro-batches of batch / gpus / accumulate)")
    args.batch = batch
    return n


def model_config(model: str, vocab_size: int, T: int | None):
    from step4_gpt2.train.model import shakespeare_char
    from step4_gpt2.weights import GPTConfig
    if model == "shakespeare_char":
        return shakespeare_char(vocab_size, block_size=T or 256)
    return GPTConfig(vocab_size=vocab_size, block_size=T or 1024)


def train_rank(rank: int, world: int, unique_id, opts: dict) -> dict:
    """One rank of a data-parallel run: its communicator, the same model and batches as every rank (the same
    seed), opts["steps"] steps of DataParallelTrainer. Returns its losses, tokens/s (after the first step) and
    AdamW's state in bytes."""
    import cupy as cp
    from step4_gpt2.parallel.comm import Comm, LocalComm
    from step4_gpt2.parallel.data_parallel import DataParallelTrainer
    from step4_gpt2.train.train import Data, TrainConfig, TrainGPT
    comm = LocalComm(opts["timeout_s"], gpu=True) if world == 1 else Comm(rank, world, unique_id, timeout_s=opts["timeout_s"])
    dp = None
    try:
        data = Data.shakespeare("char" if opts["model"] == "shakespeare_char" else "gpt2")
        cfg = model_config(opts["model"], data.vocab_size, opts["seq"])
        B, T, steps = opts["batch"], cfg.block_size, opts["steps"]
        dp = DataParallelTrainer(TrainGPT(cfg, seed=opts["seed"]), TrainConfig(batch_size=B, seed=opts["seed"]),
                                 comm, zero1=opts["zero1"], bucket_mb=opts["bucket_mb"], accumulate=opts["accumulate"],
                                 graph=opts.get("graph", False))
        losses, t0 = [], None
        for k in range(steps):
            if k == 1:                      # the first step allocates and connects: not timed
                cp.cuda.Device().synchronize()
                t0 = time.perf_counter()
            x, y = data.batch("train", B, T, step=k, seed=opts["seed"])
            dp.step(cp.asarray(x), cp.asarray(y), check=k == 0)
            losses.append(dp.last_loss)
        cp.cuda.Device().synchronize()
        seconds = time.perf_counter() - t0 if t0 is not None else float("nan")
        return {"rank": rank, "losses": [float(v) for v in losses], "tokens_per_s": B * T * (steps - 1) / seconds,
                "optimizer_bytes": int(dp.optimizer_bytes)}
    finally:
        if dp is not None:
            dp.close()                      # its graph first: NCCL waits for it before destroying the communicator
        comm.close()


def report(results: list, opts: dict, world: int) -> None:
    r0 = results[0]
    mode = "ZeRO-1" if opts["zero1"] else "data parallel"
    print(f"{mode} on {world} GPU{'s' * (world != 1)}: {opts['model']}, global batch {opts['batch']}")
    for k, loss in enumerate(r0["losses"]):
        print(f"step {k + 1:4d}  loss {loss:.6f}")
    tok = [r["tokens_per_s"] for r in results]
    print(f"tokens/s: {min(tok):,.0f} (the slowest rank); AdamW's state per rank: "
          f"{max(r['optimizer_bytes'] for r in results) / 2**20:.1f} MiB")


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    launcher = under_launcher()
    try:
        check_args(args, world=launcher_world())
    except ValueError as e:
        p.error(str(e))

    from common.device import require_gpu
    try:
        require_gpu()
    except RuntimeError as e:            # no GPU / driver: the message alone, no traceback
        print(e, file=sys.stderr)
        return 1
    import cupy as cp
    from step4_gpt2.parallel.comm import CommError
    from step4_gpt2.parallel.data_parallel import ConfigMismatchError
    from step4_gpt2.parallel.launch import LaunchError, from_env, spawn
    try:
        world = check_args(args, gpus_here=cp.cuda.runtime.getDeviceCount(), world=launcher_world())
    except ValueError as e:
        p.error(str(e))
    opts = {k: getattr(args, k) for k in ("model", "batch", "seq", "steps", "zero1", "accumulate", "bucket_mb",
                                          "graph", "seed", "timeout_s")}
    try:
        if args.tp:
            return _tensor_parallel(args, opts, world, launcher)
        if launcher:
            env = from_env(timeout_s=args.timeout_s)
            result = train_rank(env.rank, env.world, env.unique_id, opts)
            if env.rank == 0:            # the other ranks' numbers stay with them: print rank 0's
                report([result], opts, world)
            return 0
        results = [train_rank(0, 1, None, opts)] if world == 1 else \
            spawn(_importable(train_rank), world, opts, timeout_s=args.timeout_s)
    except (LaunchError, CommError, ConfigMismatchError) as e:    # a rank failed: what and where, no traceback
        print(e, file=sys.stderr)
        return 1
    report(results, opts, world)
    return 0


def _importable(fn):
    """fn as the spawned ranks can find it. Run as `python -m step4_gpt2.parallel`, this file is the module
    `__main__`, which multiprocessing's spawn does not re-import in its children (a package's __main__.py runs
    its "main only" code unconditionally): a function pickled as `__main__.train_rank` would not be found there.
    Under its own name, step4_gpt2.parallel.__main__, the module imports like any other."""
    if fn.__module__ != "__main__":
        return fn
    import importlib
    return getattr(importlib.import_module("step4_gpt2.parallel.__main__"), fn.__name__)


def _tensor_parallel(args, opts: dict, world: int, launcher: bool) -> int:
    """--tp: one training step's forward + backward split over the GPUs (Megatron), its time and the time of its
    all-reduces (the notebook sets them beside the napkin math's prediction)."""
    from dataclasses import asdict
    from step4_gpt2.parallel import tensor_parallel as tp
    from step4_gpt2.parallel.launch import from_env
    from step4_gpt2.train.train import Data
    data = Data.shakespeare("char" if args.model == "shakespeare_char" else "gpt2")
    cfg = model_config(args.model, data.vocab_size, args.seq)
    B = opts["batch"]                       # every rank computes the whole batch on its share of the model
    if launcher:
        env = from_env(timeout_s=args.timeout_s)
        row = tp.tensor_parallel_worker(env.rank, env.world, env.unique_id, asdict(cfg), B, cfg.block_size)
        if env.rank != 0:
            return 0
    else:
        row = tp.measure_tensor_parallel(cfg, B, cfg.block_size, world, timeout_s=args.timeout_s)
    print(f"tensor parallel on {world} GPUs: {args.model}, batch {B} x {cfg.block_size}: a step's forward + "
          f"backward {row['step_s'] * 1e3:.2f} ms, of which all-reduces {row['comm_s'] * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
