"""Step 2a on the GPU against the float64 references: softmax v1..v4, matmul v1..v3, naive and cuBLAS-based
attention. Random inputs (never zeros), NaN-poisoned outputs, sizes that are not multiples of any block/tile.
On the CPU: every version the wrappers of steps 1 and 2 accept has its kernel in their .cu files."""
import math

import numpy as np
import pytest

from common import assert_close, compile_offline, poison, rand, reference as R
from common.kernels import ROOT, supported_archs
from tests.kernel_names import compiled_kernels

cp = pytest.importorskip("cupy")

from step2_attention import ops  # noqa: E402

gpu = pytest.mark.gpu


def g(*shape, seed, low=-1.0, high=1.0):
    return cp.asarray(rand(*shape, seed=seed, low=low, high=high))


# --------------------------------------------------------------------------------------------- CPU
def test_every_version_a_wrapper_accepts_has_its_kernel():
    """The f-string names that tests/test_compile.py checks match any version; here each version the wrappers
    accept is looked up in what NVRTC compiles (with the owning module's defines and template names)."""
    from step1_simple import ops as ops1
    from step2_attention import flash
    zoo = (*ops1.ZOO_UNARY, *ops1.ZOO_BINARY, *ops1.ZOO_SCALAR, "fill")
    s1, s2, fl = "step1_simple/ops.py", "step2_attention/ops.py", "step2_attention/flash.py"   # owning modules
    wanted = {(s1, "step1_simple/axpb.cu"): [f"axpb_v{v}" for v in ops1.AXPB_VERSIONS],
              (s1, "step1_simple/reduce.cu"): [f"sum_v{v}" for v in ops1.SUM_VERSIONS],
              (s1, "step1_simple/zoo.cu"): [f"zoo_{op}" for op in zoo],
              (s2, "step2_attention/softmax.cu"): [f"softmax_v{v}" for v in ops.SOFTMAX_VERSIONS]
              + ["softmax_v4_scalar", "softmax_v4_long"],
              (s2, "step2_attention/matmul.cu"): [f"matmul_v{v}" for v in ops.MATMUL_VERSIONS],
              (fl, "step2_attention/flash_attention.cu"): [f"flash_v{v}" for v in flash.FLASH_VERSIONS],
              (s2, "step2_attention/mma_tile.cu"): [f"mma_tile_v{v}<{b}>" for v in ops.MMA_VERSIONS
                                                    for b in ("false", "true")]
              + [f"mma_fragments<{b}>" for b in ("false", "true")]}
    for (owner, cu), names in wanted.items():
        missing = set(names) - set(compiled_kernels(owner, ROOT / cu))
        assert not missing, f"{cu} lacks {sorted(missing)}"


def test_matmul_v3_budgets_registers_for_two_blocks_per_sm():
    """v3's speed depends on 2 x 256 threads per SM (<= 128 registers each) with no spills, on every arch."""
    for arch in [a for a in (75, 80, 90) if a in supported_archs()]:
        k = compile_offline("step2_attention/matmul.cu", arch, defines=ops.MATMUL_V3).kernels["matmul_v3"]
        assert k.registers <= 128 and k.spill_stores == 0 and k.spill_loads == 0, (arch, k)


def test_napkin_math_helpers():
    assert ops.attention_flops(8, 12, 1024, 64, causal=False) == 4 * 8 * 12 * 1024 * 1024 * 64
    assert ops.attention_flops(8, 12, 1024, 64) == 2 * 8 * 12 * 1024 * 1024 * 64
    b = ops.softmax_bytes(98304, 1024, 4)
    assert b["read"] + b["written"] == b["floor"] == 8 * 98304 * 1024
    assert ops.softmax_bytes(10, 1024, 1)["read"] == 3 * 4 * 10 * 1024
    assert ops.softmax_bytes(10, 1024, "4a")["read"] == 2 * 4 * 10 * 1024
    assert ops.softmax_bytes(10, 4096, 4)["read"] == 2 * 4 * 10 * 4096      # softmax_v4_long: two passes


