"""Python side of step 1: launch the kernels of axpb.cu, zoo.cu, fusion.cu and reduce.cu with checked
arguments. The notebooks call these; the tests check them against common.reference. The compile-time
choices (UNROLL, the reduction's block) are fixed here; step1_simple/lab/tuning.py sweeps them."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from common import expect_array, expect_choice, get_kernel, launch_grid, out_array

HERE = Path(__file__).resolve().parent
AXPB_VERSIONS = (1, 2, 3, 4)
SUM_VERSIONS = (1, 2, 3)
UNROLL = 4              # float4 loads in flight per thread (axpb v4, sum v3)
SUM_BLOCK = 256         # threads per block of the reductions
UNROLLS = (1, 2, 4, 8)                   # what axpb.cu and reduce.cu accept for UNROLL
SUM_BLOCKS = (64, 128, 256, 512, 1024)   # reduce.cu's tree halves the block: a power of two


def _per_sm(block: int) -> int:
    """Blocks per SM for a grid-stride launch: as many threads as one SM can hold (2048 on sm_70/80/90, 1536
    on sm_86/89, 1024 on sm_75), enough to fill it; each thread then loops over several elements."""
    from common.device import device_info
    return max(2, device_info()["max_threads_per_sm"] // block)


def _head(ptr: int, n: int) -> int:
    """Scalar elements before the first 16-byte-aligned float (float4 kernels)."""
    return min(n, ((16 - ptr % 16) % 16) // 4)


def axpb(x, a: float, b: float, out=None, version: int = 4, block: int = 256, grid: int | None = None):
    """y = a*x + b on a float32 GPU vector, with kernel axpb_v<version> of axpb.cu: `block` threads per block;
    `grid` blocks for the grid-stride versions (v2..v4; by default enough to fill every SM)."""
    return _axpb(x, a, b, out, version, block, grid, UNROLL)


def _axpb(x, a, b, out, version, block, grid, unroll):
    """axpb with the compile-time UNROLL as an argument: the one launch path of ops.axpb and of the lab's sweep."""
    x = expect_array(x, "x", dtype=np.float32, ndim=1)
    y = out_array(out, x.shape)
    expect_choice(version, "version", AXPB_VERSIONS)
    if not (32 <= block <= 1024 and block % 32 == 0):
        raise ValueError(f"block: expected a multiple of 32 between 32 and 1024, got {block}")
    n = x.size
    if n == 0:
        return y
    args = [x, y, np.float32(a), np.float32(b), np.int64(n)]
    if version >= 3 and x.data.ptr % 16 != y.data.ptr % 16:
        version = 2     # x and y sit at different offsets from a 16-byte boundary: no common float4 view
    if version >= 3:
        args.append(np.int32(_head(x.data.ptr, n)))
    expect_choice(unroll, "unroll", UNROLLS)
    kernel = get_kernel(HERE / "axpb.cu", f"axpb_v{version}", {"UNROLL": unroll})
    if version == 1:
        blocks = launch_grid(n, block)
    else:
        blocks = (grid,) if grid else launch_grid(n, block, per_sm=_per_sm(block))
    kernel(blocks, (block,), tuple(args))
    return y


ZOO_UNARY = ("relu", "sigmoid", "tanh", "gelu", "exp", "log", "copy")
ZOO_BINARY = ("add", "sub", "mul", "div", "pow", "relu_backward")
ZOO_SCALAR = ("add_scalar", "mul_scalar")


def zoo(op: str, *inputs, scalar: float | None = None, out=None, shape=None, block: int = 256):
    """Run zoo_<op> from zoo.cu. Unary/binary ops take 1/2 float32 arrays of one shape (any ndim,
    contiguous); add_scalar/mul_scalar take one array and `scalar`; fill takes `scalar` and `out` or `shape`."""
    import cupy as cp
    arity = {**{o: 1 for o in ZOO_UNARY}, **{o: 2 for o in ZOO_BINARY}, **{o: 1 for o in ZOO_SCALAR}, "fill": 0}
    expect_choice(op, "op", sorted(arity))
    if len(inputs) != arity[op]:
        raise TypeError(f"zoo({op!r}): expected {arity[op]} input array(s), got {len(inputs)}")
    for i, a in enumerate(inputs):
        expect_array(a, f"inputs[{i}]", dtype=np.float32)
        if a.shape != inputs[0].shape:
            raise ValueError(f"inputs[{i}]: expected shape {inputs[0].shape} like inputs[0], got {a.shape}")
    if (op in ZOO_SCALAR or op == "fill") and scalar is None:
        raise TypeError(f"zoo({op!r}): needs scalar=")
    if op == "fill":
        if out is None:
            if shape is None:
                raise TypeError("zoo('fill'): give out= or shape=")
            out = cp.empty(shape, dtype=cp.float32)
        y = expect_array(out, "out", dtype=np.float32)
    else:
        y = out_array(out, inputs[0].shape)
    n = y.size
    if n == 0:
        return y
    args = (*inputs, np.float32(scalar), y) if op in ZOO_SCALAR else \
           ((np.float32(scalar), y) if op == "fill" else (*inputs, y))
    kernel = get_kernel(HERE / "zoo.cu", f"zoo_{op}")
    kernel(launch_grid(n, block, per_sm=_per_sm(block)), (block,), (*args, np.int64(n)))
    return y


def mul_add_gelu(x, w, b, out=None, block: int = 256):
    """Fused y = gelu(x * w + b) (fusion.cu), elementwise over float32 arrays of one shape."""
    x = expect_array(x, "x", dtype=np.float32)
    w = expect_array(w, "w", dtype=np.float32, shape=x.shape)
    b = expect_array(b, "b", dtype=np.float32, shape=x.shape)
    y = out_array(out, x.shape)
    if x.size:
        kernel = get_kernel(HERE / "fusion.cu", "mul_add_gelu")
        kernel(launch_grid(x.size, block, per_sm=_per_sm(block)), (block,), (x, w, b, y, np.int64(x.size)))
    return y


def total(x, version: int = 3):
    """Sum of a float32 GPU vector with sum_v<version> of reduce.cu; returns a 0-d float32 CuPy array."""
    return _total(x, version, SUM_BLOCK, None, UNROLL)


def _total(x, version, block, grid, unroll):
    """total with block, grid and UNROLL as arguments: the one launch path of ops.total and of the lab's sweep."""
    import cupy as cp
    x = expect_array(x, "x", dtype=np.float32, ndim=1)
    expect_choice(version, "version", SUM_VERSIONS)
    expect_choice(block, "block", SUM_BLOCKS)
    n = x.size
    out = cp.zeros((), dtype=cp.float32)
    if n == 0:
        return out
    expect_choice(unroll, "unroll", UNROLLS)
    kernel = get_kernel(HERE / "reduce.cu", f"sum_v{version}", {"BLOCK": block, "UNROLL": unroll})
    blocks = grid or launch_grid(n, block, per_sm=_per_sm(block))[0]
    if version == 3:
        kernel((blocks,), (block,), (x, out, np.int64(n), np.int32(_head(x.data.ptr, n))))
        return out
    partial = cp.empty(blocks, dtype=cp.float32)
    kernel((blocks,), (block,), (x, partial, np.int64(n)))
    kernel((1,), (block,), (partial, out, np.int64(blocks)))
    return out
