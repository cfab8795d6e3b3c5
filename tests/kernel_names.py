"""Which kernels a wrapper module asks `get_kernel` for, read from its source without running it (a misspelt
name would otherwise fail only on a GPU), and which kernels NVRTC compiles from a .cu with the defines and
template names the module declares (CU_DEFINES, CU_TEMPLATES). Used by tests/test_compile.py and step tests."""
from __future__ import annotations

import ast
import functools
import importlib
import re
from pathlib import Path

from common.kernels import compile_offline, supported_archs


def kernel_requests(py) -> list[tuple[Path, str, int]]:
    """(.cu path, name pattern (a regex), line) of every get_kernel(path, name, ...) call in the Python file `py`.
    The path names its .cu literally or through a module-level constant. The name may be a literal, an f-string
    (each {...} matches any text), `a if c else b`, a dict literal indexed by a key, a local variable assigned
    those, or a parameter of its function, followed to what the module's calls of that function pass for it."""
    py = Path(py)
    tree = ast.parse(py.read_text())
    functions = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)]     # methods may share names

    def module_constant(name):
        """The value assigned to `name` at module level (also as one of `A, B = x, y`)."""
        for n in (n for n in tree.body if isinstance(n, ast.Assign)):
            for t in n.targets:
                if isinstance(t, ast.Name) and t.id == name:
                    return n.value
                if isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple):
                    for el, v in zip(t.elts, n.value.elts):
                        if isinstance(el, ast.Name) and el.id == name:
                            return v
        return None

    def arguments_for(fn: ast.FunctionDef, param: str):
        """(argument node, calling function) of every call of fn in the module that passes `param`."""
        i = [a.arg for a in fn.args.args].index(param)
        defaults = dict(zip([a.arg for a in fn.args.args][-len(fn.args.defaults):], fn.args.defaults)) \
            if fn.args.defaults else {}
        for caller in functions:
            for call in (n for n in ast.walk(caller) if isinstance(n, ast.Call)):
                f = call.func
                if (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) != fn.name:
                    continue
                kw = {k.arg: k.value for k in call.keywords}
                arg = call.args[i] if i < len(call.args) else kw.get(param, defaults.get(param))
                if arg is not None:
                    yield arg, caller

    def patterns(node, scope):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [re.escape(node.value)]
        if isinstance(node, ast.JoinedStr):
            return ["".join(re.escape(v.value) if isinstance(v, ast.Constant) else ".+" for v in node.values)]
        if isinstance(node, ast.IfExp):
            return patterns(node.body, scope) + patterns(node.orelse, scope)
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict):
            return [p for v in node.value.values for p in patterns(v, scope)]
        if isinstance(node, ast.Name):
            values = [n.value for n in ast.walk(scope) if isinstance(n, ast.Assign)
                      and any(isinstance(t, ast.Name) and t.id == node.id for t in n.targets)]
            if values:
                return [p for v in values for p in patterns(v, scope)]
            if isinstance(scope, ast.FunctionDef) and node.id in [a.arg for a in scope.args.args]:
                found = [p for arg, caller in arguments_for(scope, node.id) for p in patterns(arg, caller)]
                if found:
                    return found
        raise AssertionError(f"{py}:{node.lineno}: cannot tell which kernel name get_kernel is given (write a "
                             f"literal, an f-string, `a if c else b`, or pass one of those for a parameter)")

    found = set()
    for scope in functions:
        for call in (n for n in ast.walk(scope) if isinstance(n, ast.Call)):
            f = call.func
            if (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) != "get_kernel":
                continue
            path = call.args[0]
            table = isinstance(path, ast.Subscript) and isinstance(path.value, ast.Name)
            if table:                             # a module-level dict of them, e.g. SOURCES[version]
                path = module_constant(path.value.id) or path
            elif isinstance(path, ast.Name):      # a module-level constant such as BWD = HERE / "train_backward.cu"
                path = module_constant(path.id) or path
            cu = [n.value for n in ast.walk(path) if isinstance(n, ast.Constant)
                  and isinstance(n.value, str) and n.value.endswith(".cu")]
            assert len(cu) == 1 or (table and isinstance(path, ast.Dict) and len(cu) == len(path.values)), \
                f"{py}:{call.lineno}: get_kernel's path names no .cu file"
            for pattern in patterns(call.args[1], scope):
                for c in cu:
                    found.add(((py.parent / c).resolve(), pattern, call.lineno))
    return sorted(found)


def declared(module, attr: str) -> dict:
    """{absolute .cu path: value} of a module's CU_DEFINES or CU_TEMPLATES (empty when it has none); a relative
    key is a path from the module's own folder, not from wherever pytest runs."""
    here = Path(module.__file__).resolve().parent
    return {(here / k).resolve(): v for k, v in getattr(module, attr, {}).items()}


@functools.lru_cache(maxsize=None)
def compiled_kernels(py: str, cu: Path) -> tuple[str, ...]:
    """The kernels NVRTC compiles from `cu` with the defines and template names that the module `py` (a path
    relative to the repository, e.g. "step3_fused/ops.py") declares."""
    module = importlib.import_module(Path(py).with_suffix("").as_posix().replace("/", "."))
    cu = Path(cu).resolve()
    arch = next(a for a in (80, 90, 75) if a in supported_archs())
    report = compile_offline(cu, arch, defines=declared(module, "CU_DEFINES").get(cu),
                             name_expressions=tuple(declared(module, "CU_TEMPLATES").get(cu, ())))
    return tuple(report.kernels)
