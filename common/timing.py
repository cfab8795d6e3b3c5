"""Honest timing: CUDA events around each run, warm-up, many repeats, median and spread, cold L2.

    t = bench(lambda: kernel(grid, block, args), bytes=8 * n, name="axpb v3")
    print(t)                                   # median, spread, GB/s
    t.fraction(copy_bandwidth())               # share of the measured memory ceiling
    t.host_median_ms                           # the host's work per call (Python, launch set-up), not GPU time
"""
from __future__ import annotations

import functools
import statistics
import time

import numpy as np
from dataclasses import dataclass, field


@dataclass
class Timing:
    """Times in milliseconds; GB/s and TFLOP/s come from the bytes/FLOPs the caller counted."""
    name: str
    times_ms: list = field(repr=False)
    wall_ms: list = field(repr=False)     # host clock around launch + completion (includes launch overhead)
    bytes: float | None = None
    flops: float | None = None
    host_ms: list = field(default_factory=list, repr=False)   # host clock around fn() alone, no synchronize:
                                                              # the time to enqueue the work (one per timed run)
    lead_ms: float = 0.0                  # how long the GPU was kept busy before each start event (at the end;
                                          # a run re-timed after an overrun used a longer one, see bench)
    overruns: int = 0                     # timed runs whose host work still outlasted the lead (see bench)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def spread_ms(self) -> tuple[float, float]:
        """10th and 90th percentile, to judge whether two versions really differ. Interpolated between measured
        times ("inclusive"): with a few runs the default method extrapolates past them (p10 below the fastest
        run, even below zero)."""
        q = (statistics.quantiles(self.times_ms, n=10, method="inclusive") if len(self.times_ms) > 1
             else [self.times_ms[0]] * 9)
        return q[0], q[-1]

    @property
    def wall_median_ms(self) -> float:
        return statistics.median(self.wall_ms)

    @property
    def host_median_ms(self) -> float:
        """The host's work per call: Python, argument checks, launch set-up, until fn() returns (the GPU may
        still be running). Distinct from median_ms, the device's time between the events."""
        return statistics.median(self.host_ms) if self.host_ms else float("nan")

    @property
    def gbps(self) -> float | None:
        return None if self.bytes is None else self.bytes / (self.median_ms * 1e-3) / 1e9

    @property
    def tflops(self) -> float | None:
        return None if self.flops is None else self.flops / (self.median_ms * 1e-3) / 1e12

    def fraction(self, ceiling: float) -> float:
        """Achieved rate over a ceiling in the same unit (GB/s if bytes were given, else TFLOP/s)."""
        rate = self.gbps if self.bytes is not None else self.tflops
        return rate / ceiling

    def __str__(self) -> str:
        lo, hi = self.spread_ms
        s = f"{self.name}: {self.median_ms * 1e3:9.1f} us (p10 {lo * 1e3:.1f}, p90 {hi * 1e3:.1f}, n={len(self.times_ms)})"
        if self.bytes is not None:
            s += f"  {self.gbps:8.1f} GB/s"
        if self.flops is not None:
            s += f"  {self.tflops:7.2f} TFLOP/s"
        return s


def faster(time, anchor) -> str:
    """How `time` compares with `anchor` (Timings or milliseconds), in words a sentence can use: "2.31x faster"
    when it takes less time, "1.82x slower" when it takes more (never "0.55x faster")."""
    t = time.median_ms if isinstance(time, Timing) else float(time)
    a = anchor.median_ms if isinstance(anchor, Timing) else float(anchor)
    if not (t > 0 and a > 0):
        raise ValueError(f"faster() needs two positive times, got time={t!r} and anchor={a!r}")
    return f"{a / t:.2f}x faster" if t <= a else f"{t / a:.2f}x slower"


