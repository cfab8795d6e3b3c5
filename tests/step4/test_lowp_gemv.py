"""Fewer bytes per weight: step4_gpt2/quantize.py, gemv_lowp.cu (gemv_v6 bf16, gemv_v7 int8 + row scales, the
prefill's widening) through ops.gemv / gemv_qkv / matmul_lowp, and weights.py's dtype="bf16".
CPU part: the conversions against common/reference/quantize.py, argument rules, compiles, bf16 weight files.
GPU part: every format x epilogue x LayerNorm prologue x batch on awkward shapes against float64 references
(bf16: the reference uses the bf16-rounded weights, int8 the dequantized ones, so both are fp32-tight)."""
import itertools
import json
import types

import numpy as np
import pytest

from common import assert_close, poison, rand
from common.reference import quantize as R
from step4_gpt2 import quantize as Q
from step4_gpt2 import weights as W

gpu = pytest.mark.gpu


def _weights(N, K, seed):
    """Random weights with rows of very different magnitudes (per-row scales must follow each row)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((N, K)) * np.exp(rng.uniform(-3, 1, (N, 1)))).astype(np.float32)


# ============================================================================ CPU: conversions
def test_to_bf16_rounds_to_nearest_even_like_the_reference():
    w = np.concatenate([_weights(64, 96, 0).ravel(), np.float32([0.0, -0.0, 1.0, -2.5, 3e-30, 6e37])])
    u = Q.to_bf16(w)
    assert u.dtype == np.uint16 and u.shape == w.shape
    np.testing.assert_array_equal(Q.from_bf16(u).astype(np.float64), R.bf16_round(w))
    np.testing.assert_array_equal(R.bf16_bits_value(u), Q.from_bf16(u).astype(np.float64))
    # exact ties: the low 16 bits are 0x8000, so the even neighbour wins
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000], np.uint32).view(np.float32)
    assert Q.to_bf16(ties).tolist() == [0x3F80, 0x3F82, 0xBF80]
    # at most half a unit in the last of the 8 significant bits
    assert (np.abs(Q.from_bf16(u).astype(np.float64) - w) <= np.abs(w) * 2.0 ** -8).all()


def test_from_bf16_is_exact_and_the_round_trip_is_the_identity():
    u = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = ((u >> 7) & 0xFF) != 0xFF
    np.testing.assert_array_equal(Q.to_bf16(Q.from_bf16(u[finite])), u[finite])
    np.testing.assert_array_equal(R.bf16_bits_value(u[finite]), Q.from_bf16(u[finite]).astype(np.float64))


@pytest.mark.parametrize("N,K", [(1, 16), (37, 64), (300, 770)])
def test_quantize_int8_error_bound_and_the_reference(N, K):
    w = _weights(N, K, N + K)
    w[min(2, N - 1)] = 0.0                                  # a row of zeros: scale 0, q 0, no division by 0
    q, scale = Q.quantize_int8(w)
    assert q.dtype == np.int8 and q.shape == (N, K) and scale.dtype == np.float32 and scale.shape == (N,)
    assert np.abs(q.astype(np.int32)).max() <= 127
    nz = scale > 0
    assert (np.abs(q[nz]).max(axis=1) == 127).all()          # each row's largest weight uses the full range
    assert (q[~nz] == 0).all()
    err = np.abs(Q.dequantize_int8(q, scale).astype(np.float64) - w)
    assert (err <= scale[:, None].astype(np.float64) * (0.5 + 1e-5)).all()
    q64, s64 = R.int8_quantize(w)
    np.testing.assert_allclose(scale, s64, rtol=1e-7)
    diff = np.abs(q.astype(np.int64) - q64)                  # float32 vs float64 division: a tie may differ by 1
    assert diff.max() <= 1 and diff.mean() < 1e-3
    np.testing.assert_allclose(Q.dequantize_int8(q, scale), R.weight(q, scale), rtol=1e-7)


def test_quantize_int8_reads_bf16_bits_and_quantize_picks_the_kind():
    w = _weights(9, 32, 3)
    u = Q.to_bf16(w)
    q, s = Q.quantize_int8(u)
    q2, s2 = Q.quantize_int8(Q.from_bf16(u))
    np.testing.assert_array_equal(q, q2)
    np.testing.assert_array_equal(s, s2)
    for kind, dtype in (("fp32", np.float32), ("bf16", np.uint16), ("int8", np.int8)):
        lw = Q.quantize(w, kind)
        assert lw.kind == kind and lw.w.dtype == dtype and lw.shape == (9, 32)
        assert lw.nbytes == 9 * 32 * Q.BYTES_PER_WEIGHT[kind] + (9 * 4 if kind == "int8" else 0)
        assert np.abs(lw.dequantize() - w).max() <= np.abs(w).max() / 100
    assert Q.quantize(u, "bf16").w is u
    np.testing.assert_array_equal(Q.quantize(u, "fp32").w, Q.from_bf16(u))


def test_conversion_errors_name_the_argument():
    w = _weights(4, 16, 1)
    with pytest.raises(TypeError, match="w: expected dtype float32, got float64"):
        Q.to_bf16(w.astype(np.float64))
    with pytest.raises(TypeError, match="u: expected dtype uint16"):
        Q.from_bf16(w)
    with pytest.raises(ValueError, match="w: expected 2 dimensions"):
        Q.quantize_int8(w.ravel())
    with pytest.raises(TypeError, match="w: expected a NumPy or CuPy array, got list"):
        Q.quantize_int8([[1.0]])
    q, s = Q.quantize_int8(w)
    with pytest.raises(ValueError, match=r"scale: expected one per row of q, shape \(4,\)"):
        Q.dequantize_int8(q, s[:3])
    with pytest.raises(ValueError, match="kind: expected one of"):
        Q.quantize(w, "int4")
    with pytest.raises(ValueError, match="scale: an int8 weight needs"):
        Q.LowpWeight(q)
    with pytest.raises(ValueError, match="scale: only int8 weights have scales; w is bf16"):
        Q.LowpWeight(Q.to_bf16(w), s)
    with pytest.raises(ValueError, match=r"scale: expected shape \(4,\)"):
        Q.LowpWeight(q, s[:2])
    with pytest.raises(TypeError, match="w: expected dtype float32 or uint16 or int8, got float64"):
        Q.LowpWeight(w.astype(np.float64))


def test_reference_gemv_scales_once_per_row():
    x, w, b = rand(3, 48, seed=1), _weights(5, 48, 2), rand(5, seed=3)
    q, s = Q.quantize_int8(w)
    want = (x.astype(np.float64) @ q.astype(np.float64).T) * s.astype(np.float64) + b
    np.testing.assert_allclose(R.gemv(x, q, s, bias=b), want, rtol=1e-12)
    r = rand(3, 5, seed=4)
    np.testing.assert_allclose(R.gemv(x, q, s, bias=b, residual=r), r + want, rtol=1e-12)
    with pytest.raises(ValueError, match="scale: int8 weights need"):
        R.weight(q)


# ============================================================================ CPU: the wrappers' rules
def test_lowp_format_picks_the_kernel_and_names_bad_arguments():
    from step4_gpt2.ops import lowp_format
    assert lowp_format(np.uint16, 64, False) == ("bf16", 6)
    assert lowp_format(np.int8, 64, True, 7) == ("int8", 7)
    assert lowp_format(np.int8, 64, True, 9) == ("int8", 9)
    assert lowp_format(np.uint16, 64, False, 8) == ("bf16", 8)
    with pytest.raises(ValueError, match="scale: int8 weights need their"):
        lowp_format(np.int8, 64, False)
    with pytest.raises(ValueError, match=r"scale: only int8 weights take row scales; W is bf16"):
        lowp_format(np.uint16, 64, True)
    with pytest.raises(ValueError, match=r"W: bf16 weights are read 16 bytes \(8 weights\) at a time, so K must be "
                                         r"a multiple of 8, got K=60"):
        lowp_format(np.uint16, 60, False)
    with pytest.raises(ValueError, match="K must be a multiple of 16, got K=40"):
        lowp_format(np.int8, 40, True)
    with pytest.raises(ValueError, match=r"version: int8 weights are read by version 7 \(gemv_v7\) or 9 \(gemv_v9, tensor cores\), got 6"):
        lowp_format(np.int8, 64, True, 6)
    with pytest.raises(ValueError, match=r"version: bf16 weights are read by version 6 \(gemv_v6\) or 8 \(gemv_v8, tensor cores\), got 5"):
        lowp_format(np.uint16, 64, False, 5)
    with pytest.raises(ValueError, match=r"version: bf16 weights are read by version 6 .* got 9"):
        lowp_format(np.uint16, 64, False, 9)
    with pytest.raises(ValueError, match="version: expected one of"):
        lowp_format(np.uint16, 64, False, 10)
    with pytest.raises(TypeError, match=r"W: version 6 reads uint16 \(bf16 bit patterns\) weights, got dtype float32"):
        lowp_format(np.float32, 64, False, 6)
    with pytest.raises(TypeError, match=r"W: version 9 reads int8 weights, got dtype float32"):
        lowp_format(np.float32, 64, False, 9)
    with pytest.raises(TypeError, match="W: scale= is for uint16 .* or int8 weights, got dtype float32"):
        lowp_format(np.float32, 64, True)


def test_every_lowp_kernel_name_is_in_the_cu_file():
    import re
    from step4_gpt2 import ops
    src = ops.LOWP_CU.read_text()
    plain = set(re.findall(r'extern "C" __global__ void (\w+)\(', src))
    assert {n for n in ops.LOWP_KERNEL_NAMES if "<" not in n} == plain == {"dequant_bf16_v1", "dequant_int8_v1"}
    templates = set(re.findall(r"template <[^>]*>\s*__global__ void (?:__launch_bounds__\([^)]*\)\s*)?(\w+)\(", src))
    assert {n.split("<")[0] for n in ops.LOWP_KERNEL_NAMES if "<" in n} == templates == {"gemv_v6", "gemv_v7", "gemv_v8", "gemv_v9"}
    assert ops.CU_TEMPLATES[ops.LOWP_CU] == tuple(n for n in ops.LOWP_KERNEL_NAMES if "<" in n)


@pytest.mark.parametrize("maxb,ln1", [(8, False), (1, False), (1, True)], ids=["maxb8", "maxb1", "maxb1-ln"])
@pytest.mark.parametrize("arch", [70, 75, 80, 86, 89, 90])
def test_gemv_lowp_cu_compiles_every_instantiation(arch, maxb, ln1):
    """Every kernel the wrappers launch, for sm_70 .. sm_90, without warnings or spills: bf16 is widened with
    integer shifts, so nothing here needs sm_80 (tests/test_compile.py compiles the file the same way, with
    MAXB 8). MAXB 1 is the batch-1 module (ops.gemv_module); ln1 its UNROLL for a lone row behind the LayerNorm
    prologue (ops._v5_unroll: one module for bf16 and int8)."""
    pytest.importorskip("cupy")
    from common import kernels as K
    from step4_gpt2 import ops
    if arch not in K.supported_archs():
        pytest.skip(f"this NVRTC cannot target sm_{arch}")
    unrolls = {ops._v5_unroll(None, ln1, maxb, p) for p in ops.LOWP_PER_LOAD.values()}
    assert len(unrolls) == 1 and (unrolls == {ops.V5_UNROLL}) != ln1, unrolls
    r = K.compile_offline(ops.LOWP_CU, arch, {**ops.lowp_defines(unroll=unrolls.pop(), maxb=maxb), **ops.tc_defines(maxb)},
                          name_expressions=ops.CU_TEMPLATES[ops.LOWP_CU])
    assert not r.warnings, r.warnings
    assert set(ops.LOWP_KERNEL_NAMES) <= set(r.kernels), r.table()
    spilled = [k.name for k in r.kernels.values() if k.spill_stores or k.spill_loads]
    assert not spilled, r.table()


# ============================================================================ CPU: int8 widened without I2F
def byte_perm(x, y, s):
    """CUDA's __byte_perm(x, y, s) on uint32 arrays (the default mode): result byte n is byte s[4n+2 : 4n] of
    the eight bytes {y, x}, x's bytes numbered 0-3 from the lowest, y's 4-7."""
    x, y = np.asarray(x, np.uint64), np.asarray(y, np.uint64)
    pool = x | (y << np.uint64(32))
    out = np.zeros(np.broadcast(x, y).shape, np.uint64)
    for n in range(4):
        sel = np.uint64((s >> (4 * n)) & 0x7)
        out |= ((pool >> (np.uint64(8) * sel)) & np.uint64(0xFF)) << np.uint64(8 * n)
    return out.astype(np.uint32)


def _widening_constants():
    """(XOR mask, magic word, subtracted float, the four selectors) as common/include/lowp.cuh's i8x4_to_float4
    writes them (gemv_lowp.cu and the megakernel widen through it)."""
    import re
    from common.kernels import INCLUDE
    from tests.step4.test_pdl import _body, _code
    src = (INCLUDE / "lowp.cuh").read_text()
    magic = int(re.search(r"#define I8_MAGIC (0x[0-9A-Fa-f]+)u", src).group(1), 16)
    offset = float(re.search(r"#define I8_OFFSET ([0-9.]+)f", src).group(1))
    body = _code(_body(src, "i8x4_to_float4"))
    xor = int(re.search(r"a \^ (0x[0-9A-Fa-f]+)u", body).group(1), 16)
    selectors = [int(v, 16) for v in re.findall(r"__byte_perm\(b, I8_MAGIC, (0x[0-9A-Fa-f]+)\)", body)]
    return xor, magic, offset, selectors


def test_int8_widening_by_a_byte_permute_is_exact_for_all_256_values():
    """A NumPy model of i8x4_to_float4, with the constants read from common/include/lowp.cuh: each of the 256 int8 values,
    in each of the 4 byte positions of a word whose other bytes are random, comes out as exactly that integer
    in float32 (the FADD of float32 values, rounded to float32 once, as the GPU does)."""
    xor, magic, offset, selectors = _widening_constants()
    assert len(selectors) == 4 and xor == 0x80808080
    q = np.arange(-128, 128, dtype=np.int8)
    rng = np.random.default_rng(0)
    for i, sel in enumerate(selectors):
        words = rng.integers(0, 2**32, q.size, dtype=np.uint64).astype(np.uint32)
        shift = np.uint32(8 * i)
        words = (words & ~(np.uint32(0xFF) << shift)) | (q.view(np.uint8).astype(np.uint32) << shift)
        bits = byte_perm(words ^ np.uint32(xor), np.uint32(magic), sel)
        got = bits.view(np.float32) - np.float32(offset)           # float32 - float32: one rounding
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, q.astype(np.float32), err_msg=f"byte {i}")
    assert np.float32(offset) == offset == 2**23 + 128             # exactly representable


def test_int8_to_fp16_operands_are_exact_for_all_256_values():
    """lowp.cuh's i8x2_to_half2 (v9's weights as fp16 mma operands), modelled on the host from the constants it
    is written with: every q in -128..127, at each of a word's four bytes, comes out as the fp16 value q in its
    half (the earlier byte of a pair in the low half), and the pair's other byte (0 here) as 0."""
    import re
    from common.kernels import INCLUDE
    from tests.step4.test_pdl import _body, _code
    body = _code(_body((INCLUDE / "lowp.cuh").read_text(), "i8x2_to_half2"))
    m = re.search(r"__byte_perm\(v \^ (0x[0-9A-Fa-f]+)u, (0x[0-9A-Fa-f]+)u, high \? (0x[0-9A-Fa-f]+) : (0x[0-9A-Fa-f]+)\)",
                  body)
    xor, magic, high, low = (int(g, 16) for g in m.groups())
    sub = int(re.search(r'"r"\((0x[0-9A-Fa-f]+)u\)', body).group(1), 16)

    def half(bits):
        return np.asarray(bits, np.uint16).view(np.float16).astype(np.float64)
    assert sub >> 16 == sub & 0xFFFF and half(sub & 0xFFFF) == 1152
    q = np.arange(-128, 128)
    for i in range(4):
        v = (q & 0xFF).astype(np.uint32) << np.uint32(8 * i)              # q at byte i, zeros elsewhere
        w = byte_perm(v ^ np.uint32(xor), np.uint32(magic), high if i >= 2 else low)
        lo, hi = half(w & 0xFFFF) - 1152, half(w >> 16) - 1152             # what the half2 subtract leaves
        got, other = (lo, hi) if i % 2 == 0 else (hi, lo)
        np.testing.assert_array_equal(got, q, err_msg=f"byte {i}")
        np.testing.assert_array_equal(other, 0.0, err_msg=f"the other byte of byte {i}'s pair")


