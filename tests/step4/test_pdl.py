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


# ============================================================================ CPU: the decode step's kernels
# Every kernel a decode step launches through step4_gpt2/ops.py, by the .cu that defines it, with the names in
# its body that hold another kernel's output (its activations, caches, tokens, positions): none may be read
# before pdl_wait(). Weights (W, bias, LayerNorm parameters, wte, wpe) may.
DECODE_KERNELS = {
    "step4_gpt2/gpt2.cu": {"embedding_v1": ("tokens", "positions", "out", "te", "pe"),
                           "embedding_v2": ("tokens", "positions", "out", "te", "pe", "o"),
                           "gemv_v3": ("x", "x4", "y", "k_cache", "v_cache", "pos"),
                           "gemv_v4": ("x", "x4", "y", "k_cache", "v_cache", "pos"),
                           "gemv_v5": ("x", "x4", "y", "k_cache", "v_cache", "pos", "xs4"),
                           "argmax_v1": ("logits", "tokens", "pos", "lens", "row"),
                           "argmax_v2": ("logits", "tokens", "pos", "lens", "row", "r4"),
                           "advance_v1": ("pos", "lens")},
    "step4_gpt2/gemv_lowp.cu": {"gemv_lowp": ("x", "x4", "y", "k_cache", "v_cache", "pos", "xs4"),
                                "gemv_tc": ("x", "x4", "y", "k_cache", "v_cache", "pos", "xs4", "xf", "xh")},
    "step2_attention/decode_attention.cu": {"decode_split": ("q", "kc", "vc", "lengths", "out", "partial"),
                                            "decode_combine": ("partial", "out", "p")},
}


def _body(src: str, name: str) -> str:
    """The body of function `name` (its first definition: `name(...) {` ... the matching `}`)."""
    import re
    m = re.search(rf"\b{name}\s*\([^;{{]*\)\s*{{", src)
    assert m, f"no definition of {name}"
    depth, i = 1, m.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        i += 1
    return src[m.end():i - 1]


def _code(text: str) -> str:
    """C++ without its // comments (which may name anything)."""
    return "\n".join(line.split("//")[0] for line in text.splitlines())


def _wait_problems(body: str, outputs) -> list[str]:
    """What breaks pdl.cuh's rules in a kernel body, read as text (see the test below for what that proves)."""
    import re
    body = _code(body)
    if body.count("pdl_wait();") != 1 or body.count("pdl_launch_dependents();") != 1:
        return ["not exactly one pdl_wait() and one pdl_launch_dependents()"]
    before, after = body.split("pdl_wait();")
    problems = []
    if not after.lstrip().startswith("pdl_launch_dependents();"):
        problems.append("pdl_launch_dependents() does not follow pdl_wait()")
    if before.count("{") != before.count("}") or re.search(r"\b(if|for|while)\s*\([^;{}]*\)\s*$", before):
        problems.append("pdl_wait() is inside a block or under a condition: some threads may skip it")
    if re.search(r"\breturn\b", before):
        problems.append("a thread may return before pdl_wait()")
    uses = re.sub(r"reinterpret_cast<[^>]*>\(\s*\w+\s*\)", "", before)       # a pointer formed, not read
    uses = re.sub(r"extern __shared__ [\w ]+\b\w+\[\];", "", uses)              # shared memory declared
    uses = re.sub(r"(\w)\*\s*\w+\s*=(?!=)", r"\1* =", uses)                      # a pointer declared: T* p =
    named = [v for v in outputs if re.search(rf"(?<![.\w]){v}\b", uses)]       # not blockIdx.x
    if named:
        problems.append(f"{named} used before pdl_wait()")
    return problems


@pytest.mark.parametrize("path, name", [(p, k) for p, ks in DECODE_KERNELS.items() for k in ks])
def test_every_decode_kernel_waits_before_it_reads_another_kernels_output(path, name):
    """A textual check of pdl.cuh's rules, per kernel: pdl_wait() is called once, at the top level of the body
    (every thread reaches it: not inside an if or a loop, no return before it), then pdl_launch_dependents();
    before the wait, the names that hold another kernel's output appear only inside reinterpret_cast<...>(),
    which forms a pointer without reading through it, or as the name a pointer is declared with (T* p = ...).
    What it does not prove: that a helper called before the wait (v5_load, lowp_load) reads only weights --
    they take only the weight pointer, which the check sees -- or what the compiler does with the order (the
    PTX test below looks at that for sm_90)."""
    from common.kernels import ROOT
    assert _wait_problems(_body((ROOT / path).read_text(), name), DECODE_KERNELS[path][name]) == []


