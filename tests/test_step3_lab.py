"""Step 3's lab (step3_fused/lab/): the experiments kept apart from the modules the notebooks teach from,
tested here. On the CPU: the lab's loop checks its ids before any GPU work; on the GPU: the one-sample-per-step
training loop runs and reports like the mainline's train. (tests/test_step3_fused.py checks that the reading
path imports nothing from the lab.)"""
import numpy as np
import pytest

from step3_fused import shakespeare as S, training as T
from step3_fused.lab.per_sample import train_per_sample
from tests.test_step3_training import _trajectory_setup

try:
    import cupy as cp  # noqa: F401
except ImportError:             # the CPU test still runs; conftest skips the GPU one with a reason
    cp = None
gpu = pytest.mark.gpu


def test_lab_per_sample_checks_host_ids_before_any_gpu_work():
    from types import SimpleNamespace
    ctx, tgt = S.windows(np.arange(20, dtype=np.int32) % 7, 3)
    bad = ctx.copy(); bad[4, 1] = 7
    with pytest.raises(ValueError, match=r"train_data\[0\]\[4, 1\]: token id 7 is out of range \[0, 7\)"):
        train_per_sample(SimpleNamespace(V=7), None, (bad, tgt), samples=1, progress=False)


@gpu
def test_lab_per_sample_loop_reports():
    """The one-sample-per-step loop (moved here from step3_fused.training) runs and reports like train."""
    init, _, dims = _trajectory_setup()
    stream = np.random.default_rng(7).zipf(1.3, size=20_000) % dims[0]
    ctx, tgt = S.windows(stream.astype(np.int32), dims[3])
    m = T.Model(*dims, init=init)
    per = train_per_sample(m, T.SGD(m.params, lr=0.05), (ctx, tgt), samples=20, progress=False)
    assert per.tokens == 20 and np.isfinite(per.train[0])
