"""The megakernel ladder: GPT-2 124M decode (random weights: same shapes and bytes as the real ones).

    python -m step4_gpt2.megakernel.benchmarks                 # the table (a GPU)
    python -m common.benchmarks --only step4_gpt2:megakernel   # the same rows, in the course's results

For batch 1 and 8 and a cache of about 32 and about 1000 rows (a prompt of `ctx` rows, shortened so that
the STEPS new rows still fit GPT-2's 1024 positions), tokens/s of greedy decoding with:
    eager launches -> CUDA graph (generate.Decoder) -> the graph with programmatic dependent launch (sm_90 and
    newer: each kernel may start while the one before it drains) -> megakernel v1 (grid barriers) -> v2
    (counters + prefetch) -> v2 running all the steps in one launch (the kernel feeds its own tokens forward),
and transformers' generate on the same weights, same GPU, same process (fp32, TF32 off).

Each decoder prefills a prompt of `ctx` random tokens, then decodes STEPS tokens; the time of the decode
alone is measured on the host clock (common.bench, cpu=True) around the whole decode loop (the host's
launches, queueing and token reads included, as a user sees it): the median of REPEATS runs of prefill +
decode, less the median of REPEATS runs of the prefill alone. transformers: (generate with STEPS + 1 new
tokens - generate with 1 new token) / STEPS, so its prefill is not counted either.
The weight-bandwidth bound: copy_bandwidth / GPT.weight_bytes_per_token() (every weight read once per
step, KV-cache reads left out); fraction = achieved steps/s / bound. Also, from the lab (lab/): the in-kernel
timeline of one step (where a step's time goes, per kind of stage: waiting for inputs vs working), a few
knobs, what one hop between blocks costs (hops.cu), and the floor: the same decoders on a model whose every
layer is layer 0, the megakernel also with those weights kept in L2, so what is left is the LM head's
streaming and the chain of hops and dependent loads (floor_rows).

Weights in fewer bytes (precision_ladder, precision_rows): the graph decode and megakernel v2 (one launch per
token, and all steps in one launch) of GPT(precision="fp32" | "bf16" | "int8"), for GPT-2 124M and the GPT-2 XL
shape (random weights; the XL rows where the GPU has room), at batch 1 and 8 and a cache of about 32 rows, each
against its own bound: copy_bandwidth / GPT.weight_bytes_per_token() of that precision.
"""
from __future__ import annotations


import numpy as np

from common.benchmarks import Row
from common.timing import bench, copy_bandwidth   # not `from common import bench`: common.benchmarks shadows it
from step4_gpt2.benchmarks import random_ids, setup, wall_s

STEPS = 32
REPEATS = 3
CTXS = (32, 1000)
BATCHES = (1, 8)
PRECISIONS = ("fp32", "bf16", "int8")
XL_MEMORY_FACTOR = 1.6   # GPU memory the XL precision rows need, in units of its fp32 weights (the fp32 model,
                         # its decoders' transposed MLP copies and caches)


def prompt_len(config, ctx: int) -> int:
    """The prompt length for a cache of about ctx rows: ctx, or less where ctx + STEPS new rows would not fit."""
    return min(ctx, config.block_size - STEPS - 1)


def decoder(model, mode: str, batch: int, ctx: int, **options):
    """A greedy decoder of one rung of the ladder ("eager", "graph": lesson 4a's Decoder; "megakernel": this
    lesson's, the lab's where an option only it takes is given), sized for ctx prompt rows + STEPS new ones."""
    length = ctx + STEPS + 1
    if mode in ("eager", "graph"):
        from step4_gpt2.generate import Decoder
        return Decoder(model, batch, length, True, cuda_graph=mode == "graph", **options)
    if set(options) <= {"version", "steps_per_launch", "timeout_s"}:
        from step4_gpt2.megakernel.megakernel import MegakernelDecoder
        return MegakernelDecoder(model, batch, length, True, **options)
    from step4_gpt2.megakernel.lab.decoder import LabMegakernelDecoder
    return LabMegakernelDecoder(model, batch, length, True, **options)


def decode_s(dec, ids, steps: int = STEPS, repeats: int = REPEATS) -> float:
    """Median seconds of decoding `steps` tokens after a prefill of ids (host clock; the prefill before each run
    is not timed; the first run compiles, warms and captures and is not kept)."""
    import cupy as cp
    lens = [ids.shape[1]] * ids.shape[0]

    def prefill():
        dec.prefill(ids, lens)
        cp.cuda.runtime.deviceSynchronize()

    def decode():
        got = sum(1 for _ in dec.decode(steps))
        cp.cuda.runtime.deviceSynchronize()
        assert got == steps
    return bench(decode, cpu=True, setup=prefill, warmup=1, repeat=repeats).median_ms / 1e3


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
          ("CUDA graph + PDL", "graph", {"programmatic": True}),
          ("megakernel v1", "megakernel", {"version": 1}), ("megakernel v2", "megakernel", {"version": 2}),
          ("megakernel v2, all steps in one launch", "megakernel", {"version": 2, "steps_per_launch": STEPS})]


def rungs() -> list:
    """LADDER's rungs this GPU runs: the PDL rung needs sm_90 (step4_gpt2.pdl.PDL_ARCH)."""
    from common.device import device_info
    from step4_gpt2.pdl import PDL_ARCH
    return [r for r in LADDER if not r[2].get("programmatic") or device_info()["sm"] >= PDL_ARCH]


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
            for label, mode, opts in rungs():
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


