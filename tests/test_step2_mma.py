"""Step 2c's one-tile tensor-core example (mma_tile.cu): the fragment map against the PTX ISA's tables (CPU),
every variant compiled offline for every arch (CPU), and on the GPU: v1/v2/v3 against the float64 product of
the fp16/bf16 inputs, the versions against each other, the map against the hardware, and bad-input errors."""
import numpy as np
import pytest

from common import assert_close, compile_offline, kernel_source, poison, rand, reference as R
from common.kernels import ARCHS, supported_archs

from step2_attention import ops

gpu = pytest.mark.gpu
CU = "step2_attention/mma_tile.cu"
VARIANTS = [f"{k}<{b}>" for k in ("mma_tile_v1", "mma_tile_v2", "mma_tile_v3", "mma_fragments")
            for b in ("false", "true")]


# --------------------------------------------------------------------------------------------- CPU
def ptx_table(operand, lane, i):
    """(row, col) of element i of lane, written the way the PTX ISA's "Matrix Fragments for mma.m16n8k16 with
    floating point type" section states it (an independent spelling of ops.mma_fragment_map)."""
    group_id, tid_in_group = lane >> 2, lane % 4
    if operand == "a":
        row = group_id if (0 <= i < 2 or 4 <= i < 6) else group_id + 8
        col = tid_in_group * 2 + (i & 0x1) if i < 4 else tid_in_group * 2 + (i & 0x1) + 8
    elif operand == "b":
        row = tid_in_group * 2 + (i & 0x1) if i < 2 else tid_in_group * 2 + (i & 0x1) + 8
        col = group_id
    else:
        row = group_id if i < 2 else group_id + 8
        col = tid_in_group * 2 + (i & 0x1)
    return row, col


@pytest.mark.parametrize("operand", ["a", "b", "c"])
def test_fragment_map_matches_the_ptx_tables(operand):
    m = ops.mma_fragment_map(operand)
    assert m.shape == (32, 8 if operand == "a" else 4, 2)
    for lane in range(32):
        for i in range(m.shape[1]):
            assert tuple(m[lane, i]) == ptx_table(operand, lane, i), (operand, lane, i)


@pytest.mark.parametrize("operand", ["a", "b", "c"])
def test_every_element_is_held_exactly_once(operand):
    m = ops.mma_fragment_map(operand)
    counts = np.zeros(ops.MMA_SHAPES[operand], int)
    np.add.at(counts, (m[..., 0], m[..., 1]), 1)
    assert (counts == 1).all(), counts
    lane, elem = ops.mma_owners(operand)
    assert lane.min() >= 0 and elem.min() >= 0
    for L in range(32):      # the owner grids say the same as the map
        for i in range(m.shape[1]):
            assert lane[tuple(m[L, i])] == L and elem[tuple(m[L, i])] == i


def test_fragment_map_examples():
    """Lane 5 (g = 1, t = 1) by hand: A rows 1 and 9, columns 2, 3, 10, 11; B column 1, rows 2, 3, 10, 11."""
    assert ops.mma_fragment_map("a")[5].tolist() == [[1, 2], [1, 3], [9, 2], [9, 3], [1, 10], [1, 11], [9, 10], [9, 11]]
    assert ops.mma_fragment_map("b")[5].tolist() == [[2, 1], [3, 1], [10, 1], [11, 1]]
    assert ops.mma_fragment_map("c")[5].tolist() == [[1, 2], [1, 3], [9, 2], [9, 3]]
    lane, _ = ops.mma_owners("c")
    assert lane[0].tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and lane[8].tolist() == lane[0].tolist()


