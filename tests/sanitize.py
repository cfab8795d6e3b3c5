"""Run the course's small GPU test cases under compute-sanitizer (memcheck, then racecheck).

    python tests/sanitize.py                                  # every test marked `sanitize`
    python tests/sanitize.py tests/test_step1.py              # one file
    python tests/sanitize.py --tool racecheck tests/test_step2_flash.py

Exits non-zero if the sanitizer reports any error; without a GPU it says so in one line and exits 2. Needs a GPU and compute-sanitizer, which needs no CUDA
toolkit: requirements-dev.txt installs it from PyPI (the `nvidia-cuda-sanitizer-api-cu12` wheel, 9 MB), and a
toolkit's copy (<cuda>/bin) is used when it is on PATH. See docs/debugging.md.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def find_sanitizer() -> list[str]:
    """The compute-sanitizer command: from PATH or a CUDA toolkit, else from the PyPI wheel (whose binary
    needs the wheel's lib/ folder named as its injection path, and may be unpacked without its exec bit)."""
    for c in (shutil.which("compute-sanitizer"), "/usr/local/cuda/bin/compute-sanitizer",
              "/opt/nvidia/compute-sanitizer/compute-sanitizer"):
        if c and Path(c).is_file():
            return [c]
    spec = importlib.util.find_spec("nvidia.cuda_sanitizer_api")
    for loc in (spec.submodule_search_locations if spec and spec.submodule_search_locations else []):
        exe = Path(loc) / "bin" / "compute-sanitizer"
        if exe.is_file():
            if not os.access(exe, os.X_OK):
                exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            return [str(exe), "--injection-path", str(Path(loc) / "lib")]
    raise SystemExit("compute-sanitizer not found: pip install nvidia-cuda-sanitizer-api-cu12 "
                     "(requirements-dev.txt lists it), or put a CUDA toolkit's bin/ on PATH")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tool", action="append", choices=["memcheck", "racecheck", "initcheck", "synccheck"])
    p.add_argument("tests", nargs="*", default=["tests"])
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))          # run as a script: the course may not be installed in this Python
    from common.device import require_gpu
    try:
        require_gpu()
    except RuntimeError as e:              # no GPU: nothing was sanitized, so no verdict on errors either
        print(e, file=sys.stderr)
        return 2
    sanitizer = find_sanitizer()
    failed = []
    for tool in args.tool or ["memcheck", "racecheck"]:
        cmd = [*sanitizer, "--tool", tool, "--error-exitcode", "99", "--print-limit", "20",
               "--target-processes", "all",
               sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
               "-m", "sanitize", *args.tests]
        print("$ " + " ".join(cmd), flush=True)
        r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        print(f"== {tool}: exit {r.returncode} ({'clean' if r.returncode == 0 else 'ERRORS'})", flush=True)
        if r.returncode != 0:
            failed.append(tool)
    print("compute-sanitizer summary: " + ("0 errors" if not failed else "errors under " + ", ".join(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
