"""The course's benchmark table: every kernel against its ceiling and its anchor, measured in one run.

    python -m common.benchmarks                                # every step
    python -m common.benchmarks --only step1_simple            # one step
    python -m common.benchmarks --only step2_attention:flash   # one kernel family
    python -m common.benchmarks --only step4_gpt2:train        # one lesson inside a step (a subpackage)
    python -m common.benchmarks --list                         # the names --only accepts (no GPU needed)
    python -m common.benchmarks --from-json bench_results.json --markdown docs/results.md --readme README.md
                                                               # the results page from a saved run (no GPU)

Each step folder has one or more `benchmarks*.py` modules with `run() -> list[Row]`. A kernel family, the
`FAMILY` in `--only STEP:FAMILY`, is either
  - a benchmark module `benchmarks_FAMILY.py` (step2_attention:flash runs step2_attention/benchmarks_flash.py),
  - a function `FAMILY_rows()` that takes no arguments, in any of the step's benchmark modules
    (step2_attention:softmax runs softmax_rows() of step2_attention/benchmarks.py), or
  - a subpackage of the step with a `benchmarks.py` that has `run()` (step4_gpt2:train runs
    step4_gpt2/train/benchmarks.py), or a `benchmarks_FAMILY.py` of it with `run()`, named SUB_FAMILY
    (step4_gpt2:train_bf16 runs step4_gpt2/train/benchmarks_bf16.py); `--only STEP` runs them too.
Every row carries its anchor, timed in the same run: copy bandwidth, cuBLAS, CuPy, or torch when installed.
--markdown writes the results page: one section per step, the device, date and copy bandwidth once, every row's
numbers and what limits it (the text is NOTES in this module); --readme replaces the table between the
README's results markers.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import importlib
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def subpackages(step_dir: Path) -> list[str]:
    """The subpackages of a step folder that are benchmark families: a folder with a benchmarks.py that defines
    run() (read from the source, not imported)."""
    found = []
    for path in sorted(step_dir.glob("*/benchmarks.py")):
        if path.parent.name.startswith((".", "_")):
            continue
        tree = ast.parse(path.read_text(), str(path))
        if any(isinstance(n, ast.FunctionDef) and n.name == "run" for n in tree.body):
            found.append(path.parent.name)
    return found


def sub_modules(step_dir: Path) -> list[tuple[str, str]]:
    """(family, module path below the step) of a step folder's subpackages: SUB for SUB/benchmarks.py, SUB_FAMILY
    for SUB/benchmarks_FAMILY.py, each where the file defines run() (read from the source, not imported)."""
    found = []
    for sub in subpackages(step_dir):
        found.append((sub, f"{sub}.benchmarks"))
    for path in sorted(step_dir.glob("*/benchmarks_*.py")):
        sub = path.parent.name
        if sub.startswith((".", "_")):
            continue
        tree = ast.parse(path.read_text(), str(path))
        if any(isinstance(n, ast.FunctionDef) and n.name == "run" for n in tree.body):
            found.append((f"{sub}_{path.stem.removeprefix('benchmarks_')}", f"{sub}.{path.stem}"))
    return found


def _steps(root: Path) -> tuple[str, ...]:
    return tuple(sorted(p.name for p in root.glob("step*")
                        if p.is_dir() and (any(p.glob("benchmarks*.py")) or sub_modules(p))))


STEPS = _steps(ROOT)


@dataclass
class Row:
    name: str
    size: str
    ms: float                        # median time
    rate: float | None = None        # GB/s, TFLOP/s or tok/s
    unit: str = ""
    ceiling: str = ""                # what `fraction` is a fraction of
    fraction: float | None = None
    anchor: str = ""                 # what `ratio` compares with (anchor time / this time: > 1 is faster)
    ratio: float | None = None
    target: str = ""                 # a reference value maintainers track (docs/results.md): JSON only, never printed
    step: str = ""                   # filled in by the runner: which step folder the row comes from
    family: str = ""                 # filled in by the runner: the --only name that selects the row

    @classmethod
    def of(cls, t, size: str, ceiling: tuple | None = None, anchor: tuple | None = None,
           target: tuple | None = None) -> "Row":
        """From a common.timing.Timing. ceiling=(label, rate in the row's unit); anchor=(label, Timing);
        target=("fraction" or "ratio", reference value), recorded in the JSON only."""
        rate, unit = (t.gbps, "GB/s") if t.bytes is not None else (t.tflops, "TFLOP/s") if t.flops else (None, "")
        row = cls(t.name, size, t.median_ms, rate, unit)
        if ceiling and rate is not None:
            row.ceiling, row.fraction = ceiling[0], rate / ceiling[1]
        if anchor:
            row.anchor, row.ratio = anchor[0], anchor[1].median_ms / t.median_ms
        if target:
            row.check(*target)
        return row

    def check(self, what: str, reference: float | None, at_most: float | None = None) -> "Row":
        """Record a reference value for `fraction`, `ratio` or `rate` (JSON only; the table shows measured values):
        `what >= reference`; with at_most also `what <= at_most` (reference None: that upper bound alone)."""
        if what not in ("fraction", "ratio", "rate"):
            raise ValueError(f"what: expected 'fraction', 'ratio' or 'rate', got {what!r}")
        if reference is None and at_most is None:
            raise ValueError("reference, at_most: expected at least one bound, got neither")
        bounds = ([f"{what} >= {reference:g}"] if reference is not None else []) + \
                 ([f"{what} <= {at_most:g}"] if at_most is not None else [])
        self.target = " and ".join(bounds)
        return self

    def record(self) -> dict:
        """The row as written to the JSON file."""
        return asdict(self)


def table(rows: list[Row]) -> str:
    head = (f"| {'benchmark':38s} | {'size':16s} | {'median ms':>10s} | {'rate':>16s} | {'of ceiling':>16s} "
            f"| {'vs anchor':>22s} |")
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:
        rate = f"{rate_text(r.rate)} {r.unit}" if r.rate is not None else ""
        frac = f"{r.fraction:.1%} {r.ceiling}" if r.fraction is not None else ""
        anc = f"{r.ratio:.2f}x {r.anchor}" if r.ratio is not None else ""
        lines.append(f"| {r.name:38s} | {r.size:16s} | {r.ms:10.4f} | {rate:>16s} | {frac:>16s} | {anc:>22s} |")
    return "\n".join(lines)


def module_main(module: str, doc: str, run, argv=None, parser: argparse.ArgumentParser | None = None,
                validate=None) -> int:
    """The `python -m <benchmark module>` entry point every benchmark module shares: --help without a GPU, the
    course's one-line message instead of a traceback on a machine without one, then the table of run()'s rows.
    A module with options of its own passes its parser (and validate(args, parser), which may parser.error()
    before any GPU work); run() then receives the parsed arguments and returns rows or a finished text."""
    p = parser or argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    args = p.parse_args(argv)
    if validate:
        validate(args, p)
    from common.device import require_gpu
    try:
        require_gpu()
    except RuntimeError as e:            # no GPU / driver: the message alone, no traceback
        print(e, file=sys.stderr)
        return 1
    out = run(args) if parser else run()
    print(out if isinstance(out, str) else table(out))
    return 0


def _takes_no_arguments(fn: ast.FunctionDef) -> bool:
    a = fn.args
    return len(a.posonlyargs) + len(a.args) == len(a.defaults) and all(d is not None for d in a.kw_defaults)


def families(step: str, root: Path = ROOT) -> dict[str, list[tuple[str, str | None]]]:
    """The kernel families of one step: name -> [(module, function)], function None meaning the module's run().
    Read from the source (not imported), so names are checked before any GPU work, on any machine."""
    found: dict[str, list] = {}
    for path in sorted((root / step).glob("benchmarks*.py")):
        module = f"{step}.{path.stem}"
        if path.stem.startswith("benchmarks_"):
            found.setdefault(path.stem.removeprefix("benchmarks_"), []).append((module, None))
        for node in ast.parse(path.read_text(), str(path)).body:
            if (isinstance(node, ast.FunctionDef) and node.name.endswith("_rows") and not node.name.startswith("_")
                    and _takes_no_arguments(node)):
                found.setdefault(node.name.removesuffix("_rows"), []).append((module, node.name))
    for family, module in sub_modules(root / step):
        found.setdefault(family, []).append((f"{step}.{module}", None))
    return found


def step_modules(step: str, root: Path = ROOT) -> list[str]:
    """Every module `--only STEP` runs whole: the step's benchmarks*.py, then its subpackages' benchmarks.py and
    benchmarks_FAMILY.py."""
    return ([f"{step}.{p.stem}" for p in sorted((root / step).glob("benchmarks*.py"))]
            + [f"{step}.{module}" for _, module in sub_modules(root / step)])


def valid_names(root: Path = ROOT) -> list[str]:
    steps = STEPS if root == ROOT else _steps(root)
    return [n for step in steps for n in (step, *(f"{step}:{f}" for f in sorted(families(step, root))))]


def select(only: list[str] | None, root: Path = ROOT) -> list[tuple[str, str, str | None]]:
    """(--only name, module, function) to run, in order; a ValueError naming the valid names otherwise."""
    steps = STEPS if root == ROOT else _steps(root)
    jobs: list = []
    for name in only or steps:
        step, _, family = name.partition(":")
        if step not in steps or (family and family not in families(step, root)):
            raise ValueError(f"--only: unknown name {name!r}; valid names are: {', '.join(valid_names(root))}")
        if family:
            jobs += [(name, m, f) for m, f in families(step, root)[family]]
        else:
            jobs += [(name, m, None) for m in step_modules(step, root)]
    whole = {m for _, m, f in jobs if f is None}
    seen, out = set(), []
    for job in jobs:           # a function whose whole module runs anyway is not run twice
        if (job[1], job[2]) in seen or (job[2] is not None and job[1] in whole):
            continue
        seen.add((job[1], job[2]))
        out.append(job)
    return out


def family_of(name: str, module: str, function: str | None) -> str:
    """The family recorded with a row: STEP:SUB for a subpackage's benchmarks.py (STEP:SUB_FAMILY for its
    benchmarks_FAMILY.py), STEP:FAMILY for benchmarks_FAMILY.py or a FAMILY_rows() run alone, STEP for a step's
    benchmarks.py run whole."""
    parts = module.split(".")
    if len(parts) == 3:
        family = parts[2].removeprefix("benchmarks").lstrip("_")
        return f"{parts[0]}:{parts[1]}" + (f"_{family}" if family else "")
    if function is not None:
        return f"{parts[0]}:{function.removesuffix('_rows')}"
    family = parts[1].removeprefix("benchmarks").lstrip("_")
    return f"{parts[0]}:{family}" if family else parts[0]


# --- the results page (--markdown, --readme) -------------------------------------------------------------

SECTIONS = {                     # section key -> heading; a subpackage's family has a section of its own
    "step1_simple": "Step 1: elementwise kernels and reductions",
    "step2_attention": "Step 2: softmax, matmul, attention",
    "step3_fused": "Step 3: LayerNorm, fusion, a fused training step",
    "step4_gpt2": "Step 4a: GPT-2 inference",
    "step4_gpt2:train": "Step 4b: training a GPT",
    "step4_gpt2:train_bf16": "Step 4b in bf16: mixed-precision training, recomputation",
    "step4_gpt2:megakernel": "Step 4c: the decode megakernel",
    "step4_gpt2:torch_ops": "Step 4d: your kernels in PyTorch",
    "step4_gpt2:parallel": "Step 4e: training on several GPUs",
    "step4_gpt2:precision": "Step 4f: fewer bytes per token (bf16, int8)",
}

# What limits each row, per section: (pattern, text), the first pattern that matches the start of a row's name
# (re.match, leading spaces ignored) wins. Rows that match the same pattern share one line of the page. Words
# only: the numbers are the run's, in the table beside the text.
NOTES: dict[str, list[tuple[str, str]]] = {
    "step1_simple": [
        (r"axpb v4 \(64M\)", "The GPU kernel on the CPU row's size: DRAM bandwidth on both sides, and the GPU has "
                            "many times the CPU's."),
        (r"axpb v", "DRAM bandwidth: each element is read once and written once. The versions differ in how many "
                    "bytes each thread keeps in flight (grid-stride loop, `float4` loads, unrolling)."),
        (r"CuPy ElementwiseKernel", "Anchor: a generic elementwise kernel with scalar loads and a fixed launch "
                                    "shape."),
        (r"NumPy", "Anchor on the CPU: one thread, bound by the host's memory bandwidth."),
        (r"gelu", "DRAM bandwidth: the fused kernel skips writing and re-reading the two intermediate arrays, so "
                  "it moves a fraction of the unfused bytes."),
        (r"sum v", "DRAM bandwidth, read only: a reduction reads each element once and writes almost nothing, so "
                   "it can pass the copy ceiling, which counts a read and a write."),
        (r"cupy\.sum", "Anchor: CuPy's reduction (CUB), also read-only."),
    ],
    "step2_attention": [
        (r"softmax_v1", "One thread per row: too few threads, and each reads its row alone (uncoalesced); most "
                        "of the GPU idles."),
        (r"softmax_v", "DRAM bandwidth: the versions cut the passes over a row (three, two, then one with the "
                       "online softmax) and widen the loads."),
        (r"torch\.softmax", "Anchor: PyTorch's softmax, one pass, near copy bandwidth."),
        (r"matmul_v1", "Every multiply-add loads its two operands from memory: load-bound, not FMA-bound."),
        (r"matmul_v", "The FMA rate, once tiles in shared memory and registers reuse each load; cuBLAS keeps "
                      "more loads in flight and picks its tile per shape."),
        (r"cuBLAS", "Anchor: cuBLAS SGEMM, fp32 on CUDA cores (TF32 off)."),
        (r"attention_naive", "Three kernels, and the T by T score matrix is written to DRAM and read back: "
                             "traffic that grows with the square of T."),
        (r"attention_cublas", "Anchor: the same three steps with cuBLAS batched GEMMs; the score matrix still "
                              "crosses DRAM."),
        (r"flash fp32 v3 BR", "Tile shapes of version 3: larger tiles reuse more loads but hold more registers, "
                              "so fewer blocks fit on an SM."),
        (r"flash fp32 v[12]\b", "The earlier flash versions: fewer values per thread, so more loads per FMA."),
        (r"flash fp32", "The fp32 FMA rate: without the score matrix attention is arithmetic-bound; many "
                        "registers per thread limit the blocks per SM, and the K/V loads are not pipelined."),
        (r"torch SDPA fp32", "Anchor: PyTorch's memory-efficient attention in fp32."),
        (r"torch SDPA", "Anchor: PyTorch's flash attention backend on tensor cores."),
        (r"flash tc", "Tile shapes of the tensor-core kernel: warps per block and key-block width."),
        (r"flash tensor cores", "Tensor-core throughput, and the softmax between the two products on CUDA cores; "
                                "at long T the anchor's asynchronous copies keep its tensor cores busier."),
        (r"decode attention v1", "One block per head: at batch 1 a dozen blocks run on a GPU with many more SMs."),
        (r"decode attention v2", "Split-K spreads the cache over more blocks; the cache is small, so the launch "
                                 "and the merge of the partial results weigh as much as the bytes."),
    ],
    "step3_fused": [
        (r"fused residual\+LN vs", "The fused kernel against each anchor (rows above)."),
        (r"fused residual\+LayerNorm", "DRAM bandwidth: x and r are read once and the sum and its LayerNorm "
                                         "written once; its registers per thread cap the warps per SM."),
        (r"residual add \+ LayerNorm", "Two kernels: the sum is written to DRAM and read back."),
        (r"torch eager sublayer", "Anchor: PyTorch eager with SDPA attention."),
        (r"torch eager", "Anchor: PyTorch eager, one kernel per op."),
        (r"torch\.compile", "Anchor: `torch.compile` fuses the same ops into one generated kernel."),
        (r"layernorm v1", "One thread per row: few threads and uncoalesced reads."),
        (r"layernorm v", "DRAM bandwidth: a warp or a block per row, the row read once (v4 keeps it in "
                         "registers)."),
        (r"attention sublayer unfused|unfused:", "The unfused pipeline: the naive attention's score matrix "
                                                  "crosses DRAM, and the small ops each read and write the "
                                                  "activations."),
        (r"attention sublayer fused|fused:", "The cuBLAS fp32 GEMMs and the flash attention are most of it; the "
                                              "fused LayerNorm tail is small."),
        (r"fused sublayer vs", "Against the unfused pipeline and PyTorch: both spend most of the time in the same "
                               "cuBLAS GEMMs."),
        (r"decode \S+ host wall", "The host's time to launch one decode step on an idle GPU: fewer kernels, "
                                   "fewer launches."),
        (r"decode \S+ \(graph\)", "The same step replayed as a CUDA graph (CuPy's cuBLAS calls cannot be "
                                   "captured)."),
        (r"decode ", "A decode step reads a small KV cache: launch latency and too few blocks, not bandwidth; "
                     "split-K adds blocks."),
        (r"conv2d, bias, relu|conv2d\+bias\+relu fused$", "A direct convolution on CUDA cores: it reloads "
                                                            "inputs, so fusing the epilogue saves little."),
        (r"torch cuDNN|conv2d\+bias\+relu fused vs", "Anchor: cuDNN's convolution reuses each loaded value "
                                                     "far more."),
        (r"LayerNorm \+ cuBLAS", "The unfused baseline: a bandwidth-bound LayerNorm, then cuBLAS."),
        (r"over-fused", "Registers: recomputing the LayerNorm inside the GEMM's tile costs registers; small tiles "
                        "reuse too little, the largest spill to local memory."),
        (r"train step fused \(adamw\) vs torch", "Against PyTorch eager: the same GEMMs, fewer other kernels."),
        (r"train step|forward\+backward", "The cuBLAS GEMMs are most of the step and identical on both sides: "
                                           "fusion only shortens the rest."),
        (r"GEMMs only|non-GEMM|step ratio", "What is left to fusion: the step with every non-GEMM kernel free."),
        (r"AdamW|SGD", "DRAM bandwidth: each parameter and its optimiser state read and written once; one launch "
                       "over all tensors saves the launches."),
        (r"per-sample|batched step", "A step on one token is launches and tiny GEMMs; a batch fills the GPU."),
    ],
    "step4_gpt2": [
        (r"GEMV LM head", "The one large matrix: with enough rows per warp it streams near copy bandwidth."),
        (r"GEMV .* b=1", "Each matrix is a few MB, read in a few microseconds: the kernel's ramp-up and tail are "
                         "as long as its bytes, so it stays far below copy bandwidth."),
        (r"GEMV", "Eight input rows per weight row: more registers and arithmetic per byte, so tile shape "
                  "matters more than at batch 1."),
        (r"decode attention", "A short KV cache per step: launch latency, not bandwidth."),
        (r"decode b=\d+ HF", "Anchor: `transformers` `generate`, bound by the host's Python per token, so it "
                             "moves between runs."),
        (r"decode b=\d+ \(eager", "Host-bound: Python and one launch per kernel."),
        (r"decode b=", "A step is about sixty small kernels; each GEMV's fixed cost is above its bytes' time. "
                       "The graph removes the launch gaps, not each kernel's ramp-up and tail."),
        (r"step replay", "Which plan the decoder picks per batch and cache length: fused or split attention, "
                         "attention v1 or v2."),
        (r"A/B generate", "`generate` with each of its choices turned off in turn."),
        (r"prefill", "cuBLAS GEMMs on long sequences: the FMA rate."),
        (r"HF eager prefill", "Anchor: `transformers` eager forward."),
        (r"decode step|launch overhead", "The host's launches against one graph replay of the same kernels."),
        (r".*: eager", "Per part of the step, launched one by one: launch overhead."),
        (r".*: in graph", "Per part of the step, inside the graph: the kernels alone."),
    ],
    "step4_gpt2:train": [
        (r"train step( TF32)?, ours.*host time", "The host's time to queue one step; with the CUDA graph it is "
                                                 "one launch."),
        (r"train step( TF32)?, CUDA graph vs", "What the weight-gradient stream and moving cuBLAS's memsets off "
                                               "the critical path each save."),
        (r"train step( TF32)?, torch", "Anchor: PyTorch eager is bound by the host's Python and launches and "
                                       "moves with the host's speed; `torch.compile` less so."),
        (r"train step", "In fp32 the cuBLAS GEMMs, the same calls on both sides, are most of the step. With "
                        "TF32 GEMMs the attention and the memory-bound kernels count too."),
        (r"whole", "The step as one CUDA graph, timed on the GPU and on the host."),
        (r".*GEMM", "cuBLAS fp32 on these shapes: the part that fusion cannot change."),
        (r"attention v\d+ .*split", "The 3xTF32 operand splits: how each part is rounded sets most of the "
                                    "instructions of the kernels' inner loop."),
        (r"attention (forward|backward) v\d+ vs torch", "Against PyTorch's SDPA at fp32 accuracy."),
        (r"torch SDPA", "Anchor: PyTorch's SDPA in fp32."),
        (r"attention forward", "Tensor cores at fp32 accuracy (3xTF32): three products per tile plus the "
                               "splits."),
        (r"attention backward", "The backward's two kernels (dK/dV, then dQ from the stored dS): the products "
                                "and the splits."),
        (r"LayerNorm|bias|embeddings|fused classifier|grad-norm", "Memory-bound kernels near copy bandwidth: "
                                                                  "small parts of the step."),
        (r"sum of the pieces", "The pieces timed alone add up to more than the step: in the graph the "
                               "weight-gradient stream overlaps them."),
        (r"step timeline|in the step", "The profiler's timeline of the graph: where the GPU idles."),
    ],
    "step4_gpt2:train_bf16": [
        (r"train step, ours bf16 vs ours fp32", "bf16 on the tensor cores (GEMMs through cuBLAS, attention) "
                                                "against plain fp32 on the same model and batches: the GEMMs "
                                                "shrink most; LayerNorm, GELU, the loss and AdamW stay fp32 "
                                                "and memory-bound."),
        (r"train step, ours bf16 vs torch", "Against PyTorch autocast(bf16) on the same model, batches and fp32 "
                                            "AdamW: eager adds the host's Python, a launch per op and a cast per "
                                            "weight; `torch.compile` fuses the small ops and the casts."),
        (r"train step, bf16 \+ recompute vs", "The time paid for recomputation: one more LayerNorm pair and GELU "
                                              "per layer in the backward, memory-bound kernels."),
        (r"train step", "Tokens per second of the whole step (forward, backward, clipping, AdamW with fp32 master "
                        "weights); ours replayed as one CUDA graph."),
        (r"activations kept", "Bytes kept for the backward per batch shape, counted exactly from the buffers "
                              "allocated: bf16 halves what the GEMMs read, recomputation drops ln_1, ln_2 and the "
                              "GELU output of every layer. The time column is that variant's step."),
    ],
    "step4_gpt2:megakernel": [
        (r"decode eager", "Host-bound: one launch per kernel."),
        (r"decode CUDA graph \+ PDL", "The same graph with programmatic dependent launch (sm_90): each kernel "
                                     "starts, and asks for its first weights, while the one before it drains; it "
                                     "still waits for all of that kernel before it reads."),
        (r"decode CUDA graph", "Anchor: one kernel per op, each with its ramp-up and tail."),
        (r"decode megakernel v1", "One persistent kernel; its blocks wait for each other through counters: "
                                  "the chain of hops between blocks sets the pace."),
        (r"decode megakernel", "Version 2 prefetches the next stage's weights while a block waits; what is left "
                               "is the chain of hops and L2 round trips (findings: the megakernel's floor)."),
        (r"decode transformers", "Anchor: `transformers` `generate`, host-bound; it moves between runs."),
        (r"decode (fp32|bf16|int8) CUDA graph", "Anchor of its precision: the graph decode reading the weight "
                                                "matrices in that precision (lesson 4f's GEMVs)."),
        (r"decode (fp32|bf16|int8) megakernel", "Version 2 reading the weight matrices in that precision, widened "
                                                "in registers as the GEMVs do; the fraction is of that "
                                                "precision's own weight-bandwidth bound."),
        (r"decode (bf16|int8) best rung", "The fastest rung of that precision against the fp32 CUDA graph, and its "
                                          "share of its own bound."),
        (r"decode b=1 best|decode best", "The fastest rung against each anchor."),
        (r"megakernel v2 threads", "Threads per block and unroll depth of version 2."),
        (r"timeline|v\d+ ", "The in-kernel timeline: per stage, the time blocks wait for another block's "
                            "counter and the time they work."),
        (r"hop|L2 round trip", "The units of the chain: a hop between two blocks, a grid-wide barrier, an L2 round trip."),
        (r"floor", "The same kernel on a model whose layers are all layer 0, its weights kept in L2: the floor "
                   "of this design's chain (findings: the megakernel's floor)."),
    ],
    "step4_gpt2:precision": [
        (r"decode HF", "Anchor: `transformers` `generate` in bf16 on the same shape and batch, eager, then with a "
                       "static KV cache compiled by `torch.compile`."),
        (r"decode \S+ b=\d+ vs HF", "The course's bf16 graph decode against `transformers` in bf16."),
        (r"decode \S+ b=\d+ \(CUDA graph \+ PDL\) vs fp32", "Programmatic dependent launch in both rungs: this "
                                                            "precision against fp32."),
        (r"decode \S+ b=\d+ \(CUDA graph \+ PDL\)", "The same graph with programmatic dependent launch between "
                                                     "its kernels (sm_90): a kernel issues its first weight loads "
                                                     "while the one before drains. Anchor: the plain graph."),
        (r"decode \S+ b=\d+ vs fp32", "This precision against the fp32 decode at the same batch."),
        (r"decode \S+ b=\d+: bandwidth", "The share of this precision's own bound: its weight bytes per token at "
                                         "copy bandwidth."),
        (r"decode \S+ b=\d+ \(CUDA graph\)", "Greedy decode, each step one CUDA graph replay, the weight matrices "
                                             "in this precision and widened to float in registers; the fraction "
                                             "is of this precision's own weight-bandwidth bound. A step also "
                                             "pays fixed costs (attention, LayerNorms, each kernel's ramp-up) "
                                             "that fewer bytes do not shrink."),
        (r"perplexity change", "Perplexity against the fp32 model's on the same held-out windows, in percent."),
        (r"perplexity", "exp of the mean negative log-likelihood on held-out text, windows of the model's context, "
                        "the sum in float64."),
        (r"top-1 agreement", "Teacher-forced: the share of positions where the two precisions pick the same next "
                             "token."),
    ],
    "step4_gpt2:torch_ops": [
        (r"torch GPT step, course ops, CUDA graph vs", "The course's ops in a step recorded as one CUDA graph, "
                                                      "against each of PyTorch's ways to run the same model."),
        (r"torch GPT step, course ops(, torch\.compile)? vs", "Launched one by one, each custom op is a Python "
                                                              "call: the GPU waits for the host."),
        (r"torch GPT step, course ops", "The nanoGPT model with the course's fused kernels as torch custom ops; "
                                        "TF32 GEMMs, the same cuBLAS calls as PyTorch's."),
        (r"torch GPT step, torch", "Anchor: the same model on PyTorch's own ops, TF32 GEMMs."),
    ],
    "step4_gpt2:parallel": [
        (r"all-reduce fit", "The line fitted through every message size: its intercept (the time column) is the "
                            "latency, its slope the bus bandwidth; the tensor-parallel rows predict from them."),
        (r"all-reduce", "NCCL's ring over the GPUs' links: a large message runs at the bus bandwidth (each rank "
                        "sends and receives 2 (N-1)/N of it), a small one costs the fixed latency of a collective."),
        (r"data parallel 1 GPU", "Anchor: the same trainer on one GPU with the same per-GPU batch, no "
                                 "communication."),
        (r"ZeRO-1 AdamW state", "AdamW's moments per GPU, measured: each rank keeps the state of its shard of the "
                                "parameters only."),
        (r"data parallel .*bucket", "The gradient bucket swept: smaller buckets start reducing earlier in the "
                                       "backward (less left exposed at its end) but pay a collective's latency "
                                       "more often; the best bucket's row is a fresh run at that size."),
        (r"data parallel|ZeRO-1", "Tokens/s on N GPUs against one GPU with the same per-GPU batch. The fraction is "
                                  "the part of the step not hidden behind compute, (t_N - t_1) / t_N: gradient "
                                  "buckets reduced on a second stream while the backward runs hide the rest. "
                                  "ZeRO-1 moves the same bytes (reduce-scatter, then all-gather)."),
        (r"loss over", "Data parallel against one GPU with the same global batch, step by step; the rate is the "
                       "largest relative difference of the loss in parts per million. Each rank averages its rows, "
                       "NCCL sums the ranks' means in its algorithm's order (ring or tree) and divides by N; one GPU sums every "
                       "row inside its GEMMs: the two agree to float32 rounding."),
        (r"tensor parallel all-reduces .*waiting", "The rest of the time in the all-reduces: the ranks' wait for "
                                                   "the slower rank to arrive, which the napkin leaves out."),
        (r"tensor parallel all-reduces", "Four all-reduces per layer of a (B T, C) activation, timed with CUDA "
                                         "events, against the napkin prediction from the all-reduce fit: none "
                                         "of it hides behind compute."),
        (r"tensor parallel step", "One forward and backward with each layer split over the GPUs (Megatron), "
                                  "against the unsplit model on one GPU with the same batch; the fraction is "
                                  "the time in all-reduces, on the critical path."),
    ],
}

# The README's table: (section, row-name pattern, size contains, anchor contains, label); the first matching row
# with a ratio is shown, else the first matching row.
HEADLINES = [
    ("step1_simple", r"axpb v3$", "256M", "", "`y = a*x + b`, `float4` loads"),
    ("step1_simple", r"gelu.*fused", "", "", "`gelu(x*w + b)` fused vs 3 kernels"),
    ("step2_attention", r"softmax_v4 \(vs torch\)", "", "", "softmax v4 (online)"),
    ("step2_attention", r"matmul_v3$", "", "", "register-tiled matmul"),
    ("step2_attention", r"flash fp32 v3$", "T1024", "torch", "flash attention, fp32"),
    ("step2_attention", r"flash tensor cores bf16", "T1024", "", "flash attention, tensor cores, bf16"),
    ("step3_fused", r"fused residual\+LN vs torch eager", "", "", "fused residual + LayerNorm"),
    ("step3_fused", r"fused sublayer vs unfused", "", "", "fused attention sublayer"),
    ("step3_fused", r"train step fused \(adamw\) vs torch", "", "", "fused training step"),
    ("step4_gpt2", r"decode b=1 \(CUDA graph\)", "", "", "GPT-2 124M decode, batch 1, CUDA graph"),
    ("step4_gpt2", r"prefill .*ours", "", "", "GPT-2 prefill"),
    ("step4_gpt2:train", r"train step, ours \(graph\) vs torch eager", "", "", "GPT training step, fp32, "
                                                                              "one CUDA graph"),
    ("step4_gpt2:megakernel", r"decode b=1 best megakernel: vs graph", "", "", "GPT-2 decode, batch 1, "
                                                                             "megakernel"),
    ("step4_gpt2:torch_ops", r"torch GPT step, course ops, CUDA graph vs torch eager", "", "", "torch GPT step on "
                                                                                           "the course's ops, TF32"),
]
STEP_LABELS = {"step1_simple": "1", "step2_attention": "2", "step3_fused": "3", "step4_gpt2": "4",
               "step4_gpt2:train": "4b", "step4_gpt2:train_bf16": "4b", "step4_gpt2:megakernel": "4c",
               "step4_gpt2:torch_ops": "4d", "step4_gpt2:parallel": "4e", "step4_gpt2:precision": "4f"}
README_BEGIN, README_END = "<!-- results -->", "<!-- /results -->"
MAX_PAGE_LINES = 300


def section_of(row: dict) -> str:
    """The page section of a row as written to the JSON: its subpackage's family, else its step."""
    step, family = row.get("step", ""), row.get("family", "")
    for key in (family, f"{step}:{family}"):
        if ":" in key and key in SECTIONS:
            return key
    return step


