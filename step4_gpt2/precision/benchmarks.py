"""Fewer bytes per token, measured: GPT-2's graph decode with fp32, bf16 and int8 weights, and what the rounding
costs in perplexity.

    python -m step4_gpt2.precision.benchmarks                 # the table (a GPU)
    python -m common.benchmarks --only step4_gpt2:precision   # the same rows, in the course's results

The ladder: greedy decoding of STEPS tokens after a prompt of PROMPT_LEN random tokens, lesson 4a's Decoder
(every step replayed from a CUDA graph), at batch 1 and 8, with the weight matrices in fp32, bf16 and int8, for
GPT-2 124M and the GPT-2 XL shape (1.5B: 48 layers, C=1600, 25 heads; random weights drawn on the GPU, same
bytes as the real ones: RandomParams). The XL rows need about 1.2x its fp32 weights (7.5 GB) free on the GPU:
skipped, with the reason printed, where memory_left() is short. Time: the host clock around the decode loop
(the megakernel ladder's decode_s: prefill excluded, median of its repeats). Each precision against its own
bound:
    bound (steps/s) = copy_bandwidth / GPT.weight_bytes_per_token()
with copy_bandwidth measured in the same run (common.copy_bandwidth) and the bytes per token of that precision
(model.weight_bytes_per_token: the matrices at 4, 2 or 1 bytes per weight, int8's row scales, the fp32 biases and
LayerNorms). KV-cache reads (fp32, a few MB at this length) are left out of the bound.
The "CUDA graph + PDL" rungs (sm_90 and newer): the same Decoder with programmatic=True, each kernel of the step
launched with programmatic dependent launch, so it starts (and issues its first weight loads) while the kernel
before it drains; timed back to back with a plain graph rung of the same model, its anchor.
Anchors, same GPU, same process, where torch and transformers are installed: transformers' generate in bf16 on
a model of the same shape (random weights; its attention the default, SDPA), without compilation (dynamic KV
cache), and with a static KV cache, with which generate compiles the decoding step (torch.compile) itself; both
time (generate of STEPS + 1 tokens - generate of 1 token) / STEPS.

Quality: perplexity on the held-out plays of lesson 4b's model (shakespeare_char) trained here for
TRAIN_SECONDS, and of GPT-2 124M on the same plays' BPE tokens where the Hugging Face cache holds it (never
downloaded): fp32 vs bf16 vs int8, the change in percent, and the teacher-forced top-1 agreement with fp32.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Mapping

from common.benchmarks import Row
from common.timing import copy_bandwidth   # not `from common import ...`: common.benchmarks shadows bench
from step4_gpt2.benchmarks import random_ids, wall_s
from step4_gpt2.quantize import PRECISIONS

STEPS = 64
PROMPT_LEN = 32
BATCHES = (1, 8)
SHAPES = ("gpt2", "gpt2-xl")
XL_MEMORY_FACTOR = 1.2           # GPU memory an XL rung needs, in units of its fp32 weights' bytes
TRAIN_SECONDS = 45.0
PPL_WINDOWS = 16                 # GPT-2 124M: windows of 1024 BPE tokens scored (16K tokens)
AGREE_TOKENS = 64


def shape_label(name: str) -> str:
    return {"gpt2": "124M", "gpt2-xl": "XL 1.5B"}[name]


def fits(config) -> tuple[bool, str]:
    """Whether this GPU has room for the ladder's rungs of this shape (one model at a time), and why not."""
    from common import memory_left
    need, left = XL_MEMORY_FACTOR * config.n_params() * 4, memory_left()
    if left >= need:
        return True, ""
    return False, (f"{config.n_params() / 1e9:.2f}B parameters need about {need / 1e9:.1f} GB free for the fp32 rung; "
                   f"{left / 1e9:.1f} GB left on this GPU")


def free(*objs) -> None:
    """Give a model's (or decoder's) GPU memory back before the next one is built."""
    import cupy as cp
    del objs
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()


