"""common/ on the CPU: the comparison helpers must catch what they exist to catch."""
import re
from pathlib import Path

import numpy as np
import pytest

from common import assert_close, errors, poison, rand, launch_grid
from common.timing import Timing, bench


def test_assert_close_passes_on_rounding_and_reports_errors():
    ref = rand(1000, dtype=np.float64, seed=1)
    rel, mx = assert_close(ref.astype(np.float32), ref, rtol=1e-6)
    assert 0 < rel < 1e-7 and 0 < mx < 1e-7


def test_max_rel_error_is_relative_to_the_scale_and_refuses_bad_output():
    from common import max_rel_error
    ref = np.array([[4.0, -2.0], [0.0, 1.0]])
    assert max_rel_error(ref + np.array([[0.0, 0.0], [0.02, 0.0]]), ref) == pytest.approx(0.005)
    assert max_rel_error(np.array([[4.0, np.nan], [0.0, 1.0]]), ref) == float("inf")
    with pytest.raises(ValueError, match="shape"):
        max_rel_error(ref.ravel(), ref)


def test_is_poisoned_finds_poisons_fill_in_every_dtype():
    from common.check import is_poisoned
    for dtype in (np.float32, np.int32, np.uint16):
        a = poison(np.empty(5, dtype))
        a[2] = 3
        assert is_poisoned(a).tolist() == [True, True, False, True, True], dtype


def test_assert_close_catches_a_wrong_element():
    ref = rand(1000, dtype=np.float64, seed=2)
    out = ref.copy(); out[123] += 0.5
    with pytest.raises(AssertionError, match=r"index \(123,\)"):
        assert_close(out, ref, rtol=1e-6)


def test_assert_close_catches_unwritten_poisoned_output():
    ref = rand(64, dtype=np.float64, seed=3)
    out = poison(np.empty(64, dtype=np.float32)); out[:63] = ref[:63]
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(out, ref, rtol=1.0)


def test_assert_close_checks_shape_and_max_abs():
    ref = rand(10, dtype=np.float64, seed=4)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(ref[:9], ref)
    out = ref.copy(); out[0] += 1e-3
    assert_close(out, ref, rtol=1e-2)
    with pytest.raises(AssertionError, match="max abs error"):
        assert_close(out, ref, rtol=1e-2, atol=1e-4)


def test_errors_matches_infinities_and_flags_mismatch():
    ref = np.array([1.0, -np.inf, 2.0])
    assert errors(np.array([1.0, -np.inf, 2.0]), ref) == (0.0, 0.0)
    assert errors(np.array([1.0, 0.0, 2.0]), ref) == (float("inf"), float("inf"))


def test_rand_is_seeded_and_never_zero_filled():
    a, b = rand(4, 5, seed=7), rand(4, 5, seed=7)
    assert a.dtype == np.float32 and a.shape == (4, 5) and np.array_equal(a, b)
    assert np.count_nonzero(a) == a.size and not np.array_equal(a, rand(4, 5, seed=8))



def test_rand_on_the_gpu_rejects_what_it_cannot_draw():
    with pytest.raises(ValueError, match=r"^rng: "):
        rand(4, gpu=True, rng=np.random.default_rng(0))
    with pytest.raises(TypeError, match=r"^dtype: expected float32 or float64"):
        rand(4, gpu=True, dtype=np.int32)


@pytest.mark.gpu
def test_rand_on_the_gpu_is_seeded_in_range_and_float32_throughout():
    import cupy as cp
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    n = 1 << 24
    before = pool.total_bytes()
    a = rand(n, seed=3, low=0.5, high=1.5, gpu=True)
    assert pool.total_bytes() - before < 12 * n            # the result (4n) and no float64 temporary (8n) beside it
    b = rand(n, seed=3, low=0.5, high=1.5, gpu=True)
    assert isinstance(a, cp.ndarray) and a.dtype == cp.float32 and a.shape == (n,)
    assert bool((a == b).all()) and not bool((a == rand(n, seed=4, low=0.5, high=1.5, gpu=True)).all())
    lo, hi, mean = float(a.min()), float(a.max()), float(a.mean(dtype=cp.float64))
    assert 0.5 <= lo < 0.501 and 1.499 < hi <= 1.5 and abs(mean - 1.0) < 1e-3


def test_launch_grid():
    assert launch_grid(1, 256) == (1,)
    assert launch_grid(257, 256) == (2,)
    assert launch_grid(10**9, 256, max_blocks=1000) == (1000,)


