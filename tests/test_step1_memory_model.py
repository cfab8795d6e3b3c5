"""Lesson 01d's kernels on the GPU: the handoff versions always end (every spin is bounded), the fenced ones
(v3, v4) always hand over the right payload, and the last-block sum matches the float64 reference."""
import numpy as np
import pytest

from common import assert_close, poison, rand, reference as R

cp = pytest.importorskip("cupy")
gpu = pytest.mark.gpu

from step1_simple import memory_model as mm  # noqa: E402


@gpu
@pytest.mark.parametrize("version", mm.HANDOFF_VERSIONS)
def test_every_handoff_ends_and_accounts_for_every_block(version):
    pairs, rounds = 16, 50
    c = mm.handoff(version, pairs=pairs, rounds=rounds)
    assert c["correct"] + c["stale"] <= c["handoffs"] == pairs * rounds
    # a pair ends when both blocks finish their rounds, or when one gives up (then the other gives up too, or
    # finishes the rounds it had left before the one it waits for)
    assert 0 <= c["gave_up"] <= 2 * pairs
    if c["gave_up"] == 0:
        assert c["correct"] + c["stale"] == c["handoffs"]


@gpu
@pytest.mark.parametrize("version", [3, 4])
def test_fenced_handoffs_are_always_correct(version):
    for trial in range(3):
        c = mm.handoff(version, pairs=32, rounds=300)
        assert c == {"handoffs": 32 * 300, "gave_up": 0, "stale": 0, "correct": 32 * 300}, (version, trial, c)


@gpu
def test_handoff_refuses_more_pairs_than_the_gpu_holds():
    kernel = mm.get_kernel(mm.CU, "handoff_v3", mm.CU_DEFINES[mm.CU])
    too_many = mm.resident_blocks(kernel) // 2 + 1
    with pytest.raises(ValueError, match="pairs"):
        mm.handoff(3, pairs=too_many)
    with pytest.raises(ValueError, match="version"):
        mm.handoff(5)


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("n", [1, 255, 256, 257, 4099, 1_000_003])
@pytest.mark.parametrize("grid", [None, 1, 3])
def test_sum_last_block(n, grid):
    x = cp.asarray(rand(n, seed=n, low=0.0, high=1.0))
    for launch in range(2):                # the last block resets the ticket counter: a second launch works too
        out = poison(cp.empty((), cp.float32))
        mm.sum_last_block(x, out=out, grid=grid)
        assert_close(out, R.sum(x), rtol=1e-5, name=f"sum_last_block n={n} grid={grid} launch {launch}")


def test_ptx_of_shows_the_hoisted_load():
    """No GPU needed, but kept with the lesson's tests: v1's wait loads the flag once, before its loop; v2's
    loads it in the loop with ld.volatile; v4's with ld.acquire."""
    plain, vol, acq = (mm.ptx_of(f) for f in ("wait_plain", "wait_volatile", "wait_acquire"))
    loop = plain[plain.index("$L__"):]
    assert "ld.global" in plain[:plain.index("$L__")] and "ld." not in loop.split("bra")[0].split(":", 1)[1]
    assert "ld.volatile.global" in vol and "ld.acquire.gpu" in acq
