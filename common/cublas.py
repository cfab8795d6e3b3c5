"""`gemm(a, b, out)`: out = a @ b through cuBLAS, for float32 matrices, in a way a CUDA graph can capture.

Why not `cupy.matmul`: CuPy refuses every cuBLAS call while a stream is being captured ("calling cuBLAS API
during stream capture is currently unsupported"), although cuBLAS itself supports capture when the handle has
a workspace of its own (the cuBLAS guide, "CUDA Graphs Support"). Here the course opens its own cuBLAS handle,
gives it a workspace, and calls `cublasGemmEx` on the current CuPy stream: the same library CuPy uses (found
by `cuda.pathfinder`, as CuPy finds it), four C functions through ctypes. cuBLAS is column-major and the
course's arrays are row-major, so C = A B is computed as C^T = B^T A^T: a row-major matrix is its transpose in
column-major memory, and no data moves.

Precision follows CuPy's switch for float32 products (`CUPY_TF32=1`, or `tf32_matmuls()` below, which
also switches torch): plain fp32 (CUBLAS_COMPUTE_32F) unless TF32 is on
(CUBLAS_COMPUTE_32F_FAST_TF32, the tensor cores).
"""
from __future__ import annotations

import contextlib
import ctypes

import numpy as np

from common.check import expect_array, out_array
from common.graphs import cublas_call

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUDA_R_32F = 0
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32 = 68, 77
CUBLAS_GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20            # what the cuBLAS guide recommends on Hopper; more than enough before

_lib = None
_handles: dict = {}                   # device id, or (device id, stream): (handle, its workspace, cudaMalloc'd)
_ALPHA, _BETA = ctypes.c_float(1.0), ctypes.c_float(0.0)


class CublasError(RuntimeError):
    pass


def _cublas():
    global _lib
    if _lib is None:
        from cuda.pathfinder import load_nvidia_dynamic_lib
        lib = ctypes.CDLL(load_nvidia_dynamic_lib("cublas").abs_path)
        vp, i = ctypes.c_void_p, ctypes.c_int
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
        lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        for f in (lib.cublasCreate_v2, lib.cublasSetWorkspace_v2, lib.cublasSetStream_v2, lib.cublasGemmEx):
            f.restype = i
        _lib = lib
    return _lib


def _check(status: int, what: str):
    if status != 0:
        raise CublasError(f"{what} failed with cublasStatus_t {status} (cublas_api.h lists the codes; 7 is "
                          f"CUBLAS_STATUS_INVALID_VALUE, 13 CUBLAS_STATUS_EXECUTION_FAILED)")


