"""Every source listing of every course notebook runs on the CPU, from a folder that is not the notebook's.

A notebook shows code with `show_source`, `show_diff` and `show_excerpt` (common/kernels.py), which raise on a
kernel or line they cannot find and on a block over 80 lines. Under nbval those cells run only on a GPU, so this
test runs them without one: for each listing (a top-level call of one of the three), the statements of earlier
cells that define the names it uses (imports, assignments, functions; followed back through their own names),
then the call itself, with the current folder a fresh temporary one. A renamed kernel, a moved marker line, a
listing that grew past 80 lines, a path that resolves only from the notebook's own folder, or a name used before
the cell that defines it fails here. Nothing else of the notebook runs: no kernel is compiled or launched."""

import ast
import builtins
import contextlib
import io

import nbformat
import pytest

from common.kernels import MAX_SHOWN_LINES
from common.render import course_notebooks

LISTINGS = {"show_source", "show_diff", "show_excerpt"}
NOTEBOOKS = course_notebooks()


def _python(source: str) -> str:
    """A cell's source as Python: IPython's magics (`%time`, `!ls`) become calls, as in the notebook."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:          # without IPython: comment the magic lines out
        return "\n".join("# " + ln if ln.lstrip()[:1] in ("%", "!") else ln for ln in source.splitlines())
    return TransformerManager().transform_cell(source)


def _listing_name(node: ast.AST) -> str | None:
    """`show_source` for `show_source(...)` or `common.show_source(...)`; None for any other node."""
    if isinstance(node, ast.Call):
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        return name if name in LISTINGS else None
    return None


def _defined(stmt: ast.stmt) -> set[str]:
    """The names a top-level statement binds: imports, assignment targets, def and class."""
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in stmt.names if a.name != "*"}
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return set()


def _used(stmt: ast.stmt) -> set[str]:
    used = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    if isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name):
        used.add(stmt.target.id)
    return used


def _statements(path):
    """(cell id, statement) for every top-level statement of the notebook's code cells, in order; and the
    listings found anywhere but at the top level of a cell (those cannot run alone)."""
    out, nested = [], []
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        tree = ast.parse(_python(cell.source), filename=f"{path.name}, cell {cell.get('id')}")
        for stmt in tree.body:
            top = isinstance(stmt, ast.Expr) and _listing_name(stmt.value)
            if not top and any(_listing_name(n) for n in ast.walk(stmt)):
                nested.append(f"cell {cell.get('id')}, line {stmt.lineno}")
            out.append((cell.get("id"), stmt))
    return out, nested


def _needed(stmts, listings: list[int]) -> set[int]:
    """The listings' indices into stmts and, followed back, those of the earlier statements that last bound each
    name they use before they run."""
    need, todo = set(), list(listings)
    while todo:
        i = todo.pop()
        if i in need:
            continue
        need.add(i)
        for name in _used(stmts[i][1]):
            j = next((j for j in range(i - 1, -1, -1) if name in _defined(stmts[j][1])), None)
            if j is not None:
                todo.append(j)
    return need


def test_every_notebook_is_found():
    assert len(NOTEBOOKS) >= 10, [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_source_listings_run_without_a_gpu(path, tmp_path, monkeypatch):
    """Each listing of the notebook runs, prints something, and prints at most 80 lines, from another folder."""
    stmts, nested = _statements(path)
    assert not nested, (f"{path.name}: a source listing inside a loop, a branch or an expression ({'; '.join(nested)}): "
                        "make it a statement of its own so that it can be checked without a GPU")
    listings = [i for i, (_, s) in enumerate(stmts) if isinstance(s, ast.Expr) and _listing_name(s.value)]
    if not listings:
        pytest.skip(f"{path.name} shows no source")
    monkeypatch.chdir(tmp_path)
    need = _needed(stmts, listings)
    names = {"__name__": "__main__", "__builtins__": builtins}
    for i in sorted(need):
        cell, stmt = stmts[i]
        code = compile(ast.Module(body=[stmt], type_ignores=[]), f"{path.name}, cell {cell}", "exec")
        where = f"{path.name}, cell {cell}: {ast.unparse(stmt)[:160]}"
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                exec(code, names)
        except Exception as e:
            pytest.fail(f"{where}\n  raised {type(e).__name__}: {e}", pytrace=False)
        if i in listings:
            text = printed.getvalue().rstrip("\n")
            assert text.strip(), f"{where}\n  printed nothing"
            n = text.count("\n") + 1
            assert n <= MAX_SHOWN_LINES, f"{where}\n  printed {n} lines; a notebook shows at most {MAX_SHOWN_LINES}"
