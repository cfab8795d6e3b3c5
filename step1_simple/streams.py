"""Python side of lesson 01c, asynchronous launches, streams and events: launch streams.cu's kernels.

    busy_wait(2.0)                         # a kernel that keeps `blocks` SMs busy for 2 ms of GPU time
    late_fill(y, 1.0, after_ms=1.0)        # waits 1 ms on the GPU, then y[:] = 1.0
    check_timer(time_with_events)          # Exercise 1c.1: your timer on kernels of known GPU time, PASS/FAIL

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


# ------------------------------------------------------------------------------ Exercise 1c.1: a timer of your own
# check_timer(fn) times busy_wait kernels, whose GPU time is known in advance, with the learner's timer fn(work) ->
# milliseconds, where work() enqueues the kernel. Two cases:
#   alone:        busy_wait(2 ms) on an idle GPU;
#   behind a queue: busy_wait(20 ms) is enqueued first (not part of work), then the timer times busy_wait(0.5 ms).
# The tolerance: busy_wait cannot finish before its spin does, so a right timer reads at least the spin, less the
# clocks' resolutions (the GPU's %globaltimer ticks in about 1 us, events in about 0.5 us): 2 % below is generous.
# Above, it adds the gap between the start event and the kernel's start, and the kernel's ramp-up: a few us on an
# idle GPU, tens on a busy desktop or under Windows' display driver: 20 % + 0.05 ms is generous too. What a wrong
# timer reads is far outside: a host timer without a synchronize reads the launch (~0.01-0.05 ms, not 2 ms); one
# with a synchronize reads the queue ahead as well (20.5 ms, not 0.5 ms).
TIMER_CASES = (("2 ms kernel, idle GPU", 0.0, 2.0), ("0.5 ms kernel behind 20 ms of queued work", 20.0, 0.5))
TIMER_TOLERANCE = (0.98, 1.2, 0.05)      # accept [0.98 t, 1.2 t + 0.05 ms] for a kernel of t ms
TIMER_REPEAT = 3                         # runs per case, every one in range


def check_timer(fn):
    """Exercise 1c.1: check a timer `fn(work) -> milliseconds` (the GPU time of what `work()` enqueues) on
    busy_wait kernels of known duration, TIMER_REPEAT times each (every run must be in range). Prints a PASS/FAIL
    table and returns a common.exercises.CheckResult; never raises on a wrong timer."""
    from common.device import gpu_available, skip_reason
    from common.exercises import CaseResult, CheckResult
    result = CheckResult("Exercise 1c.1", getattr(fn, "__name__", repr(fn)), compiled=True)
    print("Exercise 1c.1: a timer of your own, on kernels whose GPU time is known")
    if not gpu_available():
        result.message = f"running it needs an NVIDIA GPU: {skip_reason()}"
        print(f"Exercise 1c.1: not run: {result.message}")
        return result
    import cupy as cp
    busy_wait(0.01)                                   # compile and load the kernel before timing anything
    cp.cuda.Device().synchronize()
    lo_f, hi_f, hi_ms = TIMER_TOLERANCE
    result.ran = True
    for name, queued_ms, ms in TIMER_CASES:
        lo, hi = lo_f * ms, hi_f * ms + hi_ms
        got = []
        try:
            for _ in range(TIMER_REPEAT):
                if queued_ms:
                    busy_wait(queued_ms)              # work already in the queue when the timer starts
                got.append(float(fn(lambda m=ms: busy_wait(m))))
                cp.cuda.Device().synchronize()
        except Exception as e:                        # e.g. elapsed time asked before the end event happened
            cp.cuda.Device().synchronize()
            result.cases.append(CaseResult(name, False, f"your timer raised {type(e).__name__}: {e}"))
            continue
        bad = [g for g in got if not lo <= g <= hi]
        shown = ", ".join(f"{g:.3f}" for g in got)
        if not bad:
            result.cases.append(CaseResult(name, True, f"read {shown} ms; the kernel takes {ms:g} ms"))
            continue
        hint = ""
        if all(lo / 1000 <= g <= hi / 1000 for g in bad):
            hint = " (seconds? the timer should return milliseconds)"
        result.cases.append(CaseResult(name, False, f"read {shown} ms; the kernel takes {ms:g} ms, accepted "
                                                    f"{lo:.3f} .. {hi:.3f} ms{hint}", got=bad[0], expected=ms))
    w = max(len(c.name) for c in result.cases)
    print(f"  {'case':{w}s}  result  detail")
    for c in result.cases:
        print(f"  {c.name:{w}s}  {'PASS' if c.passed else 'FAIL':6s}  {c.detail}")
    print(f"Exercise 1c.1: {'PASS' if result.passed else 'FAIL'}")
    return result


def event_timer(fn) -> float:
    """The solution of Exercise 1c.1: the GPU time in milliseconds of the work `fn()` enqueues on the current
    stream, between two CUDA events; the host waits for the end event only."""
    import cupy as cp
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end)
