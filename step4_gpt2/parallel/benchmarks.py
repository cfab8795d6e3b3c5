"""Benchmarks of step 4e (training 4b's GPT on several GPUs through NCCL), every number measured in one run on
this machine's GPUs (up to 4), each multi-GPU number beside one GPU measured the same way in the same run:

  - the all-reduce: bus bandwidth of a 1 GiB message, the time of a 1 KiB one, and the line fitted through every
    size (latency, bus bandwidth) that the tensor-parallel rows predict from;
  - data parallel and ZeRO-1 at the shakespeare_char size (B = 64 per GPU, T = 256) and at GPT-2 124M's size
    (B = 4 per GPU, T = 1024): tokens/s against one GPU with the same per-GPU batch, the part of the step not
    hidden behind compute, and ZeRO-1's AdamW state per GPU against one GPU's. At the shakespeare_char size the
    gradient bucket is swept first (BUCKET_SWEEP) and data parallel's row is measured again with the fastest;
  - the loss of 20 data-parallel steps against one GPU with the same global batch (python -m step4_gpt2.parallel's
    train_rank, on Shakespeare);
  - tensor parallel (Megatron): the all-reduces' transfer time of a step against the napkin prediction, the time
    the ranks waited for the slower one beside it, and the step against the unsplit model on one GPU.

    python -m step4_gpt2.parallel.benchmarks     # or: python -m common.benchmarks --only step4_gpt2:parallel

Every rank is a process of its own (launch.spawn); one GPU runs in this process. On a machine with one GPU there
is nothing to compare: run() says so and returns no rows.
"""
from __future__ import annotations

import gc

from common import require_gpu
from common.benchmarks import Row
from step4_gpt2.parallel import measure, tensor_parallel as tp
from step4_gpt2.parallel.data_parallel import BUCKET_MB     # the rows that do not sweep the bucket
from step4_gpt2.weights import GPTConfig

MAX_GPUS = 4
WORLDS = (2, 4)                        # the GPU counts measured, those this machine has
SPEEDUP = {2: 1.9, 4: 3.7}             # tokens/s on N GPUs over one GPU, same per-GPU batch (JSON only)
ZERO1_SLACK = 1.01                     # ZeRO-1's AdamW state per GPU <= 1/N of one GPU's, padding aside
LOSS_STEPS = 20
LOSS_PPM = 10.0                        # largest relative loss difference, parts per million (1e-5)
TP_WITHIN = 0.25                       # measured tensor-parallel all-reduce transfer within 25% of the prediction
BUCKET_SWEEP = (1.0, 4.0, 25.0)        # MB: at the first size only, each world (short: one start of the ranks)
COMMAND = "python -m common.benchmarks --only step4_gpt2:parallel"
ALL_REDUCE_SIZES = measure.ALL_REDUCE_SIZES
ALL_REDUCE_SMALL = (256, 4096, 65536, 2**20, 2**22)   # up to 16 MiB: the line needs sizes where bandwidth rules
TIMEOUT_S = 300.0                      # each group of ranks: a hang ends the benchmark, not the machine


def gpu_count() -> int:
    import cupy as cp
    return cp.cuda.runtime.getDeviceCount()


def sizes(small: bool = False) -> dict:
    """{label: (config, B per GPU for data parallelism, B for tensor parallelism, T)}. small: two tiny models
    for a quick check of the whole module (tests), not the benchmark's numbers."""
    if small:
        return {"tiny": (GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=65, block_size=64), 4, 4, 64)}
    from step4_gpt2.train.model import shakespeare_char
    return {"shakespeare_char": (shakespeare_char(65), 64, 64, 256), "GPT-2 124M": (GPTConfig(), 4, 8, 1024)}


def _free() -> None:
    """Give this process's GPU memory back before the ranks start: rank 0 shares GPU 0 with it."""
    import cupy as cp
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    cp.get_default_pinned_memory_pool().free_all_blocks()