@pytest.mark.parametrize("body, says", [
    ("const float v = x[i]; pdl_wait(); pdl_launch_dependents();", "['x'] used"),
    ("float4 a = __ldg(x4 + k); pdl_wait(); pdl_launch_dependents();", "['x4'] used"),
    ("if (i >= n) return; pdl_wait(); pdl_launch_dependents();", "return before"),
    ("if (i < n) { pdl_wait(); pdl_launch_dependents(); }", "inside a block"),
    ("if (i < n) pdl_wait(); pdl_launch_dependents();", "inside a block"),
    ("pdl_wait(); y[0] = 1; pdl_launch_dependents();", "does not follow"),
    ("y[0] = 1;", "not exactly one")])
def test_the_textual_check_catches_what_it_claims_to(body, says):
    problems = _wait_problems(body, ("x", "x4", "y"))
    assert any(says in p for p in problems), problems
    assert _wait_problems("const float4* x4 = reinterpret_cast<const float4*>(x); const int i = blockIdx.x;\n"
                          "pdl_wait(); pdl_launch_dependents(); y[i] = x4[i].x;", ("x", "x4", "y")) == []


def test_the_decode_kernels_have_the_instructions_on_sm_90():
    """What the compiler made of it, in the PTX for compute_90 of every instantiation the wrappers launch (with
    ops.py's defines, MAXB 8 and the batch-1 module's MAXB 1, this one also at its LayerNorm UNROLL):
    griddepcontrol.wait and .launch_dependents are there (pdl.cu's test shows them absent below sm_90), and the
    v5 / v6 / v7 GEMVs issue all ROWS x UNROLL streamed weight loads of their first tile (ld.global.cs) before the
    wait, v8 / v9 their TC_ROWS / 8 tiles x TC_UNROLL. ptxas may still schedule them later; only a profile on the
    GPU shows that."""
    from step4_gpt2 import ops
    wanted = {ops.CU: [n for n in ops.KERNEL_NAMES if n.split("<")[0] in DECODE_KERNELS["step4_gpt2/gpt2.cu"]],
              ops.LOWP_CU: [n for n in ops.LOWP_KERNEL_NAMES if n.startswith("gemv_v")]}
    ln1 = {p: ops._v5_unroll(None, True, 1, p) for p in (4, 8)}          # batch 1 behind the LayerNorm: its own UNROLL
    launched = [(ops.CU, ops.defines(ops.V5_ROWS, maxb=m)) for m in (ops.MAXB, 1)] + \
        [(ops.LOWP_CU, {**ops.lowp_defines(maxb=m), **ops.tc_defines(m)}) for m in (ops.MAXB, 1)] + \
        [(ops.CU, ops.defines(ops.V5_ROWS, ln1[4], 1)), (ops.LOWP_CU, {**ops.lowp_defines(unroll=ln1[8], maxb=1),
                                                                      **ops.tc_defines(1)})]   # gemv_module's
    for path, d in launched:
        names = wanted[path]
        entries = _ptx_entries(path, 90, names, d)
        missing = [n for n in names if "griddepcontrol.wait" not in entries[n]
                   or "griddepcontrol.launch_dependents" not in entries[n]]
        assert not missing, f"{path.name}: no griddepcontrol in {missing}"
        first_tile = d["ROWS"] * d.get("UNROLL", d.get("V5_UNROLL"))
        for n in names:
            if n.startswith(("gemv_v5", "gemv_v6", "gemv_v7", "gemv_v8", "gemv_v9")):
                want = d["TC_ROWS"] // 8 * d["TC_UNROLL"] if n.startswith(("gemv_v8", "gemv_v9")) else first_tile
                early = entries[n][:entries[n].index("griddepcontrol.wait")].count("ld.global.cs")
                assert early == want, f"{n}: {early} weight loads before the wait, not {want}"
    from step2_attention import flash                    # step 2's decode attention, launched by ops too
    names = list(DECODE_KERNELS["step2_attention/decode_attention.cu"])
    entries = _ptx_entries(flash.HERE / "decode_attention.cu", 90, names,
                           {"HEAD_DIM": 64, "WARPS": flash.DECODE_WARPS})
    assert all("griddepcontrol.wait" in entries[n] and "griddepcontrol.launch_dependents" in entries[n] for n in names)


