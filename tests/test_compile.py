"""Every .cu file of the course compiles with NVRTC for every supported arch, without a GPU, with no
warnings and no register spills. This is what CI checks on a machine without a driver.

A `.cu` whose constants come from Python (`#ifndef BLOCK / #error ...`) is compiled with the defines its
module declares in a dict `CU_DEFINES = {path of the .cu: defines}`, and its templated kernels are instantiated
with the names a module declares in `CU_TEMPLATES = {path of the .cu: names}` (CONTRIBUTING.md). Every kernel name
the wrappers of steps 1-4 can give get_kernel (read from their source: tests/kernel_names.py) is among them."""
import importlib
import os
import re

import pytest

from common.kernels import ARCHS, ROOT, KernelCompileError, compile_offline, supported_archs
from tests.kernel_names import compiled_kernels, declared, kernel_requests



def _step_files(pattern: str) -> list:
    """The steps' files, in their packages and lab/ folders too; exercises are checked by test_exercises."""
    return sorted(p for p in ROOT.glob(f"step*/**/{pattern}")
                  if "exercises" not in p.relative_to(ROOT).parts and "__pycache__" not in p.parts)


SOURCES = [p.relative_to(ROOT).as_posix() for p in _step_files("*.cu")]


def _module(py):
    return importlib.import_module(".".join(py.relative_to(ROOT).with_suffix("").parts))


def _declared(attr: str) -> dict:
    """.cu path (relative to the repository) -> value, from every step module that has a dict `attr`."""
    found = {}
    for py in _step_files("*.py"):
        if attr not in py.read_text():
            continue
        module = _module(py)
        for p, value in declared(module, attr).items():
            found[p.relative_to(ROOT).as_posix()] = value
    return found


DEFINES = {k: dict(v) for k, v in _declared("CU_DEFINES").items()}
TEMPLATES = {k: tuple(v) for k, v in _declared("CU_TEMPLATES").items()}


def test_sources_found():
    assert len(SOURCES) >= 4, SOURCES
    assert TEMPLATES, "no module declares CU_TEMPLATES"


def test_a_relative_cu_key_is_read_from_the_module_folder(monkeypatch, tmp_path):
    import types
    module = types.ModuleType("fake")
    module.__file__ = str(ROOT / "step4_gpt2" / "fake.py")
    module.CU_DEFINES = {"megakernel.cu": {"NB": 2}, str(ROOT / "step1_simple" / "x.cu"): {}}
    monkeypatch.chdir(tmp_path)                       # not the repository: the key must not depend on it
    assert declared(module, "CU_DEFINES") == {ROOT / "step4_gpt2" / "megakernel.cu": {"NB": 2},
                                              ROOT / "step1_simple" / "x.cu": {}}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES)
def test_compiles(source, arch):
    if arch not in supported_archs():
        if os.environ.get("CI"):
            pytest.fail(f"CI must check sm_{arch}, but this NVRTC supports only {supported_archs()}")
        pytest.skip(f"the NVRTC CuPy loaded cannot target sm_{arch} (CUDA 13 dropped it); CI checks it with CuPy's CUDA 12 NVRTC")
    report = compile_offline(source, arch, defines=DEFINES.get(source), name_expressions=TEMPLATES.get(source, ()))
    assert not report.warnings, f"{source} sm_{arch} warnings:\n" + "\n".join(report.warnings)
    assert report.kernels, f"{source}: no kernels in the ptxas report:\n{report.log}"
    spills = {k.name: (k.spill_stores, k.spill_loads) for k in report.kernels.values()
              if k.spill_stores or k.spill_loads}
    assert not spills, f"{source} sm_{arch} spills registers: {spills}\n{report.table()}"


def test_compile_error_names_file_line_and_source(tmp_path):
    bad = tmp_path / "broken.cu"
    bad.write_text('extern "C" __global__ void k(float* y) {\n'
                   '    y[threadIdx.x] = undefined_name * 2.0f;\n'
                   '}\n')
    with pytest.raises(KernelCompileError) as e:
        compile_offline(bad, 80)
    msg = str(e.value)
    assert f"{bad}:2: error:" in msg and "undefined_name" in msg
    assert "y[threadIdx.x] = undefined_name * 2.0f;" in msg       # the offending line is quoted


