"""Step 1 kernels on the GPU against the float64 references: random inputs, poisoned outputs, awkward sizes."""
import numpy as np
import pytest

from common import assert_close, poison, rand, reference as R

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from step1_simple import ops  # noqa: E402
from step1_simple.lab import tuning  # noqa: E402

SIZES = [1, 3, 4, 5, 31, 1000, 2 ** 20 + 7, 2 ** 24 + 3]


def gpu_rand(n, seed, low=-1.0, high=1.0):
    return cp.asarray(rand(n, seed=seed, low=low, high=high))


@pytest.mark.sanitize
@pytest.mark.parametrize("version", ops.AXPB_VERSIONS)
@pytest.mark.parametrize("n", SIZES[:6])
def test_axpb_small(version, n):
    x = gpu_rand(n, seed=n + version)
    y = poison(cp.empty_like(x))
    ops.axpb(x, 1.7, -0.3, out=y, version=version)
    assert_close(y, R.axpb(x, 1.7, -0.3), rtol=1e-6, name=f"axpb_v{version} n={n}")


@pytest.mark.parametrize("version", ops.AXPB_VERSIONS)
@pytest.mark.parametrize("n", SIZES[6:])
def test_axpb_large(version, n):
    x = gpu_rand(n, seed=n + version)
    y = poison(cp.empty_like(x))
    ops.axpb(x, -2.5, 0.125, out=y, version=version)
    assert_close(y, R.axpb(x, -2.5, 0.125), rtol=1e-6)


@pytest.mark.parametrize("block", [32, 96, 1024])
@pytest.mark.parametrize("grid", [1, 7, None])
def test_axpb_launch_configurations(block, grid):
    x = gpu_rand(100_003, seed=block)
    for v in (2, 3, 4):
        y = poison(cp.empty_like(x))
        ops.axpb(x, 3.0, 1.0, out=y, version=v, block=block, grid=grid)
        assert_close(y, R.axpb(x, 3.0, 1.0), rtol=1e-6, name=f"v{v} block={block} grid={grid}")


@pytest.mark.sanitize
@pytest.mark.parametrize("offset_x, offset_y", [(1, 1), (2, 2), (3, 3), (1, 2), (0, 3)])
def test_axpb_unaligned_views(offset_x, offset_y):
    base_x, base_y = gpu_rand(1031, seed=5), poison(cp.empty(1031, cp.float32))
    x, y = base_x[offset_x:offset_x + 1021], base_y[offset_y:offset_y + 1021]
    ops.axpb(x, 0.5, 2.0, out=y, version=4)
    assert_close(y, R.axpb(x, 0.5, 2.0), rtol=1e-6)
    # elements outside the view are untouched
    assert cp.isnan(base_y[:offset_y]).all() and cp.isnan(base_y[offset_y + 1021:]).all()


def _zoo_inputs(op, n, seed):
    if op == "log":
        return (gpu_rand(n, seed, 0.01, 10.0),)
    if op == "pow":
        return gpu_rand(n, seed, 0.1, 4.0), gpu_rand(n, seed + 1, -2.0, 2.0)
    if op == "div":
        d = gpu_rand(n, seed + 1, 0.5, 3.0)
        return gpu_rand(n, seed, -4, 4), cp.where(cp.arange(n) % 2 == 0, d, -d)
    if op == "exp":
        return (gpu_rand(n, seed, -10, 10),)
    arity = R.ZOO[op][0]
    return tuple(gpu_rand(n, seed + i, -4, 4) for i in range(arity))


@pytest.mark.sanitize
@pytest.mark.parametrize("n", [1, 37, 100_003])
@pytest.mark.parametrize("op", sorted(R.ZOO))
def test_zoo(op, n):
    arity, scalar, fn = R.ZOO[op]
    out = poison(cp.empty(n, cp.float32))
    if op == "fill":
        ops.zoo("fill", scalar=scalar, out=out)
        assert_close(out, np.full(n, scalar), rtol=0)
        return
    inputs = _zoo_inputs(op, n, seed=n)
    ops.zoo(op, *inputs, scalar=scalar, out=out)
    want = fn(*inputs, scalar) if scalar is not None else fn(*inputs)
    assert_close(out, want, rtol=2e-6, name=f"zoo_{op}")


def test_zoo_accepts_any_contiguous_shape():
    a, b = cp.asarray(rand(3, 5, 7, seed=1)), cp.asarray(rand(3, 5, 7, seed=2))
    assert_close(ops.zoo("mul", a, b), R.f64(a) * R.f64(b), rtol=1e-7)


@pytest.mark.sanitize
@pytest.mark.parametrize("n", [1, 1000, 2 ** 20 + 7])
def test_fused_mul_add_gelu_matches_three_kernels_and_reference(n):
    x, w, b = gpu_rand(n, 1, -3, 3), gpu_rand(n, 2), gpu_rand(n, 3)
    y = poison(cp.empty_like(x))
    ops.mul_add_gelu(x, w, b, out=y)
    want = R.gelu(R.f64(x) * R.f64(w) + R.f64(b))
    assert_close(y, want, rtol=1e-6)
    unfused = ops.zoo("gelu", ops.zoo("add", ops.zoo("mul", x, w), b))
    assert_close(unfused, want, rtol=1e-6)


@pytest.mark.sanitize
@pytest.mark.parametrize("version", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 2, 31, 1000, 2 ** 20 + 7])
def test_sum(version, n):
    x = gpu_rand(n, seed=n, low=0.5, high=1.5)
    got = ops.total(x, version=version)
    assert got.shape == () and got.dtype == cp.float32
    assert_close(got, R.sum(x), rtol=1e-6, name=f"sum_v{version} n={n}")


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2, 3])
def test_sum_2_to_the_28(version):
    x = cp.random.default_rng(28).uniform(0.5, 1.5, 2 ** 28, dtype=cp.float32)
    got = float(ops.total(x, version=version))
    want = float(cp.sum(x, dtype=cp.float64))       # float64 on the GPU: 1 GiB is slow to copy and sum on a host
    assert abs(got - want) / want < 1e-5, (got, want)