def _new_handle():
    """A handle with a workspace of its own: cuBLAS then allocates nothing per call, which is what lets a
    capture record it. The workspace comes straight from cudaMalloc, not from a CuPy memory pool: the handle
    outlives any pool that is current when it is made."""
    import cupy as cp
    h = ctypes.c_void_p()
    _check(_cublas().cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
    return h, cp.cuda.Memory(WORKSPACE_BYTES)


def _handle(stream_ptr: int):
    """(handle, workspace): the stream's if it has one (own_workspace), else this device's, bound to the stream.
    cublasSetStream resets the workspace to cuBLAS's default pool, so it is set again after every call."""
    import cupy as cp
    dev = cp.cuda.Device().id
    key = (dev, stream_ptr) if (dev, stream_ptr) in _handles else dev
    if key not in _handles:
        _handles[key] = _new_handle()
    lib, (h, ws) = _cublas(), _handles[key]
    _check(lib.cublasSetStream_v2(h, ctypes.c_void_p(stream_ptr)), "cublasSetStream")
    _check(lib.cublasSetWorkspace_v2(h, ctypes.c_void_p(ws.ptr), WORKSPACE_BYTES), "cublasSetWorkspace")
    return h, ws


def own_workspace(stream) -> None:
    """Give `stream` a cuBLAS handle and workspace of its own, for GEMMs that run at the same time as GEMMs on
    another stream (TrainGPT.backward's weight gradients): two GEMMs using one workspace at once would overwrite
    each other's partial sums (the cuBLAS guide asks for a workspace per stream). Kept for the life of the
    process (32 MB each), as a CUDA graph captured on the stream may still use it: for long-lived streams."""
    import cupy as cp
    key = (cp.cuda.Device().id, stream.ptr)
    if key not in _handles:
        _handles[key] = _new_handle()


def tf32_enabled() -> bool:
    """Whether CuPy's float32 matrix products use TF32 now: its compute type for float32, which CUPY_TF32=1 sets
    when CuPy first reads it and tf32_matmuls() sets for a while."""
    import cupy as cp
    from cupy import _core
    from cupy._core import _routines_linalg as linalg
    return _core.get_compute_type(cp.float32) == linalg.COMPUTE_TYPE_TF32


@contextlib.contextmanager
def tf32_matmuls():
    """Inside: float32 matrix products on TF32 tensor cores on both sides, CuPy's cuBLAS calls (gemm here
    included) and torch's (the same precision for both); restored on exit. CuPy's only public switch is the
    CUPY_TF32 environment variable, read when it is imported; this calls the setter behind it."""
    import cupy as cp
    from cupy import _core
    from cupy._core import _routines_linalg as linalg
    from common.device import torch_cuda
    torch = torch_cuda()
    old = _core.get_compute_type(cp.float32)
    old_torch = torch.backends.cuda.matmul.allow_tf32 if torch is not None else None
    _core.set_compute_type(cp.float32, linalg.COMPUTE_TYPE_TF32)
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        _core.set_compute_type(cp.float32, old)
        if torch is not None:
            torch.backends.cuda.matmul.allow_tf32 = old_torch


def _operand(x, name: str):
    """(op, ld) that makes the row-major matrix x (r, c) appear as x^T in cuBLAS's column-major terms."""
    r, c = x.shape
    s0, s1 = x.strides
    if x.flags.c_contiguous:
        return CUBLAS_OP_N, max(1, c)
    if x.flags.f_contiguous:                                   # a transposed view, e.g. w.T
        return CUBLAS_OP_T, max(1, r)
    if s1 == 4 and s0 % 4 == 0 and s0 // 4 >= c:              # rows with a gap between them (a column slice)
        return CUBLAS_OP_N, s0 // 4
    if s0 == 4 and s1 % 4 == 0 and s1 // 4 >= r:
        return CUBLAS_OP_T, s1 // 4
    raise ValueError(f"{name}: expected rows or columns with unit stride (a contiguous matrix or a transposed "
                     f"view of one), got strides {x.strides} for shape {x.shape}")


def gemm(a, b, out=None):
    """out (m, n) = a (m, k) @ b (k, n), float32 on the GPU, through cuBLAS on the current stream; a and b may be
    transposed views (x.T), out must be C-contiguous. Safe inside `common.capture_graph` (allocates nothing
    when out is given)."""
    import cupy as cp
    a = expect_array(a, "a", dtype=np.float32, ndim=2, contiguous=False)
    b = expect_array(b, "b", dtype=np.float32, ndim=2, contiguous=False)
    (m, k), (k2, n) = a.shape, b.shape
    if k2 != k:
        raise ValueError(f"b: expected {k} rows to match a's {a.shape}, got shape {b.shape}")
    out = out_array(out, (m, n))                     # checks that it is C-contiguous
    if m == 0 or n == 0:
        return out
    if k == 0:
        out.fill(0)
        return out
    op_a, lda = _operand(a, "a")
    op_b, ldb = _operand(b, "b")
    for name, v in (("m", m), ("n", n), ("k", k), ("a's row stride", lda), ("b's row stride", ldb)):
        if v >= 2 ** 31:
            raise ValueError(f"gemm: {name} = {v} does not fit cuBLAS's 32-bit int (a, b: {a.shape}, {b.shape})")
    stream = cp.cuda.get_current_stream().ptr
    lib, (h, ws) = _cublas(), _handle(stream)
    compute = CUBLAS_COMPUTE_32F_FAST_TF32 if tf32_enabled() else CUBLAS_COMPUTE_32F
    # column-major: out^T (n, m) = b^T (n, k) @ a^T (k, m)
    with cublas_call(stream, (ws.ptr, WORKSPACE_BYTES)):     # inside a capture: notes its nodes (common.graphs)
        _check(lib.cublasGemmEx(h, op_b, op_a, n, m, k, ctypes.byref(_ALPHA), ctypes.c_void_p(b.data.ptr),
                                CUDA_R_32F, ldb, ctypes.c_void_p(a.data.ptr), CUDA_R_32F, lda, ctypes.byref(_BETA),
                                ctypes.c_void_p(out.data.ptr), CUDA_R_32F, n, compute, CUBLAS_GEMM_DEFAULT),
               f"cublasGemmEx ({m}x{k} @ {k}x{n})")
    return out
