"""The training loop at one sample per step (B = 1): every step still launches every kernel and GEMM of a
batched step, so its time is launches, not math. Notebook 03b times single steps at B = 1 with common.bench;
this runs a whole loop of them and reports it like step3_fused.training.train does.

    from step3_fused.lab.per_sample import train_per_sample
    hist = train_per_sample(model, SGD(model.params, lr=0.05), (ctx, targets), samples=1000)
    hist.tokens_per_s                  # wall-clock rate of the whole loop (host clock)
"""
from __future__ import annotations

import time

from common import expect_token_ids
from step3_fused.training import History, Model, batches


def train_per_sample(model: Model, optimizer, train_data, samples: int, fused: bool = True, seed: int = 0,
                     progress: bool = True) -> History:
    """`samples` steps of one sample each; History with one train-loss point (the mean over all steps) and the
    loop's wall-clock seconds. train_data: (ctx, targets) NumPy int32 arrays, range-checked once here."""
    import cupy as cp
    from tqdm.auto import tqdm
    for i, ids in enumerate(train_data):
        expect_token_ids(ids, model.V, f"train_data[{i}]")
    hist = History()
    data = [(cp.asarray(c), cp.asarray(t)) for c, t in batches(*train_data, 1, samples, seed)]
    acc = cp.zeros((), cp.float32)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()                 # a whole run's wall time, for tokens/s (not a kernel timing)
    for c, t in tqdm(data, disable=not progress, desc="per-sample", unit="sample"):
        acc += model.step(c, t, optimizer, fused=fused, check=False)
    cp.cuda.Device().synchronize()
    hist.seconds, hist.tokens = time.perf_counter() - t0, samples
    hist.steps, hist.train = [samples], [float(acc) / samples]
    return hist