def test_timing_rates_and_cpu_bench():
    t = Timing("x", [1.0, 2.0, 3.0], [1.0, 2.0, 3.0], bytes=2e9, flops=4e12)
    assert t.median_ms == 2.0 and t.gbps == pytest.approx(1000.0) and t.tflops == pytest.approx(2000.0)
    assert t.fraction(2000.0) == pytest.approx(0.5)
    c = bench(lambda: sum(range(1000)), cpu=True, repeat=7, name="py")
    assert len(c.times_ms) == 7 and c.median_ms > 0


def test_expect_array_rejects_numpy_with_a_hint():
    pytest.importorskip("cupy")
    from common import expect_array
    with pytest.raises(TypeError, match=r"x: expected a cupy.ndarray.*cupy.asarray"):
        expect_array(np.zeros(3, np.float32), "x")


def test_kernel_source_extracts_one_kernel_with_its_comment():
    from common import kernel_source
    src = kernel_source("step1_simple/axpb.cu", "axpb_v2")
    assert src.startswith("// v2") and "axpb_v2" in src and "axpb_v3" not in src and src.rstrip().endswith("}")
    with pytest.raises(KeyError):
        kernel_source("step1_simple/axpb.cu", "nope")


def test_benchmark_runner_import_does_not_shadow_bench():
    import common
    import common.benchmarks  # noqa: F401  (the runner module)
    from common import bench as b
    assert callable(b) and b is common.timing.bench


def test_poison_every_dtype():
    assert np.isnan(poison(np.empty(3, np.float16))).all()
    assert (poison(np.empty(3, np.int32)) == -1).all()
    bits = poison(np.empty(3, np.uint16))
    assert (bits == 0xFFFF).all()
    as_f32 = (bits.astype(np.uint32) << 16).view(np.float32)      # bf16 bits -> float32
    assert np.isnan(as_f32).all()


def test_offline_compile_leaves_the_interpreter_intact():
    """Regression: an empty NVRTC log once overwrote CPython's shared b' ' object."""
    from common import compile_offline
    compile_offline("step1_simple/zoo.cu", 80)
    assert b" " == bytes([32]) and b" ".decode() == " "


def test_the_ptxas_report_reads_shared_memory_after_a_stack_size():
    """A kernel that spills gets "N bytes cumulative stack size" between its registers and its shared memory."""
    from common.kernels import _PTXAS_USED
    line = "ptxas info    : Used 48 registers, used 1 barriers, {}384 bytes smem"
    for stack in ("", "8 bytes cumulative stack size, "):
        m = _PTXAS_USED.search("ptxas info    : Compiling entry function 'k' for 'sm_90'\n" + line.format(stack))
        assert (m[1], m[2], m[3]) == ("k", "48", "384"), stack


# --- the helpers every wrapper shares -----------------------------------------------------------------------

def test_expect_choice_names_the_argument_and_the_choices():
    from common import expect_choice
    assert expect_choice(3, "version", (1, 2, 3)) == 3
    with pytest.raises(ValueError, match=r"version: expected one of \(1, 2, 3\), got 4"):
        expect_choice(4, "version", (1, 2, 3))


def test_launch_grid_per_sm_caps_at_the_gpus_sm_count(monkeypatch):
    """per_sm multiplies the SM count that device_info() reports (replaced here by a 132-SM GPU's numbers:
    the arithmetic is what is tested; test_launch_grid_per_sm_on_this_gpu uses the real device)."""
    import common.device
    monkeypatch.setattr(common.device, "device_info", lambda: {"multiprocessors": 132})
    assert launch_grid(10**9, 256, per_sm=16) == (132 * 16,)
    assert launch_grid(10**9, 256, max_blocks=1000, per_sm=16) == (1000,)
    assert launch_grid(1000, 256, per_sm=16) == (4,)           # small n: the cap does not matter


@pytest.mark.gpu
def test_launch_grid_per_sm_on_this_gpu():
    from common import device_info
    sms = device_info()["multiprocessors"]
    assert launch_grid(10**9, 128, per_sm=8) == (8 * sms,)


def test_expect_int_names_the_argument_and_returns_an_int():
    import numpy as np
    from common import expect_int
    assert expect_int(np.int64(3), "n") == 3 and type(expect_int(np.int64(3), "n")) is int
    assert expect_int(2, "world", minimum=2) == 2
    for bad in (0, -1, True, 2.0, "3", None):
        with pytest.raises(ValueError, match=rf"^n: expected a positive integer, got {re.escape(repr(bad))}$"):
            expect_int(bad, "n")
    with pytest.raises(ValueError, match=r"^nprocs: expected a number of processes >= 1, got 0$"):
        expect_int(0, "nprocs", expected="a number of processes >= 1")


