"""The exercises of lessons 1c, 2c and 4c beyond what tests/test_exercises.py does for every registered
exercise (compile for sm_70 .. sm_90, stub FAILs, solution PASSes, planted bugs FAIL):

- Exercise 1c.1 (a Python timer, checked by step1_simple/streams.check_timer): the solution (streams.event_timer)
  passes; the notebook's stub as shipped, a host timer without a synchronize and a timer in seconds fail; the
  check never raises, and without a GPU it says so and runs nothing;
- Exercise 2c.1 (step2/mma_tile): on a GPU older than sm_75 the check does not launch the kernel and says what
  it needs; the solution's fragment indices are the PTX tables (ops.mma_fragment_map), for every lane and k-step;
- Exercise 4c.1 (step4/handoff): its case without producers ends (every consumer gives up within its bounded
  spin) and reports it; the reference's payload numbers are those handoff.cu's payload_value writes;
- the four notebooks have their exercise cells.
"""
import re

import nbformat
import numpy as np
import pytest

from common import exercises as E
from common.kernels import ROOT

gpu = pytest.mark.gpu
NB_1C = ROOT / "step1_simple/01c_async_streams_events.ipynb"


def _gpu_sm():
    from common.device import device_info
    return device_info()["sm"]


def _notebook_timer():
    """The notebook's time_with_events as shipped (the host-timer stub), with the names its set-up cell gives."""
    import time

    import cupy as cp
    cell = next(c.source for c in nbformat.read(NB_1C, as_version=4).cells
                if c.cell_type == "code" and c.source.startswith("def time_with_events("))
    scope = {"time": time, "cp": cp, "device": cp.cuda.Device()}
    exec(cell, scope)
    return scope["time_with_events"]


# ----------------------------------------------------------------------------------------- no GPU needed
def test_registered_with_their_lessons():
    assert E.exercise("step2/mma_tile").stub == "step2_attention/exercises/mma_tile.cu"
    assert E.exercise("step4/handoff").stub == "step4_gpt2/megakernel/exercises/handoff.cu"
    from common import hints as H
    assert H.number("step2/mma_tile") == "2c.1" and H.number("step4/handoff") == "4c.1"


def test_mma_solution_loads_the_ptx_fragments():
    """The index arithmetic of solutions/mma_tile.cu, lane by lane, is mma_fragment_map's (the PTX tables)."""
    from step2_attention import ops
    src = (ROOT / E.exercise("step2/mma_tile").solution).read_text()
    a_terms = re.findall(r"pack\((A\[[^]]+\]), (A\[[^]]+\])\)", src)
    b_terms = re.findall(r"pack\((B\[[^]]+\]), (B\[[^]]+\])\)", src)
    c_terms = re.findall(r"^\s*(C\[[^]]+\]) = d\[(\d)\];", src, flags=re.M)
    assert len(a_terms) == 4 and len(b_terms) == 2 and len(c_terms) == 4, (a_terms, b_terms, c_terms)
    K = 48
    for k0 in range(0, K, 16):
        for lane in range(32):
            env = {"g": lane >> 2, "t": lane % 4, "K": K, "k": k0 + 2 * (lane % 4)}
            idx = lambda term: eval(term[2:-1], {}, env)       # noqa: E731  "A[g * K + k]" -> g * K + k
            got_a = [idx(x) for pair in a_terms for x in pair]
            want_a = [r * K + c + k0 for r, c in ops.mma_fragment_map("a")[lane]]
            assert got_a == want_a, (lane, k0)
            got_b = [idx(x) for pair in b_terms for x in pair]
            assert got_b == [(r + k0) * 8 + c for r, c in ops.mma_fragment_map("b")[lane]], (lane, k0)
            got_c = {int(i): idx(x) for x, i in c_terms}
            assert [got_c[i] for i in range(4)] == [r * 8 + c for r, c in ops.mma_fragment_map("c")[lane]]


def test_handoff_reference_is_what_the_kernel_writes():
    from step4_gpt2.megakernel import exercises as X
    src = (ROOT / E.exercise("step4/handoff").solution).read_text()
    assert f"seq * {X.SEQ_STRIDE} + p * PAYLOAD + k" in src
    ref = X._handoff_ref({"pairs": 3, "trials": 2, "producers": 1})
    assert ref["received"].shape == (2, 3, X.PAYLOAD) and not ref["status"].any()
    assert ref["received"][1, 2, 5] == 2 * X.SEQ_STRIDE + 2 * X.PAYLOAD + 5
    none = X._handoff_ref({"pairs": 3, "trials": 2, "producers": 0})
    assert (none["received"] == -1).all() and (none["status"] == 1).all()


def test_handoff_is_not_launched_when_its_blocks_cannot_all_be_resident(monkeypatch, capsys):
    """The GPU-only guard of the handoff's launch, on the CPU: consumers spinning on producers that cannot be
    scheduled would only give up, so a grid larger than the GPU holds at once is refused before any launch."""
    from step4_gpt2.megakernel import exercises as X
    monkeypatch.setattr(X, "_resident", lambda kernel: 5)

    class NoLaunch:
        def __call__(self, *args, **kw):
            raise AssertionError("launched although its blocks cannot all be resident")
    host = X._handoff_make({"pairs": 3, "trials": 2}, np.random.default_rng(0))
    X._handoff_launch(lambda name: NoLaunch(), host)
    assert "6 blocks must run at once" in capsys.readouterr().out


def test_check_timer_without_gpu_says_so(capsys):
    from common.device import gpu_available
    if gpu_available():
        pytest.skip("this machine has a GPU: the offline path is not taken")
    from step1_simple import streams
    result = streams.check_timer(lambda fn: 1.0)
    assert not result.ran and not result.passed and "needs an NVIDIA GPU" in capsys.readouterr().out


