"""Step 4b in bf16 (step4_gpt2/train/mixed.py, ops_bf16.py, mixed.cu, attention_bf16.cu): on the CPU the compiles
for sm_70 ... sm_90 (the bf16 kernels trap below sm_80, and the wrappers refuse those GPUs with a message), the
reference bf16 rounding the GPU checks compare the casts with, activation_bytes (exact, what recomputation saves)
and the named errors; on the GPU every kernel against a float64 reference on bf16-rounded inputs (awkward
shapes, NaN-poisoned outputs), the bf16 GEMM, one step's loss and every gradient against torch autocast(bf16), recomputation against none, the
training graph against the launches one by one, and a short run's validation loss against the fp32 run's. The
bf16 outputs fused into the kernels that make them (LayerNorm forward and backward, GELU backward, attention
backward) are checked bit for bit: each is the cast of that kernel's fp32 output, which they leave unchanged, and a
whole step gives the losses and gradients of the step that cast them separately."""
import math

import numpy as np
import pytest

from common import assert_close, max_rel_error, poison
from common.reference import train_gpt2 as R
from common.reference.quantize import bf16_round       # from the definition: 8 significant bits, ties to even
from step4_gpt2.train import mixed as MX
from step4_gpt2.train import ops_bf16 as bf
from step4_gpt2.weights import GPTConfig, random_weights

try:
    import torch
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed (pip install torch)")
gpu = pytest.mark.gpu

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=37, block_size=40)


def rand(shape, seed=0, scale=1.0):
    x = np.random.default_rng(seed).standard_normal(shape) * scale
    x[x == 0] = 0.5                                             # never a zero
    return x.astype(np.float32)


def batch(cfg, B, T, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32),
            rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32))


# ============================================================================ CPU
def test_bf16_rounding_is_to_nearest_even():
    one, ulp = 1.0, 2.0 ** -7                                   # bf16's step just above 1
    x = np.array([1, 1 + ulp / 2, 1 + 1.5 * ulp, 1 + ulp / 2 + 2 ** -20, -(1 + 1.5 * ulp), 3e38, 1e-39])
    want = np.array([1, 1, 1 + 2 * ulp, 1 + ulp, -(1 + 2 * ulp)], np.float32)
    got = bf16_round(x)
    assert np.array_equal(got[:5], want)                        # ties to the even mantissa
    assert np.isfinite(got[5]) and got[6] > 0                   # fp32's range: no overflow, no flush to zero
    r = rand(100_000, scale=1e3)
    assert np.max(np.abs(bf16_round(r) - r) / np.abs(r)) <= 2.0 ** -8
    assert one == bf16_round(np.float32(one))


@pytest.mark.parametrize("source", ["step4_gpt2/train/attention_bf16.cu", "step4_gpt2/train/mixed.cu"])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_kernels_compile_for_every_arch_and_trap_below_sm80(source, head_dim):
    from common.kernels import ARCHS, compile_offline, supported_archs
    want = {"attention_forward_bf16", "attention_delta_bf16", "attention_dkv_bf16", "attention_dq_bf16"} \
        if "attention" in source else {"to_bf16", "bias_bf16", "gelu_bias_bf16", "classifier_bf16"}
    for arch in (a for a in ARCHS if a in supported_archs()):
        report = compile_offline(source, arch, defines={"HEAD_DIM": head_dim})
        assert not report.warnings, (arch, report.warnings)
        assert set(report.kernels) == want, (arch, report.table())
        if arch >= 80 and "attention" in source and head_dim == 64:
            assert not any(k.spill_stores for k in report.kernels.values()), report.table()
            assert report.kernels["attention_forward_bf16"].registers > 32      # the real kernel, not the trap
        if arch < 80 and "attention" in source:                              # the trap: a handful of registers
            assert report.kernels["attention_dkv_bf16"].registers < 16, report.table()


def test_below_sm80_the_wrappers_refuse_with_a_message(monkeypatch):
    import common.device as dev
    monkeypatch.setattr(dev, "device_info", lambda: {"sm": 75, "name": "Tesla T4"})
    with pytest.raises(RuntimeError, match=r"bf16 mixed-precision training \(bf16 tensor cores\) needs "
                                           r"compute capability 8\.0 or newer; this GPU \(Tesla T4\) is 7\.5"):
        bf.require_bf16()
    with pytest.raises(RuntimeError, match="needs compute capability 8.0"):
        bf.attention_forward_bf16(None, 2)


@pytest.mark.parametrize("cfg,B,T", [(TINY, 3, 17), (GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50257,
                                                              block_size=1024), 8, 1024)])
def test_activation_bytes_is_what_the_buffers_hold_and_recompute_saves_12C_per_token_and_layer(cfg, B, T):
    N, C, L = B * T, cfg.n_embd, cfg.n_layer
    for recompute in (False, True):
        table = MX._buffers(cfg, B, T, recompute)
        want = sum(max(1, n) * math.prod(s) * np.dtype(d).itemsize for n, s, d in table.values())
        assert MX.activation_bytes(cfg, B, T, recompute) == want
    saved = MX.activation_bytes(cfg, B, T) - MX.activation_bytes(cfg, B, T, recompute=True)
    assert saved == (L - 1) * 12 * N * C            # ln_1, ln_2 (2 C bytes each) and h (8 C): one shared copy left
    from step4_gpt2.train.train import activation_bytes as fp32_bytes
    assert MX.activation_bytes(cfg, B, T) < fp32_bytes(cfg, B, T)
    assert MX.activation_bytes(cfg, B) == MX.activation_bytes(cfg, B, cfg.block_size)


