"""The megakernel ladder: GPT-2 124M decode (random weights: same shapes and bytes as the real ones).

For batch 1 and 8 and a cache of about 32 and about 1000 rows (a prompt of `ctx` rows, shortened so that
the STEPS new rows still fit GPT-2's 1024 positions), tokens/s of greedy decoding with:
    eager launches -> CUDA graph (generate.Decoder) -> megakernel v1 (grid barriers) -> v2 (counters +
    prefetch) -> v2 running all the steps in one launch (the kernel feeds its own tokens forward),
and transformers' generate on the same weights, same GPU, same process (fp32, TF32 off).

Each decoder prefills a prompt of `ctx` random tokens, then decodes STEPS tokens; the time of the decode
alone is measured on the host clock around the whole decode loop (the host's launches, queueing and token
reads included, as a user sees it): median of REPEATS after one warm-up. transformers: (generate with
STEPS + 1 new tokens - generate with 1 new token) / STEPS, so its prefill is not counted either.
The weight-bandwidth bound: copy_bandwidth / GPT.weight_bytes_per_token() (every weight read once per
step, KV-cache reads left out); fraction = achieved steps/s / bound. Also: the in-kernel timeline of one
step (where a step's time goes, per kind of stage: waiting for inputs vs working) and a few knobs.
"""
from __future__ import annotations

import time

import numpy as np

from common.benchmarks import Row
from common.timing import copy_bandwidth
from step4_gpt2.benchmarks import random_ids, setup, wall_s

STEPS = 32
REPEATS = 3
CTXS = (32, 1000)
BATCHES = (1, 8)


def prompt_len(config, ctx: int) -> int:
    """The prompt length for a cache of about ctx rows: ctx, or less where ctx + STEPS new rows would not fit."""
    return min(ctx, config.block_size - STEPS - 1)


def decoder(model, mode: str, batch: int, ctx: int, **options):
    """A greedy decoder of one rung of the ladder (generate's mode "eager", "graph" or "megakernel"), sized
    for ctx prompt rows + STEPS new ones, not kept on the model."""
    from step4_gpt2.generate import make_decoder
    return make_decoder(model, mode, batch, ctx + STEPS + 1, True, reuse=False, **options)


def decode_s(dec, ids, steps: int = STEPS, repeats: int = REPEATS) -> float:
    """Median seconds of decoding `steps` tokens after a prefill of ids (prefill not timed)."""
    import cupy as cp
    lens = [ids.shape[1]] * ids.shape[0]
    times = []
    for r in range(repeats + 1):
        dec.prefill(ids, lens)
        cp.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter()
        n = sum(1 for _ in dec.decode(steps))
        cp.cuda.runtime.deviceSynchronize()
        if r:                                  # the first run compiles, warms and captures
            times.append(time.perf_counter() - t0)
        assert n == steps
    return float(np.median(times))


def hf_decode_s(hf, ids, steps: int = STEPS) -> float:
    """transformers generate: seconds per decode step, prefill subtracted."""
    import torch
    x = torch.tensor(ids, dtype=torch.int64, device="cuda")

    def gen(n):
        with torch.no_grad():
            hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, use_cache=True)
    return max(wall_s(lambda: gen(steps + 1), REPEATS) - wall_s(lambda: gen(1), REPEATS), 1e-9) / steps


LADDER = [("eager launches", "eager", {}), ("CUDA graph", "graph", {}),
          ("megakernel v1", "megakernel", {"version": 1}), ("megakernel v2", "megakernel", {"version": 2}),
          ("megakernel v2, all steps in one launch", "megakernel", {"version": 2, "steps_per_launch": STEPS})]


