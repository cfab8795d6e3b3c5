"""The course's diagrams and the rendered-run exporter work without a GPU."""

from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

from common import diagrams, render  # noqa: E402


@pytest.mark.parametrize("fn", diagrams.ALL, ids=lambda f: f.__name__)
def test_every_diagram_draws(fn):
    from matplotlib.figure import Figure
    fig = fn()
    assert isinstance(fig, Figure) and fig.axes, f"{fn.__name__} drew nothing"


def test_save_all_writes_one_png_each(tmp_path):
    paths = diagrams.save_all(tmp_path)
    assert len(paths) == len(diagrams.ALL)
    for p in paths:
        assert p.stat().st_size > 1000 and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _notebook(path, cells):
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# tiny"), *(nbformat.v4.new_code_cell(c) for c in cells)]
    nbformat.write(nb, path)
    return path.read_bytes()


def test_render_exports_outputs_and_plots_without_touching_the_notebook(tmp_path):
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = tmp_path / "01_tiny.ipynb"
    before = _notebook(nb, ["print(6 * 7)",
                            "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2]); plt.show()"])
    out = tmp_path / "rendered"
    assert render.main([str(nb), "--out", str(out), "--timeout", "120"]) == 0
    page = out / "01_tiny" / "01_tiny.md"
    text = page.read_text()
    assert "42" in text and "device" in text.lower()
    assert list((out / "01_tiny").glob("*.png")), "the plot was not exported"
    assert "01_tiny" in (out / "README.md").read_text()
    assert nb.read_bytes() == before, "render wrote into the notebook"


def test_render_reports_a_failing_notebook(tmp_path):
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = tmp_path / "02_fails.ipynb"
    _notebook(nb, ["raise ValueError('planted')"])
    assert render.main([str(nb), "--out", str(tmp_path / "r"), "--timeout", "60"]) == 1
    assert "planted" in (tmp_path / "r" / "02_fails" / "02_fails.md").read_text()


def test_rendered_pages_keep_the_notebooks_links_working():
    step, page = render.ROOT / "step1_simple", render.ROOT / "docs" / "rendered" / "01_elementwise"
    md = ("[glossary](../docs/glossary.md#warp), [web](https://example.org/a.md), [here](#top), "
          "![diagram](pic.png) and [the kernel](axpb.cu)")
    got = render.relink(md, step, page)
    assert got == ("[glossary](../../glossary.md#warp), [web](https://example.org/a.md), [here](#top), "
                   "![diagram](../../../step1_simple/pic.png) and [the kernel](../../../step1_simple/axpb.cu)")
    outside = render.relink("[k](axpb.cu)", step, Path("/tmp/elsewhere"))
    assert outside == f"[k]({(step / 'axpb.cu').as_uri()})"


def test_every_relative_link_of_the_rendered_pages_resolves():
    pages = sorted((render.ROOT / "docs" / "rendered").glob("*/*.md"))
    assert pages, "no rendered pages in docs/rendered"
    broken = [f"{p.relative_to(render.ROOT)}: {m.group(2)}" for p in pages for m in render.LINK.finditer(p.read_text())
              if "://" not in m.group(2) and not (p.parent / m.group(2)).exists()]
    assert not broken, broken
    local = [f"{p.relative_to(render.ROOT)}: {m.group(2)}" for p in pages for m in render.LINK.finditer(p.read_text())
             if m.group(2).startswith("file:")]
    assert not local, f"pages rendered outside the repository (--out) link the machine they ran on: {local[:3]}"
