"""A rendered reference run of the notebooks, for readers without a GPU.

    python -m common.render                                   # every notebook of the course -> docs/rendered/
    python -m common.render step1_simple/01a_elementwise.ipynb --out /tmp/rendered --timeout 900

Each notebook is executed top to bottom in a fresh kernel with its own folder as the working directory
(nbclient, as nbval does), then written as `<out>/<stem>/<stem>.md` with its outputs, and its plots as PNG files
beside it. The device and the date head every page, and `<out>/README.md` indexes the pages in course order,
each row read from its own page, so a row and its page always come from the same run.
The notebooks themselves are never written to: they stay clean (no outputs) in the repository.

It needs a GPU and says so before writing anything. A page is built in a temporary folder and replaces the old
one only when it is complete, so an interrupted run leaves every page as it was.

The Markdown is produced from nbformat alone: markdown cells as they are, code in ```python fences, text
outputs in plain fences, images as files linked from the page.
"""
from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
META = re.compile(r"^<!-- rendered: (\{.*\}) -->$", re.M)


def device_name() -> str:
    """The GPU the notebooks run on, or why there is none (the notebooks then skip their GPU cells)."""
    from common import device
    reason = device.skip_reason()
    return device.describe() if reason is None else f"CPU only, {reason.split(':')[0]}"


def require_gpu() -> None:
    """A rendered page shows what a GPU printed: without one there is nothing to render (raises RuntimeError)."""
    from common.device import require_gpu as require
    require()


SKIP_DIRS = {".ipynb_checkpoints", "lab", "exercises"}


def course_notebooks(root: Path = ROOT) -> list[Path]:
    """Every notebook of the course, in course order: the step folders in order, and inside a step the notebooks
    by name (04a_gpt2, then 04b_train_gpt in train/, then 04c_megakernel in megakernel/). Experiments (lab/),
    exercises and Jupyter's checkpoints are not lessons."""
    found = [p for p in root.glob("step*/**/*.ipynb") if not SKIP_DIRS & set(p.relative_to(root).parts[:-1])]
    return sorted(found, key=lambda p: (p.relative_to(root).parts[0], p.stem))


def _join(s) -> str:
    return "".join(s) if isinstance(s, list) else s


def _text(s) -> str:
    """Output text as a reader elsewhere should see it: no ANSI colours, progress bars (carriage returns) collapsed
    to their last state, paths inside the repository relative to it."""
    s = ANSI.sub("", _join(s)).replace(str(ROOT) + os.sep, "")
    return "\n".join(line.rsplit("\r", 1)[-1] for line in s.split("\n"))


def _fence(text: str, lang: str = "") -> str:
    text = text.rstrip("\n")
    ticks = "```" if "```" not in text else "````"
    return f"{ticks}{lang}\n{text}\n{ticks}\n"


def _outputs(outputs, stem: str, cell: int, folder: Path) -> list[str]:
    """Markdown for one code cell's outputs; images are written to `folder`."""
    parts, n_img, merged = [], 0, []
    for out in outputs:                                  # consecutive prints to one stream: one block
        if merged and out.get("output_type") == "stream" == merged[-1].get("output_type") \
                and out.get("name") == merged[-1].get("name"):
            merged[-1] = {**merged[-1], "text": _join(merged[-1]["text"]) + _join(out["text"])}
        else:
            merged.append(out)
    for out in merged:
        kind = out.get("output_type")
        if kind == "stream":
            if _text(out["text"]).strip():
                parts.append(_fence(_text(out["text"])))
        elif kind == "error":
            parts.append(_fence(_text("\n".join(out.get("traceback") or [f"{out['ename']}: {out['evalue']}"]))))
        elif kind in ("execute_result", "display_data"):
            data = out.get("data", {})
            for mime, ext in (("image/png", "png"), ("image/jpeg", "jpg"), ("image/svg+xml", "svg")):
                if mime in data:
                    n_img += 1
                    name = f"{stem}_cell{cell:02d}_{n_img}.{ext}"
                    blob = data[mime]
                    raw = "".join(blob).encode() if ext == "svg" else base64.b64decode("".join(blob))
                    (folder / name).write_bytes(raw)
                    parts.append(f"![output of cell {cell}]({name})\n")
                    break
            else:
                if "text/markdown" in data:
                    parts.append(_text(data["text/markdown"]).rstrip() + "\n")
                elif "text/plain" in data:
                    parts.append(_fence(_text(data["text/plain"])))
    return parts


LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")


def _link(target: Path, page_dir: Path) -> str:
    """How a page in page_dir links a file: relatively when the page is inside the repository, else file://."""
    target, page_dir = target.resolve(), page_dir.resolve()
    return os.path.relpath(target, page_dir).replace(os.sep, "/") if page_dir.is_relative_to(ROOT) else target.as_uri()


def relink(markdown: str, source_dir: Path, page_dir: Path) -> str:
    """Markdown links written relative to the notebook's folder, rewritten for a page in page_dir (_link).
    Web addresses, absolute paths and in-page anchors stay."""
    def fix(m):
        if re.match(r"^[a-z][a-z0-9+.-]*:", m.group(2), re.I) or m.group(2).startswith("/"):
            return m.group(0)
        return m.group(1) + _link(source_dir / m.group(2), page_dir) + m.group(3)
    return LINK.sub(fix, markdown)


def to_markdown(nb, stem: str, folder: Path, header: str, source_dir: Path, images: Path | None = None) -> str:
    """The executed notebook `nb` as one Markdown page for `folder`; images are written to `images` (default:
    `folder`). source_dir: the notebook's folder, which its markdown cells' relative links start from."""
    parts = [header]
    for i, cell in enumerate(nb.cells):
        src = cell.source if isinstance(cell.source, str) else "".join(cell.source)
        if cell.cell_type == "markdown":
            parts.append(relink(src, source_dir, folder).rstrip() + "\n")
        elif cell.cell_type == "code":
            if src.strip():
                parts.append(_fence(src, "python"))
            parts.extend(_outputs(cell.get("outputs", []), stem, i, images or folder))
    return "\n".join(parts)