def ladder(model, hf=None, batches=BATCHES, ctxs=CTXS) -> tuple[list[Row], dict]:
    """The ladder's rows and {(batch, ctx): {rung: seconds per step}} (the notebook plots it)."""
    bw = copy_bandwidth()
    bytes_tok = model.weight_bytes_per_token()
    rows, table = [], {}
    for B in batches:
        for ctx in ctxs:
            ctx = prompt_len(model.config, ctx)
            ids = random_ids(model.config, B, ctx)
            size = f"124M, b={B}, ctx {ctx}"
            per = {}
            for label, mode, opts in LADDER:
                dec = decoder(model, mode, B, ctx, **opts)
                per[label] = decode_s(dec, ids) / STEPS
                del dec
            if hf is not None:
                per["transformers generate"] = hf_decode_s(hf, ids)
            table[(B, ctx)] = per
            graph = per["CUDA graph"]
            best_mk = min(v for k, v in per.items() if k.startswith("megakernel"))
            for label, s in per.items():
                r = Row(f"decode {label}", size, s * 1e3, B / s, "tok/s", "weight-bw bound",
                        bytes_tok / s / (bw * 1e9))
                if label != "CUDA graph" and not label.startswith("transformers"):
                    r.anchor, r.ratio = "CUDA graph", graph / s
                rows.append(r)
            hf_row = None
            if "transformers generate" in per:
                hf_row = Row("decode best megakernel vs transformers", size, best_mk * 1e3, B / best_mk, "tok/s",
                             anchor="transformers generate", ratio=per["transformers generate"] / best_mk)
                rows.append(hf_row)
            if B == 1 and ctx == min(ctxs):
                frac = bytes_tok / best_mk / (bw * 1e9)
                rows.append(Row("decode b=1 best megakernel: bandwidth", size, best_mk * 1e3, 1 / best_mk, "tok/s",
                                "weight-bw bound", frac).check("fraction", 0.5))
                rows.append(Row("decode b=1 best megakernel: vs graph", size, best_mk * 1e3, 1 / best_mk, "tok/s",
                                anchor="CUDA graph", ratio=graph / best_mk).check("ratio", 2.0))
                if hf_row is not None:
                    hf_row.check("ratio", 20.0)
    return rows, table


def knob_rows(model, ctx: int = 32) -> list[Row]:
    """v2 at batch 1 with other block sizes / loads in flight per lane (each a separate compile)."""
    rows = []
    ids = random_ids(model.config, 1, ctx)
    base = None
    for threads, unroll in ((384, 3), (512, 3), (384, 4)):
        s = decode_s(decoder(model, "megakernel", 1, ctx, version=2, threads=threads, unroll=unroll), ids) / STEPS
        base = base or s
        rows.append(Row(f"megakernel v2 threads={threads} unroll={unroll}", f"124M, b=1, ctx {ctx}", s * 1e3,
                        1 / s, "tok/s", anchor="threads=384 unroll=3", ratio=base / s))
    return rows


def timeline(model, version: int, batch: int = 1, ctx: int = 32, steps: int = 1):
    """(timeline ms (grid, stages, 3), breakdown dict summed over the steps) of `steps` steps in one launch,
    after a warm-up launch."""
    from step4_gpt2.megakernel import MegakernelDecoder, breakdown
    import cupy as cp
    dec = MegakernelDecoder(model, batch, ctx + 2 * steps + 2, version=version, timeline=True,
                            steps_per_launch=steps)
    ids = random_ids(model.config, batch, ctx)
    dec.prefill(ids, [ctx] * batch)
    for _ in range(2):                      # the second launch is the one kept (warm caches, compiled)
        dec.launch(steps)
        dec.stream.synchronize()
        dec.check()
    cp.cuda.runtime.deviceSynchronize()
    t = dec.timeline_ms()
    return t, breakdown(t, model.config.n_layer)


def timeline_rows(model) -> list[Row]:
    from step4_gpt2.megakernel import STAGES
    rows = []
    for version in (1, 2):
        for ctx in CTXS:
            _, b = timeline(model, version, 1, ctx)
            size = f"b=1, ctx {ctx}"
            rows.append(Row(f"timeline v{version}: whole step", size, b["span_ms"]))
            for stage in STAGES:
                rows.append(Row(f"  v{version} {stage}: waiting", size, b[stage]["wait_ms"]))
                rows.append(Row(f"  v{version} {stage}: working", size, b[stage]["work_ms"]))
    return rows


def run() -> list[Row]:
    model, hf, _ = setup()
    rows, _ = ladder(model, hf)
    rows += knob_rows(model)
    rows += timeline_rows(model)
    return rows


if __name__ == "__main__":
    from common.benchmarks import table
    from common.device import describe
    print(describe())
    print(f"copy bandwidth (read + write): {copy_bandwidth():,.0f} GB/s")
    print(table(run()))