# --------------------------------------------------------------------------------------------- softmax
# fp32 sums of up to 8192 terms: the float64 reference differs by a few 1e-7 (relative norm).
SOFTMAX_RTOL = 2e-6
SMALL_SHAPES = [(1, 1), (1, 7), (37, 33), (5, 1000), (37, 1024), (3, 4097)]
LARGE_SHAPES = [(4099, 1024), (1031, 1000), (257, 8192), (65, 4097), (20000, 7)]


def _seed(version) -> int:
    return 5 if version == "4a" else version


def _check_softmax(x, version, name):
    y = poison(cp.empty_like(x))
    ops.softmax(x, version=version, out=y)
    return assert_close(y, R.softmax(x), rtol=SOFTMAX_RTOL, name=name)


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("version", ops.SOFTMAX_STEPS)
@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=str)
def test_softmax_small(version, shape):
    _check_softmax(g(*shape, seed=sum(shape) + _seed(version), low=-4, high=4), version, f"softmax_v{version} {shape}")


@gpu
@pytest.mark.parametrize("version", ops.SOFTMAX_STEPS)
@pytest.mark.parametrize("shape", LARGE_SHAPES, ids=str)
def test_softmax_large(version, shape):
    _check_softmax(g(*shape, seed=_seed(version), low=-8, high=8), version, f"softmax_v{version} {shape}")


def _masked(rows, cols, seed):
    """Row 0 all -inf, row 1 one finite value (at the end), row 2 -inf except the first, the rest with
    ~half -inf at random, the last row all -inf again."""
    x = rand(rows, cols, seed=seed, low=-5, high=5)
    rng = np.random.default_rng(seed)
    x[rng.random((rows, cols)) < 0.5] = -np.inf
    x[0] = -np.inf
    x[1] = -np.inf
    x[1, -1] = 3.0
    x[2, 1:] = -np.inf
    x[-1] = -np.inf
    return cp.asarray(x)


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("version", ops.SOFTMAX_STEPS)
@pytest.mark.parametrize("cols", [1, 7, 33, 1024, 4097, 8192])
def test_softmax_masked_rows(version, cols):
    x = _masked(9, cols, seed=cols)
    y = poison(cp.empty_like(x))
    ops.softmax(x, version=version, out=y)
    assert_close(y, R.softmax(x), rtol=SOFTMAX_RTOL, name=f"softmax_v{version} masked cols={cols}")
    assert (y[0] == 0).all() and (y[-1] == 0).all(), "an all -inf row must give zeros"


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("version", ops.SOFTMAX_STEPS)
@pytest.mark.parametrize("magnitude", [1e4, 1e30, 1e38])
def test_softmax_large_magnitudes(version, magnitude):
    x = g(17, 1000, seed=3) * np.float32(magnitude)        # exp(x) overflows without the max shift
    _check_softmax(x, version, f"softmax_v{version} |x|~{magnitude:g}")


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("version", ops.SOFTMAX_STEPS)
def test_softmax_in_place_and_unaligned(version):
    x = g(13, 1024, seed=11, low=-3, high=3)
    want = R.softmax(x)
    ops.softmax(x, version=version, out=x)
    assert_close(x, want, rtol=SOFTMAX_RTOL, name="in place")
    base = g(13 * 256 + 1, seed=12, low=-3, high=3)
    view = base[1:].reshape(13, 256)                    # 4 bytes past a 16-byte boundary: v4 goes scalar
    _check_softmax(view, version, "unaligned")


@gpu
@pytest.mark.parametrize("tk, online_only", [(45, False), (48, False), (2052, False), (48, True)],
                         ids=["scalar", "float4", "float4 long rows", "online only (4a)"])
def test_softmax_v4_causal_mask_and_scale(tk, online_only):
    """The masked, scaled mode that attention_cublas uses, on its own, against the reference: in each of the
    three kernels _softmax_v4_launch picks from (softmax_v4_scalar, softmax_v4, softmax_v4_long)."""
    bh, tq, scale = 3, 37, 0.37
    s = g(bh, tq, tk, seed=5, low=-4, high=4)
    want = R.f64(s) * scale
    want = np.where(np.arange(tk)[None, :] > np.arange(tq)[:, None] + (tk - tq), -np.inf, want)
    y = poison(cp.empty_like(s))
    ops._softmax_v4_launch(s, y, bh * tq, tk, scale=scale, causal=True, period=tq, offset=tk - tq,
                           online_only=online_only)
    assert_close(y, R.softmax(want), rtol=SOFTMAX_RTOL)