@gpu
@pytest.mark.parametrize("recompute", [False, True])
def test_activation_bytes_is_what_a_model_allocates(recompute):
    """The bytes of the arrays a MixedGPT's activations hold after a step, counted from the arrays themselves
    (each buffer once, however many layers share it): the recompute buffers' sharing as the table assumes it.
    Memory the model would allocate outside _MixedActivations is not seen here."""
    import cupy as cp
    cfg, B, T = TINY, 3, 17
    m = MX.MixedGPT(cfg, random_weights(cfg, 1, notice=False), recompute=recompute)
    idx, tgt = batch(cfg, B, T)
    m.loss_and_grads(cp.asarray(idx), cp.asarray(tgt))
    a = m._acts[(B, T)]
    held = {}
    for name, v in vars(a).items():
        for x in (v if isinstance(v, list) else [v]) if name != "idx" else ():     # idx: the batch, not kept
            if isinstance(x, cp.ndarray):
                held[x.data.ptr] = x.nbytes
    assert sum(held.values()) == MX.activation_bytes(cfg, B, T, recompute=recompute)


@pytest.mark.parametrize("B,T", [(0, 4), (2.5, 4), (True, 4), (2, 0)])
def test_activation_bytes_names_bad_sizes(B, T):
    with pytest.raises(ValueError, match="B, T: expected positive integers"):
        MX.activation_bytes(TINY, B, T)


def test_make_model_names_the_precision_and_recompute():
    with pytest.raises(ValueError, match="precision"):
        MX.make_model(TINY, precision="fp16")
    with pytest.raises(ValueError, match="recompute: .*precision='bf16'"):
        MX.make_model(TINY, precision="fp32", recompute=True)


def test_wrappers_name_a_numpy_argument_before_any_gpu_work():
    h = np.zeros((2, 2), np.uint16)
    for call, name in ((lambda: bf.gemm_bf16(h, h), "a"), (lambda: bf.to_bf16(h.astype(np.float32)), "x"),
                       (lambda: bf.bias_bf16(h, None), "y"), (lambda: bf.gelu_bias_bf16(h, None), "x")):
        with pytest.raises(TypeError, match=f"^{name}: expected a cupy.ndarray on the GPU"):
            call()


def test_module_docstring_says_why_no_loss_scaling():
    doc = MX.__doc__
    assert "No loss scaling" in doc and "exponent" in doc


# ============================================================================ GPU: kernels
def cuda(x):
    import cupy as cp
    return cp.asarray(x)


def as_bf16(x):
    """float32 NumPy -> (CuPy uint16 bf16 bits, float64 NumPy of the rounded values: the reference's input)."""
    from step2_attention.flash import to_bf16
    bits = to_bf16(cuda(np.asarray(x, np.float32)))
    return bits, bf16_round(x).astype(np.float64)


def from_bf16(bits):
    from step2_attention.flash import bf16_to_float32
    return bf16_to_float32(bits).get()


def _shifted(a, offset: int):
    """a copy of the CuPy array a that starts `offset` elements into a fresh buffer: misaligned for offset 1
    (mixed.cu's casts then take their scalar path)."""
    import cupy as cp
    buf = cp.empty(a.size + offset, a.dtype)
    out = buf[offset:].reshape(a.shape)
    out[...] = a
    return out


@gpu
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("shape", [(1,), (7, 33), (3, 5), (4, 768), (300, 1001)])
def test_casts_against_numpy(shape, offset):
    import cupy as cp
    x = rand(shape, seed=1, scale=3.0)
    cuda = lambda a: _shifted(cp.asarray(a), offset)            # noqa: E731
    out = _shifted(poison(cp.empty(shape, cp.uint16)), offset)
    bf.to_bf16(cuda(x), out=out)
    assert np.array_equal(from_bf16(out), bf16_round(x))        # bit for bit: flash.to_bf16's rounding
    nan = cuda(np.array([np.nan, -np.nan, np.inf, -np.inf], np.float32))
    got = from_bf16(bf.to_bf16(nan))
    assert np.isnan(got[:2]).all() and np.array_equal(got[2:], [np.inf, -np.inf])
    if len(shape) == 2:                                         # the bias kernels read bf16 (a GEMM's output)
        bias = rand(shape[1], seed=2)
        x16, xr = as_bf16(x)
        y = _shifted(x16, offset)
        assert bf.bias_bf16(y, cuda(bias)) is y                 # in place: the fp32 sum of bf16 y and bias, rounded
        assert np.array_equal(from_bf16(y), bf16_round(xr.astype(np.float32) + bias))
        out = _shifted(poison(cp.empty(shape, cp.uint16)), offset)
        x16 = _shifted(x16, offset)
        bf.gelu_bias_bf16(x16, cuda(bias), out=out)
        assert_close(from_bf16(out), R.gelu_bias_forward(xr, bias)[1], rtol=1e-2)
        assert np.array_equal(from_bf16(x16), xr)               # x is only read


