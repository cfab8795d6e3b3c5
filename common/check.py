"""Correctness: compare with a float64 reference, poison outputs, seeded inputs, argument checks."""
from __future__ import annotations

import numpy as np


def _host(a) -> np.ndarray:
    """A NumPy copy of a NumPy or CuPy array (bf16/fp16 upcast to float64 for comparison)."""
    if hasattr(a, "get"):
        a = a.get()
    a = np.asarray(a)
    return a.astype(np.float64) if a.dtype.kind in "fc" or a.dtype.itemsize == 2 else a


def errors(out, ref) -> tuple[float, float]:
    """(relative-norm error ||out - ref|| / ||ref||, max abs error). NaN/Inf in out gives inf, inf."""
    o, r = _host(out).astype(np.float64), np.asarray(ref, dtype=np.float64)
    if o.shape != r.shape:
        raise ValueError(f"shape mismatch: output {o.shape} vs reference {r.shape}")
    finite_ref = np.isfinite(r)
    if not np.array_equal(np.isfinite(o), finite_ref) or not np.array_equal(o[~finite_ref], r[~finite_ref]):
        return float("inf"), float("inf")
    d = o[finite_ref] - r[finite_ref]
    denom = np.linalg.norm(r[finite_ref])
    rel = float(np.linalg.norm(d) / denom) if denom > 0 else float(np.linalg.norm(d))
    return rel, float(np.abs(d).max(initial=0.0))


def max_rel_error(out, ref) -> float:
    """max |out - ref| / max |ref|: the error relative to the tensor's scale, fair to values near 0 (logits,
    gradients). inf for NaN/Inf where ref is finite; a shape mismatch is an error (errors())."""
    _, max_abs = errors(out, ref)
    return max_abs / max(float(np.abs(np.asarray(ref, dtype=np.float64)).max(initial=0.0)), 1e-30)


def assert_close(out, ref, rtol: float = 1e-6, atol: float | None = None, name: str = "output") -> tuple:
    """Fail unless out matches the float64 reference: relative-norm error <= rtol and (if given)
    max abs error <= atol. NaN where the reference is finite (an unwritten, poisoned element) fails.

    Returns (rel, max_abs) so a notebook can print them.
    """
    o = _host(out)
    r = np.asarray(ref, dtype=np.float64)
    if o.shape != r.shape:
        raise AssertionError(f"{name}: shape {o.shape} but the reference has shape {r.shape}")
    bad = ~np.isfinite(o) & np.isfinite(r)
    if bad.any():
        idx = np.argwhere(bad)
        raise AssertionError(f"{name}: {bad.sum()} of {bad.size} elements are NaN/Inf where the reference is "
                             f"finite (first at index {tuple(idx[0])}); an unwritten output stays NaN-poisoned")
    rel, mx = errors(o, r)
    if not (rel <= rtol) or (atol is not None and not (mx <= atol)):
        worst = np.unravel_index(np.nanargmax(np.abs(np.nan_to_num(o - r, nan=np.inf))), r.shape) if r.size else ()
        raise AssertionError(
            f"{name}: relative-norm error {rel:.3e} (limit {rtol:.1e}), max abs error {mx:.3e}"
            + (f" (limit {atol:.1e})" if atol is not None else "")
            + (f"; worst at index {tuple(int(i) for i in worst)}: got {o[worst]!r}, expected {r[worst]!r}"
               if r.size else ""))
    return rel, mx


def poison(a):
    """Fill a (CuPy or NumPy) output buffer so an unwritten element shows: NaN for floats, -1 for signed
    integers, all ones for unsigned ones (0xFFFF is also a NaN when a uint16 buffer holds bf16 bits)."""
    kind = np.dtype(a.dtype).kind
    a.fill(np.nan if kind == "f" else np.iinfo(a.dtype).max if kind == "u" else -1)
    return a


def is_poisoned(a) -> np.ndarray:
    """Where a NumPy array still holds poison's fill (NaN for floats)."""
    if np.dtype(a.dtype).kind == "f":
        return np.isnan(a)
    return a == poison(np.empty(1, a.dtype))[0]


def rand(*shape, dtype=np.float32, seed: int | None = None, low: float = -1.0, high: float = 1.0, rng=None,
         gpu: bool = False):
    """Seeded uniform random NumPy array in [low, high) (never zeros: zeros hide indexing bugs). rng: draw from
    this numpy Generator instead (several arrays of one test case from one seed).

    gpu=True draws a cupy.ndarray on the GPU, for inputs too large to build on the host: in `dtype` and scaled
    in place, so 2^28 floats cost 1 GiB. (CuPy's `uniform(..., dtype=float32)` draws and scales in float64 first:
    temporaries several times the array's size, more than a small GPU has.)"""
    if not gpu:
        rng = np.random.default_rng(seed) if rng is None else rng
        return rng.uniform(low, high, size=shape).astype(dtype)
    if rng is not None:
        raise ValueError("rng: a NumPy Generator draws on the CPU; with gpu=True pass seed instead")
    if np.dtype(dtype) not in (np.float32, np.float64):
        raise TypeError(f"dtype: expected float32 or float64 with gpu=True, got {np.dtype(dtype)}")
    import cupy as cp
    x = cp.random.default_rng(seed).random(shape, dtype=dtype)
    x *= high - low
    x += low
    return x


