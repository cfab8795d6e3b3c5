"""Python side of lesson 01c, asynchronous launches, streams and events: launch streams.cu's kernels.

    busy_wait(2.0)                         # a kernel that keeps `blocks` SMs busy for 2 ms of GPU time
    late_fill(y, 1.0, after_ms=1.0)        # waits 1 ms on the GPU, then y[:] = 1.0

Both launch on the current CuPy stream (`with stream:` picks another) and return at once: the GPU runs them
later, in the order of their stream."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from common import expect_array, get_kernel, launch_grid, require_gpu

HERE = Path(__file__).resolve().parent
CU = HERE / "streams.cu"


def busy_wait(ms: float, blocks: int = 1, threads: int = 32) -> None:
    """Enqueue busy_wait: `blocks` blocks of `threads` threads spin for `ms` milliseconds of GPU time."""
    require_gpu()
    if not (ms >= 0 and blocks >= 1 and 1 <= threads <= 1024):
        raise ValueError(f"busy_wait: expected ms >= 0, blocks >= 1, 1 <= threads <= 1024; got {ms}, {blocks}, "
                         f"{threads}")
    get_kernel(CU, "busy_wait")((blocks,), (threads,), (np.uint64(round(ms * 1e6)),))


def late_fill(y, value: float, after_ms: float, block: int = 256) -> None:
    """Enqueue late_fill: wait `after_ms` milliseconds on the GPU, then set every element of the float32 array
    `y` to `value`."""
    y = expect_array(y, "y", dtype=np.float32)
    if not after_ms >= 0:
        raise ValueError(f"after_ms: expected >= 0, got {after_ms}")
    if y.size:
        get_kernel(CU, "late_fill")(launch_grid(y.size, block, per_sm=2), (block,),
                                    (y, np.float32(value), np.int64(y.size), np.uint64(round(after_ms * 1e6))))
