"""The course's benchmark table: every kernel against its ceiling and its anchor, measured in one run.

    python -m common.benchmarks                                # every step
    python -m common.benchmarks --only step1_simple            # one step
    python -m common.benchmarks --only step2_attention:flash   # one kernel family
    python -m common.benchmarks --list                         # the names --only accepts (no GPU needed)

Each step folder has one or more `benchmarks*.py` modules with `run() -> list[Row]`. A kernel family, the
`FAMILY` in `--only STEP:FAMILY`, is either
  - a benchmark module `benchmarks_FAMILY.py` (step2_attention:flash runs step2_attention/benchmarks_flash.py), or
  - a function `FAMILY_rows()` that takes no arguments, in any of the step's benchmark modules
    (step2_attention:softmax runs softmax_rows() of step2_attention/benchmarks.py).
Every row carries its anchor, timed in the same run: copy bandwidth, cuBLAS, CuPy, or torch when installed.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import importlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = tuple(sorted(p.name for p in ROOT.glob("step*") if p.is_dir() and any(p.glob("benchmarks*.py"))))


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

    def check(self, what: str, reference: float) -> "Row":
        """Record a reference value for `fraction` or `ratio` (JSON only; the table shows measured values)."""
        if what not in ("fraction", "ratio"):
            raise ValueError(f"what: expected 'fraction' or 'ratio', got {what!r}")
        self.target = f"{what} >= {reference:g}"
        return self

    def record(self) -> dict:
        """The row as written to the JSON file."""
        return asdict(self)


def table(rows: list[Row]) -> str:
    head = (f"| {'benchmark':38s} | {'size':16s} | {'median ms':>10s} | {'rate':>16s} | {'of ceiling':>16s} "
            f"| {'vs anchor':>22s} |")
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:
        rate = f"{r.rate:,.1f} {r.unit}" if r.rate is not None else ""
        frac = f"{r.fraction:.1%} {r.ceiling}" if r.fraction is not None else ""
        anc = f"{r.ratio:.2f}x {r.anchor}" if r.ratio is not None else ""
        lines.append(f"| {r.name:38s} | {r.size:16s} | {r.ms:10.4f} | {rate:>16s} | {frac:>16s} | {anc:>22s} |")
    return "\n".join(lines)


def _takes_no_arguments(fn: ast.FunctionDef) -> bool:
    a = fn.args
    return len(a.posonlyargs) + len(a.args) == len(a.defaults) and all(d is not None for d in a.kw_defaults)


def families(step: str) -> dict[str, list[tuple[str, str | None]]]:
    """The kernel families of one step: name -> [(module, function)], function None meaning the module's run().
    Read from the source (not imported), so names are checked before any GPU work, on any machine."""
    found: dict[str, list] = {}
    for path in sorted((ROOT / step).glob("benchmarks*.py")):
        module = f"{step}.{path.stem}"
        if path.stem.startswith("benchmarks_"):
            found.setdefault(path.stem.removeprefix("benchmarks_"), []).append((module, None))
        for node in ast.parse(path.read_text(), str(path)).body:
            if (isinstance(node, ast.FunctionDef) and node.name.endswith("_rows") and not node.name.startswith("_")
                    and _takes_no_arguments(node)):
                found.setdefault(node.name.removesuffix("_rows"), []).append((module, node.name))
    return found


def valid_names() -> list[str]:
    return [n for step in STEPS for n in (step, *(f"{step}:{f}" for f in sorted(families(step))))]


def select(only: list[str] | None) -> list[tuple[str, str, str | None]]:
    """(--only name, module, function) to run, in order; a ValueError naming the valid names otherwise."""
    jobs: list = []
    for name in only or STEPS:
        step, _, family = name.partition(":")
        if step not in STEPS or (family and family not in families(step)):
            raise ValueError(f"--only: unknown name {name!r}; valid names are: {', '.join(valid_names())}")
        if family:
            jobs += [(name, m, f) for m, f in families(step)[family]]
        else:
            jobs += [(name, f"{step}.{p.stem}", None) for p in sorted((ROOT / step).glob("benchmarks*.py"))]
    whole = {m for _, m, f in jobs if f is None}
    seen, out = set(), []
    for job in jobs:           # a function whose whole module runs anyway is not run twice
        if (job[1], job[2]) in seen or (job[2] is not None and job[1] in whole):
            continue
        seen.add((job[1], job[2]))
        out.append(job)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m common.benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", default=None, metavar="STEP[:FAMILY]",
                   help="steps or kernel families to run (default: all); --list prints the names")
    p.add_argument("--list", action="store_true", help="print the names --only accepts and exit")
    p.add_argument("--json", default="bench_results.json", help="where to write the numbers")
    return p


def main(argv=None) -> int:
    sys.path.insert(0, str(ROOT))
    p = parser()
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(valid_names()))
        return 0
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
            r.step = module.split(".")[0]
            r.family = name if ":" in name else module.split(".")[1].removeprefix("benchmarks").lstrip("_") or r.step
        print(table(new), flush=True)
        rows += new
    print("\n" + table(rows))
    result = {"device": device_info(), "date": datetime.date.today().isoformat(),
              "copy_bandwidth_gbps": copy_bandwidth(), "rows": [r.record() for r in rows], "failed": failed}
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.json}")
    if failed:
        print("FAILED: " + "; ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