class RandomParams(Mapping):
    """GPT-2 weights of one shape in the HF layout, each tensor drawn on the GPU when it is asked for, from its
    own seed (the same tensor every time): the statistics of weights.random_weights (N(0, 0.02), residual
    projections scaled by 1/sqrt(2 n_layer), LayerNorm weights near 1), without 6 GB of XL weights on the host
    or a host-side draw of 1.5B numbers. GPT(config, RandomParams(config)) builds a model from them."""

    def __init__(self, config, seed: int = 0):
        from step4_gpt2 import weights as W
        self.config, self.seed, self.shapes = config, seed, W.expected_shapes(config)
        self.index = {n: i for i, n in enumerate(self.shapes)}

    def __getitem__(self, name):
        import cupy as cp
        shape = self.shapes[name]
        x = cp.random.default_rng(self.seed * 1_000_003 + self.index[name]).standard_normal(shape, dtype=cp.float32)
        if name.endswith(("ln_1.weight", "ln_2.weight")) or name == "ln_f.weight":
            return x * cp.float32(0.1) + cp.float32(1.0)
        if name.endswith("c_proj.weight"):
            return x * cp.float32(0.02 / (2 * self.config.n_layer) ** 0.5)
        return x * cp.float32(0.02)

    def __contains__(self, name):
        return name in self.shapes

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self):
        return len(self.shapes)


def decode_step_s(model, batch: int, steps: int = STEPS, prompt_len: int = PROMPT_LEN,
                  programmatic: bool = False, tensor_cores: bool = True) -> float:
    """Seconds per greedy decode step of lesson 4a's graph Decoder after a prompt of prompt_len random tokens
    (programmatic: its kernels launched with programmatic dependent launch; tensor_cores=False: the bf16/int8
    GEMVs on the CUDA cores, ops.tensor_cores)."""
    from step4_gpt2.generate import Decoder
    from step4_gpt2.megakernel.benchmarks import decode_s
    dec = Decoder(model, batch, prompt_len + steps + 1, True, cuda_graph=True, programmatic=programmatic,
                  tensor_cores=tensor_cores)
    s = decode_s(dec, random_ids(model.config, batch, prompt_len, seed=batch), steps) / steps
    free(dec)
    return s


def ladder(name: str, params=None, batches=BATCHES, precisions=PRECISIONS) -> dict:
    """{(precision, batch): seconds per step} of the graph decode for GPT-2 shape `name` (random weights drawn on
    the GPU unless params are given), one model on the GPU at a time."""
    from step4_gpt2 import weights as W
    from step4_gpt2.model import GPT
    cfg = W.GPTConfig.from_name(name)
    params = params if params is not None else RandomParams(cfg)
    out = {}
    for p in precisions:
        model = GPT(cfg, params, precision=p)
        for B in batches:
            out[(p, B)] = decode_step_s(model, B)
        free(model)
    return out


def pdl_available() -> tuple[bool, str]:
    """Whether this GPU runs programmatic dependent launch (sm_90 and newer), and why not."""
    from common.device import device_info
    from step4_gpt2.pdl import PDL_ARCH
    sm = device_info()["sm"]
    return sm >= PDL_ARCH, f"programmatic dependent launch needs sm_{PDL_ARCH}; this GPU is sm_{sm}"


def pdl_ladder(name: str, params=None, batches=BATCHES, precisions=PRECISIONS) -> dict:
    """{(precision, batch): (seconds per step of the plain graph, of the graph + PDL)}, the two timed back to back
    on one model, for GPT-2 shape `name` (random weights unless params are given)."""
    from step4_gpt2 import weights as W
    from step4_gpt2.model import GPT
    cfg = W.GPTConfig.from_name(name)
    params = params if params is not None else RandomParams(cfg)
    out = {}
    for p in precisions:
        model = GPT(cfg, params, precision=p)
        for B in batches:
            out[(p, B)] = (decode_step_s(model, B), decode_step_s(model, B, programmatic=True))
        free(model)
    return out