def test_out_array_checks_a_given_buffer_before_any_gpu_work():
    pytest.importorskip("cupy")
    from common import out_array
    with pytest.raises(TypeError, match=r"^y: expected a cupy.ndarray"):
        out_array(np.empty(4, np.float32), (4,), name="y")


@pytest.mark.gpu
def test_out_array_new_or_checked():
    import cupy as cp
    from common import out_array
    a = out_array(None, (3, 5), np.float16)
    assert isinstance(a, cp.ndarray) and a.shape == (3, 5) and a.dtype == np.float16
    b = cp.empty((3, 5), np.float32)
    assert out_array(b, [3, 5]) is b
    with pytest.raises(ValueError, match=r"out: expected shape \(4, 5\)"):
        out_array(b, (4, 5))
    with pytest.raises(TypeError, match="out: expected dtype float16"):
        out_array(b, (3, 5), np.float16)
    with pytest.raises(ValueError, match="C-contiguous"):
        out_array(cp.empty((5, 3), np.float32).T, (3, 5))


@pytest.mark.gpu
def test_get_kernel_compiles_a_template_instantiation(tmp_path):
    """A template name goes through CuPy's name_expressions: no extern "C" wrapper needed."""
    import cupy as cp
    from common import get_kernel
    src = tmp_path / "scale.cu"
    src.write_text("template <int K>\n__global__ void scale(const float* x, float* y, int n) {\n"
                   "    int i = blockIdx.x * blockDim.x + threadIdx.x;\n    if (i < n) y[i] = K * x[i];\n}\n")
    x = cp.asarray(rand(1000, seed=5))
    for k in (3, 7):
        y = poison(cp.empty_like(x))
        get_kernel(src, f"scale<{k}>")((4,), (256,), (x, y, np.int32(1000)))
        assert_close(y, k * x.get().astype(np.float64))
    assert get_kernel(src, "scale<3>") is get_kernel(src, "scale<3>")       # cached


def test_get_kernel_refuses_a_template_name_not_among_templates():
    """A name missing from the .cu's CU_TEMPLATES would compile a module of its own: refused, before any GPU
    work (so on any machine), naming the argument and the names it may be."""
    from common import get_kernel
    with pytest.raises(ValueError, match=r"^name: 'scale<5>' is not one of templates \('scale<3>', 'scale<7>'\)"):
        get_kernel("step1_simple/axpb.cu", "scale<5>", templates=("scale<3>", "scale<7>"))


@pytest.mark.gpu
def test_get_kernel_compiles_all_templates_of_a_file_into_one_module(tmp_path, monkeypatch):
    """With templates=, every instantiation (and an extern "C" kernel of the same file) comes from one compile."""
    import cupy as cp
    from common import get_kernel
    src = tmp_path / "shift.cu"
    src.write_text("template <int K>\n__global__ void shift(const float* x, float* y, int n) {\n"
                   "    int i = blockIdx.x * blockDim.x + threadIdx.x;\n    if (i < n) y[i] = x[i] + K;\n}\n"
                   'extern "C" __global__ void neg(const float* x, float* y, int n) {\n'
                   "    int i = blockIdx.x * blockDim.x + threadIdx.x;\n    if (i < n) y[i] = -x[i];\n}\n")
    names = ("shift<2>", "shift<5>")
    compiled = []
    real = cp.RawModule
    monkeypatch.setattr(cp, "RawModule", lambda *a, **k: compiled.append(k.get("name_expressions")) or real(*a, **k))
    x = cp.asarray(rand(1000, seed=6))
    for k in (2, 5):
        y = poison(cp.empty_like(x))
        get_kernel(src, f"shift<{k}>", templates=names)((4,), (256,), (x, y, np.int32(1000)))
        assert_close(y, x.get().astype(np.float64) + k)
    y = poison(cp.empty_like(x))
    get_kernel(src, "neg", templates=names)((4,), (256,), (x, y, np.int32(1000)))
    assert_close(y, -x.get().astype(np.float64))
    assert compiled == [names], compiled
    assert get_kernel(src, "shift<5>", templates=names) is get_kernel(src, "shift<5>", templates=list(names))


