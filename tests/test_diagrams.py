"""The course's diagrams and the rendered-run exporter: drawn and tested without a GPU (render itself refuses to
run without one, so its tests stand a fake GPU in for the check)."""

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


@pytest.fixture
def fake_gpu(monkeypatch):
    """render's GPU check passes and the device line is fixed: the tiny notebooks below need no GPU."""
    monkeypatch.setattr(render, "require_gpu", lambda: None)
    monkeypatch.setattr(render, "device_name", lambda: "test device")


def test_render_exports_outputs_and_plots_without_touching_the_notebook(tmp_path, fake_gpu):
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


def test_render_reports_a_failing_notebook(tmp_path, fake_gpu):
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = tmp_path / "02_fails.ipynb"
    _notebook(nb, ["raise ValueError('planted')"])
    assert render.main([str(nb), "--out", str(tmp_path / "r"), "--timeout", "60"]) == 1
    assert "planted" in (tmp_path / "r" / "02_fails" / "02_fails.md").read_text()


def test_render_without_a_gpu_refuses_before_touching_a_file(tmp_path, monkeypatch, capsys):
    def no_gpu():
        raise RuntimeError("This needs an NVIDIA GPU with a working driver: (test)")
    monkeypatch.setattr(render, "require_gpu", no_gpu)
    nb = tmp_path / "01_tiny.ipynb"
    before = _notebook(nb, ["print(1)"])
    out = tmp_path / "rendered"
    (out / "01_tiny").mkdir(parents=True)
    (out / "01_tiny" / "01_tiny.md").write_text("old page")
    (out / "README.md").write_text("old index")
    assert render.main([str(nb), "--out", str(out)]) == 1
    assert capsys.readouterr().err.strip() == "This needs an NVIDIA GPU with a working driver: (test)"
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == \
        ["01_tiny.ipynb", "rendered", "rendered/01_tiny", "rendered/01_tiny/01_tiny.md", "rendered/README.md"]
    assert (out / "01_tiny" / "01_tiny.md").read_text() == "old page" and (out / "README.md").read_text() == "old index"
    assert nb.read_bytes() == before


def test_render_replaces_a_page_only_when_the_new_one_is_complete(tmp_path, monkeypatch, fake_gpu):
    """A failure while the page is written (here: the Markdown conversion) leaves the old page, its plots and the
    index as they were, and no temporary folder behind; a complete page replaces the old folder whole."""
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = tmp_path / "01_tiny.ipynb"
    _notebook(nb, ["print(6 * 7)"])
    out = tmp_path / "rendered"
    (out / "01_tiny").mkdir(parents=True)
    (out / "01_tiny" / "01_tiny.md").write_text("old page")
    (out / "01_tiny" / "01_tiny_cell01_1.png").write_bytes(b"old plot")
    (out / "README.md").write_text("old index")

    def broken(*args, **kwargs):
        raise OSError("disk full (planted)")
    real = render.to_markdown
    monkeypatch.setattr(render, "to_markdown", broken)
    with pytest.raises(OSError, match="planted"):
        render.main([str(nb), "--out", str(out), "--timeout", "60"])
    assert sorted(p.name for p in out.iterdir()) == ["01_tiny", "README.md"], "a temporary folder was left"
    assert sorted(p.name for p in (out / "01_tiny").iterdir()) == ["01_tiny.md", "01_tiny_cell01_1.png"]
    assert (out / "01_tiny" / "01_tiny.md").read_text() == "old page" and (out / "README.md").read_text() == "old index"

    monkeypatch.setattr(render, "to_markdown", real)
    assert render.main([str(nb), "--out", str(out), "--timeout", "60"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["01_tiny", "README.md"]
    assert [p.name for p in (out / "01_tiny").iterdir()] == ["01_tiny.md"], "the old plot outlived its page"
    assert "42" in (out / "01_tiny" / "01_tiny.md").read_text()
    index = (out / "README.md").read_text()
    assert "[01_tiny.ipynb](01_tiny/01_tiny.md) | test device |" in index


def test_course_notebooks_are_found_in_subpackages_in_course_order(tmp_path, monkeypatch):
    names = ["step4_gpt2/megakernel/04c_megakernel.ipynb", "step4_gpt2/04a_gpt2.ipynb",
             "step4_gpt2/train/04b_train_gpt.ipynb", "step1_simple/01b_reductions.ipynb",
             "step1_simple/01a_elementwise.ipynb", "step2_attention/02a_softmax.ipynb",
             "step1_simple/.ipynb_checkpoints/01a_elementwise-checkpoint.ipynb", "step4_gpt2/train/lab/try.ipynb",
             "step2_attention/exercises/ex.ipynb", "docs/not_a_step.ipynb"]
    for n in names:
        (tmp_path / n).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / n).write_text("{}")
    got = [p.relative_to(tmp_path).as_posix() for p in render.course_notebooks(tmp_path)]
    assert got == ["step1_simple/01a_elementwise.ipynb", "step1_simple/01b_reductions.ipynb",
                   "step2_attention/02a_softmax.ipynb", "step4_gpt2/04a_gpt2.ipynb",
                   "step4_gpt2/train/04b_train_gpt.ipynb", "step4_gpt2/megakernel/04c_megakernel.ipynb"]
    # the repository's own notebooks: each lesson once, and the default of `python -m common.render`
    ours = render.course_notebooks()
    assert len({p.stem for p in ours}) == len(ours) and ours[0].name == "01a_elementwise.ipynb"


def test_the_index_lists_every_notebook_in_course_order_with_its_pages_own_run(tmp_path):
    """The committed index is what write_index makes from the committed pages: each row carries its page's own
    device, date and time, and the rows follow the course."""
    import shutil
    out = tmp_path / "rendered"
    shutil.copytree(render.ROOT / "docs" / "rendered", out)
    committed = (out / "README.md").read_text()
    assert render.write_index(out).read_text() == committed, \
        "docs/rendered/README.md disagrees with its pages: regenerate it (python -c 'from common.render import " \
        "write_index, ROOT; write_index(ROOT / \"docs/rendered\")')"
    rows = [line for line in committed.splitlines() if line.startswith("| [") or " | not rendered yet |" in line]
    stems = [p.stem for p in render.course_notebooks()]
    assert [next(s for s in stems if f"{s}.ipynb" in row) for row in rows[:len(stems)]] == stems


def test_rendered_pages_keep_the_notebooks_links_working():
    step, page = render.ROOT / "step1_simple", render.ROOT / "docs" / "rendered" / "01a_elementwise"
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
