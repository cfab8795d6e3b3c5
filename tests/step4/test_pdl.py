"""Programmatic dependent launch: step4_gpt2/pdl.py (launch_pdl through cuLaunchKernelEx), pdl.cu's chain
kernels over common/include/pdl.cuh.
CPU part: the ctypes structures against cuda.h's layout (a C compiler reads the header), the argument packing,
the errors. GPU part (sm_90): chains of chain_v2 launched with the attribute, plain and captured in a CUDA
graph, against a float64 reference; the captured graph's edges are programmatic ones."""
import ctypes
import shutil
import subprocess
import types

import numpy as np
import pytest

from common import assert_close, poison, rand
from step4_gpt2 import pdl

gpu = pytest.mark.gpu
CU = "step4_gpt2/pdl.cu"


# ============================================================================ CPU: layout, packing, errors
LAYOUT_C = r"""
#include <stddef.h>
#include <stdio.h>
#include "cuda.h"
int main(void) {
    printf("%zu %zu %zu %zu %zu %zu %zu %d\n", sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, hStream),
           offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs), sizeof(CUlaunchAttribute),
           offsetof(CUlaunchAttribute, value),
           offsetof(CUlaunchAttribute, value.programmaticStreamSerializationAllowed),
           (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
    return 0;
}
"""


def test_structures_match_cuda_h(tmp_path):
    from common.kernels import _runtime_include
    cc = shutil.which("cc") or shutil.which("gcc")
    include = _runtime_include()
    if cc is None or not (include / "cuda.h").is_file():
        pytest.skip("needs a C compiler and cuda.h (the nvidia-cuda-runtime-cu12 wheel's headers)")
    src = tmp_path / "layout.c"
    src.write_text(LAYOUT_C)
    subprocess.run([cc, str(src), f"-I{include}", "-o", str(tmp_path / "layout")], check=True)
    got = [int(v) for v in subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True,
                                          text=True).stdout.split()]
    C, A, V = pdl.LaunchConfig, pdl.LaunchAttribute, pdl.LaunchAttributeValue
    assert got == [ctypes.sizeof(C), C.hStream.offset, C.attrs.offset, C.numAttrs.offset, ctypes.sizeof(A),
                   A.value.offset, A.value.offset + V.programmaticStreamSerializationAllowed.offset,
                   pdl.PROGRAMMATIC_STREAM_SERIALIZATION]


class FakeGPUArray:
    """What pack_args reads of a CuPy array: its device pointer, through __cuda_array_interface__."""

    def __init__(self, ptr):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (4,), "typestr": "<f4", "version": 3}


def test_pack_args_points_at_each_argument_in_its_c_type():
    args = (FakeGPUArray(0x7F0012345600), np.float32(1.5), np.int32(-7), np.int64(2**40 + 3), np.uint16(0xBEEF),
            np.float64(-0.25), np.bool_(True))
    params, values = pdl.pack_args(args)
    assert len(values) == len(args)
    read = [ctypes.c_void_p, ctypes.c_float, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint16, ctypes.c_double,
            ctypes.c_bool]
    got = [ctypes.cast(params[i], ctypes.POINTER(t)).contents.value for i, t in enumerate(read)]
    assert got == [0x7F0012345600, 1.5, -7, 2**40 + 3, 0xBEEF, -0.25, True]
    assert ctypes.sizeof(values[2]) == 4 and ctypes.sizeof(values[3]) == 8    # the kernel's int vs long long


@pytest.mark.parametrize("arg, says", [(3, "args[1]: a Python int"), (2.0, "args[1]: a Python float"),
                                       (np.zeros(3, np.float32), "args[1]: a NumPy array is host memory"),
                                       ("x", "args[1]: a GPU array or a NumPy scalar"),
                                       (np.complex64(1), "args[1]: a GPU array or a NumPy scalar")])
def test_pack_args_refuses_what_has_no_c_type(arg, says):
    with pytest.raises(TypeError, match=says.replace("[", r"\[").replace("]", r"\]")):
        pdl.pack_args((np.int32(1), arg))
    with pytest.raises(TypeError, match="args: a tuple"):
        pdl.pack_args(np.int32(1))