def pdl_rows(name: str, pairs: dict, bw: float) -> list[Row]:
    """The "CUDA graph + PDL" rungs: each against its own bound and against the plain graph rung timed with it."""
    from step4_gpt2 import weights as W
    from step4_gpt2.model import weight_bytes_per_token
    cfg, label = W.GPTConfig.from_name(name), shape_label(name)
    rows = []
    for (p, B), (plain, s) in pairs.items():
        bound = bw * 1e9 / weight_bytes_per_token(cfg, p)
        rows.append(Row(f"decode {p} b={B} (CUDA graph + PDL)", f"{label}, {STEPS} tok", s * 1e3, B / s, "tok/s",
                        f"{p} weight-bw bound", 1 / s / bound, "CUDA graph", plain / s))
        if p != "fp32" and ("fp32", B) in pairs:
            fp32 = pairs[("fp32", B)][1]
            rows.append(Row(f"decode {p} b={B} (CUDA graph + PDL) vs fp32", label, s * 1e3, B / s, "tok/s",
                            anchor=f"fp32 b={B} (CUDA graph + PDL)", ratio=fp32 / s))
    return rows


def ladder_rows(name: str, times: dict, bw: float) -> list[Row]:
    """Rows of one shape's ladder: each rung against its own bound and against the fp32 rung of its batch."""
    from step4_gpt2 import weights as W
    from step4_gpt2.model import weight_bytes_per_token
    cfg, label = W.GPTConfig.from_name(name), shape_label(name)
    rows = []
    for (p, B), s in times.items():
        bound = bw * 1e9 / weight_bytes_per_token(cfg, p)           # steps/s
        r = Row(f"decode {p} b={B} (CUDA graph)", f"{label}, {STEPS} tok", s * 1e3, B / s, "tok/s",
                f"{p} weight-bw bound", 1 / s / bound)
        if p != "fp32" and ("fp32", B) in times:
            r.anchor, r.ratio = f"fp32 b={B}", times[("fp32", B)] / s
        rows.append(r)
        if name == "gpt2-xl" and B == 1 and p != "fp32" and ("fp32", 1) in times:
            want = {"bf16": 1.8, "int8": 3.0}[p]
            rows.append(Row(f"decode {p} b=1 vs fp32", label, s * 1e3, 1 / s, "tok/s", anchor="fp32 b=1",
                            ratio=times[("fp32", 1)] / s).check("ratio", want))
            rows.append(Row(f"decode {p} b=1: bandwidth", label, s * 1e3, 1 / s, "tok/s", f"{p} weight-bw bound",
                            1 / s / bound).check("fraction", 0.70))
    return rows


# ----------------------------------------------------------------------------- transformers' bf16 anchors
def hf_bf16(name: str):
    """transformers' GPT2LMHeadModel of this shape in bf16 on the GPU (random weights), or None (printed why)."""
    try:
        from common import torch_cuda
        torch = torch_cuda()
        if torch is None:
            raise ImportError("torch with CUDA is not installed")
        import transformers
        from step4_gpt2 import weights as W
        hc = transformers.GPT2Config(**W.GPTConfig.from_name(name).to_hf())
        with torch.device("cuda"):
            hf = transformers.GPT2LMHeadModel._from_config(hc, dtype=torch.bfloat16).eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        return hf
    except Exception as e:          # our rows still come, without the anchor
        print(f"transformers bf16 anchor unavailable: {type(e).__name__}: {e}")
        return None


def hf_decode_s(hf, batch: int, static: bool, steps: int = STEPS, prompt_len: int = PROMPT_LEN) -> float:
    """Seconds per decode step of transformers' greedy generate: (STEPS + 1 tokens - 1 token) / STEPS. static: a
    static KV cache, with which generate compiles its decoding step (torch.compile; the warm-up call compiles)."""
    import torch
    ids = torch.tensor(random_ids(hf.config, batch, prompt_len, seed=batch), dtype=torch.int64, device="cuda")
    extra = {"cache_implementation": "static"} if static else {}

    def gen(n):
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, use_cache=True, **extra)
    return max(wall_s(lambda: gen(steps + 1)) - wall_s(lambda: gen(1)), 1e-9) / steps