def test_mma_check_on_an_old_gpu_says_so_without_launching(monkeypatch, capsys):
    """The GPU-only guard, on the CPU: a GPU said to be sm_70 gets the message and no launch (nothing in this
    path touches CUDA before the guard returns)."""
    from common import device
    from step2_attention import exercises as X2
    monkeypatch.setattr(device, "gpu_available", lambda: True)
    monkeypatch.setattr(device, "device_info", lambda: {"sm": 70, "name": "an sm_70 stand-in"})
    result = E.check("step2/mma_tile", path=ROOT / E.exercise("step2/mma_tile").solution, timing=False)
    out = capsys.readouterr().out
    assert not result.ran and not result.passed and "7.5 or newer" in out and "this GPU is 7.0" in out

    def no_launch(name):
        raise AssertionError(f"{name} was launched on a GPU without fp16 mma.sync")
    monkeypatch.setattr(X2, "_told", [])
    X2._mma_launch(no_launch, {})
    X2._mma_launch(no_launch, {})
    assert capsys.readouterr().out.count("7.5 or newer") == 1, "the launch guard says it once"


def test_check_timer_judges_with_stand_ins(monkeypatch, capsys):
    """check_timer's GPU path on the CPU: busy_wait and the device replaced by stand-ins that record the queue,
    timers that read what a right one, a host timer with a synchronize, one in seconds and one that raises
    would read."""
    import cupy as cp
    from common import device
    from step1_simple import streams
    queue = []

    class Device:
        def synchronize(self):
            queue.clear()

    monkeypatch.setattr(device, "gpu_available", lambda: True)
    monkeypatch.setattr(streams, "busy_wait", lambda ms, *a, **kw: queue.append(ms))
    monkeypatch.setattr(cp.cuda, "Device", Device)

    def right(fn):                 # the kernel fn enqueues, not the queue ahead of it
        fn()
        return queue[-1] * 1.01

    def with_queue(fn):            # the host's clock around fn() and a synchronize: the queue ahead too
        fn()
        return sum(queue)

    def raises(fn):
        raise RuntimeError("cudaErrorNotReady")

    assert streams.check_timer(right).passed
    r = streams.check_timer(with_queue)
    assert r.ran and [c.passed for c in r.cases] == [True, False] and not r.passed
    r = streams.check_timer(lambda fn: right(fn) / 1e3)
    assert not any(c.passed for c in r.cases) and "seconds?" in capsys.readouterr().out
    r = streams.check_timer(raises)
    assert r.ran and not r.passed and all("raised RuntimeError" in c.detail for c in r.cases)


@pytest.mark.parametrize("path,ex_id", [
    ("step1_simple/01d_memory_model.ipynb", "step1/find_bug_last_block"),
    ("step2_attention/02c_tensor_cores.ipynb", "step2/mma_tile"),
    ("step4_gpt2/megakernel/04c_megakernel.ipynb", "step4/handoff"),
    ("step1_simple/01c_async_streams_events.ipynb", None),
])
def test_notebooks_end_with_their_exercises(path, ex_id):
    cells = nbformat.read(ROOT / path, as_version=4).cells
    tail = "\n".join(c.source for c in cells[-3:])
    if ex_id is None:
        assert "streams.check_timer(time_with_events)" in tail and "### Exercise 1c.1 ·" in tail
    else:
        assert f'start("{ex_id}")' in tail and f'check("{ex_id}")' in tail


# ---------------------------------------------------------------------------------------------- on a GPU
@gpu
def test_check_timer_passes_the_solution_and_fails_wrong_timers(capsys):
    import time

    import cupy as cp
    from step1_simple import streams
    # Under `pytest -n` other test processes share the GPU: their kernels time-slice with ours and can stretch
    # one reading of the solution (seen once: 2.6 ms for the 0.5 ms case). Three tries; a wrong timer is off
    # on every try (below).
    assert any(streams.check_timer(streams.event_timer).passed for _ in range(3))

    def no_sync(fn):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def in_seconds(fn):
        return streams.event_timer(fn) / 1e3

    def no_wait(fn):        # asks for the time before the end event has happened: CuPy raises
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        return cp.cuda.get_elapsed_time(start, end)

    capsys.readouterr()
    for wrong in (_notebook_timer(), no_sync, in_seconds, no_wait):
        result = streams.check_timer(wrong)
        assert result.ran and not result.passed, wrong
    assert "seconds?" in capsys.readouterr().out


@gpu
def test_mma_check_on_a_gpu_without_tensor_cores_says_so(capsys):
    if _gpu_sm() >= 75:
        pytest.skip("this GPU has fp16 mma.sync: the guard is not taken")
    result = E.check("step2/mma_tile", path=ROOT / E.exercise("step2/mma_tile").solution, timing=False)
    assert not result.passed and "7.5 or newer" in capsys.readouterr().out


@gpu
def test_handoff_without_producers_gives_up_in_bounded_time():
    import time
    path = ROOT / E.exercise("step4/handoff").solution
    E.check("step4/handoff", path=path, timing=False, timeout_s=10)    # compiles (here and CuPy's own kernels)
    t0 = time.monotonic()
    result = E.check("step4/handoff", path=path, timing=False, timeout_s=10)
    assert result.passed, result.cases
    assert time.monotonic() - t0 < 20, "the bounded spins should give up within a fraction of a second each"


@gpu
def test_handoff_stress_many_runs():
    """Races pass by luck at times: the solution must pass every time, over many checks."""
    ex = E.exercise("step4/handoff")
    for _ in range(5):
        assert E.check("step4/handoff", path=ROOT / ex.solution, timing=False).passed