@pytest.mark.gpu
def test_occupancy_is_the_drivers_count_and_names_a_limit(tmp_path):
    """blocks_per_sm is what cuOccupancyMaxActiveBlocksPerMultiprocessor says, also for dynamic shared memory
    above 48 KB that the kernel has not opted in to yet (the launch will); an opt-in is never lowered."""
    from cupy.cuda import driver
    from common import device_info, get_kernel, occupancy
    src = tmp_path / "dyn.cu"
    src.write_text('extern "C" __global__ void dyn(float* y) {\n    extern __shared__ float s[];\n'
                   "    s[threadIdx.x] = threadIdx.x;\n    __syncthreads();\n    y[threadIdx.x] = s[blockDim.x - 1 - threadIdx.x];\n}\n")
    k = get_kernel(src, "dyn")
    occ = occupancy(k, 256)
    assert occ["blocks_per_sm"] == driver.occupancyMaxActiveBlocksPerMultiprocessor(k.kernel.ptr, 256, 0) >= 1
    d = device_info()     # a few registers, no static shared memory: threads or the block limit bind
    assert k.num_regs <= 32 and occ["blocks_per_sm"] == min(d["max_threads_per_sm"] // 256, d["max_blocks_per_sm"])
    assert occ["warps_per_sm"] == 8 * occ["blocks_per_sm"]
    assert occ["limited_by"] in ("registers", "threads", "shared memory", "blocks per SM")
    assert set(occ) == {"registers", "local_bytes", "blocks_per_sm", "warps_per_sm", "occupancy", "limited_by"}
    big = 50 << 10
    if device_info()["shared_per_block_optin"] < big:
        pytest.skip("this GPU allows less than 50 KB of shared memory per block")
    assert occupancy(k, 256, big)["blocks_per_sm"] >= 1 and k.max_dynamic_shared_size_bytes >= big
    k.max_dynamic_shared_size_bytes = device_info()["shared_per_block_optin"]
    occupancy(k, 256, big)
    assert k.max_dynamic_shared_size_bytes == device_info()["shared_per_block_optin"]


@pytest.mark.gpu
def test_a_library_calls_workspace_memsets_move_off_the_graphs_path():
    """capture_graph moves a memset that a library call (noted by common.graphs.cublas_call, as cublas.gemm
    notes its cuBLAS calls) makes into its own workspace: it then waits for the previous call on that workspace
    only, the call's kernel also waits for what came before the call, and the replay gives the same result.
    Two such calls with a kernel between them; a memset outside the workspace, or not the call's first node,
    stays where it is. The edges are read back from the graph."""
    import ctypes
    import cupy as cp
    from common import capture_graph
    from common.graphs import CapturedGraph, _MemsetParams, _call, _nodes, cublas_call, record_graph
    ws, other = cp.empty(64, cp.int32), cp.empty(64, cp.int32)
    add_ws = cp.ElementwiseKernel("float32 x, raw int32 ws", "float32 y", "y = x + ws[0] + ws[63] + 1.0f",
                                  "add_ws")
    x = cp.asarray(rand(1000, seed=5))
    y, z, w = (poison(cp.empty_like(x)) for _ in range(3))
    stream = cp.cuda.Stream(non_blocking=True)

    def call(src, dst, also_other=False):
        with cublas_call(stream.ptr, (ws.data.ptr, ws.nbytes)):
            cp.cuda.runtime.memsetAsync(ws.data.ptr, 0, ws.nbytes, stream.ptr)
            add_ws(src, ws, dst)
            if also_other:
                cp.cuda.runtime.memsetAsync(ws.data.ptr, 0, 4, stream.ptr)        # not the call's first node
                cp.cuda.runtime.memsetAsync(other.data.ptr, 0, 4, stream.ptr)     # outside the workspace

    def body():
        call(x, y)
        cp.multiply(y, 2.0, out=z)
        call(z, w, also_other=True)

    def memsets(graph):
        """{(dst, bytes): [node, ...]} of the graph's memset nodes, in no particular order."""
        n = ctypes.c_size_t()
        _call("cuGraphGetNodes", ctypes.c_void_p(graph), None, ctypes.byref(n))
        nodes = (ctypes.c_void_p * n.value)()
        _call("cuGraphGetNodes", ctypes.c_void_p(graph), nodes, ctypes.byref(n))
        found = {}
        for node in nodes:
            kind, p = ctypes.c_int(), _MemsetParams()
            _call("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(kind))
            if kind.value == 2:
                _call("cuGraphMemsetNodeGetParams", ctypes.c_void_p(node), ctypes.byref(p))
                found.setdefault((p.dst, p.width * p.elementSize), []).append(node)
        return found

    with stream:
        body()
    stream.synchronize()
    for hoist in (True, False):
        g = capture_graph(body, stream) if hoist else record_graph(body, stream)[0]
        assert isinstance(g, CapturedGraph) == hoist
        m = memsets(g._graph.graph if hoist else g.graph)
        first = m[ws.data.ptr, ws.nbytes]                    # each call's first node
        m1 = next(n for n in first if not _nodes("cuGraphNodeGetDependencies", n))
        m2 = next(n for n in first if n != m1)
        (k1,) = _nodes("cuGraphNodeGetDependentNodes", m1)   # call 1's kernel
        (mul,) = [n for n in _nodes("cuGraphNodeGetDependentNodes", k1) if n != m2]
        (k2,) = _nodes("cuGraphNodeGetDependentNodes", m2)   # call 2's kernel
        assert _nodes("cuGraphNodeGetDependencies", mul) == [k1]
        assert _nodes("cuGraphNodeGetDependencies", m2) == ([k1] if hoist else [mul])
        assert set(_nodes("cuGraphNodeGetDependencies", k2)) == ({m2, mul} if hoist else {m2})
        later, outside = m[ws.data.ptr, 4][0], m[other.data.ptr, 4][0]     # not moved: after k2, in order
        assert _nodes("cuGraphNodeGetDependencies", later) == [k2]
        assert _nodes("cuGraphNodeGetDependencies", outside) == [later]
        if hoist:
            assert g.hoisted == 2                              # m1 (no edges to change) and m2
        for _ in range(3):
            with stream:                                       # garbage in the workspace, NaN in the outputs
                ws.fill(7)
                for a in (y, z, w):
                    a.fill(cp.nan)
            g.launch(stream)
            stream.synchronize()
            assert_close(w, (x.get().astype(np.float64) + 1) * 2 + 1)


def test_fp32_peak_is_computed_from_device_info(monkeypatch):
    """One cached device query: the peak is SMs x fp32 lanes per SM x 2 x the clock device_info() reports."""
    import common.device as dev
    monkeypatch.setattr(dev, "device_info", lambda: {"sm": 90, "multiprocessors": 132, "clock_khz": 1_980_000})
    assert dev.fp32_peak_tflops.__wrapped__() == pytest.approx(2 * 132 * 128 * 1.98e9 / 1e12)
    monkeypatch.setattr(dev, "device_info", lambda: {"sm": 80, "multiprocessors": 108, "clock_khz": 1_410_000})
    assert dev.fp32_peak_tflops.__wrapped__() == pytest.approx(2 * 108 * 64 * 1.41e9 / 1e12)
    monkeypatch.setattr(dev, "device_info", lambda: {"sm": 80, "multiprocessors": 108, "clock_khz": None})
    assert dev.fp32_peak_tflops.__wrapped__() is None


class _Readback:
    """Stands in for a CuPy buffer where only its read-back (.get()) matters."""

    def __init__(self, a):
        self.a = a

    def get(self):
        return self.a


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.uint16])
def test_exercise_guards_are_poisoned_and_read_back_alike(dtype):
    """An exercise's guard is filled by common.poison, and a write into it is found whatever the dtype."""
    from common.exercises import _guard_damage
    buf = poison(np.empty(12, dtype))
    buf[4:8] = 3
    assert _guard_damage(_Readback(buf), (4, 8)) is None
    buf[9] = 3
    assert "past the end" in _guard_damage(_Readback(buf), (4, 8))
    buf = poison(np.empty(12, dtype))
    buf[1] = 3
    assert "before the start" in _guard_damage(_Readback(buf), (4, 8))


