"""Programmatic dependent launch (PDL): launch a CuPy-compiled kernel so that it may start while the kernel
before it in the stream is still running (sm_90 and newer).

A CuPy kernel call, `kernel(grid, block, args)`, is cuLaunchKernel: the kernel starts once the one before it
has finished. The driver's extended launch, cuLaunchKernelEx, takes a list of launch attributes; with
PROGRAMMATIC_STREAM_SERIALIZATION set, the kernel may start early, and it is the kernel's job to wait
(`pdl_wait()` of common/include/pdl.cuh) before it reads the previous kernel's output. CuPy does not wrap
cuLaunchKernelEx, so this calls it in libcuda through ctypes, as common/graphs.py does for the graph API: the
structures below are cuda.h's CUlaunchConfig and CUlaunchAttribute, field for field (tests/step4/test_pdl.py
checks them against the header). Captured into a CUDA graph (common.capture_graph), such a launch becomes a
kernel node with a programmatic edge from the kernel before it, so the overlap survives in the graph.

    launch_pdl(fn, (blocks,), (256,), (w, x, y, np.float32(b), np.int32(n)), stream)

with `fn` the kernel chain_v2 of step4_gpt2/pdl.cu from common.get_kernel, `stream` a CuPy stream.

Arguments are passed as the kernel declares them, so each scalar carries its C type: np.int32(n), not n.
"""
from __future__ import annotations

import ctypes

import numpy as np

PROGRAMMATIC_STREAM_SERIALIZATION = 6        # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
PDL_ARCH = 90                                # griddepcontrol is an sm_90 instruction
MAX_BLOCK_THREADS = 1024

# C types of the scalars a kernel may take, by NumPy type: the bytes cuLaunchKernelEx copies for each argument.
SCALAR_CTYPES = {np.dtype(k): v for k, v in {
    np.float32: ctypes.c_float, np.float64: ctypes.c_double, np.int8: ctypes.c_int8, np.uint8: ctypes.c_uint8,
    np.int16: ctypes.c_int16, np.uint16: ctypes.c_uint16, np.int32: ctypes.c_int32, np.uint32: ctypes.c_uint32,
    np.int64: ctypes.c_int64, np.uint64: ctypes.c_uint64, np.bool_: ctypes.c_bool}.items()}


class LaunchAttributeValue(ctypes.Union):    # CUlaunchAttributeValue: 64 bytes, 8-byte aligned (it holds pointers)
    _fields_ = [("pad", ctypes.c_char * 64), ("programmaticStreamSerializationAllowed", ctypes.c_int),
                ("_align", ctypes.c_uint64)]


class LaunchAttribute(ctypes.Structure):     # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", LaunchAttributeValue)]


class LaunchConfig(ctypes.Structure):        # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def _dims(value, name: str) -> tuple[int, int, int]:
    """(x, y, z) from an int or a tuple of 1-3 positive ints, as CuPy's launch takes them."""
    dims = (value,) if isinstance(value, (int, np.integer)) else value
    if not isinstance(dims, (tuple, list)) or not 1 <= len(dims) <= 3 or \
            not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and 0 < d < 2**31 for d in dims):
        raise ValueError(f"{name}: a positive int or a tuple of 1 to 3 positive ints, not {value!r}")
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


def pack_args(args) -> tuple:
    """(params, values): `params` is the void*[] that cuLaunchKernelEx reads, one pointer per argument to its
    bytes in `values` (keep both alive until the launch returns). A GPU array (anything with
    __cuda_array_interface__: CuPy, torch) passes its device pointer; a NumPy scalar its value in its own C
    type. Python numbers are refused: an int could be the kernel's int or long long, and a wrong guess reads
    garbage without any error."""
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args: a tuple of the kernel's arguments, not {type(args).__name__}")
    values = []
    for i, a in enumerate(args):
        iface = getattr(a, "__cuda_array_interface__", None)
        if iface is not None:
            values.append(ctypes.c_void_p(iface["data"][0]))
        elif isinstance(a, np.generic) and a.dtype in SCALAR_CTYPES:
            values.append(SCALAR_CTYPES[a.dtype](a.item()))
        elif isinstance(a, np.ndarray):
            raise TypeError(f"args[{i}]: a NumPy array is host memory; pass a CuPy array (cupy.asarray)")
        elif isinstance(a, (bool, int, float)):
            raise TypeError(f"args[{i}]: a Python {type(a).__name__} ({a!r}) has no C type; pass it as the kernel "
                            f"declares it: np.int32(...), np.int64(...), np.float32(...)")
        else:
            raise TypeError(f"args[{i}]: a GPU array or a NumPy scalar of {sorted(str(t) for t in SCALAR_CTYPES)}, "
                            f"not {type(a).__name__}")
    params = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
    return params, values