@gpu
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (17, 33, 65), (256, 384, 1152), (1000, 1536, 384)])
@pytest.mark.parametrize("layout", ["nn", "tn", "nt"])
def test_gemm_bf16_fp32_accumulate(m, k, n, layout):
    import cupy as cp
    a32, b32 = rand((m, k), 3), rand((k, n), 4)
    a, a64 = as_bf16(a32 if layout != "tn" else a32.T.copy())
    b, b64 = as_bf16(b32 if layout != "nt" else b32.T.copy())
    a, a64 = (a.T, a64.T) if layout == "tn" else (a, a64)
    b, b64 = (b.T, b64.T) if layout == "nt" else (b, b64)
    ref = a64 @ b64                                             # the exact product of the bf16 inputs
    out = poison(cp.empty((m, n), cp.float32))
    bf.gemm_bf16(a, b, out)
    # bf16 products are exact in fp32; the sums are fp32, rounded toward zero inside the tensor cores (k / 16
    # roundings in one direction): a few 1e-6 at k = 1536
    assert_close(out, ref, rtol=2e-5)
    bf.gemm_bf16(a, b, out, accumulate=True)
    assert_close(out, 2 * ref, rtol=2e-5)
    out16 = poison(cp.empty((m, n), cp.uint16))
    bf.gemm_bf16(a, b, out16)
    assert_close(from_bf16(out16), ref, rtol=1e-2)


@gpu
@pytest.mark.parametrize("m,n,ld", [(1, 37, 64), (257, 1001, 1024), (96, 50257, 50304)])
def test_gemm_bf16_reads_the_transposed_columns_of_a_wider_buffer(m, n, ld):
    """mixed.py's dwte GEMM: a = the transpose of the first n columns of an (m, ld) buffer (the padded dlogits),
    read with leading dimension ld."""
    import cupy as cp
    k = 48
    x, x64 = as_bf16(rand((m, k), 5))
    w, w64 = as_bf16(rand((m, n), 7))
    wide = cp.zeros((m, ld), cp.uint16)
    wide[:, :n] = w
    out = poison(cp.empty((n, k), cp.float32))
    bf.gemm_bf16(wide[:, :n].T, x, out)
    assert_close(out, w64.T @ x64, rtol=2e-5)


@gpu
@pytest.mark.parametrize("N,V,pad", [(1, 37, 0), (5, 65, 63), (33, 1001, 23), (4, 50257, 47)])
def test_classifier_bf16_is_the_fp32_classifiers_gradient_rounded(N, V, pad):
    """On bf16 logits: the same losses as step 3's fused classifier on the same rows widened to fp32 and, bit for
    bit, its fp32 gradient rounded to bf16; pad columns of -inf (mixed.py's padded logits rows) get a zero
    gradient; grad=False gives the same losses and writes no gradient; float64 reference. (A longer row is
    reduced by a bigger block, in another order: compare padded with padded.)"""
    import cupy as cp
    from step2_attention.flash import to_bf16
    from step4_gpt2.train import ops
    z = bf16_round(rand((N, V), seed=8, scale=4.0)).astype(np.float32)    # as the bf16 LM head stores it
    t = np.random.default_rng(8).integers(0, V, N).astype(np.int32)
    zp = np.concatenate([z, np.full((N, pad), -np.inf, np.float32)], axis=1)
    zb = to_bf16(cuda(zp))                                     # exact: every value is a bf16 already
    losses = poison(cp.empty(N, cp.float32))
    dz = poison(cp.empty((N, V + pad), cp.uint16))
    got = bf.classifier_bf16(zb, cuda(t), losses=losses, dlogits=dz)
    assert got is losses
    z32 = cuda(zp)
    want = ops.classifier(z32, cuda(t)).get()                 # z32 now holds the fp32 gradient
    np.testing.assert_array_equal(losses.get(), want)
    dz = from_bf16(dz)
    assert np.array_equal(dz, bf16_round(z32.get())) and np.array_equal(dz[:, V:], np.zeros((N, pad)))
    only = poison(cp.empty(N, cp.float32))
    bf.classifier_bf16(zb, cuda(t), losses=only, grad=False)
    np.testing.assert_array_equal(only.get(), want)
    z64 = z.astype(np.float64)
    lse = np.log(np.exp(z64 - z64.max(1, keepdims=True)).sum(1)) + z64.max(1)
    assert_close(losses, lse - z64[np.arange(N), t], rtol=1e-5)
    p = np.exp(z64 - lse[:, None])
    p[np.arange(N), t] -= 1
    assert_close(dz[:, :V], p / N, rtol=1e-2)


@gpu
def test_classifier_bf16_names_its_arguments():
    import cupy as cp
    z = cp.zeros((3, 10), cp.uint16)
    with pytest.raises(TypeError, match="logits: expected dtype uint16"):
        bf.classifier_bf16(cp.zeros((3, 10), cp.float32), cp.zeros(3, cp.int32))
    with pytest.raises(TypeError, match="targets: expected dtype int32"):
        bf.classifier_bf16(z, cp.zeros(3, cp.int64))
    with pytest.raises(ValueError, match="dlogits: pass it with grad=True only"):
        bf.classifier_bf16(z, cp.zeros(3, cp.int32), dlogits=cp.empty((3, 10), cp.uint16), grad=False)
    with pytest.raises(ValueError, match="dlogits: expected shape"):
        bf.classifier_bf16(z, cp.zeros(3, cp.int32), dlogits=cp.empty((3, 9), cp.uint16))


@gpu
def test_gemm_bf16_names_its_arguments():
    import cupy as cp
    a = cp.zeros((4, 8), cp.uint16)
    with pytest.raises(TypeError, match="a: expected dtype uint16, got float32"):
        bf.gemm_bf16(cp.zeros((4, 8), cp.float32), a.T)
    with pytest.raises(ValueError, match="b: expected 8 rows"):
        bf.gemm_bf16(a, a)
    with pytest.raises(ValueError, match="out"):
        bf.gemm_bf16(a, a.T, cp.empty((4, 5), cp.float32))