def _bytes_label(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def _model_label(cfg: GPTConfig, B: int, T: int, per_gpu: bool) -> str:
    return f"{cfg.n_layer}L C{cfg.n_embd} B{B}{'/GPU' if per_gpu else ''} T{T}"


# ============================================================================ the rows
def all_reduce_rows(worlds, small: bool = False) -> tuple[list[Row], dict]:
    """(rows, {world: (bus GB/s, latency us)}): each world's all-reduce over message sizes, and its fitted line."""
    sizes_ = ALL_REDUCE_SMALL if small else ALL_REDUCE_SIZES
    rows, link = [], {}
    for world in worlds:
        ar = measure.measure_all_reduce(world, sizes_, timeout_s=TIMEOUT_S)
        link[world] = tp.fit_all_reduce(ar["nbytes"], ar["seconds"], world)
        share = 2 * (world - 1) / world                # of the message each rank sends (ring: bus bandwidth)
        for k in (-1, 0):                              # the largest message, then the smallest
            n, s = ar["nbytes"][k], ar["seconds"][k]
            rows.append(Row(f"all-reduce {world} GPUs", _bytes_label(n), s * 1e3, share * n / s / 1e9, "GB/s"))
        bw, lat = link[world]
        rows.append(Row(f"all-reduce fit {world} GPUs", f"{_bytes_label(ar['nbytes'][0])} .. "
                        f"{_bytes_label(ar['nbytes'][-1])}", lat * 1e-3, bw, "GB/s"))
    return rows, link


def _scaling_row(name: str, size: str, m: dict, one: dict) -> Row:
    """A data-parallel measurement against one GPU: tokens/s, the part of the step not hidden, the speed-up."""
    return Row(name, size, m["step_s"] * 1e3, m["tokens_s"], "tok/s", ceiling="of the step exposed",
               fraction=(m["step_s"] - one["step_s"]) / m["step_s"], anchor="1 GPU",
               ratio=m["tokens_s"] / one["tokens_s"])


def data_parallel_rows(worlds, small: bool = False) -> list[Row]:
    """Data parallel and ZeRO-1 on each world against one GPU with the same per-GPU batch, at each size. At the
    first size, the bucket sweep's rows first; data parallel's row there then uses the fastest bucket, measured
    again in a run of its own (the sweep picks it, a fresh run measures it: no best-of-three luck in the row)."""
    rows = []
    for k, (cfg, B, _, T) in enumerate(sizes(small).values()):
        size = _model_label(cfg, B, T, per_gpu=True)
        one = measure.measure_data_parallel(cfg, B, T, 1, timeout_s=TIMEOUT_S)
        _free()
        rows.append(Row("data parallel 1 GPU", size, one["step_s"] * 1e3, one["tokens_s"], "tok/s"))
        for world in worlds:
            bucket, named = BUCKET_MB, ""
            if k == 0:
                sweep = measure.measure_buckets(cfg, B, T, world, BUCKET_SWEEP, timeout_s=TIMEOUT_S)
                for mb, m in sweep.items():
                    rows.append(_scaling_row(f"data parallel {world} GPUs, {mb:g} MB buckets", size, m, one))
                bucket = max(sweep, key=lambda mb: sweep[mb]["tokens_s"])
                named = f", best bucket {bucket:g} MB"
            for label, zero1 in (("data parallel", False), ("ZeRO-1", True)):
                m = measure.measure_data_parallel(cfg, B, T, world, zero1=zero1,
                                                  bucket_mb=BUCKET_MB if zero1 else bucket, timeout_s=TIMEOUT_S)
                rows.append(_scaling_row(f"{label} {world} GPUs" + ("" if zero1 else named), size, m, one)
                            .check("ratio", SPEEDUP[world]))
                if zero1:
                    rows.append(Row(f"ZeRO-1 AdamW state per GPU, {world} GPUs", size, m["step_s"] * 1e3,
                                    m["optimizer_bytes"] / 2**20, "MiB", ceiling="of one GPU's",
                                    fraction=m["optimizer_bytes"] / one["optimizer_bytes"])
                                .check("fraction", None, at_most=ZERO1_SLACK / world))
    return rows


def loss_rows(worlds, small: bool = False) -> list[Row]:
    """The losses of LOSS_STEPS data-parallel steps on each world against one GPU, the same global batch of
    Shakespeare (the CLI's train_rank): their largest relative difference, in parts per million."""
    from step4_gpt2.parallel.__main__ import PER_GPU_BATCH, train_rank
    from step4_gpt2.parallel.launch import spawn
    model = "shakespeare_char"
    batch = (2 if small else PER_GPU_BATCH[model]) * max(worlds)     # divisible by every world measured
    opts = {"model": model, "batch": batch, "seq": 64 if small else None, "steps": LOSS_STEPS, "zero1": False,
            "accumulate": 1, "bucket_mb": BUCKET_MB, "seed": 0, "timeout_s": TIMEOUT_S}
    try:
        one = train_rank(0, 1, None, opts)
    except (ModuleNotFoundError, FileNotFoundError) as e:     # the plays are not installed here
        print(f"no loss-trajectory rows: {e}", flush=True)
        return []
    _free()
    T = 64 if small else 256
    rows = []
    for world in worlds:
        run = spawn(train_rank, world, opts, timeout_s=TIMEOUT_S)
        ref, got = one["losses"], run[0]["losses"]
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
        step_s = batch * T / min(r["tokens_per_s"] for r in run)
        rows.append(Row(f"loss over {LOSS_STEPS} steps, {world} GPUs vs 1 GPU", f"{model} B{batch} T{T}",
                        step_s * 1e3, worst * 1e6, "ppm")
                    .check("rate", None, at_most=LOSS_PPM))
    return rows


def tensor_parallel_rows(worlds, link: dict, small: bool = False) -> list[Row]:
    """Tensor parallelism on each world that splits the heads: its all-reduces' transfer time against the
    prediction from the measured (bandwidth, latency), the time its ranks waited for the slower one (which the
    napkin leaves out), and its step against the unsplit model on one GPU."""
    rows = []
    for cfg, _, B, T in sizes(small).values():
        split = [w for w in worlds if cfg.n_head % w == 0]
        if not split:
            continue
        size = _model_label(cfg, B, T, per_gpu=False)
        one = tp.measure_tensor_parallel(cfg, B, T, 1, timeout_s=TIMEOUT_S)
        _free()
        rows.append(Row("tensor parallel step 1 GPU", size, one["step_s"] * 1e3, B * T / one["step_s"], "tok/s"))
        for world in split:
            m = tp.measure_tensor_parallel(cfg, B, T, world, timeout_s=TIMEOUT_S)
            predicted = tp.predict_comm_seconds(cfg, B, T, world, *link[world])
            # the ratio is predicted / measured (the page's anchor time / this time): within TP_WITHIN of the
            # prediction is measured / predicted in [1 - TP_WITHIN, 1 + TP_WITHIN]
            rows.append(Row(f"tensor parallel all-reduces {world} GPUs, transfer", size, m["transfer_s"] * 1e3,
                            anchor="napkin prediction", ratio=predicted / m["transfer_s"])
                        .check("ratio", 1 / (1 + TP_WITHIN), at_most=1 / (1 - TP_WITHIN)))
            rows.append(Row(f"tensor parallel all-reduces {world} GPUs, waiting", size, m["wait_s"] * 1e3,
                            ceiling="of the time in all-reduces", fraction=m["wait_s"] / m["comm_s"]))
            rows.append(Row(f"tensor parallel step {world} GPUs", size, m["step_s"] * 1e3, B * T / m["step_s"],
                            "tok/s", ceiling="in all-reduces", fraction=m["comm_s"] / m["step_s"], anchor="1 GPU",
                            ratio=one["step_s"] / m["step_s"]))
    return rows


def run(small: bool = False) -> list[Row]:
    """Every row above on this machine's GPUs (2 and 4 where there are that many); [] and one printed line on a
    machine with one GPU. small: tiny models and messages, for a quick check of this module."""
    require_gpu()
    gpus = min(gpu_count(), MAX_GPUS)
    worlds = [w for w in WORLDS if w <= gpus]
    if not worlds:
        print(f"step 4e's rows compare 2 or more GPUs with one; this machine has {gpus}. On a machine with "
              f"several: {COMMAND}", flush=True)
        return []
    _free()
    rows, link = all_reduce_rows(worlds, small)
    rows += data_parallel_rows(worlds, small)
    rows += loss_rows(worlds, small)
    rows += tensor_parallel_rows(worlds, link, small)
    return rows


def main(argv=None) -> int:
    from common.benchmarks import module_main
    return module_main("step4_gpt2.parallel.benchmarks", __doc__, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
