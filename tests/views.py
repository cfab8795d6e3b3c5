"""GPU array views the tests need in more than one file."""
from __future__ import annotations


def misaligned(x, elements: int = 1):
    """The values of x (CuPy or NumPy) on the GPU, in a view that starts `elements` elements past a 16-byte
    boundary: the kernels' scalar path, where their float4 / vector loads do not apply."""
    import cupy as cp
    base = cp.empty(x.size + elements, x.dtype)
    view = base[elements:].reshape(x.shape)
    view[...] = cp.asarray(x)
    assert view.data.ptr % 16 != 0
    return view