def timeline_rows(model) -> list[Row]:
    """lab/decoder.py's timeline of one step at batch 1, v1 and v2: the span, and per kind of stage the time
    waiting for inputs and working (means over blocks, summed over the layers)."""
    from step4_gpt2.megakernel.lab.decoder import timeline
    from step4_gpt2.megakernel.megakernel import STAGES
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


def hop_rows() -> list[Row]:
    """lab/hops.cu: one hop between two blocks, a grid-wide barrier, an L2 round trip."""
    from step4_gpt2.megakernel.lab.hops import hop_costs
    h = hop_costs()
    return [Row("hop: one block to another (release add, acquire poll)", "2 of the grid's blocks", h["hop"] / 1e6,
                h["hop"], "ns"),
            Row("hop: grid-wide barrier (every block to every block)", "1 block per SM", h["all"] / 1e6, h["all"], "ns"),
            Row("L2 round trip (dependent loads)", "1 MB table", h["l2"] / 1e6, h["l2"], "ns")]


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
    DRAM: their fraction is of nothing they stream). Meaningful where lab.floor.tied_fits_l2(model); the kept
    row needs sm_80 or newer (left out before)."""
    from common import device_info
    from step4_gpt2.megakernel.lab.floor import tied_layers
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


PRECISION_RUNGS = [("CUDA graph", "graph", {}), ("megakernel v2", "megakernel", {"version": 2}),
                   ("megakernel v2, all steps in one launch", "megakernel", {"version": 2, "steps_per_launch": STEPS})]


def precision_ladder(config, params=None, precisions=PRECISIONS, batches=BATCHES, ctx: int = 32) -> dict:
    """{(precision, batch, rung): seconds per step} of PRECISION_RUNGS for GPT(config, params, precision=...)
    (params: any mapping in the HF layout, e.g. lesson 4f's GPU-drawn random weights; None: weights.random_weights),
    one model on the GPU at a time."""
    import gc

    import cupy as cp
    from step4_gpt2 import weights as W
    from step4_gpt2.model import GPT
    params = params if params is not None else W.random_weights(config, notice=False)
    ctx = prompt_len(config, ctx)
    out = {}
    for p in precisions:
        model = GPT(config, params, precision=p)
        for B in batches:
            ids = random_ids(config, B, ctx, seed=B)
            for label, mode, opts in PRECISION_RUNGS:
                dec = decoder(model, mode, B, ctx, **opts)
                out[(p, B, label)] = decode_s(dec, ids) / STEPS
                del dec
        del model
        gc.collect()
        cp.get_default_memory_pool().free_all_blocks()
    return out


def precision_rows(label: str, config, times: dict, bw: float, ctx: int = 32) -> list[Row]:
    """Rows of precision_ladder's times for a shape labelled `label`: each rung against its own precision's
    weight-bandwidth bound, the megakernel rungs against the graph decode of their precision, and the best
    rung of bf16 and int8 against fp32's graph decode (at the XL shape, batch 1: checked against the
    lesson's targets)."""
    from step4_gpt2.model import weight_bytes_per_token
    rows = []
    size = lambda B: f"{label}, b={B}, ctx {prompt_len(config, ctx)}"          # noqa: E731
    for (p, B, rung), s in times.items():
        bound = bw * 1e9 / weight_bytes_per_token(config, p)                   # steps/s
        r = Row(f"decode {p} {rung}", size(B), s * 1e3, B / s, "tok/s", f"{p} weight-bw bound", 1 / s / bound)
        if rung != "CUDA graph" and (p, B, "CUDA graph") in times:
            r.anchor, r.ratio = f"{p} CUDA graph", times[(p, B, "CUDA graph")] / s
        rows.append(r)
    for p, B in dict.fromkeys((p, B) for p, B, _ in times):
        fp32 = times.get(("fp32", B, "CUDA graph"))
        if p == "fp32" or fp32 is None:
            continue
        best = min(s for (q, b, _), s in times.items() if (q, b) == (p, B))
        bound = bw * 1e9 / weight_bytes_per_token(config, p)
        vs = Row(f"decode {p} best rung vs fp32", size(B), best * 1e3, B / best, "tok/s", anchor="fp32 CUDA graph",
                 ratio=fp32 / best)
        frac = Row(f"decode {p} best rung: bandwidth", size(B), best * 1e3, B / best, "tok/s",
                   f"{p} weight-bw bound", 1 / best / bound)
        if label.startswith("XL") and B == 1:
            vs.check("ratio", {"bf16": 1.8, "int8": 3.0}[p])
            frac.check("fraction", 0.70)
        rows += [vs, frac]
    return rows


def precision_shape_rows(bw: float) -> list[Row]:
    """precision_rows for GPT-2 124M and the XL shape (skipped, with the reason printed, where the GPU is short
    of memory)."""
    from common import memory_left
    from step4_gpt2 import weights as W
    rows = []
    for name, label in (("gpt2", "124M"), ("gpt2-xl", "XL 1.5B")):
        cfg = W.GPTConfig.from_name(name)
        need, left = XL_MEMORY_FACTOR * 4 * cfg.n_params(), memory_left()
        if left < need:
            print(f"{label} precision rows skipped: about {need / 1e9:.1f} GB needed, {left / 1e9:.1f} GB left")
            continue
        rows += precision_rows(label, cfg, precision_ladder(cfg), bw)
    return rows


def run() -> list[Row]:
    model, hf, _ = setup()
    rows, _ = ladder(model, hf)
    rows += knob_rows(model)
    rows += timeline_rows(model)
    rows += hop_rows()
    rows += floor_rows(model)
    del model, hf
    rows += precision_shape_rows(copy_bandwidth())
    return rows


def main(argv=None) -> int:
    from common.benchmarks import module_main
    return module_main("step4_gpt2.megakernel.benchmarks", __doc__, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