# --- no GPU, or an old driver: one message before the first CUDA call ---------------------------------------

def _driver_loadable() -> bool:
    import ctypes
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_driver_loadable(), reason="this machine has an NVIDIA driver; the no-driver message is "
                                                "checked where libcuda cannot be loaded (CI)")
def test_every_gpu_entry_point_says_there_is_no_driver():
    """Real, not mocked: on a machine without libcuda, each entry point raises the same RuntimeError, which
    names what is missing and where to read on, before any CUDA call (no CUDARuntimeError)."""
    pytest.importorskip("cupy")
    import common
    from common.device import skip_reason
    assert skip_reason().startswith("no NVIDIA driver found (libcuda could not be loaded)")
    calls = {"require_gpu": common.require_gpu, "device_info": common.device_info,
             "fp32_peak_tflops": common.fp32_peak_tflops, "copy_bandwidth": common.copy_bandwidth,
             "bench": lambda: common.bench(lambda: None), "out_array": lambda: common.out_array(None, (4,)),
             "capture_graph": lambda: common.capture_graph(lambda: None),
             "load_module": lambda: common.load_module("step1_simple/axpb.cu"),
             "launch_grid(per_sm=)": lambda: launch_grid(10, 4, per_sm=2)}
    for name, call in calls.items():
        with pytest.raises(RuntimeError) as e:
            call()
        msg = str(e.value)
        assert type(e.value) is RuntimeError, f"{name}: {type(e.value).__name__}: {msg}"
        assert msg.startswith("This needs an NVIDIA GPU with a working driver: no NVIDIA driver found"), name
        assert "docs/environment.md" in msg, name