def note_of(section: str, name: str) -> tuple[int, str]:
    """(index of the matching pattern or -1, what limits the row)."""
    for i, (pattern, text) in enumerate(NOTES.get(section, ())):
        if re.match(pattern, name.strip()):
            return i, text
    return -1, ""


def _num(x) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def ratio_text(ratio: float | None, anchor: str) -> str:
    """'2.37× CuPy'; a ratio under 1 reads as slower: '0.76× cuBLAS (slower)'."""
    if ratio is None or not anchor:
        return ""
    shown = f"{ratio:,.0f}" if ratio >= 100 else f"{ratio:.2f}"
    return f"{shown}× {anchor}" + (" (slower)" if round(ratio, 2) < 1 else "")


def rate_text(rate: float) -> str:
    """A rate as printed: whole numbers from 1,000, one decimal from 1, two significant digits below (a
    perplexity change of 0.0022 % must not print as 0.0)."""
    if abs(rate) >= 1000:
        return f"{rate:,.0f}"
    return f"{rate:,.1f}" if abs(rate) >= 1 or rate == 0 else f"{rate:.2g}"


def cells(row: dict) -> list[str]:
    """size, median ms, rate, of ceiling, vs anchor: as printed on the page."""
    ms, rate, fraction = _num(row.get("ms")), _num(row.get("rate")), _num(row.get("fraction"))
    return [row.get("size", ""),
            "unavailable" if ms is None else f"{ms:.4f}" if ms < 100 else f"{ms:,.1f}",
            "" if rate is None else f"{rate_text(rate)} {row.get('unit', '')}",
            "" if fraction is None else f"{fraction:.1%} {row.get('ceiling', '')}",
            ratio_text(_num(row.get("ratio")), row.get("anchor", ""))]


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").strip()


