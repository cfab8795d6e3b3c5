"""Installing the course: the pins resolve together, `pip install -e .` ships every package and its `.cu`
files, and a notebook's first cell imports the course from any folder."""
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib

import pytest

from common.kernels import ROOT

# The first code cell of every notebook (docs/environment.md explains it).
FIRST_CELL = '''\
try:
    import common
except ModuleNotFoundError as e:
    raise ModuleNotFoundError("the course is not installed in this Python: run `pip install -e .` in the course "
                              "folder (the one with pyproject.toml), then restart the kernel") from e
'''


def _requirements(name: str) -> dict[str, str]:
    """Package name -> its specifier, from a requirements file (comments and -r lines skipped)."""
    out = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            m = re.match(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)", line)
            out[m[1].lower()] = (m[2] or "") + m[3]
    return out


def test_pins_keep_one_cuda_major():
    """CuPy's CUDA 12 build and the CUDA 12 wheels it loads; nothing that pins CUDA 13 pieces next to them
    (cuda-bindings 12 pins were what made pip backtrack through torch releases built for CUDA 13)."""
    req = _requirements("requirements.txt")
    assert "cupy-cuda12x" in req and req["cupy-cuda12x"].startswith(">=14")
    assert "[ctk]" not in req["cupy-cuda12x"], "the [ctk] extra brings 1 GB of libraries the course does not use"
    for piece in ("nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12", "nvidia-cublas-cu12"):
        assert req.get(piece) == "==12.*", piece
    assert "nvidia-curand-cu12" in req
    assert req.get("nvidia-nccl-cu12", "").startswith(">=2.18"), "lesson 4e: the NCCL wheel CuPy's CUDA 12 build loads"
    assert "cuda-bindings" not in req, "compile_offline uses CuPy's NVRTC; cuda-bindings would pin a CUDA major"
    assert "ipywidgets" in req, "tqdm's notebook progress bar needs ipywidgets"
    dev = _requirements("requirements-dev.txt")
    assert "-r requirements.txt" in (ROOT / "requirements-dev.txt").read_text()
    assert {"pytest", "nbval", "torch", "transformers", "nvidia-cuda-sanitizer-api-cu12"} <= set(dev)
    assert not re.search(r"<\s*2\.1[1-9]|<\s*3", dev["torch"]), "a torch cap would fight the torch already installed"


def test_pyproject_installs_the_requirements_and_every_package():
    from setuptools import find_namespace_packages
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["dynamic"]["dependencies"]["file"] == ["requirements.txt"]
    find = project["tool"]["setuptools"]["packages"]["find"]
    packages = set(find_namespace_packages(str(ROOT), include=find["include"], exclude=find["exclude"]))
    steps = {p.name for p in ROOT.glob("step*") if (p / "__init__.py").is_file()}
    assert {"common", "common.reference", *steps} <= packages, packages
    assert not any(p.startswith(("tests", "docs")) or "__pycache__" in p for p in packages), packages
    assert "*.cu" in project["tool"]["setuptools"]["package-data"]["*"]
    # every folder of a step that holds Python or CUDA (subpackages such as step4_gpt2/train/, lab/ folders,
    # exercises/) is a package, so its .py and .cu files ship
    folders = {".".join(d.relative_to(ROOT).parts) for p in ROOT.glob("step*/**/*") if p.suffix in (".py", ".cu", ".cuh")
               for d in [p.parent] if not {"__pycache__", ".ipynb_checkpoints"} & set(d.parts)}
    assert folders <= packages, f"folders that would not ship: {sorted(folders - packages)}"


def _installed() -> bool:
    """Is the course installed in this Python (not merely its metadata folder, which pip writes into the
    checkout when it prepares an editable install)?"""
    from pathlib import Path
    paths = [p for p in sys.path if p and Path(p).resolve() != ROOT]
    return any(d.metadata["Name"] == "fused-cuda-course" for d in importlib.metadata.distributions(path=paths))


def test_first_cell_from_another_folder(tmp_path):
    """Run the notebooks' first cell where the course is not the current folder (as Jupyter started from
    $HOME would): with the course installed it imports the checkout's `common`; without, it says what to run."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = FIRST_CELL + "print(common.__file__)\n"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    if _installed():
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == str(ROOT / "common" / "__init__.py")
    else:
        assert r.returncode == 1 and "run `pip install -e .` in the course folder" in r.stderr, r.stderr
        assert "StopIteration" not in r.stderr


def test_dependencies_resolve_in_one_pass_with_what_is_installed():
    """`pip install --dry-run -e . -r requirements-dev.txt` in this environment: the resolver finds a solution
    that keeps every installed package (CI's torch first, then the course, as docs/environment.md says)."""
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-",
                        "--no-build-isolation", "-e", ".", "-r", "requirements-dev.txt"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and re.search(r"Network is unreachable|Failed to establish|No matching distribution "
                                       r"found for setuptools|Could not fetch", r.stderr):
        pytest.skip(f"no package index reachable: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    report = json.loads(r.stdout)
    changed = sorted(i["metadata"]["name"] for i in report["install"]
                     if i["metadata"]["name"].lower() != "fused-cuda-course")
    assert changed == [], f"the requirements would change installed packages: {changed}"


def test_compute_sanitizer_runs_without_a_toolkit():
    """tests/sanitize.py finds compute-sanitizer (the PyPI wheel's, or a toolkit's) and it runs here; checking
    a program needs a GPU, printing its version does not."""
    sys.path.insert(0, str(ROOT / "tests"))
    from sanitize import find_sanitizer
    cmd = find_sanitizer()
    r = subprocess.run([cmd[0], "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Compute Sanitizer" in r.stdout, r.stdout + r.stderr