def test_old_driver_message_gives_both_versions_and_what_to_do():
    from common.device import driver_too_old
    msg = driver_too_old(11080, 12090)
    assert "supports CUDA 11.8" in msg and "needs CUDA 12.9" in msg and "525 or newer" in msg



# --- in a notebook without a GPU: after the course's message, no misleading "driver version is insufficient" ---

class _FakeShell:
    """What notebook_cuda_error uses of IPython's shell, recording what it was asked to show."""
    def __init__(self):
        self.shown, self.custom_exceptions = [], ()

    def showtraceback(self, exc_tuple=None, tb_offset=None):
        self.shown.append(("traceback", exc_tuple[0], str(exc_tuple[1])))

    def _showtraceback(self, etype, evalue, stb):
        self.shown.append(("lines", etype, stb))

    def set_custom_exc(self, exc_tuple, handler):
        self.custom_exceptions, self.handler = exc_tuple, handler


def test_notebook_cuda_error_handler_says_the_course_line_only_without_a_gpu(monkeypatch):
    """Called directly with the CuPy error a driverless machine raises (cudaErrorInsufficientDriver, made here
    by CuPy itself): the one line without a GPU; the untouched traceback where a GPU works (a real error)."""
    pytest.importorskip("cupy")
    from cupy_backends.cuda.api.runtime import CUDARuntimeError
    import common.device as dev
    err = CUDARuntimeError(35)
    assert "insufficient" in str(err)
    monkeypatch.setattr(dev, "skip_reason", lambda: "no NVIDIA driver found (libcuda could not be loaded)")
    shell = _FakeShell()
    assert dev.notebook_cuda_error(shell, type(err), err, None) is None
    [(kind, etype, lines)] = shell.shown
    assert kind == "lines" and etype is RuntimeError and len(lines) == 1
    assert lines[0].startswith("This needs an NVIDIA GPU with a working driver: no NVIDIA driver found")
    assert "insufficient" not in lines[0] and "docs/environment.md" in lines[0]
    monkeypatch.setattr(dev, "skip_reason", lambda: None)
    shell = _FakeShell()
    dev.notebook_cuda_error(shell, type(err), err, None)
    assert shell.shown == [("traceback", type(err), str(err))]


def test_notebook_handler_is_installed_only_inside_ipython_and_keeps_a_shells_own(monkeypatch):
    import sys
    import types
    import common.device as dev
    pytest.importorskip("cupy")
    shell = _FakeShell()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: None))
    assert dev.install_notebook_handler() is False                    # IPython imported, but not running
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    assert dev.install_notebook_handler() is True
    assert shell.handler is dev.notebook_cuda_error and all(issubclass(e, Exception) for e in shell.custom_exceptions)
    own = _FakeShell(); own.custom_exceptions = (KeyError,)
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: own))
    assert dev.install_notebook_handler() is False and own.custom_exceptions == (KeyError,)


@pytest.mark.skipif(_driver_loadable(), reason="this machine has an NVIDIA driver; checked where libcuda cannot "
                                                "be loaded (CI)")