def render(path: Path, out: Path, timeout: int, kernel: str, device: str) -> dict:
    """Execute one notebook and write its page; returns the page's metadata (also stored in the page)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    path = path.resolve()
    nb = nbformat.read(path, as_version=4)              # a copy in memory: the file is never written
    client = NotebookClient(nb, timeout=timeout, kernel_name=kernel,
                            resources={"metadata": {"path": str(path.parent)}})
    t0, status = time.perf_counter(), "ok"
    try:
        client.execute()
    except CellExecutionError:
        failed = next(((i, o) for i, c in enumerate(nb.cells) for o in c.get("outputs", [])
                       if o.get("output_type") == "error"), (None, {}))
        status = f"failed at cell {failed[0]}: {failed[1].get('ename')}: {_text(failed[1].get('evalue', ''))[:200]}"
    except Exception as e:                              # a timeout or a dead kernel: keep what ran
        status = f"failed: {type(e).__name__}: {str(e).strip()[:200]}"
    seconds = time.perf_counter() - t0
    stem = path.stem
    folder = out / stem                                 # where the page will be; its links are relative to it
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{stem}.", dir=out))
    try:
        try:
            source = path.relative_to(ROOT).as_posix()
        except ValueError:
            source = path.name
        meta = {"notebook": source, "page": f"{stem}/{stem}.md", "device": device,
                "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "seconds": round(seconds, 1), "status": status}
        header = (f"<!-- rendered: {json.dumps(meta)} -->\n"
                  f"> **Rendered run** of [`{source}`]({_link(path, folder)}) on **{device}**, {meta['date']}, by "
                  f"`python -m common.render` ({seconds:.0f} s{'' if status == 'ok' else '; ' + status}). "
                  f"Every output below was produced by that run; on your GPU the numbers will differ.\n")
        # links are computed for `folder`, the files written to `tmp`, which takes its place when complete
        page = to_markdown(nb, stem, folder, header, path.parent, images=tmp)
        (tmp / f"{stem}.md").write_text(page, encoding="utf-8")
        _replace_folder(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)          # only left when something failed before the swap
    return meta


def _replace_folder(new: Path, folder: Path) -> None:
    """Put the complete folder `new` where `folder` is: two renames on one file system, the old page removed only
    once the new one is in place."""
    new.chmod(0o755)                                    # mkdtemp's folders are private (0700); a page is not
    if not folder.exists():
        os.replace(new, folder)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old.", dir=folder.parent))
    os.replace(folder, old / folder.name)
    try:
        os.replace(new, folder)
    except BaseException:
        os.replace(old / folder.name, folder)           # put the old page back
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _pages(out: Path) -> list[dict]:
    """The metadata of every rendered page under `out`, as each page stores it."""
    rows = []
    for page in out.glob("*/*.md"):
        if page.parent.name.startswith("."):            # a page still being written, or one being replaced
            continue
        m = META.search(page.read_text(encoding="utf-8"))
        if m:
            rows.append(json.loads(m.group(1)))
    return rows


def write_index(out: Path) -> Path:
    """`<out>/README.md`: one row per rendered page found under `out`, each row read from its page (so the row and
    the page come from one run), in course order: the course's notebooks first, in their order, then any other
    page by name. A notebook of the course without a page gets a row that says so."""
    pages = {r["page"].split("/")[0]: r for r in _pages(out)}
    rows = []
    for nb in course_notebooks():
        r = pages.pop(nb.stem, None)
        rows.append(r or {"notebook": nb.relative_to(ROOT).as_posix(), "page": None, "device": "", "date": "",
                          "seconds": None, "status": "not rendered yet"})
    rows += [pages[k] for k in sorted(pages)]
    lines = ["# Rendered notebooks", "",
             "Each notebook of the course, executed top to bottom on a real GPU by `python -m common.render`, with",
             "its printed results and plots. Read these if you have no GPU at hand; run the notebooks to get your",
             "own numbers. The notebooks in the repository are stored without outputs.", "",
             "| notebook | device | date | time | status |", "|---|---|---|---|---|"]
    for r in rows:
        name = f"[{r['notebook']}]({r['page']})" if r["page"] else r["notebook"]
        time_s = "" if r["seconds"] is None else f"{r['seconds']:.0f} s"
        lines.append(f"| {name} | {r['device']} | {r['date']} | {time_s} | {r['status']} |")
    index = out / "README.md"
    tmp = index.with_name(f".README.md.{os.getpid()}")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, index)                              # readers see the old index or the new one, never half
    return index


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m common.render", description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", type=Path,
                    help="notebooks to render (default: every notebook of the course, in course order)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "rendered", help="output folder (default: %(default)s)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default: %(default)s)")
    ap.add_argument("--kernel", default="python3", help="Jupyter kernel name (default: %(default)s)")
    args = ap.parse_args(argv)
    notebooks = args.notebooks or course_notebooks()
    for p in notebooks:
        if p.suffix != ".ipynb" or not p.is_file():
            ap.error(f"notebooks: {p} is not a notebook file (expected an existing .ipynb)")
    if args.timeout <= 0:
        ap.error(f"--timeout: expected a positive number of seconds, got {args.timeout}")
    try:
        require_gpu()                                   # before any file is touched
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    device = device_name()
    print(f"device: {device}")
    failures = 0
    for p in notebooks:
        meta = render(p, args.out, args.timeout, args.kernel, device)
        failures += meta["status"] != "ok"
        write_index(args.out)                           # after each page: an interrupted run leaves a true index
        print(f"{meta['notebook']}: {meta['status']} ({meta['seconds']:.0f} s) -> {args.out / meta['page']}",
              flush=True)
    print(f"index: {args.out / 'README.md'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