def device_line(result: dict) -> str:
    d = result.get("device", {})
    l2 = f", L2 {d['l2_bytes'] / 2**20:.0f} MiB" if d.get("l2_bytes") else ""
    sm = f"sm_{d['sm']}, " if d.get("sm") else ""
    bw = result.get("copy_bandwidth_gbps")
    return (f"**{d.get('name', 'unknown GPU')}** ({sm}{d.get('multiprocessors', '?')} SMs{l2}, "
            f"CuPy {d.get('cupy_version', '?')}) on **{result.get('date', '?')}**"
            + (f"; copy bandwidth in the same run: **{bw:,.0f} GB/s** (bytes read + written)" if bw else ""))


def results_page(result: dict) -> str:
    """docs/results.md from one run's JSON: one section per step, the device, date and copy bandwidth once, every
    row's numbers, and what limits it. Rows that share a note share a line, their values one under another."""
    rows = result.get("rows", [])
    out = ["# Results", "",
           "<!-- Written by `python -m common.benchmarks --markdown docs/results.md` from one benchmark run; "
           "edit the notes in common/benchmarks.py, not this file. -->", "",
           f"Measured by `python -m common.benchmarks` on {device_line(result)}.", "",
           "Every ratio is the anchor's time divided by this row's, both timed in the same run: above 1 is "
           "faster than the anchor. A fraction is of the ceiling named beside it (copy bandwidth, the fp32 "
           "peak, or the weight-bandwidth bound of a decode step). Your GPU gives other numbers: run the command "
           "on it. Rows of one size that share what limits them share a line, their values one under another; "
           "the note stands on the first line of its rows. Terms are "
           "in the [glossary](glossary.md); what the measurements taught is in the [findings](findings/README.md).",
           ""]
    order = list(SECTIONS) + sorted({section_of(r) for r in rows} - set(SECTIONS))
    for section in order:
        mine = [r for r in rows if section_of(r) == section]
        if not mine:
            continue
        groups: dict = {}        # pattern -> size -> rows: the lines of one pattern together, a size per line
        for r in mine:
            i, text = note_of(section, r.get("name", ""))
            key = i if i >= 0 else r.get("name", "")
            groups.setdefault(key, (text, {}))[1].setdefault(r.get("size", ""), []).append(r)
        out += [f"## {SECTIONS.get(section, section)}", "",
                "| benchmark | size | median ms | rate | of ceiling | vs anchor | what limits it |",
                "|---|---|---|---|---|---|---|"]
        for text, by_size in groups.values():
            for n, members in enumerate(by_size.values()):
                columns = zip(*([_md(r.get("name", ""))] + [_md(c) for c in cells(r)] for r in members))
                out.append("| " + " | ".join("<br>".join(c) for c in columns) + f" | {_md(text) if n == 0 else ''} |")
        out.append("")
    failed = result.get("failed") or []
    if failed:
        out += ["## Not measured in this run", ""] + [f"- {_md(f)}" for f in failed] + [""]
    return "\n".join(out)