@pytest.mark.parametrize("block", [64, 1024])
def test_lab_sum_block_sizes_and_unaligned(block):
    """The lab's sweep (step1_simple/lab/tuning.py): other block sizes than ops.total's."""
    base = gpu_rand(5003, seed=block, low=0.5, high=1.5)
    for off in range(4):
        assert_close(tuning.total(base[off:], block=block), R.sum(base[off:]), rtol=1e-6)


@pytest.mark.parametrize("unroll", tuning.UNROLLS)
@pytest.mark.parametrize("grid", [1, 7, None])
def test_lab_every_unroll_and_grid_the_benchmark_sweeps(unroll, grid):
    """The lab's sweep: axpb v4 and sum v3 with each UNROLL, on a size that is no multiple of the tile, unaligned."""
    base = gpu_rand(100_003, seed=unroll, low=0.5, high=1.5)
    out = poison(cp.empty_like(base))
    for off in (0, 1):
        x, y = base[off:], out[off:]        # the same offset from 16 bytes: v4's float4 path, not v2's fallback
        tuning.axpb(x, 3.0, 1.0, out=y, version=4, grid=grid, unroll=unroll)
        assert_close(y, R.axpb(x, 3.0, 1.0), rtol=1e-6, name=f"axpb v4 UNROLL={unroll} grid={grid} offset={off}")
        assert_close(tuning.total(x, version=3, grid=grid, unroll=unroll), R.sum(x), rtol=1e-6,
                     name=f"sum v3 UNROLL={unroll} grid={grid} offset={off}")


def test_bad_inputs_are_named():
    x = gpu_rand(16, seed=0)
    with pytest.raises(TypeError, match=r"x: expected a cupy.ndarray.*NumPy"):
        ops.axpb(np.ones(16, np.float32), 1.0, 2.0)
    with pytest.raises(TypeError, match="x: expected dtype float32, got float64"):
        ops.axpb(x.astype(cp.float64), 1.0, 2.0)
    with pytest.raises(ValueError, match="x: expected a 1-D array"):
        ops.axpb(x.reshape(4, 4), 1.0, 2.0)
    with pytest.raises(ValueError, match="x: expected a C-contiguous array"):
        ops.axpb(x[::2], 1.0, 2.0)
    with pytest.raises(ValueError, match="out: expected shape"):
        ops.axpb(x, 1.0, 2.0, out=cp.empty(15, cp.float32))
    with pytest.raises(ValueError, match="version"):
        ops.axpb(x, 1.0, 2.0, version=9)
    with pytest.raises(ValueError, match="block"):
        ops.axpb(x, 1.0, 2.0, block=100)
    with pytest.raises(ValueError, match=r"inputs\[1\]: expected shape"):
        ops.zoo("add", x, gpu_rand(15, seed=1))
    with pytest.raises(ValueError, match="op: expected one of"):
        ops.zoo("nope", x)
    with pytest.raises(TypeError, match="needs scalar"):
        ops.zoo("add_scalar", x)
    with pytest.raises(ValueError, match="block"):
        tuning.total(x, block=100)
    with pytest.raises(ValueError, match="unroll"):
        tuning.axpb(x, 1.0, 2.0, unroll=3)


def test_compile_error_on_the_gpu_names_the_line(tmp_path):
    from common import KernelCompileError, get_kernel
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void k(float* y) {\n  y[0] = 1.0f\n}\n')
    with pytest.raises(KernelCompileError, match=r"bad.cu:3: error") as e:
        get_kernel(bad, "k")
    assert "|" in str(e.value)


def test_header_edit_takes_effect(tmp_path):
    from common import get_kernel
    (tmp_path / "value.cuh").write_text("#define VALUE 1.0f\n")
    src = tmp_path / "h.cu"
    src.write_text('#include "value.cuh"\nextern "C" __global__ void k(float* y) { y[0] = VALUE; }\n')
    y = cp.zeros(1, cp.float32)
    get_kernel(src, "k")((1,), (1,), (y,))
    (tmp_path / "value.cuh").write_text("#define VALUE 2.0f\n")
    get_kernel(src, "k")((1,), (1,), (y,))
    assert float(y[0]) == 2.0


def test_get_kernel_is_cached_and_occupancy_reports_a_limit():
    from common import get_kernel, occupancy
    k1 = get_kernel(ops.HERE / "reduce.cu", "sum_v1", {"BLOCK": 256})
    assert get_kernel(ops.HERE / "reduce.cu", "sum_v1", {"BLOCK": 256}) is k1
    occ = occupancy(k1, 256)
    assert 1 <= occ["blocks_per_sm"] <= 32 and 0 < occ["occupancy"] <= 1
    assert occ["limited_by"] in ("registers", "threads", "shared memory")


def test_allow_dynamic_smem_opts_in_and_names_the_cause():
    from common import allow_dynamic_smem, device_info
    from common import get_kernel
    k = get_kernel(ops.HERE / "reduce.cu", "sum_v1", {"BLOCK": 256})
    limit = device_info()["shared_per_block_optin"]
    allow_dynamic_smem(k, 1024, "tiny")                  # below 48 KB: nothing to do
    allow_dynamic_smem(k, min(limit, 60 << 10), "ok")     # opts in
    with pytest.raises(ValueError, match=r"tiles: 3x3 need .* B of shared memory per block"):
        allow_dynamic_smem(k, limit + 1, "tiles: 3x3")