def test_byte_perm_model_matches_cudas_documented_examples():
    """The model against __byte_perm's definition on hand-worked words (the model is what the proof rests on)."""
    x, y = np.uint32(0x44332211), np.uint32(0x88776655)
    assert byte_perm(x, y, 0x3210) == 0x44332211                  # x itself
    assert byte_perm(x, y, 0x7654) == 0x88776655                  # y itself
    assert byte_perm(x, y, 0x0123) == 0x11223344                  # x's bytes reversed
    assert byte_perm(x, y, 0x7540) == 0x88665511                  # x byte 0, y bytes 0, 1 and 3
    assert byte_perm(np.uint32(0x000000AB), np.uint32(0x4B000000), 0x7540) == 0x4B0000AB


def test_the_int8_kernels_widen_without_conversion_instructions():
    """In the PTX for sm_90: gemv_v7's and dequant_int8_v1's weights are widened by byte permutes (prmt), 16 per
    16-byte load, with no int -> float conversion (cvt.rn.f32.s32) left but the LayerNorm prologue's one (K as
    a float). What only a GPU can show is the time this saves (python -m step4_gpt2.lab.lowp_launch)."""
    from tests.step4.test_pdl import _ptx_entries
    from step4_gpt2 import ops
    names = [n for n in ops.LOWP_KERNEL_NAMES if n.startswith("gemv_v7") or n == "dequant_int8_v1"]
    entries = _ptx_entries(ops.LOWP_CU, 90, names)
    loads = ops.V5_ROWS * ops.V5_UNROLL                              # the file's defaults: 16-byte loads per lane
    for n in names:
        ln = n.endswith("true>")
        assert entries[n].count("cvt.rn.f32.s32") == (1 if ln else 0), n
        assert entries[n].count("prmt.b32") == 16 * (1 if n == "dequant_int8_v1" else loads), n


