"""How the course stores its notebooks, and the git filter that keeps them that way.

    python -m common.notebooks                    # put every notebook git tracks in its stored form, in place
    python -m common.notebooks --check            # list those not in their stored form; writes nothing
    python -m common.notebooks --install-filter   # contributors, once per clone: nbstripout as git's filter

A notebook is stored as JupyterLab writes it when it opens it with the course's kernel, "Python 3 (ipykernel)",
less what differs from one run or one machine to the next: no outputs, every execution_count null, no cell
metadata but tags, and language_info without the Python version. Opening a notebook then changes one line on
disk (the version); running cells adds outputs. With the filter installed, git strips exactly those parts from
what it stores, so `git status` stays clean; without it, git lists the notebook as modified
(`git checkout -- <notebook>` puts the stored form back). tests/test_notebooks_clean.py checks what git holds.
"""
from __future__ import annotations

import argparse
import copy
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What JupyterLab 4 writes from the kernel's spec and its kernel_info reply (ipykernel), version left out.
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
LANGUAGE_INFO = {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
                 "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
                 "pygments_lexer": "ipython3"}
CELL_METADATA = {"tags"}

# nbstripout already drops outputs, execution counts, metadata.signature/widgets and the usual cell-level view
# state (collapsed, scrolled, ExecuteTime, execution, hidden, heading_collapsed). These keys are what else
# JupyterLab, Colab and VS Code write; --keep-id keeps the cells' ids, so a diff shows only the cells edited.
EXTRA_KEYS = ("metadata.language_info.version metadata.colab metadata.accelerator metadata.gpuClass "
              "metadata.kaggle metadata.vscode metadata.toc cell.metadata.jp-MarkdownHeadingCollapsed "
              "cell.metadata.editable cell.metadata.deletable cell.metadata.slideshow cell.metadata.colab "
              "cell.metadata.id cell.metadata.outputId cell.metadata.vscode cell.metadata.trusted")
NBSTRIPOUT_ARGS = ["--keep-id", "--extra-keys", EXTRA_KEYS]


def problems(nb) -> list[str]:
    """What keeps the notebook `nb` (a dict as nbformat reads it) from its stored form; [] when it is stored."""
    found = []
    meta = nb.get("metadata", {})
    if set(meta) - {"kernelspec", "language_info"}:
        found.append(f"volatile notebook metadata: {sorted(set(meta) - {'kernelspec', 'language_info'})}")
    if meta.get("kernelspec") != KERNELSPEC:
        found.append(f"kernelspec is {meta.get('kernelspec')}, expected {KERNELSPEC}")
    info = meta.get("language_info", {})
    if "version" in info:
        found.append("language_info carries versions: the Python version differs per machine")
    if {k: v for k, v in info.items() if k != "version"} != LANGUAGE_INFO:
        found.append(f"language_info is {info}, expected {LANGUAGE_INFO}")
    for i, cell in enumerate(nb.get("cells", [])):
        if set(cell.get("metadata", {})) - CELL_METADATA:
            found.append(f"cell {i}: volatile metadata {sorted(set(cell['metadata']) - CELL_METADATA)}")
        if cell.get("cell_type") == "code":
            if cell.get("outputs"):
                found.append(f"cell {i} has stored outputs")
            if cell.get("execution_count") is not None:
                found.append(f"cell {i} has execution_count {cell['execution_count']}")
    return found


def stored_form(nb):
    """A copy of the notebook `nb` (an nbformat NotebookNode) in its stored form."""
    import nbformat
    nb = copy.deepcopy(nb)
    nb.metadata = nbformat.from_dict({"kernelspec": KERNELSPEC, "language_info": LANGUAGE_INFO})
    for cell in nb.cells:
        cell.metadata = nbformat.from_dict({k: v for k, v in cell.metadata.items() if k in CELL_METADATA})
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb


def tracked_notebooks(root: Path = ROOT) -> list[Path]:
    """The notebooks git tracks (outside a git checkout: every .ipynb under step*/, checkpoints left out)."""
    r = subprocess.run(["git", "ls-files", "-z", "--", "*.ipynb"], cwd=root, capture_output=True, text=True)
    if r.returncode == 0:
        return [root / f for f in r.stdout.split("\0") if f and (root / f).is_file()]
    return sorted(p for p in root.glob("step*/**/*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def normalise(path: Path) -> bool:
    """Write the notebook at `path` in its stored form; True when that changed the file."""
    import nbformat
    before = path.read_text(encoding="utf-8")
    after = nbformat.writes(stored_form(nbformat.reads(before, as_version=4))) + "\n"
    if after != before:
        path.write_text(after, encoding="utf-8")
    return after != before


def install_filter(root: Path = ROOT) -> list[list[str]]:
    """Make nbstripout (with NBSTRIPOUT_ARGS) this clone's git filter for notebooks; .gitattributes names it."""
    try:
        import nbstripout  # noqa: F401
    except ImportError:
        raise SystemExit("nbstripout is not installed in this Python: pip install -r requirements-dev.txt")
    strip = subprocess.list2cmdline([sys.executable, "-m", "nbstripout", *NBSTRIPOUT_ARGS])
    cmds = [["git", "config", "filter.nbstripout.clean", strip],
            ["git", "config", "filter.nbstripout.smudge", "cat"],
            ["git", "config", "filter.nbstripout.required", "true"],
            ["git", "config", "diff.ipynb.textconv", strip + " -t"]]
    for cmd in cmds:
        subprocess.run(cmd, cwd=root, check=True)
    return cmds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m common.notebooks", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="*", type=Path, help="notebooks (default: every notebook git tracks)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="list the notebooks not in their stored form, exit 1 "
                                                           "if any; writes nothing")
    mode.add_argument("--install-filter", action="store_true",
                      help="set nbstripout as this clone's git filter for notebooks (git config, once per clone)")
    args = ap.parse_args(argv)
    if args.install_filter:
        for cmd in install_filter():
            print(subprocess.list2cmdline(cmd))
        return 0
    paths = args.notebooks or tracked_notebooks()
    for p in paths:
        if p.suffix != ".ipynb" or not p.is_file():
            ap.error(f"notebooks: {p} is not a notebook file (expected an existing .ipynb)")
    import nbformat
    bad = 0
    for p in paths:
        if args.check:
            found = problems(nbformat.read(p, as_version=4))
            bad += bool(found)
            for f in found:
                print(f"{p}: {f}")
        elif normalise(p):
            print(f"normalised {p}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