def headline(result: dict, section: str, pattern: str, size: str, anchor: str) -> dict | None:
    found = [r for r in result.get("rows", []) if section_of(r) == section
             and re.match(pattern, r.get("name", "").strip())
             and size in r.get("size", "") and anchor in r.get("anchor", "")]
    with_ratio = [r for r in found if _num(r.get("ratio")) is not None]
    return (with_ratio or found or [None])[0]


def readme_table(result: dict) -> str:
    """The README's block: the device and date once, then one line per headline row."""
    out = [f"Measured by `python -m common.benchmarks` on {device_line(result)}. Ratios are to anchors timed in "
           "the same run. Every row, and what limits it: [docs/results.md](docs/results.md).", "",
           "| step | kernel | size | measured |", "|---|---|---|---|"]
    for section, pattern, size, anchor, label in HEADLINES:
        r = headline(result, section, pattern, size, anchor)
        if r is None:
            continue
        _, ms, rate, fraction, ratio = cells(r)
        rate = rate if r.get("unit") in ("tok/s", "TFLOP/s") else ""
        shown = [c for c in (rate, fraction, ratio) if c] or [f"{ms} ms"]
        out.append(f"| {STEP_LABELS.get(section, section)} | {label} | {_md(r.get('size', ''))} | "
                   f"{_md('; '.join(shown))} |")
    return "\n".join(out)


