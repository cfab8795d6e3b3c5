"""Steps 2b and 2c: fused attention (fp32 flash, QKV-buffer variant, decode; tensor cores) vs float64 references.
Random inputs, NaN-poisoned outputs, awkward lengths (1, 7, 63, 64, 65, 1000, 1024), B*H odd."""
import functools

import numpy as np
import pytest

from common import assert_close, capture_graph, poison, rand, reference as R
from common.reference import fusion as RF

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

from step2_attention import flash  # noqa: E402
from step2_attention.lab import tiles as lab_tiles  # noqa: E402
from tests.views import misaligned as _misaligned  # noqa: E402

misaligned = functools.partial(_misaligned, elements=2)   # fp32: 8 bytes past a 16-byte boundary, fp16: 4

TS = [1, 7, 63, 64, 65, 1000, 1024]
SMALL_TS = [1, 7, 65]


def qkv_tensors(B, H, T, D, seed):
    return [cp.asarray(rand(B, H, T, D, seed=seed + i)) for i in range(3)]


def need_arch(sm, what):
    from common import require_arch
    try:
        require_arch(sm, what)
    except RuntimeError as e:
        pytest.skip(str(e))


def need_smem(nbytes, what):
    from common import device_info
    if not flash.smem_fits(nbytes):
        pytest.skip(f"{what} needs {nbytes:,} B of shared memory per block; this GPU allows "
                    f"{device_info()['shared_per_block_optin']:,} B")


def check_fp32(version, T, causal, D, B=1, H=3, scale=None):
    q, k, v = qkv_tensors(B, H, T, D, seed=T + D + version)
    out = poison(cp.empty_like(q))
    flash.flash_attention(q, k, v, causal=causal, scale=scale, out=out, version=version)
    assert_close(out, R.attention(q, k, v, causal=causal, scale=scale), rtol=1e-5,
                 name=f"flash_v{version} T={T} D={D} causal={causal}")


@pytest.mark.sanitize
@pytest.mark.parametrize("version", flash.FLASH_VERSIONS)
@pytest.mark.parametrize("T", SMALL_TS)
@pytest.mark.parametrize("causal", [True, False])
def test_flash_fp32_small(version, T, causal):
    check_fp32(version, T, causal, D=64)


@pytest.mark.parametrize("version", flash.FLASH_VERSIONS)
@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("D", [32, 64])
def test_flash_fp32(version, T, causal, D):
    check_fp32(version, T, causal, D)


def test_flash_fp32_custom_scale_and_batch():
    check_fp32(3, 129, True, 64, B=3, H=5, scale=0.3)
    check_fp32(2, 129, False, 32, B=3, H=5, scale=0.05)


@pytest.mark.parametrize("tiles", [{"BR": 64, "BC": 32, "TM": 4}, {"BR": 128, "BC": 64, "TM": 4},
                                   {"BR": 32, "BC": 64, "TM": 2}])
def test_flash_fp32_other_tile_sizes(tiles):
    need_smem(flash.fp32_smem_bytes(64, tiles), f"tiles {tiles}")
    q, k, v = qkv_tensors(1, 3, 300, 64, seed=3)
    for causal in (True, False):
        out = poison(cp.empty_like(q))
        flash.flash_attention(q, k, v, causal=causal, out=out, tiles=tiles)
        assert_close(out, R.attention(q, k, v, causal=causal), rtol=1e-5, name=str(tiles))


def test_flash_fp32_tiles_too_large_for_shared_memory_are_refused():
    q, k, v = qkv_tensors(1, 1, 16, 64, seed=3)
    huge = {"BR": 256, "BC": 128, "TM": 8}        # 241,664 B: more than any GPU's per-block limit
    assert not flash.smem_fits(flash.fp32_smem_bytes(64, huge))
    with pytest.raises(ValueError, match=r"tiles: .*D=64 need 241,664 B of shared memory"):
        flash.flash_attention(q, k, v, tiles=huge)