# ============================================================================ CPU: the batch-1 module
def test_the_batch_1_modules_read_x_from_global_memory_without_ln():
    """In the PTX for sm_90, without the LayerNorm prologue: the MAXB=1 modules (gemv_v5/v6/v7) read x as the
    MAXB=8 ones do, with __ldg inside the FMA loop (one ld.global.nc per float4 of x a lane multiplies per chunk
    and batch row: UNROLL x 16-byte loads / 4 weights) and no vector load from shared memory (a copy of x into
    shared memory first was not faster); MAXB=1 has 1/MAXB as many of those loads, its batch loop being one
    row. The LayerNorm prologue's modules read the normalised x from shared memory at either MAXB."""
    from tests.step4.test_pdl import _ptx_entries
    from step4_gpt2 import ops
    files = {ops.CU: ([n for n in ops.KERNEL_NAMES if n.startswith("gemv_v5")], ops.defines, 1),
             ops.LOWP_CU: ([n for n in ops.LOWP_KERNEL_NAMES if n.startswith(("gemv_v6", "gemv_v7"))], ops.lowp_defines,
                           None)}
    for path, (names, defs, per_float4) in files.items():
        loads = {}
        for maxb in (1, ops.MAXB):
            d = defs(ops.V5_ROWS, ops.V5_UNROLL, maxb)
            assert d["MAXB"] == maxb and "X_SMEM" not in d
            entries = _ptx_entries(path, 90, names, d)
            for n in names:
                g = per_float4 or ops.LOWP_PER_LOAD["bf16" if n.startswith("gemv_v6") else "int8"] // 4
                x_loads = ops.V5_UNROLL * g                     # float4s of x per chunk per lane and batch row
                glob, shared = entries[n].count("ld.global.nc.v4.f32"), entries[n].count("ld.shared.v4.f32")
                if n.endswith("false>"):
                    assert (glob, shared) == (maxb * x_loads, 0), f"{path.name} {n} MAXB {maxb}: {glob} global, " \
                                                                  f"{shared} shared"
                    loads[n, maxb] = glob
                else:
                    assert shared >= maxb * x_loads, f"{path.name} {n} MAXB {maxb}: {shared} shared"
        for n in names:
            if n.endswith("false>"):
                assert loads[n, 1] < loads[n, ops.MAXB], (path.name, n, loads)