def replace_block(text: str, block: str) -> str:
    """text with what lies between the README's results markers replaced by block."""
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        raise ValueError(f"--readme: the file has no {README_BEGIN} ... {README_END} block to replace")
    return text[:begin + len(README_BEGIN)] + "\n" + block + "\n" + text[end:]


def write_pages(result: dict, markdown: str | None, readme: str | None) -> None:
    """Write the results page and/or the README's block; the README is checked before anything is written."""
    new_readme = replace_block(Path(readme).read_text(), readme_table(result)) if readme else None
    if markdown:
        page = results_page(result)
        Path(markdown).write_text(page + "\n")
        n = page.count("\n") + 1
        print(f"wrote {markdown} ({n} lines)" + (f"; over {MAX_PAGE_LINES}: add NOTES patterns that group rows"
                                                 if n > MAX_PAGE_LINES else ""))
    if readme:
        Path(readme).write_text(new_readme)
        print(f"wrote the results table of {readme}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m common.benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", default=None, metavar="STEP[:FAMILY]",
                   help="steps or kernel families to run (default: all); --list prints the names")
    p.add_argument("--list", action="store_true", help="print the names --only accepts and exit")
    p.add_argument("--json", default="bench_results.json", help="where to write the numbers")
    p.add_argument("--from-json", metavar="FILE", default=None,
                   help="run nothing: read a run's numbers from FILE (no GPU needed) for --markdown / --readme")
    p.add_argument("--markdown", metavar="PATH", default=None,
                   help="write the results page (e.g. docs/results.md) from the run")
    p.add_argument("--readme", metavar="PATH", default=None,
                   help=f"replace the table between {README_BEGIN} and {README_END} in PATH (e.g. README.md)")
    return p