def test_launch_config_and_the_programmatic_attribute():
    attrs = pdl.programmatic_attrs()
    assert attrs[0].id == 6 and attrs[0].value.programmaticStreamSerializationAllowed == 1
    c = pdl.launch_config((5, 2), 256, 4096, 0xABC0, attrs)
    assert (c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, c.blockDimY, c.blockDimZ) == (5, 2, 1, 256, 1, 1)
    assert c.sharedMemBytes == 4096 and c.hStream == 0xABC0 and c.numAttrs == 1
    assert c.attrs[0].value.programmaticStreamSerializationAllowed == 1


@pytest.mark.parametrize("grid, block, smem, says", [((0,), 128, 0, "grid:"), ((1, 2, 3, 4), 128, 0, "grid:"),
                                                     (1, (32, 33), 0, "block: at most 1024"),
                                                     (1, (True,), 0, "block:"), (1, 64, -1, "shared_mem:")])
def test_launch_checks_its_arguments_before_the_gpu(grid, block, smem, says):
    with pytest.raises(ValueError, match=says):
        pdl.launch_pdl(object(), grid, block, (np.int32(1),), shared_mem=smem)


def test_launch_needs_sm_90(monkeypatch):
    import common.device as device
    monkeypatch.setattr(device, "require_gpu", lambda: None)
    monkeypatch.setattr(device, "device_info", lambda: {"sm": 80, "name": "Some A100"})
    with pytest.raises(RuntimeError, match=r"programmatic dependent launch .* needs compute capability 9\.0 .*"
                                           r"Some A100\) is 8\.0"):
        pdl.launch_pdl(object(), 1, 32, (np.int32(1),))


def test_a_driver_without_cuLaunchKernelEx_is_named(monkeypatch):
    import common.graphs as graphs
    monkeypatch.setattr(graphs, "_driver", lambda: types.SimpleNamespace())
    with pytest.raises(RuntimeError, match="cuLaunchKernelEx"):
        pdl._launch_kernel_ex()


def test_kernel_side_compiles_to_griddepcontrol_on_sm_90_only():
    """pdl.cuh's instructions are in chain_v2's code for sm_90 and absent below it (tests/test_compile.py
    compiles pdl.cu for every arch; this looks at what it compiled to)."""
    from common.device import nvrtc
    from common.kernels import INCLUDE, ROOT
    nv = nvrtc()
    src = (ROOT / CU).read_text()
    for arch, present in ((80, False), (90, True)):
        prog = nv.createProgram(src, "pdl.cu", (), ())
        try:
            nv.compileProgram(prog, (f"--gpu-architecture=compute_{arch}", f"-I{INCLUDE}"))
            ptx = nv.getPTX(prog)
        finally:
            nv.destroyProgram(prog)
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        assert ("griddepcontrol.wait" in ptx) is present and ("griddepcontrol.launch_dependents" in ptx) is present


# ============================================================================ GPU (sm_90): chains
def _chain_inputs(n, steps, seed):
    rng = np.random.default_rng(seed)
    # All positive and w ~ 1: no cancellation, and 24 steps neither vanish nor blow up, so fp32 stays ~1e-6.
    ws = [rand(n, rng=rng, low=0.9, high=1.1) for _ in range(steps)]
    bs = [np.float32(rng.uniform(0.1, 1.0)) for _ in range(steps)]
    return rand(n, rng=rng, low=0.5, high=1.5), ws, bs


def _reference(x, ws, bs):
    y = x.astype(np.float64)
    for w, b in zip(ws, bs):
        y = w.astype(np.float64) * y + np.float64(b)
    return y