def test_gemv_module_and_the_shared_memory_a_launch_asks_for(monkeypatch):
    """gemv_module(B): MAXB 1 at batch 1, whatever the row length (nothing of x is staged without LN), else
    MAXB; _v5_launch asks for nb rows of x in shared memory with the LayerNorm prologue only, and the MAXB=1
    module launches its one row at a time."""
    from step4_gpt2 import ops
    assert not hasattr(ops, "x_smem") and not hasattr(ops, "X_SMEM_MAX_K")
    assert ops.gemv_module(1) == 1
    assert ops.gemv_module(2) == ops.gemv_module(8) == ops.gemv_module(11) == ops.MAXB
    monkeypatch.setattr(ops, "_resident", lambda fn, block, smem: 16)
    monkeypatch.setattr(ops, "device_info", lambda: {"sm": 90, "sms": 132, "multiprocessors": 132,
                                                     "shared_per_block_optin": 227 << 10})
    monkeypatch.setattr(ops, "launch_grid", lambda n, per_block, per_sm=1: (-(-n // per_block),))
    for ln in (False, True):
        for nb in (1, 3):
            _, block, smem = ops._v5_launch(None, 1600, 6400, nb, ln, per_load=16)
            assert smem == (nb * 6400 * 4 if ln else 0) and block == (128,), (ln, nb, smem)
        assert ops._v5_rows_per_launch(None, 1 << 16, ln, maxb=1) == 1
    assert ops._v5_rows_per_launch(None, 6400, False) == ops.MAXB


def test_a_lone_row_behind_the_layernorm_takes_fewer_loads_a_lane():
    """_v5_unroll: V5_LN1_WEIGHTS weights a lane (fp32 2 float4s, bf16 and int8 one 16-byte load) for batch 1's module
    with the LayerNorm prologue, so its block has more warps to share normalising the row; V5_UNROLL elsewhere,
    and an unroll given is kept. lowp_version decides on v6/v7's usual shape, so the tensor-core choice stands."""
    from step4_gpt2 import ops
    assert [ops._v5_unroll(None, True, 1, p) for p in (4, 8, 16)] == [2, 1, 1]
    assert {ops._v5_unroll(None, ln, m, p) for ln, m in ((True, ops.MAXB), (False, 1)) for p in (4, 8, 16)} == \
        {ops.V5_UNROLL}
    assert ops._v5_unroll(3, True, 1) == 3
    assert ops._v5_warps(1600, ops._v5_unroll(None, True, 1), 4) == 7 > ops._v5_warps(1600, ops.V5_UNROLL, 4) == 4


def test_the_tensor_core_launch_and_its_shared_memory(monkeypatch):
    """gemv_v8/v9's launch (ops._tc_call): TC_WARPS warps per block, one block per TC_ROWS rows up to
    TC_BLOCKS_PER_SM per SM, and the shared memory tc_smem counts: each x row as operand pairs, padded to
    gemv_lowp.cu's Tc::row_words (a whole number of 4-lane chunks, rounded to 32 words, plus the bank shift),
    after nb x K floats with the LayerNorm prologue. The rows per launch: as many as fit, at most MAXB."""
    from step4_gpt2 import ops, tc_gemv
    launched = []
    monkeypatch.setattr(ops, "_resident", lambda fn, block, smem: 16)
    monkeypatch.setattr(ops, "allow_dynamic_smem", lambda fn, n, what: None)
    monkeypatch.setattr(ops, "device_info", lambda: {"sm": 90, "multiprocessors": 132, "shared_per_block_optin": 64 << 10})
    monkeypatch.setattr(ops, "launch_grid", lambda n, per_block, per_sm=1: (min(-(-n // per_block), 132 * per_sm),))
    monkeypatch.setattr(ops, "_launch", lambda fn, grid, block, args, smem: launched.append((grid, block, smem)))
    assert tc_gemv.tc_row_words(1600, "int8") == 800 + 4 and tc_gemv.tc_row_words(1600, "bf16") == 800 + 16
    assert tc_gemv.tc_row_words(16, "int8") == 32 + 4 and tc_gemv.tc_row_words(8, "bf16") == 32 + 16
    for kind in ("bf16", "int8"):
        for ln in (False, True):
            ops._tc_call(None, 6400, 1600, 3, ln, kind, ())
            grid, block, smem = launched.pop()
            assert block == (32 * ops.TC_WARPS,) and grid == (min(6400 // ops.TC_ROWS, 132 * ops.TC_BLOCKS_PER_SM),)
            assert smem == (3 * 1600 * 4 if ln else 0) + 3 * tc_gemv.tc_row_words(1600, kind) * 4, (kind, ln, smem)
    fn = types.SimpleNamespace(shared_size_bytes=2048)
    monkeypatch.setattr(ops, "lowp_kernel", lambda name, rows, unroll, maxb: fn)
    step, launch = ops._lowp_launcher("int8", 9, "EPI_BIAS", 6400, 4096, True, 8)
    assert step == ((64 << 10) - 2048) // tc_gemv.tc_smem(4096, 1, "int8", True) == 2    # 24,592 B a row with LN
    launch(2, ())
    assert launched.pop()[2] == tc_gemv.tc_smem(4096, 2, "int8", True)
    assert ops._lowp_launcher("bf16", 8, "EPI_NONE", 64, 64, False, 8)[0] == 8
    with pytest.raises(ValueError, match=r"K: gemv_v9 stages x in shared memory, 393,232 B for a row of K=65536"):
        ops._lowp_launcher("int8", 9, "EPI_NONE", 64, 65536, True, 8)
    with pytest.raises(ValueError, match=r"rows/unroll: v6/v7's launch shape, not gemv_v9's"):
        ops._lowp_launcher("int8", 9, "EPI_NONE", 64, 64, False, 8, rows=2)
    monkeypatch.setattr(ops, "device_info", lambda: {"sm": 75, "shared_per_block_optin": 64 << 10})
    with pytest.raises(ValueError, match=r"version: gemv_v8 runs bf16 weights on tensor cores, which needs sm_80; "
                                         r"this GPU is sm_75 \(version 6 runs everywhere\)"):
        ops._lowp_launcher("bf16", 8, "EPI_NONE", 64, 64, False, 8)
    assert ops.lowp_version("int8", 8, 6400) == 9 and ops.lowp_version("bf16", 8, 6400) == 6     # sm_75: no v8
    # batch 1: the tensor cores where v7 would run a block as one warp (32 lanes x 4 loads x 16 weights = 2048)
    assert ops.lowp_version("int8", 1, 2048) == 9 and ops.lowp_version("int8", 1, 2064) == 7
    with ops.tensor_cores(False):
        assert ops.lowp_version("int8", 8, 6400) == 7 and ops.lowp_version("int8", 1, 1600) == 7
    assert ops.lowp_version("int8", 8, 6400, rows=2) == 7 and ops.lowp_version("int8", 1, 64, unroll=2) == 7
    monkeypatch.setattr(ops, "device_info", lambda: {"sm": 90})
    assert [ops.lowp_version("bf16", 1, K) for K in (768, 1024, 1032, 1600)] == [8, 8, 6, 6]    # 8 weights a load


class _Fake:
    """Stands for a CuPy array where the wrappers only look at shape and dtype (their checks stubbed)."""
    def __init__(self, shape, dtype=np.float32):
        self.shape, self.dtype, self.ndim = tuple(shape), np.dtype(dtype), len(shape)
        self.data = type("D", (), {"ptr": id(self)})()

    def __getitem__(self, idx):
        return self


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
def test_every_gemv_wrapper_launches_the_batch_1_module_at_batch_1(monkeypatch, kind):
    """ops.gemv and ops.gemv_qkv, fp32 (v5), bf16 (v6 / v8) and int8 (v7 / v9), every fusion: the kernel comes
    from the module gemv_module picks (MAXB 1 at batch 1, MAXB for more rows), bf16/int8 from the tensor-core
    version for more rows and at batch 1 for short rows, the CUDA-core one at batch 1 for long rows (lowp_version,
    on an sm_90 stand-in), and the launches cover the B rows; a CUDA-core kernel is launched with the UNROLL its
    module was compiled for (_v5_unroll's). Run on the CPU, the arrays' checks and the launch stubbed."""
    from step4_gpt2 import ops
    asked, launched, compiled, called = [], [], [], []
    monkeypatch.setattr(ops, "expect_array", lambda a, *args, **kw: a)
    monkeypatch.setattr(ops, "out_array", lambda out, shape, **kw: out)
    monkeypatch.setattr(ops, "_index_vector", lambda a, name, n: a)
    monkeypatch.setattr(ops, "_check_caches", lambda k, v, B, C: k.shape[1:])
    monkeypatch.setattr(ops, "device_info", lambda: {"sm": 90, "shared_per_block_optin": 227 << 10})

    names = []

    def kernel(name, rows=4, unroll=4, maxb=ops.MAXB):
        asked.append(maxb)
        compiled.append(unroll)
        names.append(name.split("<")[0])
        return types.SimpleNamespace(name=name, shared_size_bytes=2048)
    monkeypatch.setattr(ops, "kernel", kernel)
    monkeypatch.setattr(ops, "lowp_kernel", kernel)
    monkeypatch.setattr(ops, "_v5_call", lambda fn, N, K, nb, ln, args, rows=4, unroll=4, per_load=4:
                        (launched.append(nb), called.append(unroll)))
    monkeypatch.setattr(ops, "_tc_call", lambda fn, N, K, nb, ln, kind, args: launched.append(nb))
    H, L = 2, 4
    wdt = {"fp32": np.float32, "bf16": np.uint16, "int8": np.int8}[kind]
    for C, B in itertools.product((64, 2560), (1, 3, 11)):       # rows of one warp's loads, and of more
        scale = _Fake((3 * C,)) if kind == "int8" else None
        want = 1 if B == 1 else ops.MAXB
        version = 5 if kind == "fp32" else (ops.LOWP_VERSION if B == 1 and C > 64 else ops.TC_VERSION)[kind]
        x, bias, g = _Fake((B, C)), _Fake((3 * C,)), _Fake((C,))
        per_load = ops.LOWP_PER_LOAD.get(kind, 4)

        def same_unroll(ln):
            if version in (5, 6, 7):
                assert set(called) == set(compiled) == {ops._v5_unroll(None, ln is not None, want, per_load)}, \
                    (B, ln, called, compiled)
            compiled.clear(), called.clear()
        for ln in (None, (g, g)):
            for fusion in ({}, {"gelu": True}, {"residual": True}):
                asked.clear(), launched.clear(), names.clear()
                ops.gemv(x, _Fake((3 * C, C), wdt), bias, out=_Fake((B, 3 * C)), ln=ln, scale=scale, **fusion)
                assert asked == [want] and sum(launched) == B and max(launched) <= want, (B, ln, fusion)
                assert names == [f"gemv_v{version}"], (B, names)
                same_unroll(ln)
            asked.clear(), launched.clear(), names.clear()
            ops.gemv_qkv(x, _Fake((3 * C, C), wdt), bias, _Fake((B, C)), _Fake((B, H, L, C // H)),
                         _Fake((B, H, L, C // H)), _Fake((B,), np.int32), ln=ln, scale=scale)
            assert asked == [want] and sum(launched) == B and max(launched) <= want, (B, ln, "qkv")
            assert names == [f"gemv_v{version}"], (B, names)
            same_unroll(ln)


# ============================================================================ CPU: the launch-shape lab
def test_the_lowp_launch_lab_sweeps_within_v5s_register_budget():
    from step4_gpt2 import ops
    from step4_gpt2.lab import lowp_launch as lab
    from step4_gpt2.weights import GPTConfig
    pairs = lab.choices()
    assert (ops.V5_ROWS, ops.V5_UNROLL) in pairs and len(set(pairs)) == len(pairs)
    assert all(r * u <= ops.V5_ROWS * ops.V5_UNROLL for r, u in pairs) and {u for _, u in pairs} == {1, 2, 4}
    m = lab.matrices(GPTConfig.from_name("gpt2-xl"))
    assert m["c_fc"][:2] == (6400, 1600) and m["mlp_proj"][:2] == (1600, 6400) and m["lm_head"][:2] == (50257, 1600)
    assert all(K % 16 == 0 for _, K, _ in m.values())                # every shape takes int8's 16-byte loads


@pytest.mark.parametrize("rows, unroll", [(4, 1), (8, 2)])
def test_gemv_lowp_cu_compiles_for_the_labs_launch_shapes(rows, unroll):
    """The lab's other (ROWS, UNROLL) modules compile for sm_90 without warnings (sm_70 .. sm_90 at the
    defaults: test_gemv_lowp_cu_compiles_every_instantiation). Spills are allowed here -- ptxas holds (4, 1)'s
    LayerNorm instantiations of gemv_v7 to 80 registers with a few spilled; the lab's times include that."""
    pytest.importorskip("cupy")
    from common import kernels as K
    from step4_gpt2 import ops
    if 90 not in K.supported_archs():
        pytest.skip("this NVRTC cannot target sm_90")
    r = K.compile_offline(ops.LOWP_CU, 90, ops.lowp_defines(rows, unroll),
                          name_expressions=ops.CU_TEMPLATES[ops.LOWP_CU])
    assert not r.warnings, r.warnings
    assert set(ops.LOWP_KERNEL_NAMES) <= set(r.kernels), r.table()


# ============================================================================ CPU: bf16 weight files
def _write_safetensors(path, tensors: dict, bf16=()):
    """A safetensors file written by hand (the format: an 8-byte header length, a JSON header, the data), so a
    BF16 tensor needs neither torch nor ml_dtypes: the names in `bf16` are uint16 arrays of bf16 bits."""
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        dtype = "BF16" if name in bf16 else {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}[a.dtype]
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        blobs.append(a.astype(a.dtype.newbyteorder("<")).tobytes())
        off += a.nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))


TINY = W.GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=50, block_size=16)


def test_load_bf16_keeps_a_bf16_files_bits(tmp_path):
    params = W.random_weights(TINY, seed=5, notice=False)
    bits = {n: Q.to_bf16(t) for n, t in params.items()}
    f = tmp_path / "model.safetensors"
    _write_safetensors(f, bits, bf16=set(bits))
    cfg, kept = W.load_file(f, TINY, dtype="bf16")
    for n, t in kept.items():
        if W.is_matrix(n):
            assert t.dtype == np.uint16, n
            np.testing.assert_array_equal(t, bits[n])         # not a bit changed
        else:
            assert t.dtype == np.float32, n
            np.testing.assert_array_equal(t, Q.from_bf16(bits[n]))
    _, wide = W.load_file(f, TINY)                            # the default: everything float32, widened exactly
    for n, t in wide.items():
        assert t.dtype == np.float32
        np.testing.assert_array_equal(t, Q.from_bf16(bits[n]))
    assert {n for n in kept if W.is_matrix(n)} == {"wte.weight", "h.0.attn.c_attn.weight", "h.0.attn.c_proj.weight",
                                                   "h.0.mlp.c_fc.weight", "h.0.mlp.c_proj.weight"}


def test_load_bf16_rounds_an_fp32_file_and_names_a_bad_dtype(tmp_path):
    params = W.random_weights(TINY, seed=6, notice=False)
    W.save(params, TINY, tmp_path)
    cfg, p = W.load_file(tmp_path, dtype="bf16")
    for n, t in p.items():
        np.testing.assert_array_equal(t, Q.to_bf16(params[n]) if W.is_matrix(n) else params[n])
    _, p2, is_random = W.load(path=tmp_path, dtype="bf16")
    assert not is_random and all(np.array_equal(p[n], p2[n]) for n in p)
    with pytest.raises(ValueError, match=r"dtype: expected one of \('fp32', 'bf16'\), got 'int8'"):
        W.load_file(tmp_path, dtype="int8")
    with pytest.raises(ValueError, match="dtype: expected one of"):
        W.load(path=tmp_path, dtype="float16")
    r = W.as_dtype(W.random_weights(TINY, seed=7, notice=False), "bf16")
    assert r["wte.weight"].dtype == np.uint16 and r["wpe.weight"].dtype == np.float32


def test_a_uint16_tensor_that_is_not_bf16_is_still_refused(tmp_path):
    params = W.random_weights(TINY, seed=8, notice=False)
    bad = dict(params, **{"ln_f.bias": np.zeros(32, np.uint16)})
    with pytest.raises(W.WeightFileError, match="ln_f.bias has dtype uint16"):
        W.validate(bad, TINY)
    W.validate(bad, TINY, bf16=frozenset({"ln_f.bias"}))


def test_torch_bf16_files_read_the_same_bits(tmp_path):
    """A bf16 checkpoint as torch writes it (Hugging Face's bf16 files) reads back bit for bit."""
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    params = W.random_weights(TINY, seed=9, notice=False)
    st.save_file({n: torch.from_numpy(t).to(torch.bfloat16) for n, t in params.items()},
                 str(tmp_path / "model.safetensors"))
    _, p = W.load_file(tmp_path / "model.safetensors", TINY, dtype="bf16")
    want = torch.from_numpy(params["h.0.mlp.c_fc.weight"]).to(torch.bfloat16).view(torch.int16).numpy()
    np.testing.assert_array_equal(p["h.0.mlp.c_fc.weight"], want.view(np.uint16))
    np.testing.assert_array_equal(Q.to_bf16(params["h.0.mlp.c_fc.weight"]), want.view(np.uint16))


# ============================================================================ GPU
@pytest.fixture(scope="module")
def cp():
    from common.device import skip_reason
    if skip_reason():
        pytest.skip(f"no GPU: {skip_reason()}")
    import cupy
    return cupy


SHAPES = {"bf16": [(37, 64), (769, 264), (9001, 40), (5, 8200)],      # K/8 = 8, 33, 5, 1025 (> one chunk)
          "int8": [(37, 64), (769, 272), (9001, 48), (5, 16400)]}     # K/16 = 4, 17, 3, 1025


def _stored(cp, w, kind):
    lw = Q.quantize(w, kind)
    return Q.LowpWeight(cp.asarray(lw.w), None if lw.scale is None else cp.asarray(lw.scale)), lw


def _impl(kind, tc, K):
    """(version, x's operand format for the reference, rtol, rtol with LN) of the CUDA-core (v6/v7) or the
    tensor-core (v8/v9) GEMV for this weight format and rows of K. The tensor cores multiply x rounded to bf16
    (v8) or fp16 (v9), which the reference rounds too; they add the exact products in fp32, in their own order.
    With the LayerNorm prologue the kernel rounds its fp32 LN(x), the reference its float64 one: an element
    within float32's error of a rounding boundary lands one step (at most 2^-8 of it) apart, which moves its
    batch row by up to about 2^-8 / sqrt(K) of the row's norm; the limit allows two such (a missing or wrong
    element costs far more)."""
    from step4_gpt2 import ops
    if not tc:
        return ops.LOWP_VERSION[kind], None, 1e-6, 1e-5
    return ops.TC_VERSION[kind], {"bf16": "bf16", "int8": "fp16"}[kind], 1e-5, max(3e-4, 2 * 2 ** -8 / np.sqrt(K))


def _gelu_rtol(rtol, want, pre):
    """The limit for a GELU epilogue: GELU flattens large negative sums to ~0 and passes on the sums' error
    (|gelu'| <= 1.13), so the error is measured against the sums before it (pre), not against ~0."""
    return rtol * max(1.0, float(np.linalg.norm(pre) / np.linalg.norm(want)))


def _skip_without_tc(kind, tc):
    from common import device_info
    from step4_gpt2 import ops
    sm = device_info()["sm"]
    if tc and sm < ops.TC_ARCH[kind]:
        pytest.skip(f"gemv_v{ops.TC_VERSION[kind]} ({kind} on tensor cores) needs sm_{ops.TC_ARCH[kind]}; this GPU is sm_{sm}")


@gpu
@pytest.mark.parametrize("B", [1, 3, 8, 11])
@pytest.mark.parametrize("case", range(4))
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("tc", [False, True], ids=["cuda_cores", "tensor_cores"])
def test_gemv_lowp_every_fusion(cp, kind, case, B, tc):
    """v6 / v7 and v8 / v9 on awkward shapes (N odd, K/vector not a multiple of 32, more tiles than blocks, more
    vectors than one chunk), batches past MAXB, every epilogue, with and without the LayerNorm prologue."""
    from step4_gpt2.ops import gemv
    _skip_without_tc(kind, tc)
    N, K = SHAPES[kind][case]
    version, operand, tol_tc, tol_ln = _impl(kind, tc, K)
    rng = np.random.default_rng(100 * case + B)
    x0 = rng.uniform(-1, 1, (B, K)).astype(np.float32) * 3 + 0.5
    b0, g0, o0 = (rng.uniform(-1, 1, n).astype(np.float32) for n in (N, K, K))
    lw_gpu, lw = _stored(cp, _weights(N, K, case), kind)
    x, b, g, o = (cp.asarray(a) for a in (x0, b0, g0, o0))
    tol = (1e-6 if K <= 4100 else 3e-6) if not tc else tol_tc
    for ln in (None, (g, o)):
        ref_ln = None if ln is None else (g0, o0)
        t = tol if ln is None else tol_ln
        for epi in ("none", "bias", "gelu", "residual"):
            name = f"{kind} v{version} {epi} ln={ln is not None} B={B} N={N} K={K}"
            if epi == "residual":
                r0 = rand(B, N, seed=case)
                y = cp.asarray(r0)
                gemv(x, lw_gpu, b, out=y, residual=True, ln=ln, version=version)
                want = R.gemv(x0, lw.w, lw.scale, bias=b0, ln=ref_ln, residual=r0, operand=operand)
            else:
                y = poison(cp.empty((B, N), cp.float32))
                gemv(x, lw_gpu, None if epi == "none" else b, out=y, gelu=epi == "gelu", ln=ln, version=version)
                want = R.gemv(x0, lw.w, lw.scale, bias=None if epi == "none" else b0, gelu=epi == "gelu", ln=ref_ln,
                              operand=operand)
            rtol = t
            if epi == "gelu":
                rtol = _gelu_rtol(t, want, R.gemv(x0, lw.w, lw.scale, bias=b0, ln=ref_ln, operand=operand))
            assert_close(y, want, rtol=rtol, name=name)
    if case == 0 and not tc:           # W and scale= as two arguments, and other rows per tile (8: a one-warp
        for rows in (1, 2, 8):         # block stores ROWS * MAXB = 64 outputs in two passes)
            y = poison(cp.empty((B, N), cp.float32))
            gemv(x, lw_gpu.w, b, out=y, scale=lw_gpu.scale, rows=rows, version=version)
            assert_close(y, R.gemv(x0, lw.w, lw.scale, bias=b0), rtol=tol, name=f"{kind} rows={rows}")


@gpu
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_gemv_lowp_every_launch_shape_the_lab_times(cp, kind):
    """step4_gpt2/lab/lowp_launch.py's (ROWS, UNROLL) choices against the reference, LayerNorm prologue and GELU
    epilogue, batch 1 and 11, on a shape whose rows take 1-2 warps and more tiles than one block."""
    from step4_gpt2 import ops
    from step4_gpt2.lab.lowp_launch import choices
    from step4_gpt2.ops import gemv
    N, K = SHAPES[kind][1]
    lw_gpu, lw = _stored(cp, _weights(N, K, 9), kind)
    rng = np.random.default_rng(9)
    b0, g0, o0 = (rng.uniform(-1, 1, n).astype(np.float32) for n in (N, K, K))
    b, g, o = (cp.asarray(a) for a in (b0, g0, o0))
    for B in (1, 11):
        x0 = rng.uniform(-1, 1, (B, K)).astype(np.float32) * 3 + 0.5
        want = R.gemv(x0, lw.w, lw.scale, bias=b0, ln=(g0, o0))
        for rows, unroll in choices():
            y = poison(cp.empty((B, N), cp.float32))
            gemv(cp.asarray(x0), lw_gpu, b, out=y, ln=(g, o), rows=rows, unroll=unroll, version=ops.LOWP_VERSION[kind])
            assert_close(y, want, rtol=1e-5, name=f"{kind} B={B} ROWS={rows} UNROLL={unroll}")


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("tc", [False, True], ids=["cuda_cores", "tensor_cores"])
def test_gemv_lowp_small_cases(cp, kind, tc):
    """K of one 16-byte load, N = 1, B = 1: under compute-sanitizer too."""
    from step4_gpt2.ops import gemv
    _skip_without_tc(kind, tc)
    version, operand, tol, _ = _impl(kind, tc, 16)          # no LayerNorm here
    for B, N, K in [(1, 1, 16), (2, 3, 32), (9, 5, 48)]:
        x0, b0 = rand(B, K, seed=N), rand(N, seed=K)
        lw_gpu, lw = _stored(cp, _weights(N, K, B), kind)
        y = poison(cp.empty((B, N), cp.float32))
        gemv(cp.asarray(x0), lw_gpu, cp.asarray(b0), out=y, gelu=True, version=version)
        assert_close(y, R.gemv(x0, lw.w, lw.scale, bias=b0, gelu=True, operand=operand), rtol=tol,
                     name=f"{kind} v{version} B={B} N={N} K={K}")


@gpu
@pytest.mark.parametrize("B", [1, 3, 8, 11])
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("tc", [False, True], ids=["cuda_cores", "tensor_cores"])
def test_gemv_qkv_lowp(cp, kind, B, tc):
    """q and row pos[b] of each sequence's k/v cache; every other cache row stays as it was (NaN)."""
    from step4_gpt2.ops import gemv_qkv
    _skip_without_tc(kind, tc)
    H, D, L = 3, 32, 9
    C = H * D
    version, operand, tol_tc, tol_ln = _impl(kind, tc, C)
    rng = np.random.default_rng(B)
    x0 = rng.uniform(-1, 1, (B, C)).astype(np.float32) * 2 + 0.3
    b0, g0, o0 = (rng.uniform(-1, 1, n).astype(np.float32) for n in (3 * C, C, C))
    p0 = rng.integers(0, L, B).astype(np.int32)
    lw_gpu, lw = _stored(cp, _weights(3 * C, C, 7), kind)
    x, b, g, o, p = (cp.asarray(a) for a in (x0, b0, g0, o0, p0))
    for ln in (None, (g, o)):
        want = R.gemv(x0, lw.w, lw.scale, bias=b0, ln=None if ln is None else (g0, o0), operand=operand)
        q = poison(cp.empty((B, C), cp.float32))
        kc, vc = poison(cp.empty((B, H, L, D), cp.float32)), poison(cp.empty((B, H, L, D), cp.float32))
        gemv_qkv(x, lw_gpu, b, q, kc, vc, p, ln=ln, version=version)
        tol = (1e-6 if not tc else tol_tc) if ln is None else tol_ln
        assert_close(q, want[:, :C], rtol=tol, name=f"{kind} q ln={ln is not None}")
        for i in range(B):
            assert_close(kc[i, :, int(p0[i])], want[i, C:2 * C].reshape(H, D), rtol=tol, name=f"k row {i}")
            assert_close(vc[i, :, int(p0[i])], want[i, 2 * C:].reshape(H, D), rtol=tol, name=f"v row {i}")
            for c in (kc, vc):
                others = np.delete(c[i].get(), int(p0[i]), axis=1)
                assert np.isnan(others).all(), f"{kind}: a cache row other than pos[{i}] was written"


@gpu
@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_dequantize_and_matmul_lowp(cp, kind):
    """The prefill: W widened on the GPU exactly as on the host, then cuBLAS, for 1 .. 1000 rows."""
    from step4_gpt2.ops import dequantize, matmul_lowp
    N, K = 777, 272
    lw_gpu, lw = _stored(cp, _weights(N, K, 11), kind)
    wide = poison(cp.empty((N, K), cp.float32))
    dequantize(lw_gpu, out=wide)
    np.testing.assert_array_equal(wide.get(), lw.dequantize())           # bit for bit: one fp32 multiply each
    for M in (1, 7, 1000):
        x0 = rand(M, K, seed=M)
        y = poison(cp.empty((M, N), cp.float32))
        matmul_lowp(cp.asarray(x0), lw_gpu.w, lw_gpu.scale, out=y)
        assert_close(y, R.gemv(x0, lw.w, lw.scale), rtol=1e-5, name=f"matmul_lowp {kind} M={M}")
    w32 = cp.asarray(_weights(N, K, 12))
    x0 = rand(5, K, seed=1)
    assert_close(matmul_lowp(cp.asarray(x0), w32), R.gemv(x0, w32.get()), rtol=1e-5, name="fp32 W")


@gpu
def test_quantize_on_the_gpu_matches_the_host(cp):
    w = _weights(300, 770, 13)
    np.testing.assert_array_equal(Q.to_bf16(cp.asarray(w)).get(), Q.to_bf16(w))
    np.testing.assert_array_equal(Q.from_bf16(cp.asarray(Q.to_bf16(w))).get(), Q.from_bf16(Q.to_bf16(w)))
    qg, sg = Q.quantize_int8(cp.asarray(w))
    q, s = Q.quantize_int8(w)
    np.testing.assert_array_equal(sg.get(), s)
    diff = np.abs(qg.get().astype(np.int32) - q)
    assert diff.max() <= 1 and diff.mean() < 1e-4
    np.testing.assert_array_equal(Q.dequantize_int8(qg, sg).get(), Q.dequantize_int8(qg.get(), sg.get()))


@gpu
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("tc", [False, True], ids=["cuda_cores", "tensor_cores"])
def test_gemv_lowp_ln_prologue_splits_the_batch_to_fit_shared_memory(cp, monkeypatch, kind, tc):
    """As for v5: 11 rows of K = 4112 floats (180 KB) on a GPU with 64 KB per block run as several launches, on
    the CUDA cores (v6/v7) and on the tensor cores (v8/v9, whose launches also hold x's rows as operands)."""
    from step4_gpt2 import ops as M
    _skip_without_tc(kind, tc)
    real = M.device_info()
    monkeypatch.setattr(M, "device_info", lambda: {**real, "shared_per_block_optin": 64 << 10})
    calls = []
    launcher = "_tc_call" if tc else "_v5_call"
    orig = getattr(M, launcher)
    monkeypatch.setattr(M, launcher, lambda fn, N, K, nb, ln, *a, **k: (calls.append(nb),
                                                                        orig(fn, N, K, nb, ln, *a, **k)))
    B, N, K = 11, 37, 4112
    x0, b0, g0, o0 = rand(B, K, seed=1) * 3 + 0.5, rand(N, seed=2), rand(K, seed=3), rand(K, seed=4)
    _, operand, _, tol_ln = _impl(kind, tc, K)
    lw_gpu, lw = _stored(cp, _weights(N, K, 5), kind)
    y = poison(cp.empty((B, N), cp.float32))
    with M.tensor_cores(tc):
        M.gemv(cp.asarray(x0), lw_gpu, cp.asarray(b0), out=y, ln=(cp.asarray(g0), cp.asarray(o0)), gelu=True)
    want = R.gemv(x0, lw.w, lw.scale, bias=b0, gelu=True, ln=(g0, o0), operand=operand)
    pre = R.gemv(x0, lw.w, lw.scale, bias=b0, ln=(g0, o0), operand=operand)
    assert_close(y, want, rtol=_gelu_rtol(tol_ln, want, pre), name=kind)
    assert len(calls) > 2 and sum(calls) == B


@gpu
@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
def test_the_batch_1_module_gives_the_maxb_modules_bits(cp, kind, monkeypatch):
    """At batch 1 ops launches the MAXB=1 module (one accumulator per row, x read the same way): the same
    products summed in the same order as the MAXB=8 module's at the same launch shape (the batch-1 UNROLL behind
    the LayerNorm, ops._v5_unroll), so the same bits, for every fusion and gemv_qkv (v5 fp32, v6 bf16, v7 int8
    on the CUDA cores; XL's K = 1600 and 6400, several tiles per block)."""
    from step4_gpt2 import ops
    C, H, L = 1600, 25, 3
    rng = np.random.default_rng(37)
    g, o = (cp.asarray(rng.uniform(-1, 1, C).astype(np.float32)) for _ in range(2))
    pos = cp.asarray(np.int32([1]))

    def weight(N, K, seed):
        w = _weights(N, K, seed)
        return cp.asarray(w) if kind == "fp32" else _stored(cp, w, kind)[0]

    cases = []
    for N, K in ((9001, C), (C, 4 * C)):
        W = weight(N, K, N)
        x = cp.asarray(rng.uniform(-1, 1, (1, K)).astype(np.float32) * 3 + 0.5)
        b, r0 = (cp.asarray(rng.uniform(-1, 1, (1, N)).astype(np.float32)) for _ in range(2))
        for ln in ((None, (g, o)) if K == C else (None,)):
            for epi in ("none", "bias", "gelu", "residual"):
                cases.append((f"N={N} K={K} {epi} ln={ln is not None}", W, x, b[0], r0, ln, epi))
    Wq = weight(3 * C, C, 3)
    xq = cp.asarray(rng.uniform(-1, 1, (1, C)).astype(np.float32))
    bq = cp.asarray(rng.uniform(-1, 1, 3 * C).astype(np.float32))

    def run():
        out = []
        for name, W, x, b, r0, ln, epi in cases:
            y = r0.copy() if epi == "residual" else poison(cp.empty(r0.shape, cp.float32))
            ops.gemv(x, W, None if epi == "none" else b, out=y, ln=ln, gelu=epi == "gelu", residual=epi == "residual")
            out.append((name, y.get()))
        for ln in (None, (g, o)):
            q = poison(cp.empty((1, C), cp.float32))
            kc, vc = (poison(cp.empty((1, H, L, C // H), cp.float32)) for _ in range(2))
            ops.gemv_qkv(xq, Wq, bq, q, kc, vc, pos, ln=ln)
            out.append((f"qkv ln={ln is not None}", np.concatenate([q.get().ravel(), kc[0, :, 1].get().ravel(),
                                                                     vc[0, :, 1].get().ravel()])))
        return out

    with ops.tensor_cores(False):                                # int8 rows of 1600 would take v9 at batch 1
        batch1 = run()
        unroll = ops._v5_unroll
        monkeypatch.setattr(ops, "gemv_module", lambda B: ops.MAXB)
        monkeypatch.setattr(ops, "_v5_unroll", lambda u, ln, maxb, per_load=4: unroll(u, ln, 1, per_load))
        maxb = run()
    for (name, got), (_, want) in zip(batch1, maxb):
        np.testing.assert_array_equal(got, want, err_msg=f"{kind} {name}: MAXB 1 vs MAXB {ops.MAXB}")


@gpu
def test_lowp_wrappers_name_bad_arguments(cp):
    from step4_gpt2.ops import gemv, gemv_qkv, matmul_lowp
    B, N, K = 2, 24, 64
    x, b = cp.asarray(rand(B, K, seed=1)), cp.asarray(rand(N, seed=2))
    w = _weights(N, K, 3)
    q, s = (cp.asarray(a) for a in Q.quantize_int8(w))
    u = cp.asarray(Q.to_bf16(w))
    with pytest.raises(ValueError, match="scale: int8 weights need"):
        gemv(x, q, b)
    with pytest.raises(ValueError, match="scale: only int8 weights take row scales"):
        gemv(x, u, b, scale=s)
    with pytest.raises(TypeError, match="W: scale= is for"):
        gemv(x, cp.asarray(w), b, scale=s)
    with pytest.raises(ValueError, match=r"scale: expected shape \(24\)"):
        gemv(x, q, b, scale=s[:5])
    with pytest.raises(TypeError, match="scale: expected dtype float32"):
        gemv(x, q, b, scale=s.astype(cp.float64))
    with pytest.raises(ValueError, match="K must be a multiple of 16, got K=56"):
        gemv(cp.asarray(rand(B, 56, seed=4)), cp.asarray(Q.quantize_int8(w[:, :56].copy())[0]), b,
             scale=s)
    with pytest.raises(ValueError, match=r"W: expected shape \(\*, 64\)"):
        gemv(x, cp.asarray(Q.to_bf16(w[:, :32].copy())), b)
    with pytest.raises(ValueError, match="version: bf16 weights are read by version 6"):
        gemv(x, u, b, version=5)
    with pytest.raises(TypeError, match="W: version 7 reads int8"):
        gemv(x, cp.asarray(w), b, version=7)
    with pytest.raises(ValueError, match="scale: W is a LowpWeight"):
        gemv(x, Q.LowpWeight(q, s), b, scale=s)
    with pytest.raises(ValueError, match="residual: out"):
        gemv(x, u, out=cp.empty((B, N), cp.float32), residual=True)
    with pytest.raises(ValueError, match="gelu=True needs a bias"):
        gemv(x, u, gelu=True)
    with pytest.raises(ValueError, match=r"W: expected \(3C, K\)"):
        gemv_qkv(x, u[:23], b[:23], cp.empty((B, 8), cp.float32), cp.empty((B, 2, 4, 4), cp.float32),
                 cp.empty((B, 2, 4, 4), cp.float32), cp.zeros(B, cp.int32))
    with pytest.raises(ValueError, match="scale: int8 weights need"):
        matmul_lowp(x, q)


@gpu
@pytest.mark.sanitize
def test_int8_widening_on_the_gpu_is_exact_for_all_256_values(cp):
    """The byte-permute widening on the device, bit for bit: dequant_int8_v1 gives every int8 value times a unit
    scale as itself, and times a random scale as float32's one rounding of the product; the int8 GEMV with one-hot
    x rows (256 rows: v9, whose fp16 operands hold 0 and 1 exactly, where the GPU has it, else v7) returns q's
    columns exactly."""
    from step4_gpt2.ops import dequantize, gemv
    q = np.stack([np.random.default_rng(i).permutation(np.arange(-128, 128)).astype(np.int8) for i in range(7)])
    dq = cp.asarray(q)
    out = poison(cp.empty((7, 256), cp.float32))
    np.testing.assert_array_equal(dequantize(dq, cp.ones(7, cp.float32), out=out).get(), q.astype(np.float32))
    s = rand(7, seed=1, low=0.001, high=2.0)
    out = poison(cp.empty((7, 256), cp.float32))
    np.testing.assert_array_equal(dequantize(dq, cp.asarray(s), out=out).get(), q.astype(np.float32) * s[:, None])
    y = poison(cp.empty((256, 7), cp.float32))
    gemv(cp.eye(256, dtype=cp.float32), dq, out=y, scale=cp.ones(7, cp.float32))
    np.testing.assert_array_equal(y.get(), q.T.astype(np.float32))
