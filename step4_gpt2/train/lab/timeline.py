"""Lab: the profiler's timeline of training steps, for `python -m step4_gpt2.train.benchmarks --timeline`.

torch.profiler's CUPTI session sees every kernel of the process, CuPy's and cuBLAS's inside our CUDA graph
included: kernel_records() splits its trace into steps, idle_time() measures the time no kernel, memset or copy
ran. train_timeline_rows (step4_gpt2.train.benchmarks) turns them into rows, with cuBLAS's memsets in place
(lab/variants.py) and moved off the path (the mainline).
"""
from __future__ import annotations


def kernel_records(step, batches, steps: int) -> list[list[dict]]:
    """The kernels, memsets and copies the GPU ran in each of `steps` training steps, as the profiler's trace
    records them (name, ts and dur in us). Steps are told apart by the classifier kernel, which each step runs
    once: a step here runs from one classifier to the next, so it includes the copy of the next batch and the
    graph's launch. `step(x, y)` runs one step; the first 3 batches warm up."""
    import json
    import os
    import tempfile
    import cupy as cp
    from common import torch_cuda
    torch = torch_cuda()
    if torch is None:
        raise RuntimeError("torch with CUDA is not installed: the timeline needs torch.profiler (pip install torch)")
    from torch.profiler import ProfilerActivity, profile

    def sync():
        cp.cuda.Device().synchronize()
        torch.cuda.synchronize()
    for x, y in batches[:3]:
        step(x, y)
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for x, y in batches[3:4 + steps]:
            step(x, y)
        sync()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    finally:
        os.unlink(path)
    events.sort(key=lambda e: e["ts"])
    starts = [i for i, e in enumerate(events) if e["name"].startswith("classifier_fused")]
    if len(starts) < steps + 1:
        raise RuntimeError(f"the profiler recorded {len(starts)} of the {steps + 1} classifier kernels it should "
                           f"have (CUPTI dropped records?): no timeline")
    return [events[a:b] for a, b in zip(starts, starts[1:])][:steps]


def idle_time(events) -> tuple[float, float, int]:
    """(span, idle, gaps) of one step's records in ms: idle is the time no kernel, memset or copy was running."""
    end, idle, gaps = events[0]["ts"] + events[0]["dur"], 0.0, 0
    for e in events[1:]:
        if e["ts"] > end:
            idle, gaps = idle + e["ts"] - end, gaps + 1
        end = max(end, e["ts"] + e["dur"])
    return (end - events[0]["ts"]) / 1e3, idle / 1e3, gaps