def _enqueue(fn, x, ws, bufs, bs, n, stream, first_plain):
    """Kernel i reads bufs[i % 2] (x for the first) and writes bufs[(i + 1) % 2]; all but maybe the first PDL."""
    block = 256
    grid = (-(-n // block),)
    src = x
    for i, (w, b) in enumerate(zip(ws, bs)):
        dst = bufs[(i + 1) % 2]
        args = (w, src, dst, b, np.int32(n))
        if i == 0 and first_plain:
            with stream:                                             # CuPy launches on its current stream
                fn(grid, (block,), args)
        else:
            pdl.launch_pdl(fn, grid, (block,), args, stream)
        src = dst
    return src


def _skip_below_sm90():
    from common.device import device_info
    if device_info()["sm"] < pdl.PDL_ARCH:
        pytest.skip(f"programmatic dependent launch needs sm_90; this GPU is sm_{device_info()['sm']}")


@gpu
@pytest.mark.parametrize("n, steps, first_plain", [(1, 2, True), (1000, 2, True), (3 * 2**20 + 37, 2, False),
                                                   (2**22 + 5, 24, True)])
def test_chain_launched_with_pdl_matches_the_reference(n, steps, first_plain):
    import cupy as cp
    from common import get_kernel
    _skip_below_sm90()
    fn = get_kernel(CU, "chain_v2")
    x, ws, bs = _chain_inputs(n, steps, seed=n + steps)
    dx, dws = cp.asarray(x), [cp.asarray(w) for w in ws]
    bufs = [poison(cp.empty(n, cp.float32)), poison(cp.empty(n, cp.float32))]
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()     # the copies and the poison ran on the null stream: a non-blocking one
    out = _enqueue(fn, dx, dws, bufs, bs, n, stream, first_plain)      # does not wait for it
    stream.synchronize()
    assert_close(out.get(), _reference(x, ws, bs), rtol=2e-6)


def _programmatic_edges(graph_ptr: int) -> int | None:
    """How many edges of the CUgraph are programmatic (CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC); None when the
    driver cannot say (cuGraphGetEdges_v2 is CUDA 12.3's)."""
    from common.graphs import _driver
    get = getattr(_driver(), "cuGraphGetEdges_v2", None)
    if get is None:
        return None
    n = ctypes.c_size_t()
    assert get(ctypes.c_void_p(graph_ptr), None, None, None, ctypes.byref(n)) == 0
    src, dst = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)()
    data = (ctypes.c_ubyte * (8 * n.value))()                  # CUgraphEdgeData: from_port, to_port, type, reserved[5]
    assert get(ctypes.c_void_p(graph_ptr), src, dst, data, ctypes.byref(n)) == 0
    return sum(data[8 * i + 2] == 1 for i in range(n.value))


@gpu
@pytest.mark.parametrize("n, steps", [(1000, 2), (2**22 + 5, 24)])
def test_chain_captured_in_a_graph_replays_right_on_fresh_inputs(n, steps):
    import cupy as cp
    from common import capture_graph, get_kernel
    from common.graphs import record_graph
    _skip_below_sm90()
    fn = get_kernel(CU, "chain_v2")
    x, ws, bs = _chain_inputs(n, steps, seed=7 * n + steps)
    dx, dws = cp.asarray(x), [cp.asarray(w) for w in ws]
    bufs = [cp.empty(n, cp.float32), cp.empty(n, cp.float32)]
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    out = _enqueue(fn, dx, dws, bufs, bs, n, stream, True)           # warm-up: compiled before the capture
    graph = capture_graph(lambda: _enqueue(fn, dx, dws, bufs, bs, n, stream, True), stream)
    for seed in (1, 2):                                              # fresh inputs in the same buffers
        x2, ws2, _ = _chain_inputs(n, steps, seed=seed)
        dx.set(x2)
        for d, w in zip(dws, ws2):
            d.set(w)
        for b in bufs:
            poison(b)
        cp.cuda.Device().synchronize()       # as above: the null stream's work first
        graph.launch(stream)
        stream.synchronize()
        assert_close(out.get(), _reference(x2, ws2, bs), rtol=2e-6)
    recorded, _ = record_graph(lambda: _enqueue(fn, dx, dws, bufs, bs, n, stream, True), stream)
    edges = _programmatic_edges(recorded.graph)
    if edges is not None:
        assert edges == steps - 1                                    # every PDL launch kept its early start
