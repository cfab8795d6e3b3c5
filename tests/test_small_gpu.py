"""Small GPUs and cloud notebooks (CPU only): `pytest --gpu-memory-gib N` caps CuPy's memory pool in pytest's
process and in every process it starts (the notebooks' kernels), and every notebook has an "open in Colab" link
that names one repository, the same one the set-up commands clone (docs/environment.md, docs/colab.md)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import conftest as course_conftest
from common.render import course_notebooks

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = tuple(p.relative_to(ROOT).as_posix() for p in course_notebooks(ROOT))
COLAB = re.compile(r"https://colab\.research\.google\.com/github/([\w.-]+/[\w.-]+)/blob/main/(\S+?\.ipynb)\)")
CLONE = re.compile(r"https://github\.com/([\w.-]+/[\w.-]+?)(?:\.git)?\s")
GIB = 2**30


def test_cap_values_read_as_cupy_reads_them():
    cap = course_conftest.cap_bytes
    assert cap("6442450944", None) == 6 * GIB
    assert cap(" 1024 ", 80 * GIB) == 1024
    assert cap("25%", 16 * GIB) == 4 * GIB
    assert cap("25%", None) is None                       # a share of a GPU that is not there: nothing to cap
    assert cap("", 16 * GIB) is None and cap("0", 16 * GIB) is None and cap("0%", 16 * GIB) is None
    for bad in ("6G", "-5", "150%", "abc", "x%", "nan%"):
        with pytest.raises(ValueError, match="CUPY_GPU_MEMORY_LIMIT"):
            cap(bad, 16 * GIB)


def test_torch_gets_the_same_cap_as_a_fraction():
    assert course_conftest.torch_fraction(6 * GIB, 80 * GIB) == pytest.approx(0.075)
    assert course_conftest.torch_fraction(6 * GIB, 4 * GIB) == 1.0        # a cap above the GPU's memory: no cap


def test_option_sets_cupys_variable():
    assert course_conftest.cap_environment(6) == {"CUPY_GPU_MEMORY_LIMIT": str(6 * GIB)}
    assert course_conftest.cap_environment(0.5) == {"CUPY_GPU_MEMORY_LIMIT": str(GIB // 2)}
    for bad in (0, -1):
        with pytest.raises(pytest.UsageError, match="greater than 0"):
            course_conftest.cap_environment(bad)


PROBE = '''
import os, subprocess, sys

def test_a_child_process_inherits_the_cap():
    """What nbval does for a notebook: start a new Python process with pytest's environment."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('CUPY_GPU_MEMORY_LIMIT'))"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == os.environ["COURSE_WANT_LIMIT"]
'''


def _pytest_with_course_conftest(tmp_path, *args):
    """pytest on a probe test outside the course, with the course's conftest.py loaded as a plugin."""
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("CUPY_GPU_MEMORY_LIMIT", None)
    env["COURSE_WANT_LIMIT"] = str(6 * GIB)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py"), *args],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)


def test_the_cap_reaches_the_processes_pytest_starts(tmp_path):
    run = _pytest_with_course_conftest(tmp_path, "--gpu-memory-gib", "6")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 passed" in run.stdout
    assert "GPU memory cap:" in run.stdout and str(6 * GIB) in run.stdout      # said in the report's header


def test_a_bad_cap_is_a_usage_error(tmp_path):
    run = _pytest_with_course_conftest(tmp_path, "--gpu-memory-gib", "0")
    assert run.returncode == 4, run.stdout[-3000:] + run.stderr[-3000:]       # pytest's exit code for usage errors
    assert "--gpu-memory-gib" in run.stderr and "greater than 0" in run.stderr


def _colab_links(text: str) -> list[tuple[str, str]]:
    return COLAB.findall(text)


def test_every_notebook_opens_in_colab_from_one_repository():
    """The README's learning path links every notebook to Colab, on its own row; all links name one
    repository, the one the README's `git clone` and docs/colab.md's install cell fetch (a fork changes it in
    one find-and-replace)."""
    readme = (ROOT / "README.md").read_text()
    rows = [line for line in readme.splitlines() if re.match(r"\| \d+ \| ", line) and ".ipynb" in line]
    linked = {}
    for row in rows:
        links = _colab_links(row)
        assert len(links) == 1, f"a learning-path row without exactly one Colab link: {row[:100]}"
        repo, path = links[0]
        assert f"[`{path}`]({path})" in row, f"the Colab link opens {path}, another notebook than its row's"
        linked[path] = repo
    assert sorted(linked) == sorted(NOTEBOOKS), f"notebooks without a Colab link: {set(NOTEBOOKS) - set(linked)}"
    repos = set(linked.values())
    assert len(repos) == 1, f"Colab links name several repositories: {repos}"
    clones = CLONE.findall(readme) + CLONE.findall((ROOT / "docs" / "colab.md").read_text())
    assert clones and set(clones) == repos, f"git clone fetches {set(clones)}, the Colab links open {repos}"