def test_a_registers_are_the_four_ldmatrix_tiles():
    """ldmatrix gives lane L row L/4, columns 2(L%4), +1 of each 8x8 tile; A's register j is tile j of
    rows 0-7|8-15 x columns 0-7|8-15 in the order (0, 0), (8, 0), (0, 8), (8, 8): what v2 relies on."""
    m = ops.mma_fragment_map("a")
    for L in range(32):
        for j, (r0, c0) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8)]):
            assert m[L, 2 * j].tolist() == [r0 + L // 4, c0 + 2 * (L % 4)]
            assert m[L, 2 * j + 1].tolist() == [r0 + L // 4, c0 + 2 * (L % 4) + 1]


def test_two_c_tiles_are_one_a_fragment():
    """The FlashAttention-2 register trick (flash_attention_tc.cu): the C fragments of two neighbouring 16x8
    tiles (columns 0-7 and 8-15) are, element for element, the A fragment of the 16x16 they form."""
    a, c = ops.mma_fragment_map("a"), ops.mma_fragment_map("c")
    assert (a[:, :4] == c).all() and (a[:, 4:] == c + [0, 8]).all()


def test_pack_unpack_round_trip():
    for operand, shape in ops.MMA_SHAPES.items():
        x = rand(*shape, seed=1).astype(np.float16)
        frag = ops.mma_pack(x, operand)
        assert frag.shape == ops.mma_fragment_map(operand).shape[:2]
        assert frag[0, 0] == x[0, 0]         # lane 0's first element is always the top-left corner
        assert np.array_equal(ops.mma_unpack(frag, operand), x)
    with pytest.raises(ValueError, match="x: expected shape"):
        ops.mma_pack(np.zeros((16, 8)), "a")
    with pytest.raises(ValueError, match="operand"):
        ops.mma_fragment_map("d")


def test_bad_version_is_rejected_before_anything_else():
    with pytest.raises(ValueError, match="version"):
        ops.mma_tile(None, None, version=4)
    with pytest.raises(ValueError, match="version"):
        ops.mma_kernel(0)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_variant_compiles_on_every_arch(arch):
    """fp16 and bf16 of every version, guarded parts included, compile for sm_70 .. sm_90 without warnings
    or spills (instantiated through the name expressions the wrappers use, as on the GPU)."""
    if arch not in supported_archs():
        pytest.skip(f"the NVRTC CuPy loaded cannot target sm_{arch} (CUDA 13 dropped it); CI checks it with CuPy's CUDA 12 NVRTC")
    report = compile_offline(CU, arch, defines=ops.MMA_DEFINES, name_expressions=ops.MMA_KERNELS)
    assert not report.warnings, report.warnings
    assert sorted(report.kernels) == sorted(VARIANTS), report.table()
    assert not any(k.spill_stores or k.spill_loads for k in report.kernels.values()), report.table()
    if arch >= 75:      # the fp16 kernels really do work from sm_75 on (a trapping kernel uses ~4 registers)
        assert all(report.kernels[f"{k}<false>"].registers > 8 for k in ("mma_tile_v1", "mma_tile_v3"))


def test_kernel_source_shows_the_layout_and_the_instruction():
    src = kernel_source(CU, "mma_tile_v1")
    assert src.lstrip().startswith("//") and "template <bool BF16> __global__" in src
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in src and "a[g * 16 + 2 * t]" in src
    assert "ldmatrix" in kernel_source(CU, "mma_tile_v2") and "k0 += 16" in kernel_source(CU, "mma_tile_v3")


# --------------------------------------------------------------------------------------------- GPU
DTYPES = ["fp16", "bf16"]


def need_dtype(dt):
    from common import require_arch
    try:
        require_arch(80 if dt == "bf16" else 75, f"{dt} mma.sync")
    except RuntimeError as e:
        pytest.skip(str(e))


def to_dt(x, dt):
    """float32 NumPy -> CuPy fp16, or bf16 bit patterns (uint16)."""
    import cupy as cp
    from step2_attention import flash
    return cp.asarray(x.astype(np.float16)) if dt == "fp16" else flash.to_bf16(cp.asarray(x, dtype=cp.float32))


def f64(x):
    """fp16 or bf16-bits CuPy array -> float64 NumPy: the values the tensor core really multiplies."""
    from step2_attention import flash
    return R.f64(flash.bf16_to_float32(x) if x.dtype == np.uint16 else x)


def rtol_for(K):
    # Products of fp16/bf16 values are exact in fp32, and one k16 step adds 16 of them: ~1e-7 relative. Over
    # many k-steps tensor cores add in fp32 with truncating alignment, not rounding, so the error grows with K.
    return 1e-5 if K <= 64 else 1e-4


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("version", ops.MMA_VERSIONS)
@pytest.mark.parametrize("dt", DTYPES)
def test_one_tile_matches_float64(version, dt):
    import cupy as cp
    need_dtype(dt)
    a, b = to_dt(rand(16, 16, seed=version), dt), to_dt(rand(16, 8, seed=10 + version), dt)
    c = poison(cp.empty((16, 8), cp.float32))
    assert ops.mma_tile(a, b, version=version, out=c) is c
    assert_close(c, f64(a) @ f64(b), rtol=1e-5, name=f"mma_tile_v{version} {dt}")


@gpu
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("M, K, N", [(1, 1, 1), (16, 16, 8), (17, 33, 9), (64, 7, 130), (100, 1000, 72),
                                     (129, 48, 8), (300, 64, 301)])
def test_v3_gemm_on_awkward_shapes(M, K, N, dt):
    import cupy as cp
    need_dtype(dt)
    a, b = to_dt(rand(M, K, seed=M + K), dt), to_dt(rand(K, N, seed=K + N), dt)
    c = poison(cp.empty((M, N), cp.float32))
    ops.mma_tile(a, b, version=3, out=c)
    assert_close(c, R.matmul(f64(a), f64(b)), rtol=rtol_for(K), name=f"mma_tile_v3 {dt} M={M} K={K} N={N}")


@gpu
@pytest.mark.parametrize("dt", DTYPES)
def test_versions_agree_bit_for_bit(dt):
    """v1 (global loads), v2 (ldmatrix) and v3 (one k-step) feed the same registers to the same instruction."""
    import cupy as cp
    need_dtype(dt)
    a, b = to_dt(rand(16, 16, seed=7, low=-4, high=4), dt), to_dt(rand(16, 8, seed=8, low=-4, high=4), dt)
    outs = [ops.mma_tile(a, b, version=v) for v in ops.MMA_VERSIONS]
    for v, o in zip(ops.MMA_VERSIONS[1:], outs[1:]):
        assert cp.array_equal(o, outs[0]), f"mma_tile_v{v} differs from v1 ({dt})"


@gpu
@pytest.mark.parametrize("dt", DTYPES)
def test_fragment_map_on_the_hardware(dt):
    """The bare instruction with matrices placed by mma_pack and read back by mma_unpack gives A @ B."""
    need_dtype(dt)
    A, B = rand(16, 16, seed=3), rand(16, 8, seed=4)
    a, b = to_dt(A, dt), to_dt(B, dt)
    c_frag = ops.mma_fragments(ops.mma_pack(a, "a"), ops.mma_pack(b, "b"))
    assert_close(ops.mma_unpack(c_frag, "c"), f64(a) @ f64(b), rtol=1e-5, name=f"mma_fragments {dt}")


@gpu
@pytest.mark.parametrize("dt", DTYPES)
def test_which_lane_holds_which_element_on_the_hardware(dt):
    """Feed labels instead of numbers: each lane puts its own codes (8 lane + i for A's element i, 4 lane + i for
    B's) into its registers, and identity / one-hot matrices on the other side carry them into C unchanged
    (small integers are exact in fp16 and bf16, products by 1 and sums with 0 are exact)."""
    need_dtype(dt)
    lane_a, elem_a = ops.mma_owners("a")
    lane_b, elem_b = ops.mma_owners("b")
    codes_a = np.arange(256, dtype=np.float32).reshape(32, 8)
    codes_b = np.arange(128, dtype=np.float32).reshape(32, 4)
    # B: A = identity, so C = B: C's element (r, n) is the code of the lane the map says holds B[r][n]
    eye = to_dt(np.eye(16, dtype=np.float32), dt)
    c = ops.mma_unpack(ops.mma_fragments(ops.mma_pack(eye, "a"), to_dt(codes_b, dt)), "c").get()
    assert np.array_equal(c, 4 * lane_b + elem_b), f"B owners on the GPU ({dt}):\n{c}\nmap says:\n{4 * lane_b + elem_b}"
    # A: B = one-hot columns picking k = n (then k = n + 8), so C shows columns 0-7 (then 8-15) of A
    got = []
    for shift in (0, 8):
        onehot = to_dt(np.eye(16, 8, -shift, dtype=np.float32), dt)
        got.append(ops.mma_unpack(ops.mma_fragments(to_dt(codes_a, dt), ops.mma_pack(onehot, "b")), "c").get())
    got = np.hstack(got)
    assert np.array_equal(got, 8 * lane_a + elem_a), f"A owners on the GPU ({dt}):\n{got}\nmap says:\n{8 * lane_a + elem_a}"
    # C: lane L's raw register i is C's element at the map's (row, col), with no unpacking in between
    raw = ops.mma_fragments(ops.mma_pack(eye, "a"), to_dt(codes_b, dt)).get()
    m = ops.mma_fragment_map("c")
    assert np.array_equal(raw, (4 * lane_b + elem_b)[m[..., 0], m[..., 1]])


@gpu
def test_bad_inputs_name_the_argument():
    import cupy as cp
    need_dtype("fp16")
    a, b = to_dt(rand(16, 16, seed=1), "fp16"), to_dt(rand(16, 8, seed=2), "fp16")
    with pytest.raises(TypeError, match="a: expected dtype float16"):
        ops.mma_tile(a.astype(cp.float32), b)
    with pytest.raises(TypeError, match="b: expected dtype float16"):
        ops.mma_tile(a, b.astype(cp.float32))
    with pytest.raises(ValueError, match=r"a: expected shape \(16, 16\)"):
        ops.mma_tile(a[:8], b)
    with pytest.raises(ValueError, match=r"b: expected shape \(16, 8\)"):
        ops.mma_tile(a, a)
    with pytest.raises(ValueError, match="a: expected a C-contiguous"):
        ops.mma_tile(a.T, b)
    with pytest.raises(ValueError, match="b: expected a C-contiguous"):
        ops.mma_tile(a, cp.asarray(b.get().T.copy()).T)
    with pytest.raises(ValueError, match=r"b: expected shape \(16, \*\)"):
        ops.mma_tile(a, a[:8], version=3)
    with pytest.raises(TypeError, match="a: expected a cupy.ndarray"):
        ops.mma_tile(a.get(), b)
    with pytest.raises(TypeError, match="out: expected dtype float32"):
        ops.mma_tile(a, b, out=cp.empty((16, 8), cp.float16))
    with pytest.raises(ValueError, match=r"out: expected shape \(16, 8\)"):
        ops.mma_tile(a, b, out=cp.empty((8, 16), cp.float32))
    with pytest.raises(ValueError, match=r"b_frag: expected shape \(32, 4\)"):
        ops.mma_fragments(ops.mma_pack(a, "a"), b)


@gpu
def test_empty_and_k0():
    import cupy as cp
    need_dtype("fp16")
    assert ops.mma_tile(cp.empty((0, 5), cp.float16), cp.empty((5, 3), cp.float16), version=3).shape == (0, 3)
    c = ops.mma_tile(cp.empty((4, 0), cp.float16), cp.empty((0, 3), cp.float16), version=3)
    assert c.shape == (4, 3) and not c.any()
