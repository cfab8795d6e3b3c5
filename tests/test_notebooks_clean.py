"""Notebooks are stored clean: valid nbformat, no outputs, execution_count null, no volatile metadata."""
import json
import re
import subprocess

import nbformat
import pytest

from common.kernels import ROOT

NOTEBOOKS = sorted(p for p in ROOT.glob("step*/*.ipynb") if ".ipynb_checkpoints" not in p.parts)
ALLOWED_NB_METADATA = {"kernelspec", "language_info"}
ALLOWED_CELL_METADATA = {"tags"}


def test_every_step_has_a_notebook():
    steps = {p.parent.name for p in NOTEBOOKS}
    assert "step1_simple" in steps, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_stored_clean(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert set(nb.metadata) <= ALLOWED_NB_METADATA, f"volatile notebook metadata: {set(nb.metadata) - ALLOWED_NB_METADATA}"
    assert set(nb.metadata.get("language_info", {})) <= {"name"}, "language_info carries versions; keep only name"
    for i, cell in enumerate(nb.cells):
        assert set(cell.metadata) <= ALLOWED_CELL_METADATA, f"cell {i}: volatile metadata {set(cell.metadata)}"
        if cell.cell_type == "code":
            assert cell.outputs == [], f"cell {i} has stored outputs"
            assert cell.execution_count is None, f"cell {i} has execution_count {cell.execution_count}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_first_cell_imports_the_installed_course(path):
    """The first code cell imports the course installed with `pip install -e .` (tests/test_install.py runs
    that cell from another folder) and says what to run when it is missing; no walking up from the cwd."""
    from tests.test_install import FIRST_CELL
    nb = json.loads(path.read_text())
    first = "".join(next(c for c in nb["cells"] if c["cell_type"] == "code")["source"])
    assert first.startswith(FIRST_CELL.rstrip("\n")), f"first code cell:\n{first}\n--- expected it to start with:\n{FIRST_CELL}"
    assert "sys.path" not in first


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
