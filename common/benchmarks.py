"""The course's benchmark table: `python -m common.benchmarks [--only step1_simple ...] [--json FILE]`.

Each step folder has one or more `benchmarks*.py` modules with `run() -> list[Row]`. Every row carries its anchor, measured
in the same run (copy bandwidth, cuBLAS, CuPy, torch when installed), and the issue's target if it has one.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("step1_simple", "step2_attention", "step3_fused", "step4_gpt2")


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
    target: str = ""                 # the target, e.g. "fraction >= 0.92"
    met: bool | None = None
    step: str = ""                   # filled in by the runner: which step folder the row comes from

    @classmethod
    def of(cls, t, size: str, ceiling: tuple | None = None, anchor: tuple | None = None,
           target: tuple | None = None) -> "Row":
        """From a common.timing.Timing. ceiling=(label, rate in the row's unit); anchor=(label, Timing);
        target=("fraction" or "ratio", minimum)."""
        rate, unit = (t.gbps, "GB/s") if t.bytes is not None else (t.tflops, "TFLOP/s") if t.flops else (None, "")
        row = cls(t.name, size, t.median_ms, rate, unit)
        if ceiling and rate is not None:
            row.ceiling, row.fraction = ceiling[0], rate / ceiling[1]
        if anchor:
            row.anchor, row.ratio = anchor[0], anchor[1].median_ms / t.median_ms
        if target:
            row.check(*target)
        return row

    def check(self, what: str, minimum: float) -> "Row":
        value = getattr(self, what)
        self.target, self.met = f"{what} >= {minimum:g}", value is not None and value >= minimum
        return self


def table(rows: list[Row]) -> str:
    head = f"| {'benchmark':38s} | {'size':16s} | {'median ms':>10s} | {'rate':>16s} | {'of ceiling':>16s} | {'vs anchor':>22s} | target |"
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:
        rate = f"{r.rate:,.1f} {r.unit}" if r.rate is not None else ""
        frac = f"{r.fraction:.1%} {r.ceiling}" if r.fraction is not None else ""
        anc = f"{r.ratio:.2f}x {r.anchor}" if r.ratio is not None else ""
        tgt = "" if r.met is None else ("met" if r.met else "MISSED") + f" ({r.target})"
        lines.append(f"| {r.name:38s} | {r.size:16s} | {r.ms:10.4f} | {rate:>16s} | {frac:>16s} | {anc:>22s} | {tgt} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    sys.path.insert(0, str(ROOT))
    from common.device import describe, device_info, require_gpu
    from common.timing import copy_bandwidth

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", default=None, help="step folders to run (default: all)")
    p.add_argument("--json", default="bench_results.json", help="where to write the numbers")
    args = p.parse_args(argv)
    require_gpu()
    print(describe(), flush=True)
    print(f"copy bandwidth (read + write): {copy_bandwidth():,.0f} GB/s", flush=True)
    rows, failed = [], []
    modules = [f"{step}.{p.stem}" for step in (args.only or STEPS) for p in sorted((ROOT / step).glob("benchmarks*.py"))]
    for name in modules:
        print(f"\n== {name}", flush=True)
        try:
            new = importlib.import_module(name).run()
        except Exception as e:   # one broken module should not hide the others' numbers
            import traceback
            traceback.print_exc()
            failed.append(f"{name}: {type(e).__name__}: {e}")
            continue
        for r in new:
            r.step = name.split(".")[0]
        print(table(new), flush=True)
        rows += new
    print("\n" + table(rows))
    result = {"device": device_info(), "date": datetime.date.today().isoformat(),
              "copy_bandwidth_gbps": copy_bandwidth(), "rows": [asdict(r) for r in rows], "failed": failed}
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.json}")
    if failed:
        print("FAILED: " + "; ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
