"""common/ on the CPU: the comparison helpers must catch what they exist to catch."""
import numpy as np
import pytest

from common import assert_close, errors, poison, rand, launch_grid
from common.timing import Timing, bench


def test_assert_close_passes_on_rounding_and_reports_errors():
    ref = rand(1000, dtype=np.float64, seed=1)
    rel, mx = assert_close(ref.astype(np.float32), ref, rtol=1e-6)
    assert 0 < rel < 1e-7 and 0 < mx < 1e-7


def test_assert_close_catches_a_wrong_element():
    ref = rand(1000, dtype=np.float64, seed=2)
    out = ref.copy(); out[123] += 0.5
    with pytest.raises(AssertionError, match=r"index \(123,\)"):
        assert_close(out, ref, rtol=1e-6)


def test_assert_close_catches_unwritten_poisoned_output():
    ref = rand(64, dtype=np.float64, seed=3)
    out = poison(np.empty(64, dtype=np.float32)); out[:63] = ref[:63]
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(out, ref, rtol=1.0)


def test_assert_close_checks_shape_and_max_abs():
    ref = rand(10, dtype=np.float64, seed=4)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(ref[:9], ref)
    out = ref.copy(); out[0] += 1e-3
    assert_close(out, ref, rtol=1e-2)
    with pytest.raises(AssertionError, match="max abs error"):
        assert_close(out, ref, rtol=1e-2, atol=1e-4)


def test_errors_matches_infinities_and_flags_mismatch():
    ref = np.array([1.0, -np.inf, 2.0])
    assert errors(np.array([1.0, -np.inf, 2.0]), ref) == (0.0, 0.0)
    assert errors(np.array([1.0, 0.0, 2.0]), ref) == (float("inf"), float("inf"))


def test_rand_is_seeded_and_never_zero_filled():
    a, b = rand(4, 5, seed=7), rand(4, 5, seed=7)
    assert a.dtype == np.float32 and a.shape == (4, 5) and np.array_equal(a, b)
    assert np.count_nonzero(a) == a.size and not np.array_equal(a, rand(4, 5, seed=8))


def test_launch_grid():
    assert launch_grid(1, 256) == (1,)
    assert launch_grid(257, 256) == (2,)
    assert launch_grid(10**9, 256, max_blocks=1000) == (1000,)


def test_timing_rates_and_cpu_bench():
    t = Timing("x", [1.0, 2.0, 3.0], [1.0, 2.0, 3.0], bytes=2e9, flops=4e12)
    assert t.median_ms == 2.0 and t.gbps == pytest.approx(1000.0) and t.tflops == pytest.approx(2000.0)
    assert t.fraction(2000.0) == pytest.approx(0.5)
    c = bench(lambda: sum(range(1000)), cpu=True, repeat=7, name="py")
    assert len(c.times_ms) == 7 and c.median_ms > 0


def test_expect_array_rejects_numpy_with_a_hint():
    pytest.importorskip("cupy")
    from common import expect_array
    with pytest.raises(TypeError, match=r"x: expected a cupy.ndarray.*cupy.asarray"):
        expect_array(np.zeros(3, np.float32), "x")


def test_kernel_source_extracts_one_kernel_with_its_comment():
    from common import kernel_source
    src = kernel_source("step1_simple/axpb.cu", "axpb_v2")
    assert src.startswith("// v2") and "axpb_v2" in src and "axpb_v3" not in src and src.rstrip().endswith("}")
    with pytest.raises(KeyError):
        kernel_source("step1_simple/axpb.cu", "nope")


def test_benchmark_runner_import_does_not_shadow_bench():
    import common
    import common.benchmarks  # noqa: F401  (the runner module)
    from common import bench as b
    assert callable(b) and b is common.timing.bench


def test_poison_every_dtype():
    assert np.isnan(poison(np.empty(3, np.float16))).all()
    assert (poison(np.empty(3, np.int32)) == -1).all()
    bits = poison(np.empty(3, np.uint16))
    assert (bits == 0xFFFF).all()
    as_f32 = (bits.astype(np.uint32) << 16).view(np.float32)      # bf16 bits -> float32
    assert np.isnan(as_f32).all()


def test_offline_compile_leaves_the_interpreter_intact():
    """Regression: an empty NVRTC log once overwrote CPython's shared b' ' object."""
    from common import compile_offline
    compile_offline("step1_simple/zoo.cu", 80)
    assert b" " == bytes([32]) and b" ".decode() == " "