def anchor_rows(name: str, times: dict, batches=BATCHES) -> list[Row]:
    """transformers' bf16 generate (no compile at each batch; static cache + compile at batch 1) against our bf16
    rung of the same batch."""
    hf = hf_bf16(name)
    if hf is None:
        return []
    label, rows = shape_label(name), []
    runs = [(B, False) for B in batches] + [(1, True)]
    for B, static in runs:
        try:
            s = hf_decode_s(hf, B, static)
        except Exception as e:     # e.g. torch.compile without a working compiler: say so, keep the rest
            print(f"transformers bf16 generate ({'static cache + compile' if static else 'no compile'}, b={B}) "
                  f"failed: {type(e).__name__}: {e}")
            continue
        how = "static cache + torch.compile" if static else "no compile"
        rows.append(Row(f"decode HF bf16 generate ({how}) b={B}", f"{label}, {STEPS} tok", s * 1e3, B / s, "tok/s"))
        if ("bf16", B) in times:
            ours = times[("bf16", B)]
            rows.append(Row(f"decode bf16 b={B} vs HF bf16 ({how})", label, ours * 1e3, B / ours, "tok/s",
                            anchor=f"HF bf16 {how}", ratio=s / ours))
    free(hf)
    return rows


# ----------------------------------------------------------------------------- quality
def quality_rows(seconds: float = TRAIN_SECONDS) -> list[Row]:
    """Perplexity fp32 / bf16 / int8 of 4b's model trained for `seconds` (held-out plays, characters) and of
    GPT-2 124M where cached (the same plays, BPE); the change vs fp32 checked (<= 0.5% bf16, <= 2% int8)."""
    from step4_gpt2.precision.quality import gpt2_cached, quality_table, shakespeare_model
    rows = []
    cfg, params, data = shakespeare_model(seconds)
    cases = [("4b char model", cfg, params, data.val, cfg.block_size, None)]
    gcfg, gparams, why = gpt2_cached()
    if gcfg is None:
        print(f"GPT-2 124M perplexity rows skipped: {why}")
    else:
        from step4_gpt2.train.train import Data
        cases.append(("GPT-2 124M", gcfg, gparams, Data.shakespeare("gpt2").val, gcfg.block_size, PPL_WINDOWS))
    for label, c, p, ids, T, nw in cases:
        prompts = [list(map(int, ids[k:k + 16])) for k in (0, len(ids) // 3, 2 * len(ids) // 3)]
        t0 = time.perf_counter()
        table = quality_table(c, p, ids, T, max_windows=nw, prompts=prompts, n=AGREE_TOKENS)
        ms = (time.perf_counter() - t0) * 1e3
        size = f"{label}, T={T}"
        for prec, r in table.items():
            rows.append(Row(f"perplexity {prec} ({label})", size, ms, r["ppl"], "ppl"))
            if prec == "fp32":
                continue
            limit = {"bf16": 0.5, "int8": 2.0}[prec]
            rows.append(Row(f"perplexity change {prec} vs fp32 ({label})", size, ms, 100 * r["change"],
                            "% ppl").check("rate", None, at_most=limit))
            if r["agreement"] is not None:
                rows.append(Row(f"top-1 agreement {prec} vs fp32 ({label})", size, ms, 100 * r["agreement"].top1,
                                "% tokens"))
        free()
    return rows


def run() -> list[Row]:
    from step4_gpt2 import weights as W
    bw = copy_bandwidth()
    rows = []
    for name in SHAPES:
        ok, why = fits(W.GPTConfig.from_name(name))
        if not ok:
            print(f"{shape_label(name)} rows skipped: {why}")
            continue
        times = ladder(name)
        rows += ladder_rows(name, times, bw)
        ok, why = pdl_available()
        if ok:
            rows += pdl_rows(name, pdl_ladder(name), bw)
        else:
            print(f"{shape_label(name)} CUDA graph + PDL rows skipped: {why}")
        rows += anchor_rows(name, times)
    rows += quality_rows()
    return rows


def main(argv=None) -> int:
    from common.benchmarks import module_main
    return module_main("step4_gpt2.precision.benchmarks", __doc__, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