def test_header_edits_change_the_compiled_text(tmp_path):
    from common.kernels import _source
    (tmp_path / "h.cuh").write_text("#define K 1\n")
    src = tmp_path / "a.cu"
    src.write_text('#include "h.cuh"\nextern "C" __global__ void k(int* y) { *y = K; }\n')
    before = _source(src)
    (tmp_path / "h.cuh").write_text("#define K 2\n")
    assert _source(src) != before, "CuPy's cache key would miss a header edit"


def test_defines_reach_the_compiler():
    r128 = compile_offline("step1_simple/reduce.cu", 80, defines={"BLOCK": 128})
    r1024 = compile_offline("step1_simple/reduce.cu", 80, defines={"BLOCK": 1024})
    assert r128.kernels["sum_v1"].shared_bytes == 128 * 4
    assert r1024.kernels["sum_v1"].shared_bytes == 1024 * 4


def test_missing_source_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="no_such_file.cu"):
        compile_offline("step1_simple/no_such_file.cu", 80)


def test_missing_define_names_the_line(tmp_path):
    """`#error` is a 'catastrophic error' in NVRTC's log: it is quoted like any other."""
    src = tmp_path / "needs.cu"
    src.write_text('#ifndef BLOCK\n#error "BLOCK must be defined"\n#endif\n'
                   'extern "C" __global__ void k(float* y) { y[threadIdx.x] = BLOCK; }\n')
    with pytest.raises(KernelCompileError, match=rf'(?s){src}:2: error: #error directive.*\| #error "BLOCK'):
        compile_offline(src, 80)
    assert compile_offline(src, 80, defines={"BLOCK": 64}).kernels


# Every step module that asks get_kernel for a kernel by name (found, so a moved or new module is never missed).
WRAPPERS = [p.relative_to(ROOT).as_posix() for p in _step_files("*.py") if "get_kernel(" in p.read_text()]


@pytest.mark.parametrize("module", WRAPPERS)
def test_every_kernel_a_wrapper_asks_for_is_compiled_from_its_cu(module):
    """A misspelt kernel name would only fail on the GPU: each name a wrapper can give get_kernel is checked
    against the kernels NVRTC compiles from that .cu (with the module's CU_DEFINES and CU_TEMPLATES)."""
    requests = kernel_requests(ROOT / module)
    assert requests, f"{module}: expected its get_kernel calls, found {requests}"
    for cu, pattern, line in requests:
        kernels = compiled_kernels(module, cu)
        matches = [k for k in kernels if re.fullmatch(pattern, k)]
        assert matches, f"{module}:{line} asks for a kernel {pattern!r} that {cu.name} does not define; it has {sorted(kernels)}"


def test_kernel_requests_sees_every_form_of_name(tmp_path):
    py = tmp_path / "m.py"
    py.write_text('K = HERE / "c.cu"\n'
                  'def f(v, vec):\n'
                  '    get_kernel(HERE / "a.cu", "k1")\n'
                  '    get_kernel(HERE / "a.cu", f"k_v{v}", {"X": 1})\n'
                  '    name = "k3" if vec else "k3_scalar"\n'
                  '    common.get_kernel(HERE / "b.cu", name)\n'
                  '    get_kernel(K, {1: "k4", 2: "k5"}[v])\n'
                  'def g(kernel, n):\n'
                  '    get_kernel(K, kernel)\n'
                  'def h():\n'
                  '    g("k6", 1)\n'
                  '    g(kernel="k7", n=2)\n')
    got = [(c.name, p) for c, p, _ in kernel_requests(py)]
    assert sorted(got) == sorted([("a.cu", "k1"), ("a.cu", "k_v.+"), ("b.cu", "k3"), ("b.cu", "k3_scalar"),
                                  ("c.cu", "k4"), ("c.cu", "k5"), ("c.cu", "k6"), ("c.cu", "k7")])
    py.write_text('def f(x):\n    get_kernel(HERE / "a.cu", x.name)\n')
    with pytest.raises(AssertionError, match="cannot tell which kernel name"):
        kernel_requests(py)
