"""Notebooks are stored clean: what git holds (the index, which is what CI's clone and the next commit see) is
valid nbformat in the stored form of common/notebooks.py -- JupyterLab's kernelspec and language_info without the
Python version, no outputs, execution_count null, no volatile metadata. A learner's working copy is never checked:
opening or running a notebook changes the file on disk, not what git holds. Contributors keep it that way with
nbstripout as git's filter (CONTRIBUTING.md); `python -m common.notebooks` puts every notebook in its stored form."""
import json
import re
import subprocess
import sys

import nbformat
import pytest

from common import notebooks
from common.kernels import ROOT

FIX = "run `python -m common.notebooks` and stage the result (CONTRIBUTING.md: the nbstripout filter does it for you)"


def _committed() -> tuple[dict[str, str], str | None]:
    """{path: text} of every notebook in git's index under step*/, or ({}, why not) outside a git checkout."""
    try:
        r = subprocess.run(["git", "ls-files", "-s", "-z", "--", "*.ipynb"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    except FileNotFoundError:
        return {}, "git is not installed: the hygiene check reads the notebooks git holds"
    if r.returncode != 0:
        return {}, f"not a git checkout ({r.stderr.strip()[:120]}): the hygiene check reads the notebooks git holds"
    blobs = {}
    for entry in filter(None, r.stdout.split("\0")):
        info, path = entry.split("\t", 1)
        if path.startswith("step") and ".ipynb_checkpoints" not in path:
            blob = subprocess.run(["git", "cat-file", "blob", info.split()[1]], cwd=ROOT, capture_output=True,
                                  timeout=60, check=True).stdout
            blobs[path] = blob.decode("utf-8")
    return blobs, None


COMMITTED, WHY_NOT = _committed()
NOTEBOOKS = sorted(COMMITTED) or [pytest.param(None, marks=pytest.mark.skip(reason=WHY_NOT or "no notebooks"))]


def test_every_step_has_a_notebook():
    if WHY_NOT:
        pytest.skip(WHY_NOT)
    steps = {p.split("/")[0] for p in COMMITTED}
    assert "step1_simple" in steps, sorted(COMMITTED)
    on_disk = {p.name for p in ROOT.glob("step*") if (p / "__init__.py").is_file()}
    assert on_disk <= steps, f"steps without a notebook in git: {sorted(on_disk - steps)}"


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_stored_clean(path):
    nb = nbformat.reads(COMMITTED[path], as_version=4)
    nbformat.validate(nb)
    found = notebooks.problems(nb)
    assert not found, f"{path} as git holds it:\n  " + "\n  ".join(found) + f"\n{FIX}"
    assert COMMITTED[path] == nbformat.writes(nb) + "\n", f"{path} is not laid out as JupyterLab writes it: {FIX}"


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_first_cell_imports_the_installed_course(path):
    """The first code cell imports the course installed with `pip install -e .` (tests/test_install.py runs
    that cell from another folder) and says what to run when it is missing; no walking up from the cwd."""
    from tests.test_install import FIRST_CELL
    nb = json.loads(COMMITTED[path])
    first = "".join(next(c for c in nb["cells"] if c["cell_type"] == "code")["source"])
    assert first.startswith(FIRST_CELL.rstrip("\n")), f"first code cell:\n{first}\n--- expected it to start with:\n{FIRST_CELL}"
    assert "sys.path" not in first


def _opened_and_run(text: str) -> dict:
    """The notebook as JupyterLab saves it after opening it and running every cell on some machine."""
    nb = json.loads(text)
    nb["metadata"]["language_info"] = {**notebooks.LANGUAGE_INFO, "version": "3.12.9"}
    nb["metadata"]["kernelspec"] = dict(notebooks.KERNELSPEC)
    nb["metadata"]["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    for n, cell in enumerate(nb["cells"], 1):
        if cell["cell_type"] == "code":
            cell["execution_count"] = n
            cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["42\n"]},
                               {"output_type": "execute_result", "execution_count": n, "metadata": {},
                                "data": {"text/plain": ["42"]}}]
            cell["metadata"].update({"ExecuteTime": {"end_time": "now"}, "scrolled": True, "collapsed": False})
        else:
            cell["metadata"]["jp-MarkdownHeadingCollapsed"] = True
    return nb


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_opening_and_running_changes_nothing_git_stores(path, tmp_path):
    """What JupyterLab saves after opening and running a notebook goes back to the stored form byte for byte,
    through the git filter (nbstripout with the course's options) and through `python -m common.notebooks`."""
    stored = COMMITTED[path]
    if notebooks.problems(json.loads(stored)):
        pytest.skip(f"{path} is not in its stored form (test_stored_clean says why)")
    opened = tmp_path / "opened.ipynb"
    opened.write_text(json.dumps(_opened_and_run(stored), indent=2), encoding="utf-8")
    assert nbformat.writes(notebooks.stored_form(nbformat.read(opened, as_version=4))) + "\n" == stored
    pytest.importorskip("nbstripout", reason="the git filter's nbstripout is in requirements-dev.txt")
    r = subprocess.run([sys.executable, "-m", "nbstripout", *notebooks.NBSTRIPOUT_ARGS, "-t", str(opened)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == stored, "nbstripout with common.notebooks.NBSTRIPOUT_ARGS does not give the stored form"


def test_gitattributes_names_the_notebook_filter():
    if WHY_NOT:
        pytest.skip(WHY_NOT)
    r = subprocess.run(["git", "check-attr", "filter", "diff", "--", "step1_simple/01a_elementwise.ipynb"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert "filter: nbstripout" in r.stdout and "diff: ipynb" in r.stdout, r.stdout + r.stderr


# Words that speak of how the course was made rather than of the course, and verdicts against targets tuned
# for one GPU: learner-facing text (notebooks, docs, README, code and its comments) never shows them.
FORBIDDEN = [re.compile(w, re.I) for w in (r"the seed of this course", r"the seed's", r"issue's target",
                                           r"issues' targets")] + [re.compile(r"\bMISSED\b")]


def _learner_facing() -> list:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True)
    files = ([ROOT / f for f in listed.stdout.splitlines()] if listed.returncode == 0
             else [p for p in ROOT.rglob("*") if ".venv" not in p.parts])
    keep = []
    for p in files:
        rel = p.relative_to(ROOT)
        if not p.is_file() or rel.parts[0] in ("tests", ".ci") or p.name == "CONTRIBUTING.md":
            continue
        if p.suffix in (".ipynb", ".md", ".py", ".cu", ".cuh") or p.name == "README.md":
            keep.append(p)
    return sorted(keep)


def test_learner_facing_words():
    files = _learner_facing()
    assert any(p.name == "README.md" for p in files) and any(p.suffix == ".ipynb" for p in files)
    hits = []
    for p in files:
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            for w in FORBIDDEN:
                if w.search(line):
                    hits.append(f"{p.relative_to(ROOT)}:{n}: {w.pattern!r}: {line.strip()[:120]}")
    assert not hits, f"{len(hits)} forbidden phrases in learner-facing files:\n" + "\n".join(hits)