@pytest.mark.parametrize("causal", [True, False])
def test_flash_fp32_misaligned_views_fall_back_to_v2(causal):
    """float4 loads need 16-byte aligned rows: v3 on a misaligned q, k, v or out runs v2 instead."""
    q, k, v = qkv_tensors(2, 3, 77, 64, seed=21)
    want = R.attention(q, k, v, causal=causal)
    for which in range(4):
        args = [misaligned(x) if i == which else x for i, x in enumerate((q, k, v))]
        out = poison(misaligned(cp.empty_like(q)) if which == 3 else cp.empty_like(q))
        flash.flash_attention(*args, causal=causal, out=out, version=3)
        assert_close(out, want, rtol=1e-5, name=f"misaligned argument {which}")


def qkv_reference(qkv, n_head, causal, bias):
    q, k, v = RF.split_heads(R.f64(qkv) + (0.0 if bias is None else R.f64(bias)), n_head)   # (B, H, T, D)
    return RF.merge_heads(R.attention(q, k, v, causal=causal))                            # (B, T, C)


@pytest.mark.parametrize("T", [1, 65, 1000])
@pytest.mark.parametrize("n_head, D", [(3, 64), (5, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_qkv(T, n_head, D, with_bias, causal):
    B, C = 2, n_head * D
    qkv = cp.asarray(rand(B, T, 3 * C, seed=T + C))
    bias = cp.asarray(rand(3 * C, seed=7, low=-0.5, high=0.5)) if with_bias else None
    out = poison(cp.empty((B, T, C), cp.float32))
    flash.flash_attention_qkv(qkv, n_head, causal=causal, bias=bias, out=out)
    assert_close(out, qkv_reference(qkv, n_head, causal, bias), rtol=1e-5, name="flash_attention_qkv")


@pytest.mark.sanitize
@pytest.mark.parametrize("version", flash.FLASH_VERSIONS)
def test_flash_qkv_small_all_versions(version):
    B, T, n_head, D = 1, 33, 3, 32
    qkv = cp.asarray(rand(B, T, 3 * n_head * D, seed=1))
    bias = cp.asarray(rand(3 * n_head * D, seed=2))
    out = poison(cp.empty((B, T, n_head * D), cp.float32))
    flash.flash_attention_qkv(qkv, n_head, bias=bias, out=out, version=version)
    assert_close(out, qkv_reference(qkv, n_head, True, bias), rtol=1e-5)


@pytest.mark.parametrize("misaligned_bias", [False, True])
def test_flash_qkv_misaligned_buffer_falls_back_to_v2(misaligned_bias):
    B, T, n_head, D = 2, 70, 3, 64
    C = n_head * D
    qkv = misaligned(cp.asarray(rand(B, T, 3 * C, seed=31)))
    bias = cp.asarray(rand(3 * C, seed=32))
    if misaligned_bias:
        bias = misaligned(bias)
    out = poison(cp.empty((B, T, C), cp.float32))
    flash.flash_attention_qkv(qkv, n_head, bias=bias, out=out, version=3)
    assert_close(out, qkv_reference(qkv, n_head, True, bias), rtol=1e-5, name="misaligned qkv")


def test_flash_qkv_aligned_buffer_with_misaligned_bias_falls_back_to_v2():
    B, T, n_head, D = 1, 40, 2, 32
    C = n_head * D
    qkv = cp.asarray(rand(B, T, 3 * C, seed=33))
    bias = misaligned(cp.asarray(rand(3 * C, seed=34)))
    out = poison(cp.empty((B, T, C), cp.float32))
    flash.flash_attention_qkv(qkv, n_head, bias=bias, out=out, version=3)
    assert_close(out, qkv_reference(qkv, n_head, True, bias), rtol=1e-5, name="misaligned bias")


@pytest.mark.sanitize
@pytest.mark.parametrize("version", flash.FLASH_VERSIONS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_head, D", [(3, 64), (5, 32)])
def test_flash_qkv_writes_lse(version, causal, n_head, D):
    """lse= (what step 4b's attention backward keeps) is each row's log-sum-exp of the scaled scores, and
    asking for it leaves the output bit for bit as it is without."""
    B, T, C = 2, 77, n_head * D
    qkv = cp.asarray(rand(B, T, 3 * C, seed=41))
    bias = cp.asarray(rand(3 * C, seed=42, low=-0.5, high=0.5))
    plain = flash.flash_attention_qkv(qkv, n_head, causal=causal, bias=bias, version=version)
    out, lse = poison(cp.empty((B, T, C), cp.float32)), poison(cp.empty((B, n_head, T), cp.float32))
    flash.flash_attention_qkv(qkv, n_head, causal=causal, bias=bias, out=out, version=version, lse=lse)
    assert cp.array_equal(out, plain)
    q, k, _ = RF.split_heads(R.f64(qkv) + R.f64(bias), n_head)
    assert_close(lse, R.attention_lse(q, k, causal=causal), rtol=1e-6, name=f"lse v{version} causal={causal} D={D}")


# ------------------------------------------------------------------------------------- tensor cores
def tc_inputs(B, H, T, D, dtype, seed):
    q, k, v = qkv_tensors(B, H, T, D, seed)
    if dtype == "fp16":
        need_arch(75, "fp16 tensor-core attention")
        q, k, v = (x.astype(cp.float16) for x in (q, k, v))
        as32 = [x.astype(cp.float32) for x in (q, k, v)]
    else:
        need_arch(80, "bf16 tensor cores")
        q, k, v = (flash.to_bf16(x) for x in (q, k, v))
        as32 = [flash.bf16_to_float32(x) for x in (q, k, v)]
    return (q, k, v), as32


def as_float(x):
    return x.astype(cp.float32) if x.dtype == cp.float16 else flash.bf16_to_float32(x)


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("T", SMALL_TS)
def test_flash_tc_small(dtype, T):
    (q, k, v), ref_in = tc_inputs(1, 3, T, 64, dtype, seed=T)
    out = poison(cp.empty_like(q)) if dtype == "fp16" else cp.full(q.shape, 0x7FC0, cp.uint16)   # bf16 NaN
    flash.flash_attention_tc(q, k, v, causal=True, out=out)
    assert_close(as_float(out), R.attention(*ref_in, causal=True), rtol=1e-2, name=f"flash_tc {dtype} T={T}")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("D", [32, 64, 128])
def test_flash_tc(dtype, T, causal, D):
    need_smem(flash.tc_smem_bytes(D), f"tensor-core attention at D={D} with the default tiles {flash.TC_TILES}")
    (q, k, v), ref_in = tc_inputs(1, 3, T, D, dtype, seed=T + D)
    out = poison(cp.empty_like(q)) if dtype == "fp16" else cp.full(q.shape, 0x7FC0, cp.uint16)
    flash.flash_attention_tc(q, k, v, causal=causal, out=out)
    assert_close(as_float(out), R.attention(*ref_in, causal=causal), rtol=1e-2,
                 name=f"flash_tc {dtype} T={T} D={D} causal={causal}")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("tiles", [{"WARPS": 4, "BC": 32}, {"WARPS": 2, "BC": 64}], ids=str)
def test_lab_flash_tc_d128_small_tiles(dtype, tiles):
    """The lab's tile sweep (step2_attention/lab/tiles.py): D=128 with tiles that fit a T4's 64 KB of shared
    memory (the defaults need 87 KB)."""
    need_smem(flash.tc_smem_bytes(128, tiles), f"tiles {tiles} at D=128")
    (q, k, v), ref_in = tc_inputs(2, 3, 200, 128, dtype, seed=5)
    for causal in (True, False):
        out = poison(cp.empty_like(q)) if dtype == "fp16" else cp.full(q.shape, 0x7FC0, cp.uint16)
        lab_tiles.flash_attention_tc(q, k, v, causal=causal, out=out, tiles=tiles)
        assert_close(as_float(out), R.attention(*ref_in, causal=causal), rtol=1e-2,
                     name=f"flash_tc {dtype} D=128 {tiles} causal={causal}")


def test_lab_flash_tc_tiles_too_large_for_shared_memory_are_refused():
    (q, k, v), _ = tc_inputs(1, 1, 16, 128, "fp16", seed=1)
    huge = {"WARPS": 16, "BC": 256}               # 348,160 B: more than any GPU's per-block limit
    assert not flash.smem_fits(flash.tc_smem_bytes(128, huge))
    with pytest.raises(ValueError, match=r"tiles: .*D=128 need 348,160 B of shared memory"):
        lab_tiles.flash_attention_tc(q, k, v, tiles=huge)


def test_flash_tc_misaligned_views_are_refused():
    """cp.async / 16-byte copies of a misaligned view would fault (a sticky error): the wrapper refuses."""
    (q, k, v), _ = tc_inputs(1, 2, 33, 64, "fp16", seed=2)
    for i, name in enumerate("qkv"):
        args = [misaligned(x) if j == i else x for j, x in enumerate((q, k, v))]
        with pytest.raises(ValueError, match=f"{name}: expected a 16-byte aligned array"):
            flash.flash_attention_tc(*args)
    with pytest.raises(ValueError, match="out: expected a 16-byte aligned array"):
        flash.flash_attention_tc(q, k, v, out=misaligned(cp.empty_like(q)))
    out = poison(cp.empty_like(q))        # the context is still usable: a normal call works afterwards
    flash.flash_attention_tc(q, k, v, out=out)
    assert not bool(cp.isnan(out.astype(cp.float32)).any())


def test_too_many_heads_for_the_grid_are_refused():
    q = cp.asarray(rand(65536, 1, 1, 32, seed=1))
    with pytest.raises(ValueError, match=r"q: B\*H = 65536 exceeds the grid's 65535"):
        flash.flash_attention(q, q, q)
    qkv = cp.asarray(rand(65536, 1, 3 * 32, seed=2))
    with pytest.raises(ValueError, match=r"qkv: B\*n_head = 65536 exceeds the grid's 65535"):
        flash.flash_attention_qkv(qkv, 1)
    need_arch(75, "fp16 tensor-core attention")
    with pytest.raises(ValueError, match=r"q: B\*H = 65536 exceeds the grid's 65535"):
        flash.flash_attention_tc(*(q.astype(cp.float16),) * 3)


@pytest.mark.parametrize("T", [7, 65])
def test_lab_flash_fp16_fp32_fallback_for_sm70(T):
    """The V100 path (no m16n8k8): fp16 in, fp32 flash kernel, fp16 out. Forced here on any GPU, through the
    lab (step2_attention/lab/tiles.py)."""
    q, k, v = (x.astype(cp.float16) for x in qkv_tensors(2, 3, T, 64, seed=T))
    out = poison(cp.empty_like(q))
    lab_tiles.flash_attention_tc(q, k, v, causal=True, out=out, fp32_fallback=True)
    ref = R.attention(*(x.astype(cp.float32) for x in (q, k, v)), causal=True)
    assert_close(out.astype(cp.float32), ref, rtol=1e-2, name=f"fp16 fallback T={T}")


def test_bf16_conversion_round_trip():
    x = cp.asarray(rand(1000, seed=4, low=-100, high=100))
    y = flash.bf16_to_float32(flash.to_bf16(x))
    assert float(cp.max(cp.abs(y - x) / cp.abs(x))) <= 2.0 ** -8


# ------------------------------------------------------------------------------------------- decode
def decode_inputs(B, H, Lmax, D, seed):
    q = cp.asarray(rand(B, H, D, seed=seed))
    kc = cp.asarray(rand(B, H, Lmax, D, seed=seed + 1))
    vc = cp.asarray(rand(B, H, Lmax, D, seed=seed + 2))
    return q, kc, vc


@pytest.mark.sanitize
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("Lmax, lengths", [(1, [1, 1, 1]), (65, [1, 33, 65]), (300, [300, 7, 129])])
def test_decode_small(version, Lmax, lengths):
    q, kc, vc = decode_inputs(3, 3, Lmax, 64, seed=Lmax)
    lens = cp.asarray(np.array(lengths, np.int32))
    out = poison(cp.empty_like(q))
    flash.decode_attention(q, kc, vc, lens, out=out, version=version)
    assert_close(out, R.decode_attention(q, kc, vc, lengths), rtol=1e-5, name=f"decode v{version}")


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("B, H, Lmax", [(1, 3, 1024), (5, 3, 2049)])
def test_decode(version, D, B, H, Lmax):
    q, kc, vc = decode_inputs(B, H, Lmax, D, seed=B + D)
    lengths = np.array([Lmax, 1, 999, 64, 2001][:B], np.int32).clip(1, Lmax)
    out = poison(cp.empty_like(q))
    flash.decode_attention(q, kc, vc, cp.asarray(lengths), out=out, version=version, scale=0.2)
    assert_close(out, R.decode_attention(q, kc, vc, lengths, scale=0.2), rtol=1e-5)


def test_decode_cuda_graph_replays_with_new_lengths():
    B, H, Lmax, D = 4, 3, 1024, 64
    q, kc, vc = decode_inputs(B, H, Lmax, D, seed=11)
    lens = cp.asarray(np.array([1, 2, 3, 4], np.int32))
    out = cp.empty_like(q)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        flash.decode_attention(q, kc, vc, lens, out=out)     # compiles and allocates the workspace
        s.synchronize()
        g = capture_graph(lambda: flash.decode_attention(q, kc, vc, lens, out=out), s)
        for lengths in ([1, 1024, 77, 513], [1024, 1024, 1024, 1024], [5, 300, 1, 999]):
            lens.set(np.array(lengths, np.int32), stream=s)
            poison(out)
            g.launch(s)
            s.synchronize()
            assert_close(out, R.decode_attention(q, kc, vc, lengths), rtol=1e-5, name=f"graph replay {lengths}")


def test_bad_inputs_are_named():
    q, k, v = qkv_tensors(1, 3, 16, 64, seed=0)
    with pytest.raises(TypeError, match=r"q: expected a cupy.ndarray.*NumPy"):
        flash.flash_attention(q.get(), k, v)
    with pytest.raises(TypeError, match="k: expected dtype float32"):
        flash.flash_attention(q, k.astype(cp.float64), v)
    with pytest.raises(ValueError, match="v: expected shape"):
        flash.flash_attention(q, k, v[:, :, :8])
    with pytest.raises(ValueError, match="q: expected head dim"):
        flash.flash_attention(q[..., :48].copy(), k[..., :48].copy(), v[..., :48].copy())
    with pytest.raises(ValueError, match="version"):
        flash.flash_attention(q, k, v, version=7)
    with pytest.raises(ValueError, match="scale"):
        flash.flash_attention(q, k, v, scale=-1.0)
    with pytest.raises(ValueError, match="out: expected shape"):
        flash.flash_attention(q, k, v, out=cp.empty((1, 3, 15, 64), cp.float32))
    qkv = cp.asarray(rand(1, 16, 3 * 192, seed=1))
    with pytest.raises(ValueError, match="n_head"):
        flash.flash_attention_qkv(qkv, 5)
    with pytest.raises(ValueError, match="bias: expected shape"):
        flash.flash_attention_qkv(qkv, 3, bias=cp.zeros(192, cp.float32))
    with pytest.raises(ValueError, match=r"lse: expected shape \(1, 3, 16\)"):
        flash.flash_attention_qkv(qkv, 3, lse=cp.empty((1, 16, 3), cp.float32))
    with pytest.raises(TypeError, match="q: expected dtype float16"):
        flash.flash_attention_tc(q, k, v)
    qd, kc, vc = decode_inputs(2, 3, 32, 64, seed=0)
    with pytest.raises(TypeError, match="lengths: expected dtype int32"):
        flash.decode_attention(qd, kc, vc, cp.ones(2, cp.int64))
    with pytest.raises(ValueError, match="lengths: expected shape"):
        flash.decode_attention(qd, kc, vc, cp.ones(3, cp.int32))
    with pytest.raises(ValueError, match="v_cache: expected shape"):
        flash.decode_attention(qd, kc, vc[:, :, :16], cp.ones(2, cp.int32))