small = pytest.mark.sanitize
ATT_SHAPES = [pytest.param(1, 1, 1, 64, marks=small), pytest.param(2, 3, 17, 64, marks=small),
              pytest.param(1, 2, 64, 32, marks=small), (2, 2, 100, 64), (1, 1, 300, 32), (1, 2, 1024, 64)]


def att_inputs(B, T, H, D, seed=0):
    C = H * D
    qkv, qkv64 = as_bf16(rand((B, T, 3 * C), seed))
    dout, dout64 = as_bf16(rand((B, T, C), seed + 1))
    return qkv, qkv64, dout, dout64


@gpu
@pytest.mark.parametrize("B,H,T,D", ATT_SHAPES)
def test_attention_forward_bf16(B, H, T, D):
    import cupy as cp
    qkv, qkv64, _, _ = att_inputs(B, T, H, D)
    out, lse = poison(cp.empty((B, T, H * D), cp.uint16)), poison(cp.empty((B, H, T), cp.float32))
    bf.attention_forward_bf16(qkv, H, out=out, lse=lse)
    ref, ref_lse = R.attention_forward(qkv64, None, H)
    assert_close(from_bf16(out), ref, rtol=1e-2)                 # P and O rounded to bf16
    assert_close(lse, ref_lse, rtol=1e-5)                        # the scores and their sums are fp32


@gpu
@pytest.mark.parametrize("B,H,T,D", ATT_SHAPES)
def test_attention_backward_bf16(B, H, T, D):
    import cupy as cp
    qkv, qkv64, dout, dout64 = att_inputs(B, T, H, D, seed=5)
    out, lse = bf.attention_forward_bf16(qkv, H)
    dqkv = poison(cp.empty((B, T, 3 * H * D), cp.float32))
    bf.attention_backward_bf16(dout, qkv, out, lse, H, dqkv=dqkv)
    ref = R.attention_backward(dout64, qkv64, None, H)
    C = H * D
    for j, name in enumerate(("dq", "dk", "dv")):
        assert_close(dqkv[..., j * C:(j + 1) * C], ref[..., j * C:(j + 1) * C], rtol=2e-2, name=name)


@gpu
def test_attention_bf16_names_its_arguments():
    import cupy as cp
    from tests.views import misaligned
    qkv = cp.zeros((1, 4, 3 * 64), cp.uint16)
    with pytest.raises(TypeError, match="qkv"):
        bf.attention_forward_bf16(qkv.astype(cp.float32), 1)
    with pytest.raises(ValueError, match="n_head: head_dim"):
        bf.attention_forward_bf16(qkv, 4)
    with pytest.raises(ValueError, match="qkv: expected an array starting on a 16-byte boundary"):
        bf.attention_forward_bf16(misaligned(qkv), 1)
    with pytest.raises(ValueError, match="out: expected an array starting on a 16-byte boundary"):
        bf.attention_forward_bf16(qkv, 1, out=misaligned(cp.zeros((1, 4, 64), cp.uint16)))
    out, lse = bf.attention_forward_bf16(qkv, 1)
    with pytest.raises(ValueError, match="dout: expected an array starting on a 16-byte boundary"):
        bf.attention_backward_bf16(misaligned(out), qkv, out, lse, 1)


# ============================================================================ GPU: bf16 written by the producer
# Each fused bf16 output is compared with mixed.cu's cast (to_bf16) of the fp32 output the same kernel variant
# writes without it, bit for bit (uint16 patterns; fp32 compared as their bits, so NaN == NaN). The variants differ
# in their last bits (vec LayerNorms sum in another order), so the fp32 run is made to take the variant the bf16
# run takes: where the bf16 output is too misaligned for the 8-byte stores, its fp32 output is misaligned too.
PLACES = {"aligned": 0, "bf16 +2 bytes": 1, "bf16 +4 bytes": 2, "bf16 +8 bytes": 4, "inputs +4 bytes": 0}
BF16_SCALAR = ("bf16 +2 bytes", "bf16 +4 bytes")     # too misaligned for four bf16 at a time: the scalar kernels


def _same_bits(a, b) -> bool:
    """The same shape, dtype and bit patterns (fp32 compared as uint32: NaN equals NaN, -0 does not equal 0)."""
    import cupy as cp
    a, b = cp.asarray(a), cp.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.ravel(), b.ravel()
    if a.dtype == cp.float32:
        a, b = a.view(cp.uint32), b.view(cp.uint32)
    return bool(cp.array_equal(a, b))


def _input(x, where):
    from tests.views import misaligned
    return misaligned(x) if where == "inputs +4 bytes" else cuda(x)


def _out32(shape, where):
    """The fp32 path's output buffer: poisoned, and misaligned where the bf16 run takes the scalar kernels."""
    import cupy as cp
    from tests.views import misaligned
    out = poison(cp.empty(shape, cp.float32))
    return misaligned(out) if where in BF16_SCALAR else out


def _out16(shape, where):
    import cupy as cp
    return _shifted(poison(cp.empty(shape, cp.uint16)), PLACES[where])


def _names(monkeypatch):
    """The train_gpt2.cu kernels ops.py launches from here on, in order."""
    from step4_gpt2.train import ops
    used, k = [], ops._k
    monkeypatch.setattr(ops, "_k", lambda name: used.append(name) or k(name))
    return used


