"""A rendered reference run of the notebooks, for readers without a GPU.

    python -m common.render                                   # every step*/0*.ipynb -> docs/rendered/
    python -m common.render step1_simple/01_elementwise.ipynb --out /tmp/rendered --timeout 900

Each notebook is executed top to bottom in a fresh kernel with its own folder as the working directory
(nbclient, as nbval does), then written as `<out>/<stem>/<stem>.md` with its outputs, and its plots as PNG files
beside it. The device and the date head every page, and `<out>/README.md` indexes all pages found in `<out>`.
The notebooks themselves are never written to: they stay clean (no outputs) in the repository.

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


def to_markdown(nb, stem: str, folder: Path, header: str, source_dir: Path) -> str:
    """The executed notebook `nb` as one Markdown page; images go to `folder`. source_dir: the notebook's folder,
    which its markdown cells' relative links start from."""
    parts = [header]
    for i, cell in enumerate(nb.cells):
        src = cell.source if isinstance(cell.source, str) else "".join(cell.source)
        if cell.cell_type == "markdown":
            parts.append(relink(src, source_dir, folder).rstrip() + "\n")
        elif cell.cell_type == "code":
            if src.strip():
                parts.append(_fence(src, "python"))
            parts.extend(_outputs(cell.get("outputs", []), stem, i, folder))
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
    folder = out / stem
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
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
    (folder / f"{stem}.md").write_text(to_markdown(nb, stem, folder, header, path.parent), encoding="utf-8")
    return meta


def write_index(out: Path) -> Path:
    """`<out>/README.md`: one row per rendered page found under `out`."""
    rows = []
    for page in sorted(out.glob("*/*.md")):
        m = META.search(page.read_text(encoding="utf-8"))
        if m:
            rows.append(json.loads(m.group(1)))
    lines = ["# Rendered notebooks", "",
             "Each notebook of the course, executed top to bottom on a real GPU by `python -m common.render`, with",
             "its printed results and plots. Read these if you have no GPU at hand; run the notebooks to get your",
             "own numbers. The notebooks in the repository are stored without outputs.", "",
             "| notebook | device | date | time | status |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| [{r['notebook']}]({r['page']}) | {r['device']} | {r['date']} | {r['seconds']:.0f} s "
                     f"| {r['status']} |")
    index = out / "README.md"
    index.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return index


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m common.render", description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", type=Path,
                    help="notebooks to render (default: every step*/0*.ipynb of the repository)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "rendered", help="output folder (default: %(default)s)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default: %(default)s)")
    ap.add_argument("--kernel", default="python3", help="Jupyter kernel name (default: %(default)s)")
    args = ap.parse_args(argv)
    notebooks = args.notebooks or sorted(ROOT.glob("step*/0*.ipynb"))
    for p in notebooks:
        if p.suffix != ".ipynb" or not p.is_file():
            ap.error(f"notebooks: {p} is not a notebook file (expected an existing .ipynb)")
    if args.timeout <= 0:
        ap.error(f"--timeout: expected a positive number of seconds, got {args.timeout}")
    args.out.mkdir(parents=True, exist_ok=True)
    device = device_name()
    print(f"device: {device}")
    failures = 0
    for p in notebooks:
        meta = render(p, args.out, args.timeout, args.kernel, device)
        failures += meta["status"] != "ok"
        print(f"{meta['notebook']}: {meta['status']} ({meta['seconds']:.0f} s) -> {args.out / meta['page']}",
              flush=True)
    print(f"index: {write_index(args.out)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