def launch_config(grid, block, shared_mem: int, stream_ptr: int, attrs) -> LaunchConfig:
    """The CUlaunchConfig of one launch; `attrs` (a LaunchAttribute array) must outlive the launch."""
    g, b = _dims(grid, "grid"), _dims(block, "block")
    if b[0] * b[1] * b[2] > MAX_BLOCK_THREADS:
        raise ValueError(f"block: at most {MAX_BLOCK_THREADS} threads in all, not {b}")
    if not isinstance(shared_mem, (int, np.integer)) or not 0 <= shared_mem < 2**32:
        raise ValueError(f"shared_mem: bytes of dynamic shared memory, an int >= 0, not {shared_mem!r}")
    return LaunchConfig(*g, *b, int(shared_mem), ctypes.c_void_p(stream_ptr),
                        ctypes.cast(attrs, ctypes.POINTER(LaunchAttribute)), len(attrs))


def programmatic_attrs():
    """A one-element LaunchAttribute array: PROGRAMMATIC_STREAM_SERIALIZATION allowed."""
    attrs = (LaunchAttribute * 1)()
    attrs[0].id = PROGRAMMATIC_STREAM_SERIALIZATION
    attrs[0].value.programmaticStreamSerializationAllowed = 1
    return attrs


def _launch_kernel_ex():
    """libcuda's cuLaunchKernelEx (CUDA 12.0 drivers and newer; CuPy's CUDA 12 build needs one anyway)."""
    from common.graphs import _driver
    try:
        return _driver().cuLaunchKernelEx
    except AttributeError:
        raise RuntimeError("programmatic dependent launch needs cuLaunchKernelEx, which this CUDA driver lacks: "
                           "update the NVIDIA driver to one made for CUDA 12 or newer") from None


def _error_name(status: int) -> str:
    from common.graphs import _driver
    name = ctypes.c_char_p()
    if _driver().cuGetErrorName(status, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return f"CUresult {status}"


def require_pdl() -> None:
    """Raise unless this GPU runs programmatic dependent launch (sm_90: H100, H200, and newer)."""
    from common.device import require_arch, require_gpu
    require_gpu()
    require_arch(PDL_ARCH, "programmatic dependent launch (griddepcontrol)")


def launch_pdl(kernel, grid, block, args, stream=None, shared_mem: int = 0) -> None:
    """Launch `kernel` (a cupy.RawKernel, e.g. from common.get_kernel) on `stream` (CuPy's current stream when
    None) so that it may start before the previous kernel in the stream finishes. The kernel must call
    pdl_wait() (common/include/pdl.cuh) before it reads that kernel's output. Same arguments as CuPy's
    `kernel(grid, block, args, shared_mem=...)`; a kernel above 48 KB of dynamic shared memory opts in first
    (common.allow_dynamic_smem), as for a CuPy launch."""
    params, values = pack_args(args)             # the CPU-checkable errors first, then the GPU's
    attrs = programmatic_attrs()
    config = launch_config(grid, block, shared_mem, 0, attrs)
    require_pdl()
    import cupy as cp
    function = getattr(getattr(kernel, "kernel", None), "ptr", None)     # the CUfunction CuPy loaded
    if function is None:
        raise TypeError(f"kernel: a cupy.RawKernel (common.get_kernel's result), not {type(kernel).__name__}")
    config.hStream = (stream or cp.cuda.get_current_stream()).ptr
    status = _launch_kernel_ex()(ctypes.byref(config), ctypes.c_void_p(function),
                                 params if values else None, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed: {_error_name(status)} (grid {grid}, block {block}, "
                           f"shared_mem {shared_mem})")


__all__ = ["launch_pdl", "require_pdl", "pack_args", "launch_config", "programmatic_attrs", "LaunchConfig",
           "LaunchAttribute", "PROGRAMMATIC_STREAM_SERIALIZATION", "PDL_ARCH"]