@gpu
@pytest.mark.parametrize("h16", [False, True])
@pytest.mark.parametrize("where", list(PLACES))
@pytest.mark.parametrize("rows,cols", [(1, 1), (300, 37), (7, 132), (257, 3072), (33, 6400)])
def test_gelu_backward_writes_dpre_in_bf16_bit_for_bit(rows, cols, where, h16, monkeypatch):
    """dpre16 is the cast of the dpre the fp32 path writes, and dbias is the fp32 path's, bit for bit: float4
    kernels (cols % 4 == 0, dpre16 8-byte aligned), float ones (cols odd, or dpre16 2 or 4 bytes off). h16: h in
    bf16 (mixed.py's pre-activation, as its GEMM wrote it), against the fp32 path on the widened values."""
    import cupy as cp
    from step2_attention.flash import bf16_to_float32
    from step4_gpt2.train import ops
    names = _names(monkeypatch)
    dout, bias = _input(rand((rows, cols), 1), where), cuda(rand(cols, 3))
    h = _input(rand((rows, cols), 2, 2.0), where)
    if h16:
        hb = _shifted(bf.to_bf16(cp.ascontiguousarray(h)), 2 if where == "inputs +4 bytes" else 0)
        h = _input(bf16_to_float32(hb), where)
    dpre, dbias = _out32((rows, cols), where), poison(cp.empty(cols, cp.float32))
    ops.gelu_bias_backward(dout, h, bias, dpre=dpre, dbias=dbias)
    dpre16, dbias16 = _out16((rows, cols), where), poison(cp.empty(cols, cp.float32))
    got, _ = ops.gelu_bias_backward(dout, hb if h16 else h, bias, dpre16=dpre16, dbias=dbias16)
    assert got is dpre16
    t = "float4" if cols % 4 == 0 and where in ("aligned", "bf16 +8 bytes") else "float"
    b = ops.BF16_OF[t]
    assert names[::2] == [f"gelu_backward_partial<{t}, {t}, {t}>",
                          f"gelu_backward_partial<{t}, {b}, {b if h16 else t}>"], names
    assert _same_bits(dpre16, bf.to_bf16(dpre))
    assert _same_bits(dbias16, dbias)
    assert _same_bits(dout, _input(rand((rows, cols), 1), where))      # dout is only read


@gpu
@pytest.mark.parametrize("rows,cols", [(7, 132), (33, 6400)])
def test_gelu_backward_reads_a_misaligned_bf16_h_one_element_at_a_time(rows, cols, monkeypatch):
    """h in bf16 two bytes off while dout, bias and dpre16 are aligned: h's alignment alone stops the 8-byte
    loads (ops._bf16x4_rows(h)), so the float kernel runs, and its dpre16 and dbias are the aligned h's bit for
    bit (the test above misaligns h only together with dout)."""
    import cupy as cp
    from step4_gpt2.train import ops
    names = _names(monkeypatch)
    dout, bias = cuda(rand((rows, cols), 1)), cuda(rand(cols, 3))
    hb = bf.to_bf16(cuda(rand((rows, cols), 2, 2.0)))
    want16, wantb = poison(cp.empty((rows, cols), cp.uint16)), poison(cp.empty(cols, cp.float32))
    ops.gelu_bias_backward(dout, hb, bias, dpre16=want16, dbias=wantb)
    got16, gotb = poison(cp.empty((rows, cols), cp.uint16)), poison(cp.empty(cols, cp.float32))
    ops.gelu_bias_backward(dout, _shifted(hb, 1), bias, dpre16=got16, dbias=gotb)
    b = ops.BF16_OF
    assert names[::2] == [f"gelu_backward_partial<float4, {b['float4']}, {b['float4']}>",
                          f"gelu_backward_partial<float, {b['float']}, {b['float']}>"], names
    assert _same_bits(got16, want16) and _same_bits(gotb, wantb)


LN_SHAPES = [(1, 4), (37, 45), (13, 132), (77, 768), (5, 1024), (9, 1600)]


def _ln_kernel(direction: str, C: int, where: str) -> str:
    """The LayerNorm kernel both runs should take: the row in registers where C % 4 == 0, C <= 1024 (LN_VECS) and
    every buffer is aligned for it; C = 1600 takes the scalar kernel."""
    from step4_gpt2.train import ops
    vec = next((v for v in ops.LN_VECS if 128 * v >= C), None) if C % 4 == 0 else None
    if vec is None or where in BF16_SCALAR + ("inputs +4 bytes",):
        return f"layernorm_{direction}"
    return f"layernorm_{direction}_vec<{vec}>"


@gpu
@pytest.mark.parametrize("where", list(PLACES))
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("N,C", LN_SHAPES)
def test_layernorm_forward_writes_its_output_in_bf16_bit_for_bit(N, C, fused, where, monkeypatch):
    """out16 is the cast of the out the fp32 path writes; mean, rstd (and the fused residual) are the fp32 path's,
    bit for bit. Rows not a multiple of a block's 8, C = 45 (scalar), 132 (a last float4 column some lanes hold),
    768 and 1024 (the vec kernels), 1600 (scalar: longer than LN_VECS holds)."""
    import cupy as cp
    from step4_gpt2.train import ops
    names = _names(monkeypatch)
    x, w, b = _input(rand((N, C), 1, 2.0), where), cuda(rand(C, 2)), cuda(rand(C, 3))
    extra = {"y": _input(rand((N, C), 4), where), "ybias": cuda(rand(C, 5))} if fused else {}
    runs = []
    for out16 in (None, _out16((N, C), where)):
        stats = [poison(cp.empty(N, cp.float32)) for _ in range(2)]
        resid = {"resid": poison(cp.empty((N, C), cp.float32))} if fused else {}
        out = {"out": _out32((N, C), where)} if out16 is None else {"out16": out16}
        got = ops.layernorm_forward(x, w, b, mean=stats[0], rstd=stats[1], **extra, **resid, **out)
        assert got[-3] is (out16 if out16 is not None else out["out"])
        runs.append((got[-3], *stats, *resid.values()))
    assert names == [_ln_kernel("forward", C, where)] * 2, names
    (out, *kept), (out16, *kept16) = runs
    assert _same_bits(out16, bf.to_bf16(cp.ascontiguousarray(out)))
    for a, b16 in zip(kept, kept16):
        assert _same_bits(b16, a)