def expect_array(x, name: str, dtype=None, ndim: int | None = None, shape: tuple | None = None,
                 contiguous: bool = True):
    """Check a GPU op's argument; raise TypeError/ValueError naming the argument and what was expected.

    `shape` may hold None for a free dimension. Returns x, so wrappers can write `x = expect_array(x, "x")`.
    """
    import cupy as cp

    if not isinstance(x, cp.ndarray):
        hint = " (a NumPy array lives on the CPU; move it with cupy.asarray(x))" if isinstance(x, np.ndarray) else ""
        raise TypeError(f"{name}: expected a cupy.ndarray on the GPU, got {type(x).__module__}.{type(x).__name__}{hint}")
    if dtype is not None:
        dtypes = dtype if isinstance(dtype, (tuple, list)) else (dtype,)
        if x.dtype not in [np.dtype(d) for d in dtypes]:
            want = " or ".join(str(np.dtype(d)) for d in dtypes)
            raise TypeError(f"{name}: expected dtype {want}, got {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {x.shape}")
    if shape is not None:
        if len(shape) != x.ndim or any(s is not None and s != d for s, d in zip(shape, x.shape)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{name}: expected shape {want}, got {x.shape}")
    if contiguous and not x.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array (got strides {x.strides}); "
                         f"use cupy.ascontiguousarray({name})")
    if x.device.id != cp.cuda.Device().id:
        raise ValueError(f"{name}: lives on GPU {x.device.id}, but the current device is {cp.cuda.Device().id}")
    return x


def expect_int(value, name: str, minimum: int = 1, expected: str = "a positive integer") -> int:
    """value as an int when it is an integer (Python or NumPy; a bool is not one) of at least `minimum`, else a
    ValueError that names the argument: f"{name}: expected {expected}, got {value!r}"."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return int(value)


def expect_choice(value, name: str, allowed):
    """Check a choice such as a kernel version or a mode; a ValueError naming the argument otherwise."""
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {tuple(allowed)}, got {value!r}")
    return value


def expect_token_ids(ids, vocab: int, name: str = "ids", *, ndim: int | None = None, dtype=None):
    """The course's one check of token ids: integers in [0, vocab), since a bad id would read outside the
    embedding table. A CuPy array stays on the GPU (any integer dtype, or exactly `dtype` if given; its range
    is read back in one transfer). Anything else (a list, a NumPy array) comes back as an int64 NumPy array;
    a non-integer element is a TypeError and an out-of-range id a ValueError, each naming its position."""
    try:
        import cupy as cp
        on_gpu = isinstance(ids, cp.ndarray)
    except Exception:                   # no CuPy: host ids only
        on_gpu = False
    if on_gpu:
        ids = expect_array(ids, name, dtype=dtype, ndim=ndim, contiguous=False)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"{name}: token ids are integers, got dtype {ids.dtype}")
        if ids.size:
            lo, hi = (int(v) for v in cp.stack([ids.min().astype(cp.int64), ids.max().astype(cp.int64)]).get())
            if lo < 0 or hi >= vocab:
                raise ValueError(f"{name}: token ids must be in [0, {vocab}) (the vocabulary size), got values in "
                                 f"[{lo}, {hi}]")
        return ids
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
        raise TypeError(f"{name}: expected a sequence of integer token ids, got {type(ids).__name__}")
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise TypeError(f"{name}: token ids are integers, got dtype {ids.dtype}")
        arr = ids.astype(np.int64)
    else:
        arr = np.asarray(ids, dtype=object)
        for pos in zip(*np.nonzero(np.ones(arr.shape, dtype=bool))) if arr.ndim else [()]:
            t = arr[pos]
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                where = "[" + ", ".join(map(str, pos)) + "]"
                raise TypeError(f"{name}{where}: token ids are integers, got {t!r} ({type(t).__name__})")
        arr = arr.astype(np.int64)
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D sequence of token ids, got shape {arr.shape}")
    bad = np.argwhere((arr < 0) | (arr >= vocab))
    if len(bad):
        pos = tuple(int(i) for i in bad[0])
        where = "[" + ", ".join(map(str, pos)) + "]"
        raise ValueError(f"{name}{where}: token id {int(arr[pos])} is out of range [0, {vocab})")
    return arr


def launch_grid(n: int, block: int, max_blocks: int | None = None, per_sm: int | None = None) -> tuple[int]:
    """Blocks needed to cover n items with `block` threads each. Grid-stride kernels cap the grid: at
    `max_blocks`, or at `per_sm` blocks for each SM of this GPU (enough to fill it, few enough that each
    thread loops over several items)."""
    blocks = max(1, -(-n // block))
    if per_sm:
        from common.device import device_info
        cap = device_info()["multiprocessors"] * per_sm
        max_blocks = min(max_blocks, cap) if max_blocks else cap
    return (min(blocks, max_blocks) if max_blocks else blocks,)


def null_or(a):
    """a, or a null pointer (np.uint64(0)) for None: a kernel's optional pointer argument (the kernel checks for
    nullptr)."""
    return np.uint64(0) if a is None else a


def float4_rows(cols: int, *arrays) -> bool:
    """Whether float4 (16-byte) loads and stores are legal on rows of `cols` float32s: cols % 4 == 0 and every
    array (None is skipped) starts on a 16-byte boundary. The float4 kernels of steps 2-4 fall back to scalar
    ones where this is False."""
    return cols % 4 == 0 and all(a is None or a.data.ptr % 16 == 0 for a in arrays)


def out_array(out, shape, dtype=np.float32, name: str = "out"):
    """The output buffer of a GPU op: a new uninitialised CuPy array when `out` is None, else `out`
    checked to be a contiguous CuPy array of this shape and dtype (a named error otherwise)."""
    import cupy as cp
    shape = tuple(int(s) for s in shape)
    if out is None:
        from common.device import require_gpu
        require_gpu()
        return cp.empty(shape, dtype=dtype)
    return expect_array(out, name, dtype=dtype, shape=shape)
