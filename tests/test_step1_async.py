"""Lesson 01c's kernels on the GPU: busy_wait takes the time it is asked for (on the GPU's clock), late_fill
writes every element after its wait, and a second stream that waits for an event sees the producer's result."""
import numpy as np
import pytest

from common import poison

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from step1_simple import streams  # noqa: E402


def _elapsed_ms(fn):
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(); fn(); end.record(); end.synchronize()
    return cp.cuda.get_elapsed_time(start, end)


@pytest.mark.parametrize("ms", [0.2, 1.0, 3.0])
def test_busy_wait_takes_at_least_its_time(ms):
    streams.busy_wait(0.1)                                   # warm: compile and load before timing
    t = _elapsed_ms(lambda: streams.busy_wait(ms, blocks=4))
    assert ms <= t < ms + 5.0, t


@pytest.mark.parametrize("n", [1, 255, 257, 1_000_003])
def test_late_fill_writes_every_element(n):
    y = poison(cp.empty(n, cp.float32))
    streams.late_fill(y, 2.5, after_ms=0.05)
    assert bool((y == np.float32(2.5)).all())


def test_wait_event_orders_two_streams():
    n = 1 << 20
    x = poison(cp.empty(n, cp.float32))
    cp.cuda.Device().synchronize()      # the NaN fill ran on the default stream, which non-blocking streams ignore
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with s1:
        streams.late_fill(x, 3.0, after_ms=2.0)
        done = cp.cuda.Event(); done.record(s1)
    s2.wait_event(done)
    with s2:
        y = x * 2
    s2.synchronize()
    assert bool((y == np.float32(6.0)).all())


def test_arguments_are_checked():
    with pytest.raises(ValueError):
        streams.busy_wait(-1.0)
    with pytest.raises(TypeError):
        streams.late_fill(cp.zeros(4, cp.float64), 1.0, after_ms=0.0)