@gpu
@pytest.mark.parametrize("where", list(PLACES))
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("N,C", LN_SHAPES)
def test_layernorm_backward_writes_dx_in_bf16_too_bit_for_bit(N, C, accumulate, where, monkeypatch):
    """dx16 is the cast of the final dx (after accumulating), and dx, dweight, dbias are the fp32 path's, bit for
    bit. Rows not a multiple of a block's 32."""
    import cupy as cp
    from step4_gpt2.train import ops
    dy, x, w = _input(rand((N, C), 1), where), _input(rand((N, C), 2, 2.0), where), cuda(rand(C, 3))
    _, mean, rstd = ops.layernorm_forward(x, w, cuda(rand(C, 4)))
    names = _names(monkeypatch)
    base = rand((N, C), 5)
    runs = []
    for dx16 in (None, _out16((N, C), where)):
        dx = _out32((N, C), where)
        if accumulate:
            dx[...] = cuda(base)
        dw, db = poison(cp.empty(C, cp.float32)), poison(cp.empty(C, cp.float32))
        got = ops.layernorm_backward(dy, x, w, mean, rstd, dx=dx, dweight=dw, dbias=db, accumulate=accumulate,
                                     dx16=dx16)
        assert all(g is e for g, e in zip(got, (dx, dw, db)))
        runs.append((dx16, dx, dw, db))
    assert names[::2] == [_ln_kernel("backward", C, where)] * 2, names
    (_, *want), (dx16, *got) = runs
    assert _same_bits(dx16, bf.to_bf16(cp.ascontiguousarray(want[0])))
    for a, b16 in zip(want, got):
        assert _same_bits(b16, a)


@gpu
@pytest.mark.parametrize("B,H,T,D", ATT_SHAPES)
def test_attention_backward_writes_dqkv_in_bf16_too_bit_for_bit(B, H, T, D):
    """dqkv16 is the cast of dqkv, and dqkv is what the backward writes without dqkv16, bit for bit (T not a
    multiple of a block's 64 rows)."""
    import cupy as cp
    qkv, _, dout, _ = att_inputs(B, T, H, D, seed=9)
    out, lse = bf.attention_forward_bf16(qkv, H)
    shape = (B, T, 3 * H * D)
    want = bf.attention_backward_bf16(dout, qkv, out, lse, H, dqkv=poison(cp.empty(shape, cp.float32)))
    dqkv16 = poison(cp.empty(shape, cp.uint16))
    got = bf.attention_backward_bf16(dout, qkv, out, lse, H, dqkv=poison(cp.empty(shape, cp.float32)), dqkv16=dqkv16)
    assert _same_bits(got, want)
    assert _same_bits(dqkv16, bf.to_bf16(want))


@gpu
def test_bf16_outputs_name_their_argument():
    import cupy as cp
    from step4_gpt2.train import ops
    from tests.views import misaligned
    N, C = 4, 8
    x, w = cp.ones((N, C), cp.float32), cp.ones(C, cp.float32)
    with pytest.raises(TypeError, match="^out16: expected dtype uint16, got float32"):
        ops.layernorm_forward(x, w, w, out16=cp.empty((N, C), cp.float32))
    with pytest.raises(ValueError, match=r"^out16: expected shape \(4, 8\), got \(4, 9\)"):
        ops.layernorm_forward(x, w, w, out16=cp.empty((N, C + 1), cp.uint16))
    with pytest.raises(ValueError, match="^out16: the bf16 output replaces out; pass out or out16, not both"):
        ops.layernorm_forward(x, w, w, out=cp.empty((N, C), cp.float32), out16=cp.empty((N, C), cp.uint16))
    with pytest.raises(ValueError, match="^dpre16: expected a C-contiguous array"):
        ops.gelu_bias_backward(x, x, w, dpre16=cp.empty((C, N), cp.uint16).T)
    with pytest.raises(ValueError, match="^dpre16: the bf16 output replaces dpre; pass dpre or dpre16, not both"):
        ops.gelu_bias_backward(x, x, w, dpre=x, dpre16=cp.empty((N, C), cp.uint16))
    _, mean, rstd = ops.layernorm_forward(x, w, w)
    with pytest.raises(TypeError, match="^dx16: expected dtype uint16, got float32"):
        ops.layernorm_backward(x, x, w, mean, rstd, dx16=x)
    qkv = cp.zeros((1, 4, 3 * 64), cp.uint16)
    out, lse = bf.attention_forward_bf16(qkv, 1)
    with pytest.raises(ValueError, match="^dqkv16: expected an array starting on a 16-byte boundary"):
        bf.attention_backward_bf16(out, qkv, out, lse, 1, dqkv16=misaligned(cp.zeros(qkv.shape, cp.uint16)))
    with pytest.raises(TypeError, match="^dqkv16: expected dtype uint16, got float32"):
        bf.attention_backward_bf16(out, qkv, out, lse, 1, dqkv16=cp.zeros(qkv.shape, cp.float32))


