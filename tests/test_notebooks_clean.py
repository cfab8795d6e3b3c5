"""Notebooks are stored clean: valid nbformat, no outputs, execution_count null, no volatile metadata."""
import json

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
def test_finds_common_from_any_folder(path):
    """The first code cell locates the repository from the notebook's folder upwards."""
    nb = json.loads(path.read_text())
    first = next(c for c in nb["cells"] if c["cell_type"] == "code")
    assert "common" in "".join(first["source"]) and "sys.path" in "".join(first["source"])
