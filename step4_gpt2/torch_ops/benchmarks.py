"""Benchmarks of the torch GPT with the course's kernels as torch custom ops (step4_gpt2.torch_ops), at nanoGPT's
shakespeare_char size: 6 layers, 6 heads, C = 384, context 256, batch 64, a 65-token vocabulary. Precision: fp32
tensors, and TF32 matrix products on both sides (torch.backends.cuda.matmul.allow_tf32, what
torch.set_float32_matmul_precision("high") sets; a GPU before sm_80 has no TF32 and runs them in fp32). In plain fp32
the cuBLAS GEMMs, the same calls on both sides, are most of the step (lesson 4b's rows show it); with TF32 the
kernels the course fuses count.

Rows: tokens/s and ms of a whole training step (forward, loss, backward, clipping, AdamW: torch_ops/train.py's
step, 4b's hyper-parameters in every row) of one model in six modes, on the same batches, in one run: PyTorch's ops
eagerly, under torch.compile and replayed as one CUDA graph per step; the course's ops eagerly, under torch.compile,
and replayed as one CUDA graph. Each step's time is the host clock around a loop of steps queued back to back,
until the GPU has finished them (lesson 4b's loop_wall_s), after warm-up steps that also compile and record the
graph.

    python -m step4_gpt2.torch_ops.benchmarks          # or: python -m common.benchmarks --only step4_gpt2:torch_ops
    python -m step4_gpt2.torch_ops.benchmarks --no-compile
"""
from __future__ import annotations

import contextlib
import gc

import common
from common import torch_cuda
from common.cublas import tf32_matmuls
from common.benchmarks import Row

B, T, V = 64, 256, 65
SIZE = f"6L C384 B{B} T{T}"
WARMUP = 5              # untimed steps: more than train.WARMUP_STEPS, so that the graph is recorded before timing
# (label, course_ops, compile, graph)
MODES = (("torch eager", False, False, False), ("torch.compile", False, True, False),
         ("torch, CUDA graph", False, False, True), ("course ops", True, False, False),
         ("course ops, torch.compile", True, True, False), ("course ops, CUDA graph", True, False, True))
# (ours, anchor) pairs reported as ratios; the first is the one held to a target
VERSUS = (("course ops, CUDA graph", "torch eager"), ("course ops, CUDA graph", "torch.compile"),
          ("course ops, CUDA graph", "torch, CUDA graph"), ("course ops", "torch eager"),
          ("course ops, torch.compile", "torch.compile"))


def step_seconds(course_ops: bool, compile: bool = False, graph: bool = False, steps: int = 20,
                 tf32: bool = True) -> float:
    """Seconds per training step of the shakespeare_char GPT (model.py) in one mode, on lesson 4b's benchmark
    batches (random ids, lower ids more frequent), copied to the GPU before timing. tf32: the matrix products in
    TF32 (on sm_80 and later), through common.cublas.tf32_matmuls, as lesson 4b's benchmark does."""
    torch = torch_cuda()
    from step4_gpt2.torch_ops.model import GPT, shakespeare_char
    from step4_gpt2.torch_ops.train import TrainConfig, stepper
    from step4_gpt2.train.benchmarks import loop_wall_s, random_batches
    torch._dynamo.reset()           # a fresh compile for each model: earlier models do not count against its limit
    with tf32_matmuls() if tf32 else contextlib.nullcontext():
        model = GPT(shakespeare_char(V), course_ops=course_ops).cuda()
        _, step = stepper(model, TrainConfig(batch_size=B), compile=compile, graph=graph)
        batches = [tuple(torch.as_tensor(a, device="cuda").long() for a in b) for b in random_batches(steps + WARMUP)]
        count = iter(range(len(batches)))
        seconds = loop_wall_s(lambda x, y: step(next(count), x, y), batches, warmup=WARMUP)
    del model, step, batches        # the next mode's model gets the memory (a CUDA graph's pool included)
    gc.collect()
    torch.cuda.empty_cache()
    return seconds


def train_rows(compile_torch: bool = True, steps: int = 20) -> list[Row]:
    """tok/s and ms per step of each mode (MODES; without compile_torch, the torch.compile rows are left out),
    then the course's ops against PyTorch's modes (VERSUS)."""
    tokens, rows, t = B * T, [], {}
    for label, course, compiled, graph in MODES:
        if compiled and not compile_torch:
            continue
        t[label] = step_seconds(course, compile=compiled, graph=graph, steps=steps)
        rows.append(Row(f"torch GPT step, {label} (tok/s)", SIZE, t[label] * 1e3, rate=tokens / t[label],
                        unit="tok/s"))
    for k, (ours, anchor) in enumerate(VERSUS):
        if ours not in t or anchor not in t:
            continue
        r = Row(f"torch GPT step, {ours} vs {anchor}", SIZE, t[ours] * 1e3, rate=tokens / t[ours], unit="tok/s",
                anchor=anchor, ratio=t[anchor] / t[ours])
        rows.append(r.check("ratio", 1.2) if k == 0 else r)
    return rows


def run(compile_torch: bool = True, steps: int = 20) -> list[Row]:
    common.require_gpu()
    if torch_cuda() is None:
        print("torch with CUDA not installed: no torch GPT rows")
        return []
    return train_rows(compile_torch=compile_torch, steps=steps)


def main(argv=None) -> int:
    import argparse
    from common.benchmarks import module_main
    ap = argparse.ArgumentParser(prog="python -m step4_gpt2.torch_ops.benchmarks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows (each compiles for a "
                                                              "minute)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode (default 20)")

    def validate(args, ap):
        if args.steps < 1:
            ap.error(f"--steps: expected a positive number of steps, got {args.steps}")

    return module_main("step4_gpt2.torch_ops.benchmarks", __doc__,
                       lambda args: run(compile_torch=not args.no_compile, steps=args.steps), argv, ap, validate)


if __name__ == "__main__":
    raise SystemExit(main())
