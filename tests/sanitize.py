"""Run the course's small GPU test cases under compute-sanitizer (memcheck, then racecheck).

    python tests/sanitize.py                                  # every test marked `sanitize`
    python tests/sanitize.py tests/test_step1.py              # one file
    python tests/sanitize.py --tool racecheck tests/test_step2_flash.py

Exits non-zero if the sanitizer reports any error; without a GPU it says so in one line and exits 2. Needs a GPU and compute-sanitizer, which needs no CUDA
toolkit: requirements-dev.txt installs it from PyPI (the `nvidia-cuda-sanitizer-api-cu12` wheel, 9 MB), and a
toolkit's copy (<cuda>/bin) is used when it is on PATH. See docs/debugging.md. One exercise's check under the
sanitizer, from a notebook: `common.sanitize.sanitize` (the same `find_sanitizer`).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:          # run as a script: the course may not be installed in this Python
    sys.path.insert(0, str(ROOT))

from common.sanitize import TOOLS, find_sanitizer, sanitizer_command  # noqa: E402  (one way: common/sanitize.py)

__all__ = ["find_sanitizer", "main"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tool", action="append", choices=TOOLS)
    p.add_argument("tests", nargs="*", default=["tests"])
    args = p.parse_args()
    from common.device import require_gpu
    try:
        require_gpu()
    except RuntimeError as e:              # no GPU: nothing was sanitized, so no verdict on errors either
        print(e, file=sys.stderr)
        return 2
    failed = []
    for tool in args.tool or ["memcheck", "racecheck"]:
        cmd = sanitizer_command(tool, [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
                                       "-m", "sanitize", *args.tests], extra=("--target-processes", "all"))
        print("$ " + " ".join(cmd), flush=True)
        r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        print(f"== {tool}: exit {r.returncode} ({'clean' if r.returncode == 0 else 'ERRORS'})", flush=True)
        if r.returncode != 0:
            failed.append(tool)
    print("compute-sanitizer summary: " + ("0 errors" if not failed else "errors under " + ", ".join(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
