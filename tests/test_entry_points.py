"""Every command-line entry point of the course answers `--help` on any machine, a GPU or none: it exits 0, prints
its usage, and writes nothing -- not in the folder it runs from, not in the repository. On a machine without a
GPU, asked for GPU work, it prints the course's one-line message (common.require_gpu's) and exits non-zero, with
no traceback and nothing written.

The entry points are found, not listed: every `python -m` module under common/ and step*/ (a module with
`if __name__ == "__main__":`, or a package with a `__main__.py`), and the scripts under tests/ that have one
(tests/sanitize.py)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common.kernels import ROOT

MAIN = re.compile(r"""^if __name__ == ["']__main__["']:""", re.M)
# The learner's output folders (.gitignore) are skipped too: the exercise and training tests write there, and under
# pytest -n they may do so while an entry point runs.
SKIP_DIRS = {"__pycache__", ".ipynb_checkpoints", "my_exercises", "runs"}
TIMEOUT_S = 180          # the slowest import (torch, transformers) on a loaded CPU machine, with room to spare


def entry_points(root: Path = ROOT) -> list[tuple[str, ...]]:
    """The command lines (without --help) of every entry point under root."""
    found = []
    for top in ["common", *sorted(p.name for p in root.glob("step*") if p.is_dir())]:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            if SKIP_DIRS & set(rel.parts):
                continue
            module = ".".join(rel.with_suffix("").parts)
            if path.name == "__main__.py":
                found.append(("-m", module.removesuffix(".__main__")))
            elif MAIN.search(path.read_text(encoding="utf-8", errors="replace")):
                found.append(("-m", module))
    for path in sorted((root / "tests").glob("*.py")):
        if not path.name.startswith("test_") and MAIN.search(path.read_text(encoding="utf-8")):
            found.append((path.relative_to(root).as_posix(),))
    return found


def _files(root: Path) -> set[str]:
    """Every file under root, except git's and Python's own (bytecode, the virtual environment, build metadata)."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")
                       and not (d.startswith(".") and d != ".ci")]
        out.update(os.path.join(dirpath, f) for f in filenames)
    return out


ENTRY_POINTS = entry_points()
# Entry points that need no GPU for what they do (they write files: never run here without --help) ...
NO_GPU_WORK = {("-m", "common.diagrams"), ("-m", "common.notebooks")}
# ... and the arguments that ask the others for GPU work, where running with none does not.
GPU_WORK_ARGS = {("-m", "step4_gpt2"): ["Hello"]}


def _run(cmd, args, tmp_path):
    """Run one entry point in an empty folder; returns the result, a printable account, and what it wrote."""
    work = tmp_path / "cwd"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "Agg"}
    argv = [sys.executable, *(c if c.startswith("-") or i else str(ROOT / c) for i, c in enumerate(cmd)), *args]
    before = _files(ROOT)
    r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    shown = f"$ {' '.join(argv)}\n--- stdout\n{r.stdout[-2000:]}\n--- stderr\n{r.stderr[-3000:]}"
    wrote = sorted(p.relative_to(work).as_posix() for p in work.rglob("*"))
    wrote += sorted(os.path.relpath(p, ROOT) for p in _files(ROOT) - before)
    return r, shown, wrote


def test_entry_points_are_found():
    names = {" ".join(e) for e in ENTRY_POINTS}
    assert {"-m common.render", "-m common.diagrams", "-m common.benchmarks", "tests/sanitize.py"} <= names, names
    assert any(n.startswith("-m step4_gpt2") for n in names), names


@pytest.mark.parametrize("cmd", ENTRY_POINTS, ids=lambda c: "python " + " ".join(c))
def test_help_exits_0_prints_usage_and_writes_nothing(cmd, tmp_path):
    r, shown, wrote = _run(cmd, ["--help"], tmp_path)
    assert r.returncode == 0, shown
    assert "usage:" in r.stdout.lower(), shown
    assert wrote == [], f"--help wrote {wrote}\n{shown}"


@pytest.mark.parametrize("cmd", [c for c in ENTRY_POINTS if c not in NO_GPU_WORK],
                         ids=lambda c: "python " + " ".join(c))
def test_without_a_gpu_one_line_says_so(cmd, tmp_path):
    from common.device import require_gpu
    try:
        require_gpu()
    except RuntimeError as e:
        message = str(e)
    else:
        pytest.skip("needs a machine without a GPU (here it would do the GPU work)")
    r, shown, wrote = _run(cmd, GPU_WORK_ARGS.get(cmd, []), tmp_path)
    assert r.returncode != 0, shown
    assert "Traceback" not in r.stderr, f"a traceback instead of the course's message\n{shown}"
    assert r.stderr.strip() == message, f"expected stderr to be the one line:\n{message}\n{shown}"
    assert wrote == [], f"wrote {wrote} before refusing\n{shown}"