def load_result(path: str) -> dict:
    """A run's JSON as written by main(); a ValueError naming the file and what is wrong otherwise."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--from-json: cannot read {path}: {e}") from None
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        raise ValueError(f"--from-json: {path} is not a benchmark run (expected an object with a 'rows' list)")
    return result


def main(argv=None) -> int:
    sys.path.insert(0, str(ROOT))
    p = parser()
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(valid_names()))
        return 0
    if args.from_json:
        if args.only:
            p.error("--only: not with --from-json (the file holds the rows of one run)")
        if not (args.markdown or args.readme):
            p.error("--from-json: give --markdown PATH and/or --readme PATH to write")
        try:
            write_pages(load_result(args.from_json), args.markdown, args.readme)
        except ValueError as e:
            p.error(str(e))
        except OSError as e:
            p.error(f"cannot write: {e}")
        return 0
    if args.readme:
        try:
            replace_block(Path(args.readme).read_text(), "")     # checked before the run, not after it
        except (OSError, ValueError) as e:
            p.error(f"--readme: {e}" if isinstance(e, OSError) else str(e))
    try:
        jobs = select(args.only)          # names are checked before any GPU work
    except ValueError as e:
        p.error(str(e))

    from common.device import describe, device_info, require_gpu
    from common.timing import copy_bandwidth
    try:
        require_gpu()
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    print(describe(), flush=True)
    print(f"copy bandwidth (read + write): {copy_bandwidth():,.0f} GB/s", flush=True)
    rows, failed = [], []

    def save() -> dict:                   # after every family: a run cut short keeps what it measured
        result = {"device": device_info(), "date": datetime.date.today().isoformat(),
                  "copy_bandwidth_gbps": copy_bandwidth(), "rows": [r.record() for r in rows], "failed": failed}
        Path(args.json).write_text(json.dumps(result, indent=1))
        return result

    for name, module, function in jobs:
        label = module if function is None else f"{module}.{function}()"
        print(f"\n== {label}", flush=True)
        try:
            mod = importlib.import_module(module)
            new = mod.run() if function is None else getattr(mod, function)()
        except Exception as e:   # one broken module should not hide the others' numbers
            import traceback
            traceback.print_exc()
            failed.append(f"{label}: {type(e).__name__}: {e}")
            continue
        for r in new:
            r.step, r.family = module.split(".")[0], family_of(name, module, function)
        print(table(new), flush=True)
        rows += new
        save()
    print("\n" + table(rows))
    result = save()
    print(f"\nwrote {args.json}")
    write_pages(result, args.markdown, args.readme)
    if failed:
        print("FAILED: " + "; ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