@functools.lru_cache(maxsize=None)
def _flush_buffer():
    import cupy as cp
    from common.device import device_info
    buf = cp.empty(max(2 * device_info()["l2_bytes"], 8 << 20) // 4, dtype=cp.float32)
    buf.fill(1)
    return buf


@functools.lru_cache(maxsize=None)
def _gpu_sleep():
    """A kernel that keeps the GPU busy for a given number of nanoseconds (PTX %globaltimer)."""
    import cupy as cp
    return cp.RawKernel(r"""
extern "C" __global__ void course_gpu_sleep(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}""", "course_gpu_sleep")


LEAD_MIN_MS = 0.1      # the shortest GPU sleep before a start event
LEAD_MAX_MS = 50.0     # the longest: a fn() whose enqueue takes longer is not hidden (see `Timing.overruns`)
RETRIES = 1            # re-times of one run whose host work outlasted the lead, with a lead twice that host time:
                       # if that overruns too, the host work grew with the lead (fn() waits for the GPU: a
                       # synchronize, a .get(), a cudaFree), and no lead can hide it


def _lead_for(host_ms: float) -> float:
    """A lead comfortably longer than the host's enqueue time: twice it plus 50 us, within the bounds."""
    return min(LEAD_MAX_MS, max(LEAD_MIN_MS, 2.0 * host_ms + 0.05))


def bench(fn, *, name: str = "", bytes: float | None = None, flops: float | None = None,
          warmup: int = 3, repeat: int | None = None, target_ms: float = 200.0,
          flush_l2: bool = True, cpu: bool = False, setup=None) -> Timing:
    """Time fn() with CUDA events (or the host clock if cpu=True): warm-up, then `repeat` runs.

    Without `repeat`, as many runs as fit in ~target_ms (10 to 500). With flush_l2, a read of a buffer
    twice the L2 size precedes every run, so inputs are read cold from DRAM.

    Why a lead: a CUDA launch is asynchronous, and the start event is queued before fn() runs its Python
    (argument checks, launch set-up). If the GPU were idle, it would pass the start event at once and then wait
    for fn()'s kernel, and that wait, host time, would land between the events. So before each start event a
    GPU sleep keeps the device busy for longer than the host needs to enqueue fn()'s work (the lead: twice the
    90th percentile of the enqueue times of the untimed runs plus 50 us, 0.1 to 50 ms); when the sleep ends,
    the work is already queued and runs back to back, as in a real pipeline: the events measure the device's
    time only. Each timed run checks it: if the host's time from the sleep's launch to the end event exceeded
    the lead, that run is re-timed once with a lead of twice that time (a run still over is counted in
    `overruns`: its host work grew with the lead, i.e. fn() waits for the GPU). One slow run (a garbage
    collection) does not lengthen the others; when re-times become the rule, the lead grows to cover the runs'
    median. bench's own kernels (the sleep, the L2 flush) are compiled and loaded before anything is timed.

    `host_ms` (median: `host_median_ms`) is the host clock around fn() alone in each timed run, without a
    synchronize: the host's work per call (for a course wrapper: its Python, argument checks and launch set-up),
    measured as in a pipeline, while the GPU is busy (a launch behind queued work can take the host a little
    longer than one on an idle GPU). `wall_ms` is the host clock around fn() + synchronize from an idle
    GPU (what a waiting Python loop sees). setup(), if given, runs before every run of fn() and is not timed
    (e.g. the prefill before a timed decode).
    """
    prepare = setup or (lambda: None)
    if cpu:
        for _ in range(warmup):
            prepare(); fn()
        n = repeat
        if n is None:                        # as many runs as fit in ~target_ms, from one estimating run
            prepare(); t0 = time.perf_counter(); fn(); est = (time.perf_counter() - t0) * 1e3
            n = max(5, min(200, int(target_ms / max(est, 1e-3))))
        times = []
        for _ in range(n):
            prepare(); t0 = time.perf_counter(); fn(); times.append((time.perf_counter() - t0) * 1e3)
        return Timing(name, times, list(times), bytes, flops, host_ms=list(times))

    from common.device import require_gpu
    require_gpu()                  # a clear message without a GPU or with an old driver, not a CUDA error
    import cupy as cp
    stream = cp.cuda.get_current_stream()
    flush = _flush_buffer() if flush_l2 else None
    sleep = _gpu_sleep()
    # bench's own kernels first: the first launch of each compiles or loads it (milliseconds), which would
    # otherwise land in the first timed run and stretch its lead
    if flush is not None:
        flush.sum()
    sleep((1,), (1,), (np.uint64(0),), stream=stream)
    for _ in range(warmup):
        prepare(); fn()
    stream.synchronize()
    walls, enqueue = [], []
    for _ in range(max(3, min(20, repeat or 20))):
        prepare(); stream.synchronize()
        t0 = time.perf_counter()
        fn()
        enqueue.append((time.perf_counter() - t0) * 1e3)       # the host's work alone, GPU maybe still busy
        stream.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
    est = statistics.median(walls)
    # not the longest: one garbage collection there would set a long lead for every run (re-times cover the rest)
    lead = _lead_for(statistics.quantiles(enqueue, n=10, method="inclusive")[-1])
    n = repeat or max(10, min(500, int(target_ms / max(est + lead, 1e-3))))
    start, end = cp.cuda.Event(), cp.cuda.Event()      # re-recorded by every run: no event made inside the loop
    times, hosts, spans, overruns = [], [], [], 0
    for _ in range(n):
        run_lead = lead
        for attempt in range(RETRIES + 1):
            prepare()
            if flush is not None:
                flush.sum()  # a read: evicts the inputs from L2 without leaving dirty lines to write back
            t_lead = time.perf_counter()         # the sleep starts on the GPU no earlier than this
            sleep((1,), (1,), (np.uint64(int(run_lead * 1e6)),), stream=stream)
            start.record(stream)
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            end.record(stream)
            t2 = time.perf_counter()
            end.synchronize()
            ahead_ms = (t2 - t_lead) * 1e3       # host time the sleep had to cover, up to the end event
            if ahead_ms < run_lead:
                break                            # the GPU was still asleep when the end event was queued
            if attempt == RETRIES or run_lead >= LEAD_MAX_MS:
                overruns += 1                    # keep the run; `overruns` says host time may have leaked in
                break
            run_lead = _lead_for(ahead_ms)       # re-time this run with a longer lead
        times.append(cp.cuda.get_elapsed_time(start, end))
        hosts.append((t1 - t0) * 1e3)
        spans.append(ahead_ms)
        if attempt and ahead_ms < run_lead:      # a re-time that the longer lead fixed: if the runs' usual span
            lead = max(lead, _lead_for(statistics.median(spans)))   # has outgrown the lead, later runs start longer
    return Timing(name, times, walls, bytes, flops, host_ms=hosts, lead_ms=lead, overruns=overruns)


@functools.lru_cache(maxsize=None)
def copy_bandwidth() -> float:
    """Measured device-to-device copy bandwidth in GB/s, counting bytes read + written (cached per process).

    This is the roofline for the course's memory-bound kernels: a kernel that reads and writes each byte
    once cannot beat a plain copy by much.
    """
    from common.device import memory_left
    import cupy as cp
    nbytes = min(1 << 30, memory_left() // 8) // 16 * 16
    src = cp.empty(nbytes, dtype=cp.uint8)
    src.fill(7)
    dst = cp.empty_like(src)
    kind = cp.cuda.runtime.memcpyDeviceToDevice
    stream = cp.cuda.get_current_stream()
    t = bench(lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, kind, stream.ptr),
              name="device-to-device copy", bytes=2 * nbytes, flush_l2=False)
    return t.gbps