def test_a_notebook_cell_without_a_driver_shows_the_course_line_not_cupys():
    """Real, in a fresh IPython shell as a notebook runs one: after `import common` (a notebook's first cell), a
    later cell's CuPy call fails with the course's one line and no traceback; other errors keep theirs."""
    pytest.importorskip("IPython")
    import subprocess
    import sys
    from common.kernels import ROOT
    code = ("from IPython.core.interactiveshell import InteractiveShell\n"
            "sh = InteractiveShell.instance()\n"
            "assert sh.run_cell('import common, cupy as cp').success\n"
            "print('cell 2 failed:', not sh.run_cell('x = cp.zeros(3)').success)\n"
            "sh.run_cell('1 / 0')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "cell 2 failed: True" in out
    assert "This needs an NVIDIA GPU with a working driver: no NVIDIA driver found" in out
    assert "insufficient" not in out and "CUDARuntimeError" not in out
    assert "ZeroDivisionError" in out                                 # not a CUDA error: shown as usual


# --- python -m common.benchmarks: names are checked before any GPU work -------------------------------------

def _benchmarks(*args):
    import subprocess
    import sys
    from common.kernels import ROOT
    return subprocess.run([sys.executable, "-m", "common.benchmarks", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_benchmarks_unknown_name_is_an_error_listing_the_valid_ones():
    r = _benchmarks("--only", "step1")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "unknown name 'step1'" in r.stderr and "step1_simple" in r.stderr and "step2_attention:flash" in r.stderr
    assert "GPU" not in r.stderr                      # refused before anything asked for a GPU
    r = _benchmarks("--only", "step2_attention:flsh")
    assert r.returncode == 2 and "unknown name 'step2_attention:flsh'" in r.stderr


def test_benchmarks_help_and_list_without_a_gpu():
    r = _benchmarks("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m common.benchmarks")
    for word in ("seed", "issue", "target", "MISSED", " met"):
        assert word not in r.stdout, word
    r = _benchmarks("--list")
    names = r.stdout.split()
    assert r.returncode == 0 and "step1_simple" in names and "step2_attention:flash" in names
    assert "step2_attention:softmax" in names


def test_benchmarks_family_selection():
    from common.benchmarks import select
    jobs = select(["step2_attention:flash"])
    assert jobs == [("step2_attention:flash", "step2_attention.benchmarks_flash", None)]
    assert select(["step2_attention:softmax"]) == [("step2_attention:softmax", "step2_attention.benchmarks",
                                                    "softmax_rows")]
    # a family inside a module that runs whole anyway is not run twice
    both = select(["step2_attention:flash", "step2_attention:decode"])
    assert [j[1:] for j in both] == [("step2_attention.benchmarks_flash", None)]
    with pytest.raises(ValueError, match="valid names are: step1_simple"):
        select(["nope"])


@pytest.mark.skipif(_driver_loadable(), reason="this machine has an NVIDIA driver")
def test_benchmarks_without_a_gpu_says_so_without_a_traceback():
    r = _benchmarks("--only", "step1_simple")
    assert r.returncode == 1 and "no NVIDIA driver found" in r.stderr and "Traceback" not in r.stderr


def test_row_check_records_upper_bounds_and_ranges():
    from common.benchmarks import Row
    row = Row("x", "s", 1.0)
    assert row.check("ratio", 1.9).target == "ratio >= 1.9"
    assert row.check("rate", None, at_most=10).target == "rate <= 10"
    assert row.check("ratio", 0.8, at_most=1.25).target == "ratio >= 0.8 and ratio <= 1.25"
    with pytest.raises(ValueError, match="reference, at_most"):
        row.check("fraction", None)
    with pytest.raises(ValueError, match="what"):
        row.check("ms", 1.0)


def test_benchmark_table_prints_measured_values_not_verdicts():
    from common.benchmarks import Row, table
    from common.timing import Timing
    t, anchor = Timing("k", [1.0], [1.0], bytes=2e9), Timing("a", [2.0], [2.0], bytes=2e9)
    row = Row.of(t, "1M", ceiling=("copy bw", 4000.0), anchor=("ref", anchor), target=("ratio", 3.0))
    text = table([row])
    assert "2.00x ref" in text and "50.0% copy bw" in text
    assert "target" not in text and "met" not in text and "MISSED" not in text
    assert row.record()["target"] == "ratio >= 3" and "met" not in row.record()


def test_small_rates_keep_two_significant_digits():
    from common.benchmarks import cells, rate_text
    assert [rate_text(v) for v in (123456.7, 12.34, 0.0022356, 0.088, 0.0, -0.0004)] == \
        ["123,457", "12.3", "0.0022", "0.088", "0.0", "-0.0004"]
    assert cells({"size": "s", "ms": 1.0, "rate": 0.0022356, "unit": "% ppl"})[2] == "0.0022 % ppl"


# --- the course's modules: each imports alone, no import cycle, the reading path imports nothing from a lab --

def _course_modules() -> dict:
    """{dotted name: file} of every Python module of the course: common (with common.reference) and every step
    package, its subpackages and lab/ folders included; discovered from the tree, so moved modules count."""
    from common.kernels import ROOT
    tops = [ROOT / "common", *sorted(p for p in ROOT.glob("step*") if (p / "__init__.py").is_file())]
    mods = {}
    for top in tops:
        for f in sorted(top.rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            if any(not p.isidentifier() for p in parts):      # .ipynb_checkpoints and the like
                continue
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _imports(name: str, path, mods: dict) -> set:
    """The course modules `name` imports anywhere in its file (at the top or inside a function: a cycle through
    an import inside a function still ties the two modules together). `from p import x` counts as importing
    the module p.x when there is one, else p itself (x is then a name p's __init__ defines)."""
    import ast
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for a in node.names:
                found.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod)
    out = set()
    for m in found:
        while m and m not in mods:          # `import step1_simple.ops as x` and friends: the module itself
            m = m.rpartition(".")[0]
        if m and m != name:
            out.add(m)
    return out


def _cycles(graph: dict) -> list:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1
        stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1
                    stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    return comps


def test_course_modules_are_discovered():
    mods = _course_modules()
    for name in ("common", "common.device", "common.kernels", "common.reference", "step1_simple.ops",
                 "step2_attention.flash"):
        assert name in mods, name
    assert not any("checkpoint" in m for m in mods)


def test_no_import_cycles_among_the_course_modules():
    mods = _course_modules()
    graph = {m: _imports(m, f, mods) for m, f in mods.items()}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]   # the finder finds
    cycles = _cycles(graph)
    assert not cycles, "import cycles (each list imports itself through the others, counting imports inside " \
                       "functions): " + "; ".join(" <-> ".join(c) for c in cycles)


def _reading_path(module: str) -> bool:
    """A module a notebook may teach from: not in a lab/ folder, not a benchmark module."""
    parts = module.split(".")
    return "lab" not in parts and not parts[-1].startswith("benchmarks")


def test_the_reading_path_imports_nothing_from_a_lab():
    mods = _course_modules()
    labs = [m for m in mods if "lab" in m.split(".")]
    bad = {m: sorted(i for i in _imports(m, f, mods) if i in labs) for m, f in mods.items() if _reading_path(m)}
    bad = {m: i for m, i in bad.items() if i}
    assert not bad, f"reading-path modules that import from a lab/ package (move the experiment to the lab, " \
                    f"or have the lab wrap the mainline): {bad}"
    assert _reading_path("step1_simple.ops") and not _reading_path("step1_simple.lab.tuning")
    assert not _reading_path("step4_gpt2.train.benchmarks")


def _reading_path_file(path) -> bool:
    """A file a learner reads: not in a lab/ or exercises/ folder, not a benchmark module."""
    parts = path.parts
    return "lab" not in parts and "exercises" not in parts and not path.name.startswith("benchmarks")


def test_no_reading_path_file_is_over_600_lines():
    """Every module and .cu/.cuh a notebook teaches from, in every step and in common/, stays readable: at most
    600 lines (experiments that would make it longer belong in the step's lab/)."""
    from common.kernels import ROOT
    files = [f for top in (ROOT / "common", *ROOT.glob("step*")) for ext in ("*.py", "*.cu", "*.cuh")
             for f in top.rglob(ext) if _reading_path_file(f.relative_to(ROOT))]
    assert len(files) > 40, files
    long = {f.relative_to(ROOT).as_posix(): n for f in files if (n := len(f.read_text().splitlines())) > 600}
    assert not long, f"reading-path files over 600 lines: {long}"
    assert not _reading_path_file(Path("step4_gpt2/megakernel/lab/hops.py"))
    assert not _reading_path_file(Path("step4_gpt2/train/benchmarks.py"))


def test_no_notebook_imports_a_lab():
    """What a notebook runs imports nothing from a lab/ package (the notebooks teach the mainline)."""
    import ast
    import nbformat
    from common.kernels import ROOT
    notebooks = [p for p in ROOT.glob("step*/**/*.ipynb") if ".ipynb_checkpoints" not in p.parts]
    assert len(notebooks) >= 10, notebooks
    bad = {}
    for p in notebooks:
        code = "\n".join(c.source for c in nbformat.read(p, as_version=4).cells if c.cell_type == "code")
        tree = ast.parse("\n".join(l for l in code.splitlines() if not l.lstrip().startswith(("%", "!"))))
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
        labs = [m for m in names if "lab" in m.split(".")]
        if labs:
            bad[p.relative_to(ROOT).as_posix()] = labs
    assert not bad, f"notebooks that import a lab: {bad}"


def test_every_course_module_imports_alone_in_a_fresh_interpreter():
    """Each module first, in its own interpreter: an import cycle or a dangling import after a move fails here
    with Python's own message, whatever module happened to be imported before it elsewhere. No GPU needed:
    importing the course never touches CUDA (`__main__` modules are entry points: running them is not an
    import; tests/test_entry_points.py runs them)."""
    import os
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor
    from common.kernels import ROOT
    names = [m for m in _course_modules() if m.rpartition(".")[2] != "__main__"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}

    def load(m):
        r = subprocess.run([sys.executable, "-c", f"import {m}"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
        return m, r.returncode, r.stderr.strip().splitlines()[-1:]

    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        failed = {m: err for m, rc, err in pool.map(load, names) if rc}
    assert not failed, f"modules that do not import on their own: {failed}"