# --------------------------------------------------------------------------------------------- matmul
SMALL_MNK = [(1, 1, 1), (7, 63, 65), (65, 7, 63), (63, 129, 7), (129, 65, 128), (130, 132, 68), (1, 256, 4)]
LARGE_MNK = [(256, 256, 256), (1000, 1000, 1000), (129, 1031, 257), (1024, 4, 1024), (333, 1024, 1000)]


def _check_matmul(M, N, K, version, seed=0):
    a, b = g(M, K, seed=seed + M), g(K, N, seed=seed + N + 1)
    c = poison(cp.empty((M, N), cp.float32))
    ops.matmul(a, b, version=version, out=c)
    return assert_close(c, R.matmul(a, b), rtol=2e-6, name=f"matmul_v{version} {M}x{N}x{K}")


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("version", ops.MATMUL_VERSIONS)
@pytest.mark.parametrize("mnk", SMALL_MNK, ids=str)
def test_matmul_small(version, mnk):
    _check_matmul(*mnk, version)


@gpu
@pytest.mark.parametrize("version", ops.MATMUL_VERSIONS)
@pytest.mark.parametrize("mnk", LARGE_MNK, ids=str)
def test_matmul_large(version, mnk):
    _check_matmul(*mnk, version)


@gpu
@pytest.mark.parametrize("mnk", [(7, 63, 65), (129, 65, 128), (130, 132, 68), (333, 1024, 1000)], ids=str)
def test_lab_matmul_v3_tiles_the_benchmark_sweeps(mnk):
    """The lab's tile sweep (step2_attention/lab/tiles.py): matmul v3 with each alternative tile config that the
    benchmark times, on the float4 and the scalar path; a config for another version is refused."""
    from step2_attention.benchmarks import MATMUL_V3_ALTERNATIVES
    from step2_attention.lab import tiles as lab_tiles
    M, N, K = mnk
    a, b = g(M, K, seed=M), g(K, N, seed=N + 1)
    for alt in MATMUL_V3_ALTERNATIVES:
        c = poison(cp.empty((M, N), cp.float32))
        lab_tiles.matmul(a, b, version=3, out=c, config={**ops.MATMUL_V3, **alt})
        assert_close(c, R.matmul(a, b), rtol=2e-6, name=f"matmul_v3 {alt} {M}x{N}x{K}")
    with pytest.raises(ValueError, match="config: only matmul version 3"):
        lab_tiles.matmul(a, b, version=2, config={"BK": 16})


@gpu
def test_matmul_v3_vector_and_scalar_paths_agree():
    """K, N multiples of 4 take the float4 path; an unaligned view of the same data takes the scalar one."""
    a, b = g(300, 516, seed=1), g(516, 260, seed=2)
    base = cp.empty(300 * 516 + 1, cp.float32)
    a_off = base[1:].reshape(300, 516)
    a_off[...] = a
    assert a_off.data.ptr % 16 != 0
    want = R.matmul(a, b)
    assert_close(ops.matmul(a, b), want, rtol=2e-6, name="float4 path")
    assert_close(ops.matmul(a_off, b), want, rtol=2e-6, name="scalar path")


@gpu
@pytest.mark.parametrize("version", ops.MATMUL_VERSIONS)
def test_matmul_k_zero_gives_zeros(version):
    c = poison(cp.empty((5, 3), cp.float32))
    ops.matmul(cp.empty((5, 0), cp.float32), cp.empty((0, 3), cp.float32), version=version, out=c)
    assert c.shape == (5, 3) and bool((c == 0).all())


# --------------------------------------------------------------------------------------------- attention
ATTN = [(1, 1, 1, 64), (1, 3, 7, 64), (3, 1, 63, 64), (1, 3, 64, 64), (3, 3, 65, 32), (1, 3, 1000, 64),
        (1, 1, 1024, 64), (1, 5, 129, 80)]


def _qkv(B, H, Tq, D, seed, Tk=None):
    Tk = Tq if Tk is None else Tk
    return g(B, H, Tq, D, seed=seed), g(B, H, Tk, D, seed=seed + 1), g(B, H, Tk, D, seed=seed + 2)


@gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", ATTN, ids=str)
@pytest.mark.parametrize("impl", ["naive", "cublas"])
def test_attention(impl, shape, causal):
    B, H, T, D = shape
    q, k, v = _qkv(B, H, T, D, seed=T + D)
    if impl == "naive":
        o = poison(cp.empty_like(q))
        ops.attention_naive(q, k, v, causal=causal, out=o)
    else:
        o = ops.attention_cublas(q, k, v, causal=causal)
    assert_close(o, R.attention(q, k, v, causal=causal), rtol=1e-5, name=f"attention_{impl} {shape} causal={causal}")


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tq, tk", [(1, 1), (7, 7), (33, 33), (65, 65), (7, 65), (65, 7)])
@pytest.mark.parametrize("impl", ["naive", "cublas"])
def test_attention_small_and_uneven_lengths(impl, tq, tk, causal):
    """Tq != Tk: query i sees keys up to i + (Tk - Tq); with Tq > Tk the first rows see nothing (zeros)."""
    q, k, v = _qkv(1, 3, tq, 32, seed=tq * 100 + tk, Tk=tk)
    scale = 0.2
    if impl == "naive":    # poisoned: the fully masked rows (tq > tk) must be written as zeros
        o = poison(cp.empty_like(q))
        ops.attention_naive(q, k, v, causal=causal, scale=scale, out=o)
    else:                  # returns a fresh array from cupy.matmul (no out= to poison)
        o = ops.attention_cublas(q, k, v, causal=causal, scale=scale)
    assert_close(o, R.attention(q, k, v, causal=causal, scale=scale), rtol=1e-5)


# --------------------------------------------------------------------------------------------- bad inputs
@gpu
def test_bad_inputs_are_named():
    x = g(4, 8, seed=0)
    with pytest.raises(TypeError, match=r"x: expected a cupy.ndarray.*NumPy"):
        ops.softmax(np.ones((4, 8), np.float32))
    with pytest.raises(TypeError, match="x: expected dtype float32, got float64"):
        ops.softmax(x.astype(cp.float64))
    with pytest.raises(ValueError, match="x: expected a 2-D array"):
        ops.softmax(x.reshape(2, 2, 8))
    with pytest.raises(ValueError, match="x: expected a C-contiguous array"):
        ops.softmax(x[:, ::2])
    with pytest.raises(ValueError, match="out: expected shape"):
        ops.softmax(x, out=cp.empty((4, 7), cp.float32))
    with pytest.raises(ValueError, match="version"):
        ops.softmax(x, version=5)
    with pytest.raises(ValueError, match=r"b: expected shape \(8, \*\)"):
        ops.matmul(x, g(7, 3, seed=1))
    with pytest.raises(TypeError, match="b: expected dtype float32"):
        ops.matmul(x, g(8, 3, seed=1).astype(cp.float16))
    with pytest.raises(ValueError, match="version"):
        ops.matmul(x, g(8, 3, seed=1), version=0)
    with pytest.raises(ValueError, match="out: expected shape"):
        ops.matmul(x, g(8, 3, seed=1), out=cp.empty((3, 4), cp.float32))
    q = g(1, 2, 5, 16, seed=2)
    with pytest.raises(ValueError, match="q: expected a 4-D array"):
        ops.attention_naive(q[0], q[0], q[0])
    with pytest.raises(ValueError, match=r"k: expected shape \(1, 2, \*, 16\)"):
        ops.attention_naive(q, g(1, 2, 5, 8, seed=3), q)
    with pytest.raises(ValueError, match="v: expected shape"):
        ops.attention_cublas(q, q, g(1, 2, 6, 16, seed=4))
    with pytest.raises(ValueError, match="q: expected a C-contiguous"):
        ops.attention_cublas(q.transpose(0, 2, 1, 3), q, q)
    with pytest.raises(TypeError, match="q: expected a cupy.ndarray"):
        ops.attention_naive(q.get(), q, q)


@gpu
def test_attention_default_scale_is_inverse_sqrt_d():
    q, k, v = _qkv(1, 1, 9, 16, seed=9)
    assert_close(ops.attention_naive(q, k, v), R.attention(q, k, v, scale=1 / math.sqrt(16)), rtol=1e-5)
