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
step (where a step's time goes, per kind of stage: waiting for inputs vs working), a few knobs, what one hop
between blocks costs (hops.cu), and the floor: the same decoders on a model whose every layer is layer 0, the
megakernel also with those weights kept in L2, so what is left is the LM head's streaming and the chain of hops
and dependent loads (tied_layers, floor_rows).
"""
from __future__ import annotations

import time
from pathlib import Path

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


HERE = Path(__file__).resolve().parent
HOPS = HERE / "hops.cu"


def hop_costs(rounds: int = 2000, repeats: int = 5, timeout_s: float = 2.0) -> dict:
    """Nanoseconds (median of `repeats` launches, each timing `rounds` repetitions inside the kernel) of:
    "hop": one block to one other through a counter (release add, acquire poll; block 0 and the last block of
    a grid of one block per SM, on the two SMs "hop_sms"); "all": a grid-wide barrier of one block per SM (every
    block to every block); "l2": one L2 round trip (a chain of dependent loads through a 1 MB table that stays
    in L2)."""
    import cupy as cp
    from common import device_info, get_kernel
    sms = device_info()["multiprocessors"]
    err, out = cp.zeros(4, cp.int32), cp.zeros(max(sms, 3), cp.uint64)

    def timed(fn, name, grid, args, per):            # (median of per(out) over the repeats, the last out)
        vals = []
        for r in range(repeats + 1):                     # the first launch compiles and warms: not kept
            out.fill(0)
            cp.cuda.runtime.deviceSynchronize()          # nothing else running: every block must be resident
            fn((grid,), (128,), args())
            cp.cuda.runtime.deviceSynchronize()
            e = err.get()
            if e[0]:
                raise RuntimeError(f"hops.cu {name}: block {e[1]} waited more than {timeout_s:g} s in round {e[2]}: "
                                   f"were all {grid} blocks resident (another kernel running concurrently?)")
            o = out.get()
            if r:
                vals.append(per(o))
        return float(np.median(vals)), o

    timeout_ns = np.int64(timeout_s * 1e9)
    res = {}
    res["hop"], o = timed(get_kernel(HOPS, "hop_pingpong"), "hop_pingpong", sms,
                          lambda: (cp.zeros(64, cp.uint32), np.int32(rounds), timeout_ns, err, out),
                          lambda o: o[0] / (2 * rounds))
    res["hop_sms"] = (int(o[1]), int(o[2]))
    res["all"], _ = timed(get_kernel(HOPS, "hop_all"), "hop_all", sms,
                          lambda: (cp.zeros(1, cp.uint32), np.int32(rounds), timeout_ns, err, out),
                          lambda o: np.median(o[:sms]) / rounds)
    n = 1 << 18                                          # a random cycle through all n entries
    perm = np.random.default_rng(0).permutation(n).astype(np.uint32)
    nxt = np.empty(n, np.uint32)
    nxt[perm] = np.roll(perm, -1)
    table = cp.asarray(nxt)
    res["l2"], _ = timed(get_kernel(HOPS, "l2_chase"), "l2_chase", 1, lambda: (table, np.int32(20 * rounds), out),
                         lambda o: o[0] / (20 * rounds))
    return res


def hop_rows() -> list[Row]:
    h = hop_costs()
    return [Row("hop: one block to another (release add, acquire poll)", "2 of the grid's blocks", h["hop"] / 1e6,
                h["hop"], "ns"),
            Row("hop: grid-wide barrier (every block to every block)", "1 block per SM", h["all"] / 1e6, h["all"], "ns"),
            Row("L2 round trip (dependent loads)", "1 MB table", h["l2"] / 1e6, h["l2"], "ns")]


def tied_layers(model):
    """A shallow copy of `model` whose every layer is layer 0 (the same arrays; each layer keeps its own KV
    cache). Not GPT-2 any more, but the same shapes and the same kernels, with one layer's weights (28 MB for
    the 124M shape) read twelve times per step. L2 keeps only part of them between layers while the weights
    stream evict-first; a megakernel built with keep_layers_in_l2 loads them evict-last, so L2 keeps them all
    where they fit (tied_fits_l2) and only the LM head streams from DRAM."""
    import copy
    tied = copy.copy(model)
    tied.__dict__.pop("_kept_decoder", None)
    tied.h = [model.h[0]] * model.config.n_layer
    return tied


def tied_fits_l2(model) -> bool:
    """Whether one layer's weights fit in this GPU's L2 with room to spare (1.5x), as the floor assumes."""
    from common import device_info
    C = model.config.n_embd
    return 1.5 * 4 * 12 * C * C <= device_info()["l2_bytes"]


FLOOR = [("CUDA graph, GPT-2", False, "graph", {}),
         ("megakernel, GPT-2", False, "megakernel", {}),
         ("CUDA graph, every layer = layer 0", True, "graph", {}),
         ("megakernel, every layer = layer 0", True, "megakernel", {}),
         ("megakernel, every layer = layer 0, kept in L2", True, "megakernel", {"keep_layers_in_l2": True})]


def floor_rows(model, batch: int = 1, ctx: int = 32) -> list[Row]:
    """The best rung (v2, all steps in one launch) and the graph decode on the model and on tied_layers(model)
    (the megakernel also with its layer weights kept in L2: the floor where only the LM head streams), each
    measured in turn, twice (median of the two). Every row's fraction is of the model's weight-bandwidth bound
    and the megakernel rows' ratio is to the model's graph decode, the tied rows' too (they read less from
    DRAM: their fraction is of nothing they stream). Meaningful where tied_fits_l2(model); the kept row needs
    sm_80 or newer (left out before)."""
    from common import device_info
    bw, bytes_tok = copy_bandwidth(), model.weight_bytes_per_token()
    ctx = prompt_len(model.config, ctx)
    ids = random_ids(model.config, batch, ctx)
    tied = tied_layers(model)
    cases = [c for c in FLOOR if device_info()["sm"] >= 80 or "keep_layers_in_l2" not in c[3]]
    runs = {}
    for _ in range(2):
        for label, is_tied, mode, opts in cases:
            extra = {"version": 2, "steps_per_launch": STEPS} if mode == "megakernel" else {}
            dec = decoder(tied if is_tied else model, mode, batch, ctx, **extra, **opts)
            runs.setdefault(label, []).append(decode_s(dec, ids) / STEPS)
            if opts.get("keep_layers_in_l2"):
                dec.release_l2()
            del dec
    size = f"124M, b={batch}, ctx {ctx}"
    graph = float(np.median(runs["CUDA graph, GPT-2"]))
    rows = []
    for label, *_ in cases:
        t = float(np.median(runs[label]))
        r = Row(f"floor: {label}", size, t * 1e3, batch / t, "tok/s", "weight-bw bound (GPT-2)",
                bytes_tok / t / (bw * 1e9))
        if label.startswith("megakernel"):
            r.anchor, r.ratio = "CUDA graph on GPT-2", graph / t
        rows.append(r)
    return rows


def run() -> list[Row]:
    model, hf, _ = setup()
    rows, _ = ladder(model, hf)
    rows += knob_rows(model)
    rows += timeline_rows(model)
    rows += hop_rows()
    rows += floor_rows(model)
    return rows


if __name__ == "__main__":
    from common.benchmarks import table
    from common.device import describe
    print(describe())
    print(f"copy bandwidth (read + write): {copy_bandwidth():,.0f} GB/s")
    print(table(run()))