def _ptx_entries(path, arch: int, names, defines=None) -> dict:
    """{name: the PTX of its .entry} for kernels `names` (extern "C" or template instantiations) of a .cu,
    compiled by NVRTC for compute_<arch> with `defines` (else the file's own defaults)."""
    import re
    from common.device import nvrtc
    from common.kernels import INCLUDE, _define_options, _runtime_include
    nv = nvrtc()
    prog = nv.createProgram(path.read_text(), path.name, (), ())
    try:
        for n in names:
            if "<" in n:
                nv.addNameExpression(prog, n)
        nv.compileProgram(prog, (f"--gpu-architecture=compute_{arch}", "--std=c++17", f"-I{INCLUDE}",
                                 f"-I{_runtime_include()}", *_define_options(defines)))
        ptx = nv.getPTX(prog)
        lowered = {n: nv.getLoweredName(prog, n) if "<" in n else n for n in names}
    finally:
        nv.destroyProgram(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    parts = re.split(r"\.entry\s+", ptx)[1:]
    entries = {p[:p.index("(")].strip(): p for p in parts}
    return {n: entries[lowered[n]] for n in names}


def test_programmatic_routes_the_launches_only_inside_and_on_sm_90(monkeypatch):
    """ops.programmatic(): launches go through pdl.launch_pdl inside it on sm_90+, through CuPy's launch
    outside it and below sm_90; the switch is restored on the way out, an error included."""
    from step4_gpt2 import ops
    calls = []

    class Kernel:
        def __call__(self, grid, block, args, shared_mem=0):
            calls.append(("plain", grid, block, shared_mem))
    monkeypatch.setattr(ops.pdl, "launch_pdl", lambda fn, grid, block, args, shared_mem=0:
                        calls.append(("pdl", grid, block, shared_mem)))
    for sm, inside in ((90, "pdl"), (100, "pdl"), (80, "plain"), (75, "plain")):
        monkeypatch.setattr(ops, "device_info", lambda sm=sm: {"sm": sm})
        calls.clear()
        ops._launch(Kernel(), (3,), (64,), (), 128)
        with ops.programmatic():
            ops._launch(Kernel(), (3,), (64,), (), 128)
            with ops.programmatic(False):
                ops._launch(Kernel(), (1,), (32,), ())
            ops._launch(Kernel(), (2,), (32,), ())
        ops._launch(Kernel(), (1,), (32,), ())
        assert [c[0] for c in calls] == ["plain", inside, "plain", inside, "plain"], sm
        assert calls[1][1:] == ((3,), (64,), 128)
    with pytest.raises(ZeroDivisionError):
        with ops.programmatic():
            1 / 0
    assert ops._switch == {"programmatic": False, "tensor_cores": True}
    with pytest.raises(ZeroDivisionError):
        with ops.tensor_cores(False):
            assert ops._switch["tensor_cores"] is False
            1 / 0
    assert ops._switch == {"programmatic": False, "tensor_cores": True}


def test_the_decoder_takes_the_switch_and_keeps_one_decoder_per_setting():
    """generate()'s decoder_options reach Decoder(programmatic=...), and make_decoder keys on them, so a graph
    captured with programmatic launches is never replayed for a call without (read from the signatures)."""
    import inspect
    from step4_gpt2 import generate as G
    assert inspect.signature(G.Decoder).parameters["programmatic"].default is False
    assert "decoder_options" in inspect.signature(G.generate).parameters
    assert "options.items()" in inspect.getsource(G.make_decoder)


def test_the_ladder_gains_pdl_rungs_against_their_bound_and_the_plain_graph():
    from step4_gpt2 import weights as W
    from step4_gpt2.model import weight_bytes_per_token
    from step4_gpt2.precision import benchmarks as PB
    pairs = {(p, b): (t, 0.8 * t) for p, t in zip(PB.PRECISIONS, (3e-3, 2e-3, 1.5e-3)) for b in (1, 8)}
    bw = 4000.0
    rows = PB.pdl_rows("gpt2-xl", pairs, bw)
    cfg = W.GPTConfig.from_name("gpt2-xl")
    rungs = [r for r in rows if r.name.endswith("(CUDA graph + PDL)")]
    assert len(rungs) == 6
    for r in rungs:
        p = r.name.split()[1]
        assert r.ceiling == f"{p} weight-bw bound" and r.anchor == "CUDA graph"
        assert r.fraction == pytest.approx(weight_bytes_per_token(cfg, p) / (r.ms / 1e3) / (bw * 1e9))
        assert r.ratio == pytest.approx(1 / 0.8)
    vs = {r.name: r.ratio for r in rows if r.name.endswith("vs fp32")}
    assert vs["decode int8 b=1 (CUDA graph + PDL) vs fp32"] == pytest.approx(3e-3 / 1.5e-3)
    assert not any(r.target for r in rows)                      # the targets stay on the plain graph's rows


# ============================================================================ GPU (sm_90): the decode step
def _decode_run(model, lens, steps, plan, programmatic, cuda_graph=True, seed=0):
    """Greedy decode of random prompts of `lens` tokens with lesson 4a's Decoder: every step's tokens (host) and
    logits (host), one step at a time (pipeline depth 1, so the logits read are that step's)."""
    from step4_gpt2.generate import Decoder, pad_prompts
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(0, model.config.vocab_size, n)) for n in lens]
    dec = Decoder(model, len(lens), max(lens) + steps, True, cuda_graph=cuda_graph, plan=plan,
                  programmatic=programmatic)
    dec.pipeline_depth = 1
    tokens, logits = [dec.prefill(pad_prompts(prompts), lens)], []
    with dec.stream:                      # on the decoder's stream: its first step writes after the poison
        poison(dec.state.logits)
    for t in dec.decode(steps):
        tokens.append(t)
        logits.append(dec.state.logits.get())
    return tokens, logits, dec