def _cast_after(monkeypatch):
    """The step as it ran before its kernels wrote bf16 themselves: each bf16 output made by writing the fp32 one
    (the GELU's in place, as then) and casting it with mixed.cu's to_bf16. The bf16 weights need no stand-in:
    test_fused_bf16_outputs_... compares each with the cast of its parameter."""
    import cupy as cp
    from step4_gpt2.train import ops
    ln_f, gelu_b, ln_b, att_b = ops.layernorm_forward, ops.gelu_bias_backward, ops.layernorm_backward, \
        bf.attention_backward_bf16

    def layernorm_forward(*args, out16=None, **kw):
        if out16 is None:
            return ln_f(*args, **kw)
        got = ln_f(*args, out=cp.empty(out16.shape, cp.float32), **kw)
        return (*got[:-3], bf.to_bf16(got[-3], out=out16), *got[-2:])

    def gelu_bias_backward(dout, h, bias, dpre=None, dbias=None, dpre16=None):
        if dpre16 is None:
            return gelu_b(dout, h, bias, dpre=dpre, dbias=dbias)
        _, dbias = gelu_b(dout, h, bias, dpre=dout, dbias=dbias)
        return bf.to_bf16(dout, out=dpre16), dbias

    def layernorm_backward(*args, dx16=None, **kw):
        got = ln_b(*args, **kw)
        if dx16 is not None:
            bf.to_bf16(got[0], out=dx16)
        return got

    def attention_backward_bf16(*args, dqkv16=None, **kw):
        dqkv = att_b(*args, **kw)
        if dqkv16 is not None:
            bf.to_bf16(dqkv, out=dqkv16)
        return dqkv

    for module, f in ((ops, layernorm_forward), (ops, gelu_bias_backward), (ops, layernorm_backward),
                      (bf, attention_backward_bf16)):
        monkeypatch.setattr(module, f.__name__, f)


@gpu
@pytest.mark.parametrize("cfg,recompute", [(TINY, False), (TINY, True),
                                           (GPTConfig(n_layer=2, n_head=3, n_embd=96, vocab_size=101, block_size=24),
                                            False)])
def test_fused_bf16_outputs_give_the_cast_steps_loss_and_gradients_bit_for_bit(cfg, recompute, monkeypatch):
    """A MixedGPT step with the bf16 copies written by their producers gives the loss and every gradient of the step
    that wrote fp32 and cast it (_cast_after), bit for bit; the bf16 weights (wte's the LM head's copy, the rest
    cast from the flat buffer after wte) are each the cast of its parameter. Odd vocabularies, C = 64 and 96."""
    import cupy as cp
    P = random_weights(cfg, 7, notice=False)
    idx, tgt = batch(cfg, 3, 19, seed=7)

    def step():
        m = MX.MixedGPT(cfg, P, recompute=recompute)
        loss = m.loss_and_grads(cp.asarray(idx), cp.asarray(tgt))
        return m, loss.get(), {k: v.get() for k, v in m.grads.items()}

    m, loss, grads = step()
    assert m.flat16.size == m.flat.size - cfg.vocab_size * cfg.n_embd
    assert m.params16["wte.weight"].data.ptr == m.head16.data.ptr
    for k, w16 in m.params16.items():
        assert _same_bits(w16, bf.to_bf16(cp.ascontiguousarray(m.params[k]))), k
    _cast_after(monkeypatch)
    _, want_loss, want = step()
    assert _same_bits(loss, want_loss), (float(loss), float(want_loss))
    for k in want:
        assert _same_bits(grads[k], want[k]), k


# ============================================================================ GPU: the model
def _models(cfg, P, **kw):
    from step4_gpt2.train.model import TrainGPT
    return TrainGPT(cfg, P), MX.MixedGPT(cfg, P, **kw)


@gpu
@needs_torch
@pytest.mark.parametrize("cfg,B,T", [(TINY, 3, 37), (GPTConfig(n_layer=2, n_head=6, n_embd=384, vocab_size=65,
                                                              block_size=256), 4, 256)])
def test_one_step_against_torch_autocast_bf16(cfg, B, T):
    """Loss within bf16's tolerance of torch autocast(bf16) on the same weights and batch; every gradient tensor's
    relative error printed (||ours - theirs|| / ||theirs||, and max |ours - theirs| / max |theirs|), the first
    under 2e-2. Both sides round to bf16, at different places (torch's GELU runs on bf16 inputs, ours in fp32)."""
    import cupy as cp
    from step4_gpt2.train import torch_gpt as TT
    P = random_weights(cfg, 3, notice=False)
    idx, tgt = batch(cfg, B, T, seed=3)
    m = MX.MixedGPT(cfg, P)
    loss = float(m.loss_and_grads(cp.asarray(idx), cp.asarray(tgt)))
    ours = {k: v.get() for k, v in m.grads.items()}
    model = TT.build(cfg).load(P)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        tl = model(torch.as_tensor(idx, device="cuda").long(), torch.as_tensor(tgt, device="cuda").long())
    tl.backward()
    theirs = model.grads()
    assert abs(loss - tl.item()) <= 1e-2 * abs(tl.item()), (loss, tl.item())
    errs = {k: np.linalg.norm(ours[k] - theirs[k]) / max(np.linalg.norm(theirs[k]), 1e-30) for k in ours}
    print("\n".join(f"{k:28s} {e:.2e} (max {max_rel_error(ours[k], theirs[k]):.2e})" for k, e in errs.items()))
    assert max(errs.values()) < 2e-2, max(errs.items(), key=lambda kv: kv[1])


