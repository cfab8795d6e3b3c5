"""Is there a usable GPU, and what is it? Everything else asks here first."""
from __future__ import annotations

import functools
import sys

try:
    import cupy as cp
except Exception as e:  # the course still imports (references, offline compiles) without CuPy
    cp = None
    _IMPORT_ERROR = f"CuPy could not be imported ({type(e).__name__}: {e})"
else:
    _IMPORT_ERROR = None


def _cuda(v: int) -> str:
    """CUDA's version number (12090) as people write it (12.9)."""
    return f"{v // 1000}.{v % 1000 // 10}"


def driver_too_old(driver: int, runtime: int) -> str:
    """The message for a driver older than the CUDA this CuPy build needs (versions as CUDA numbers, 12090)."""
    return (f"the NVIDIA driver supports CUDA {_cuda(driver)}, but this CuPy build needs CUDA {_cuda(runtime)} "
            f"(CUDA {runtime // 1000}.x runs on any driver made for CUDA {runtime // 1000}.0 or newer): "
            f"update the NVIDIA driver" + (" to version 525 or newer" if runtime // 1000 == 12 else "")
            + " (`nvidia-smi` shows the installed one)")


@functools.lru_cache(maxsize=None)
def skip_reason() -> str | None:
    """None when a CUDA GPU is usable, else a sentence saying what was found and what to do (used for every
    GPU skip and by require_gpu). Asks the CUDA runtime for versions only, before any GPU work."""
    if cp is None:
        return _IMPORT_ERROR + "; install the course: pip install -e . -r requirements.txt"
    rt = cp.cuda.runtime
    try:
        runtime = rt.runtimeGetVersion()        # the CUDA version this CuPy build runs on
        driver = rt.driverGetVersion()          # 0 when libcuda (the driver) cannot be loaded
    except Exception as e:
        return f"CUDA is not usable here ({type(e).__name__}: {e})"
    if driver == 0:
        return ("no NVIDIA driver found (libcuda could not be loaded): this machine has no NVIDIA GPU or its "
                "driver is not installed; on a cloud notebook, choose a GPU runtime")
    if driver // 1000 < runtime // 1000:
        return driver_too_old(driver, runtime)
    try:
        count = rt.getDeviceCount()
    except Exception as e:
        if "InsufficientDriver" in str(e):
            return driver_too_old(driver, runtime)
        if "NoDevice" in str(e):
            count = 0
        else:
            return f"CUDA is not usable here ({type(e).__name__}: {e})"
    if count == 0:
        return (f"the NVIDIA driver (CUDA {_cuda(driver)}) sees no GPU: check `nvidia-smi`, and that "
                f"CUDA_VISIBLE_DEVICES does not hide it")
    compiler = _nvrtc_version()      # None without NVRTC: the first compile says so, with CuPy's own message
    if compiler and compiler[0] > driver // 1000:
        return (f"CuPy found NVRTC {compiler[0]}.{compiler[1]} (the run-time compiler), newer than what the driver "
                f"supports (CUDA {_cuda(driver)}), so kernels it compiles would not load; another package "
                f"(often a torch built for CUDA {compiler[0]}) installed it: install torch's CUDA "
                f"{runtime // 1000} build instead (docs/environment.md), or update the driver")
    return None


def gpu_available() -> bool:
    return skip_reason() is None


def no_gpu_message(reason: str) -> str:
    """The course's one line for a machine without a usable GPU, from skip_reason()'s sentence."""
    return (f"This needs an NVIDIA GPU with a working driver: {reason}. "
            f"See docs/environment.md, 'No GPU or an old driver'.")


def require_gpu() -> None:
    """Raise a RuntimeError that says what was found and what to do; every GPU entry point of the course
    calls this before its first CUDA call (cached: free after the first call)."""
    reason = skip_reason()
    if reason:
        raise RuntimeError(no_gpu_message(reason))


def _cuda_errors() -> tuple:
    """CuPy's exceptions for a failed CUDA runtime or driver call: what any CuPy call raises without a driver."""
    from cupy_backends.cuda.api.driver import CUDADriverError
    from cupy_backends.cuda.api.runtime import CUDARuntimeError
    return CUDARuntimeError, CUDADriverError


def notebook_cuda_error(shell, etype, value, tb, tb_offset=None):
    """IPython's handler for CuPy's CUDA errors (registered by `import common` inside IPython): without a usable
    GPU, the course's one line instead of CuPy's traceback, whose "CUDA driver version is insufficient" is
    wrong when there is no driver at all; with a GPU, the usual traceback (a real error)."""
    reason = skip_reason()
    if reason is None:
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        return None
    msg = no_gpu_message(reason)
    # one line, no frames: the cell's code is not what went wrong. _showtraceback is what IPython and ipykernel
    # (which sends it to the notebook as the cell's error) both implement for a prepared traceback.
    shell._showtraceback(RuntimeError, RuntimeError(msg), [msg])
    return None


def install_notebook_handler() -> bool:
    """Inside IPython (a notebook), show CuPy's CUDA errors through notebook_cuda_error. True when installed;
    a shell that already has its own custom exception handler keeps it."""
    ipython = sys.modules.get("IPython")        # only where IPython runs already: a script never imports it
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    if shell is None or cp is None:
        return False
    if getattr(shell, "_course_cuda_handler", False):
        return True
    if shell.custom_exceptions:
        return False
    shell.set_custom_exc(_cuda_errors(), notebook_cuda_error)
    shell._course_cuda_handler = True
    return True


@functools.lru_cache(maxsize=None)
def device_info() -> dict:
    """Name, compute capability, SM count, clock, L2 size, memory and driver/runtime versions of device 0."""
    require_gpu()
    rt = cp.cuda.runtime
    dev = cp.cuda.Device()
    props = rt.getDeviceProperties(dev.id)
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else name
    try:    # an attribute, not props["clockRate"]: CUDA 13 dropped that field from cudaDeviceProp
        clock_khz = rt.deviceGetAttribute(rt.cudaDevAttrClockRate, dev.id) or None
    except rt.CUDARuntimeError:
        clock_khz = None
    return {
        "name": name,
        "compute_capability": (props["major"], props["minor"]),
        "sm": props["major"] * 10 + props["minor"],
        "multiprocessors": props["multiProcessorCount"],
        "clock_khz": clock_khz,                     # boost clock; None when the driver reports none
        "l2_bytes": props["l2CacheSize"],
        "memory_bytes": props["totalGlobalMem"],
        "shared_per_block_optin": props.get("sharedMemPerBlockOptin", props["sharedMemPerBlock"]),
        "shared_per_sm": props["sharedMemPerMultiprocessor"],
        "registers_per_sm": props["regsPerMultiprocessor"],
        "max_threads_per_sm": props["maxThreadsPerMultiProcessor"],
        "max_blocks_per_sm": props.get("maxBlocksPerMultiProcessor", 16),   # 16 on sm_75/86, 24 on sm_89, 32 else
        "driver_version": cp.cuda.runtime.driverGetVersion(),
        "runtime_version": cp.cuda.runtime.runtimeGetVersion(),
        "cupy_version": cp.__version__,
    }


def require_arch(sm: int, what: str) -> None:
    """Raise if the GPU is older than sm (e.g. 80 for bf16 tensor cores), naming what needs it."""
    have = device_info()["sm"]
    if have < sm:
        raise RuntimeError(
            f"{what} needs compute capability {sm // 10}.{sm % 10} or newer; "
            f"this GPU ({device_info()['name']}) is {have // 10}.{have % 10}")


def describe() -> str:
    """One line for the top of a notebook or a benchmark table."""
    if not gpu_available():
        return f"no GPU: {skip_reason()}"
    d = device_info()
    return (f"{d['name']} (sm_{d['sm']}, {d['multiprocessors']} SMs, L2 {d['l2_bytes'] / 2**20:.0f} MiB, "
            f"{d['memory_bytes'] / 2**30:.0f} GiB), CuPy {d['cupy_version']}, "
            f"driver {d['driver_version']}, runtime {d['runtime_version']}, NVRTC "
            + (".".join(map(str, _nvrtc_version() or ())) or "not loadable"))


def nvrtc():
    """CuPy's own binding of NVRTC, the run-time compiler it uses on the GPU: it loads without a driver, so the
    same compiler compiles and sizes kernels on any machine (the CUDA 12 NVRTC that `cupy-cuda12x` brings
    targets sm_70 .. sm_90). Here, not in common.kernels, because skip_reason asks its version and
    common.kernels asks this module for require_gpu: one direction of import only."""
    from cupy_backends.cuda.libs import nvrtc as binding
    return binding


def nvrtc_version() -> tuple[int, int]:
    return tuple(nvrtc().getVersion())


def _nvrtc_version() -> tuple[int, int] | None:
    try:
        return nvrtc_version()
    except Exception:
        return None


# fp32 FMA lanes per SM by compute capability (V100, Xavier, T4 and A100 have 64; sm_61 and sm_86+ have 128)
FP32_LANES_PER_SM = {60: 64, 70: 64, 72: 64, 75: 64, 80: 64}


@functools.lru_cache(maxsize=None)
def fp32_peak_tflops() -> float | None:
    """fp32 FMA peak of the current device at its reported boost clock: SMs x fp32 lanes per SM x 2 FLOPs
    x clock, in TFLOP/s (a ceiling to compare kernels with, from the device's own attributes). None when
    the driver reports no clock."""
    d = device_info()
    if not d["clock_khz"]:
        return None
    lanes = FP32_LANES_PER_SM.get(d["sm"], 128)
    return 2.0 * d["multiprocessors"] * lanes * d["clock_khz"] * 1e3 / 1e12


@functools.lru_cache(maxsize=None)
def torch_cuda():
    """PyTorch with a usable CUDA device and TF32 switched off (fair fp32 comparisons), or None when torch
    is not installed or has no CUDA. Benchmarks and notebooks use it for their torch anchors."""
    try:
        import torch
    except Exception:
        return None
    if not torch.cuda.is_available():
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import cupy as cp
    limit = cp.get_default_memory_pool().get_limit()
    if limit:   # the course's memory cap (docs/environment.md): torch's allocator gets the same size
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), 0)
    return torch


def memory_left() -> int:
    """Bytes this process can still allocate on the GPU: the device's free memory plus what CuPy's pool holds
    unused, capped by CuPy's own limit (CUPY_GPU_MEMORY_LIMIT; `pytest --gpu-memory-gib`) when one is set.
    What a notebook sizes a large problem from, instead of cudaMemGetInfo, which ignores the cap."""
    require_gpu()
    import cupy as cp
    pool = cp.get_default_memory_pool()
    free, _ = cp.cuda.runtime.memGetInfo()
    left = free + pool.free_bytes()
    limit = pool.get_limit()
    return max(0, min(left, limit - pool.used_bytes())) if limit else left