PDL_TINY = dict(n_layer=2, n_head=4, n_embd=128, vocab_size=1001, block_size=256)   # V: not a tile multiple
PDL_124M = dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=256)  # kernels big enough to overlap


@gpu
@pytest.mark.parametrize("shape", ["tiny", "124M"])
@pytest.mark.parametrize("plan", ["fused", "split"])
@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_greedy_decode_with_pdl_equals_without(precision, B, plan, shape):
    """Token for token, logits within 1e-6, every step; the longest prompt crosses the cache length where
    decode attention switches from v1 to v2 (split + combine), so both graphs run. At GPT-2 124M's shape the
    kernels are long enough for a missing wait to show as a race; the tiny one runs every kernel's edge cases."""
    from step4_gpt2 import weights as W
    from step4_gpt2.model import GPT
    _skip_below_sm90()
    cfg = W.GPTConfig(**(PDL_TINY if shape == "tiny" else PDL_124M))
    model = GPT(cfg, W.random_weights(cfg, seed=B, notice=False), precision=precision)
    lens = [124] + [int(n) for n in np.random.default_rng(B).integers(2, 124, B - 1)]
    steps = 12
    want_t, want_l, _ = _decode_run(model, lens, steps, plan, programmatic=False)
    got_t, got_l, dec = _decode_run(model, lens, steps, plan, programmatic=True)
    assert dec.info["attention_versions"] == {1, 2}
    assert all(np.array_equal(a, b) for a, b in zip(got_t, want_t))
    for k, (g, w) in enumerate(zip(got_l, want_l)):
        assert_close(g, w.astype(np.float64), rtol=1e-6, name=f"{precision} b={B} {plan} logits, step {k}")


@gpu
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_eager_decode_with_pdl_equals_the_plain_graph(precision):
    from step4_gpt2 import weights as W
    from step4_gpt2.model import GPT
    _skip_below_sm90()
    cfg = W.GPTConfig(**PDL_TINY)
    model = GPT(cfg, W.random_weights(cfg, seed=3, notice=False), precision=precision)
    lens = [5, 40, 17]
    want_t, want_l, _ = _decode_run(model, lens, 8, None, programmatic=False)
    got_t, got_l, _ = _decode_run(model, lens, 8, None, programmatic=True, cuda_graph=False)
    assert all(np.array_equal(a, b) for a, b in zip(got_t, want_t))
    assert_close(got_l[-1], want_l[-1].astype(np.float64), rtol=1e-6, name=f"{precision} eager + PDL")


@gpu
@pytest.mark.parametrize("plan", ["fused", "split"])
def test_the_captured_decode_step_keeps_programmatic_edges(plan):
    """Recorded as the Decoder captures it: the edges into our own kernels and step 2's decode attention are
    programmatic ones (the edge into a kernel after step 3's plain LayerNorm launches may be either); without
    programmatic(), none is."""
    from common.graphs import record_graph
    from step4_gpt2 import ops
    from step4_gpt2 import weights as W
    from step4_gpt2.model import GPT
    _skip_below_sm90()
    cfg = W.GPTConfig(**PDL_TINY)
    model = GPT(cfg, W.random_weights(cfg, seed=5, notice=False))
    _, _, dec = _decode_run(model, [9, 9], 2, plan, programmatic=True)
    s, L = dec.state, cfg.n_layer

    def step(on):
        with ops.programmatic(on):
            model.decode_step(s, greedy=True, attention_version=1, plan=plan)
    counts = {}
    for on in (False, True):
        graph, _ = record_graph(lambda: step(on), dec.stream)
        counts[on] = _programmatic_edges(graph.graph)
    if counts[True] is None:
        pytest.skip("this driver has no cuGraphGetEdges_v2 (CUDA 12.3): edge types cannot be read")
    assert counts[False] == 0
    # Edges between two kernels launched with PDL (ours and the attention, v1: one kernel) are programmatic for
    # sure; one from step 3's plain LayerNorms into ours may be either. fused, per block: qkv <- embedding or
    # mlp_proj, attention <- qkv, c_proj <- attention, c_fc <- c_proj, mlp_proj <- c_fc; then lm_head <- mlp_proj,
    # argmax <- lm_head, all sure. split, per block: attention, c_proj and mlp_proj sure, qkv and c_fc after a
    # LayerNorm either; lm_head either, argmax sure.
    sure = {"fused": 5 * L + 2, "split": 3 * L + 1}[plan]
    assert sure <= counts[True] <= 5 * L + 2, counts