def test_the_logits_rows_are_padded_to_a_multiple_of_64():
    assert [MX.padded_vocab(v) for v in (1, 37, 64, 65, 50257)] == [64, 64, 64, 128, 50304]
    N, V = 3 * 17, TINY.vocab_size
    table = MX._buffers(TINY, 3, 17, False)
    assert table["logits"][1] == (N, 64) and table["dlogits"][1] == (N, 64)


@gpu
def test_logits_without_targets_are_the_fp32_models_within_bf16():
    """forward(idx) returns the (B, T, V) logits: the padded buffer's first V columns, not its -inf pad."""
    import cupy as cp
    P = random_weights(TINY, 6, notice=False)
    idx, _ = batch(TINY, 2, 9, seed=6)
    fp32, mixed = _models(TINY, P)
    want, got = fp32.forward(cp.asarray(idx)).get(), mixed.forward(cp.asarray(idx)).get()
    assert got.shape == want.shape == (2, 9, TINY.vocab_size) and np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2


@gpu
@pytest.mark.parametrize("T", [1, 37])
def test_recompute_gives_the_same_loss_and_gradients(T):
    import cupy as cp
    P = random_weights(TINY, 4, notice=False)
    idx, tgt = batch(TINY, 2, T, seed=4)
    a, b = MX.MixedGPT(TINY, P), MX.MixedGPT(TINY, P, recompute=True)
    la = float(a.loss_and_grads(cp.asarray(idx), cp.asarray(tgt)))
    lb = float(b.loss_and_grads(cp.asarray(idx), cp.asarray(tgt)))
    assert la == lb
    for k in a.grads:                      # the same kernels on the same bits: equal (1e-6 leaves room for none)
        assert max_rel_error(b.grads[k], a.grads[k].get()) <= 1e-6, k


@gpu
def test_graph_step_is_the_same_as_launches_one_by_one():
    import cupy as cp
    from step4_gpt2.train.train import Trainer, TrainConfig
    P = random_weights(TINY, 5, notice=False)
    runs = {}
    for graph, recompute in ((False, False), (True, False), (True, True)):      # and recomputation in the graph
        m = MX.MixedGPT(TINY, P, recompute=recompute)
        tr = Trainer(m, TrainConfig(batch_size=2, warmup=1, max_steps=10), graph=graph)
        out = []
        for s in range(4):
            x, y = batch(TINY, 2, 33, seed=10 + s)
            tr.step(cp.asarray(x), cp.asarray(y))
            out.append(float(tr.last_loss))
        runs[graph, recompute] = (out, m.flat.get())
    first = runs[False, False]
    for key, (out, flat) in runs.items():
        assert out == first[0], key
        assert np.array_equal(flat, first[1]), key


@gpu
def test_short_run_validation_loss_within_003_of_fp32():
    """150 steps at the shakespeare_char shape (batch 16): the bf16 run's validation loss within 0.03 of fp32's."""
    from step4_gpt2.train.model import TrainGPT, shakespeare_char
    from step4_gpt2.train.train import Data, Trainer, TrainConfig, init_params
    try:
        data = Data.shakespeare("char")
    except ModuleNotFoundError as e:
        pytest.skip(f"the Shakespeare corpus is not installed: {e}")
    cfg = shakespeare_char(data.vocab_size)
    P = init_params(cfg, 0)
    tc = TrainConfig(batch_size=16, max_steps=150, warmup=15, eval_every=150, eval_batches=10)
    val = {}
    for name, m in (("fp32", TrainGPT(cfg, P)), ("bf16", MX.MixedGPT(cfg, P))):
        h = Trainer(m, tc, graph=True).fit(data, 150, progress=False)
        val[name] = h.val[-1]
    print(val)
    assert abs(val["bf16"] - val["fp32"]) <= 0.03, val
    assert val["fp32"] < 3.0                                    # it learned something (ln 65 = 4.17)


@gpu
def test_mixed_model_checks_its_config():
    with pytest.raises(ValueError, match="head_dim"):
        MX.MixedGPT(GPTConfig(n_layer=1, n_head=3, n_embd=48, vocab_size=19, block_size=9))


@gpu
def test_a_checkpoint_resumes_in_bf16_bit_for_bit(tmp_path):
    """Trainer.from_checkpoint(precision="bf16"): the fp32 master weights and AdamW state of a bf16 run, resumed,
    give the same next step as the run that went on."""
    import cupy as cp
    from step4_gpt2.train.train import Trainer, TrainConfig
    P = random_weights(TINY, 6, notice=False)
    tc = TrainConfig(batch_size=2, warmup=1, max_steps=10)
    batches = [batch(TINY, 2, 20, seed=20 + s) for s in range(3)]
    tr = Trainer(MX.MixedGPT(TINY, P), tc)
    for x, y in batches[:2]:
        tr.step(cp.asarray(x), cp.asarray(y))
    tr.save(tmp_path)
    again = Trainer.from_checkpoint(tmp_path, precision="bf16", recompute=True)
    assert isinstance(again.model, MX.MixedGPT) and again.model.recompute
    for t in (tr, again):
        t.step(cp.asarray(batches[2][0]), cp.asarray(batches[2][1]))
    assert float(tr.last_loss) == float(again.last_loss)
    assert np.array_equal(tr.model.flat.get(), again.model.flat.get())
