"""Step 3 (fusion) against float64 references: LayerNorm v1..v4, fused residual + LayerNorm, the glue of
the unfused sublayer, both attention-sublayer pipelines, the decode-step tail's schedules (separate / two / one
kernel), conv2d + bias + ReLU and the over-fused LayerNorm + GEMM. Random inputs, poisoned outputs,
awkward shapes (C not a multiple of 4 or of 32, rows = 1, rows longer than the register cache).

Tolerances (relative-norm error vs float64): 2e-6 for LayerNorm-type kernels (each output is a short
fp32 computation on O(1) values); 1e-5 where an fp32 dot product of hundreds to thousands of terms is
involved (convolution, decode attention + projection, the over-fused GEMM); 2e-5 for the attention
sublayers, which chain two fp32 cuBLAS GEMMs (K = C and 3C accumulations, possibly split-K) with
attention over T keys: each adds ~sqrt(K) * 6e-8 relative error, and LayerNorm passes it on."""

import importlib
import re

import numpy as np
import pytest

from common import assert_close, capture_graph, occupancy, poison, rand, reference as R
from common.kernels import ROOT, kernel_source
from tests.kernel_names import compiled_kernels, declared, kernel_requests
from common.reference import fusion as RF

try:
    import cupy as cp
except Exception:       # CPU-only CI: the reference tests below still run
    cp = None

gpu = pytest.mark.gpu
LN_SHAPES = [(1, 1), (1, 768), (3, 5), (7, 33), (17, 127), (64, 768), (5, 1027), (3, 2051), (1000, 768)]


# ------------------------------------------------------------------ CPU: the references themselves
def test_reference_sublayer_matches_torch():
    torch = pytest.importorskip("torch", reason="torch is optional: cross-check of the float64 reference")
    F = torch.nn.functional
    B, T, C, H = 2, 9, 16, 2
    x = rand(B, T, C, seed=1, dtype=np.float64)
    p = {k: rand(*s, seed=i + 2, dtype=np.float64) for i, (k, s) in enumerate(
        {"ln1_w": (C,), "ln1_b": (C,), "w_qkv": (C, 3 * C), "b_qkv": (3 * C,), "w_proj": (C, C), "b_proj": (C,),
         "ln2_w": (C,), "ln2_b": (C,)}.items())}
    t = {k: torch.tensor(v) for k, v in p.items()}
    xt = torch.tensor(x)
    h = F.layer_norm(xt, (C,), t["ln1_w"], t["ln1_b"], 1e-5)
    q, k, v = (h @ t["w_qkv"] + t["b_qkv"]).split(C, dim=-1)
    q, k, v = (z.view(B, T, H, C // H).transpose(1, 2) for z in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
    r = xt + o @ t["w_proj"] + t["b_proj"]
    y = F.layer_norm(r, (C,), t["ln2_w"], t["ln2_b"], 1e-5)
    rr, yy = RF.attention_sublayer(x, p, H)
    np.testing.assert_allclose(rr, r.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(yy, y.numpy(), rtol=1e-10, atol=1e-12)


def test_reference_conv_matches_torch():
    torch = pytest.importorskip("torch", reason="torch is optional: cross-check of the float64 reference")
    x, w, b = rand(2, 3, 7, 6, seed=1, dtype=np.float64), rand(5, 3, 3, 3, seed=2, dtype=np.float64), rand(5, seed=3)
    want = torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), torch.tensor(b, dtype=torch.float64),
                                      padding=1).relu().numpy()
    np.testing.assert_allclose(RF.conv2d_bias_relu(x, w, b), want, rtol=1e-12, atol=1e-12)


def test_reference_decode_sublayer_is_the_last_row_of_the_full_sublayer():
    """Decoding token t with a cache of t+1 rows gives the full sublayer's row t (same weights)."""
    B, T, C, H = 2, 6, 8, 2
    D = C // H
    x = rand(B, T, C, seed=4, dtype=np.float64)
    p = {k: rand(*s, seed=i + 5, dtype=np.float64) for i, (k, s) in enumerate(
        {"ln1_w": (C,), "ln1_b": (C,), "w_qkv": (C, 3 * C), "b_qkv": (3 * C,), "w_proj": (C, C), "b_proj": (C,),
         "ln2_w": (C,), "ln2_b": (C,)}.items())}
    r, y = RF.attention_sublayer(x, p, H)
    qkv = R.layernorm(x, p["ln1_w"], p["ln1_b"]) @ p["w_qkv"] + p["b_qkv"]
    q, k, v = RF.split_heads(qkv, H)
    rd, yd = RF.decode_sublayer(x[:, -1], q[:, :, -1], k, v, np.full(B, T), p["w_proj"], p["b_proj"],
                                p["ln2_w"], p["ln2_b"])
    np.testing.assert_allclose(rd, r[:, -1], rtol=1e-12)
    np.testing.assert_allclose(yd, y[:, -1], rtol=1e-12)
    assert RF.merge_heads(q).shape == (B, T, C) and q.shape == (B, H, T, D)


# ------------------------------------------------------------------ CPU: every kernel the wrappers name exists
@pytest.mark.parametrize("module", ["step3_fused/ops.py", "step3_fused/training.py"])
def test_cu_defines_list_every_launched_file_and_every_kernel_has_its_source(module):
    """tests/test_compile.py checks that each name the wrappers launch is compiled from its .cu with CU_DEFINES;
    here CU_DEFINES names exactly the files the module launches, and every launched kernel's source can be
    shown in a notebook (common.kernel_source)."""
    mod = importlib.import_module(module[:-3].replace("/", "."))
    requests = kernel_requests(ROOT / module)
    assert {cu for cu, _, _ in requests} == set(declared(mod, "CU_DEFINES")), \
        "CU_DEFINES must list exactly the .cu files launched"
    for cu, pattern, _ in requests:
        names = [k for k in compiled_kernels(module, cu) if re.fullmatch(pattern, k)]
        assert names, f"{module}: no kernel of {cu.name} matches {pattern}"
        for name in names:
            assert kernel_source(cu, name), name


# ------------------------------------------------------------------ CPU: the shape of step 3's code
def test_version_lists_are_numbered_and_decode_schedules_are_named():
    """A kernel family's versions are ints 1..N in <FAMILY>_VERSIONS; the decode tail's four ways of cutting
    the same work into kernels are schedules, named as such."""
    ops = importlib.import_module("step3_fused.ops")
    assert ops.LAYERNORM_VERSIONS == (1, 2, 3, 4)
    assert ops.DECODE_SCHEDULES == ("separate", "separate-splitk", "two", "fused")
    assert not hasattr(ops, "LN_VERSIONS") and not hasattr(ops, "DECODE_VERSIONS")


def test_benchmarks_training_answers_help_without_a_gpu(tmp_path):
    """`python -m step3_fused.benchmarks_training --help` prints its usage and writes nothing; the run itself
    without a GPU prints the course's one-line message, no traceback."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "step3_fused.benchmarks_training"]
    out = subprocess.run(cmd + ["--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage: python -m step3_fused.benchmarks_training" in out.stdout, out.stderr
    assert list(tmp_path.iterdir()) == [], "--help wrote files"
    from common.device import skip_reason
    if skip_reason():
        out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert "This needs an NVIDIA GPU" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ GPU
def _ops():
    from step3_fused import ops
    return ops


def g(*shape, seed, low=-1.0, high=1.0):
    return cp.asarray(rand(*shape, seed=seed, low=low, high=high))


def _ln_params(C, seed):
    return g(C, seed=seed, low=0.5, high=1.5), g(C, seed=seed + 1, low=-0.5, high=0.5)


@gpu
@pytest.mark.parametrize("version", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", LN_SHAPES)
def test_layernorm(version, shape):
    N, C = shape
    x = g(N, C, seed=N * C + version, low=-1.0, high=3.0)       # a non-zero mean tests the variance
    w, b = _ln_params(C, seed=C)
    y = poison(cp.empty_like(x))
    _ops().layernorm(x, w, b, version=version, out=y)
    assert_close(y, R.layernorm(x, w, b, 1e-5), rtol=2e-6, name=f"layernorm_v{version} {shape}")


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("version", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (9, 130), (2, 1029)])
def test_layernorm_small(version, shape):
    test_layernorm(version, shape)


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("C", [768, 1029])
def test_layernorm_v4_unaligned_view(C):
    N = 5
    base, ybase = g(N * C + 3, seed=7), poison(cp.empty(N * C + 3, cp.float32))
    x, y = base[1:1 + N * C].reshape(N, C), ybase[2:2 + N * C].reshape(N, C)
    w, b = _ln_params(C, seed=1)
    _ops().layernorm(x, w, b, eps=1e-3, out=y)
    assert_close(y, R.layernorm(x, w, b, 1e-3), rtol=2e-6)
    assert cp.isnan(ybase[:2]).all() and cp.isnan(ybase[2 + N * C:]).all()


def _residual_case(N, C, seed, with_bias=True):
    x, p = g(N, C, seed=seed, low=-2, high=2), g(N, C, seed=seed + 1)
    pb = g(C, seed=seed + 2) if with_bias else None
    w, b = _ln_params(C, seed=seed + 3)
    return x, p, pb, w, b


@gpu
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", LN_SHAPES)
def test_residual_layernorm(shape, with_bias):
    N, C = shape
    x, p, pb, w, b = _residual_case(N, C, seed=N + C, with_bias=with_bias)
    r, y = poison(cp.empty_like(x)), poison(cp.empty_like(x))
    got = _ops().residual_layernorm(x, p, pb, w, b, out_residual=r, out_ln=y)
    assert got[0] is r and got[1] is y
    want_r, want_y = R.residual_layernorm(x, p, pb, w, b, 1e-5)
    assert_close(r, want_r, rtol=2e-6, name="residual")
    assert_close(y, want_y, rtol=2e-6, name="ln")


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("shape", [(1, 1), (1, 768), (4, 33), (3, 1030), (2, 2052)])
def test_residual_layernorm_in_place(shape):
    N, C = shape
    x, p, pb, w, b = _residual_case(N, C, seed=3)
    want_r, want_y = R.residual_layernorm(x, p, pb, w, b, 1e-5)
    y = poison(cp.empty_like(x))
    r, _ = _ops().residual_layernorm(x, p, pb, w, b, out_residual=x, out_ln=y)
    assert r is x
    assert_close(x, want_r, rtol=2e-6, name="residual written in place")
    assert_close(y, want_y, rtol=2e-6, name="ln after an in-place residual")


@gpu
@pytest.mark.sanitize
def test_residual_layernorm_unaligned():
    """Unaligned views (x and both outputs one float past a 16-byte boundary) take the scalar kernel."""
    N, C = 3, 768
    x = g(N * C + 1, seed=2)[1:].reshape(N, C)
    _, p, pb, w, b = _residual_case(N, C, seed=9)
    r = poison(cp.empty(N * C + 1, cp.float32))[1:].reshape(N, C)
    y = poison(cp.empty(N * C + 1, cp.float32))[1:].reshape(N, C)
    got_r, got_y = _ops().residual_layernorm(x, p, pb, w, b, out_residual=r, out_ln=y)
    assert got_r is r and got_y is y
    want_r, want_y = R.residual_layernorm(x, p, pb, w, b, 1e-5)
    assert_close(r, want_r, rtol=2e-6)
    assert_close(y, want_y, rtol=2e-6)


@gpu
@pytest.mark.sanitize
def test_residual_layernorm_allocating():
    """Without out= buffers the wrapper allocates both outputs. CuPy's pool hands back the blocks freed
    just before, so they are filled with NaN first: an element the kernel skipped would stay NaN."""
    N, C = 5, 768
    x, p, pb, w, b = _residual_case(N, C, seed=10)
    stale = [poison(cp.empty((N, C), cp.float32)) for _ in range(4)]
    del stale
    r, y = _ops().residual_layernorm(x, p, pb, w, b)
    assert r.shape == y.shape == (N, C) and r.dtype == y.dtype == cp.float32
    want_r, want_y = R.residual_layernorm(x, p, pb, w, b, 1e-5)
    assert_close(r, want_r, rtol=2e-6)
    assert_close(y, want_y, rtol=2e-6)


@gpu
def test_layernorm_and_residual_are_graph_capturable():
    ops = _ops()
    N, C = 33, 768
    x, p, pb, w, b = _residual_case(N, C, seed=11)
    x0 = x.copy()
    r, y, z = cp.empty_like(x), cp.empty_like(x), cp.empty_like(x)
    ops.residual_layernorm(x, p, pb, w, b, out_residual=r, out_ln=y)    # compile outside the capture
    ops.layernorm(y, w, b, out=z)
    poison(r), poison(y), poison(z)
    cp.cuda.Device().synchronize()     # the fills run on the default stream, which a non-blocking one does not wait for
    stream = cp.cuda.Stream(non_blocking=True)
    graph = capture_graph(lambda: (ops.residual_layernorm(x, p, pb, w, b, out_residual=r, out_ln=y),
                                   ops.layernorm(y, w, b, out=z)), stream)
    graph.launch(stream)
    stream.synchronize()
    want_r, want_y = R.residual_layernorm(x0, p, pb, w, b, 1e-5)
    assert_close(r, want_r, rtol=2e-6)
    assert_close(z, R.layernorm(want_y, w, b, 1e-5), rtol=5e-6)


@gpu
@pytest.mark.sanitize
def test_glue_kernels():
    ops = _ops()
    B, T, H, D = 2, 5, 3, 7
    C = H * D
    qkv = g(B, T, 3 * C, seed=1)
    bias = g(3 * C, seed=2)
    qb = ops.bias_add_rows(qkv, bias, out=poison(cp.empty_like(qkv)))
    assert_close(qb, R.f64(qkv) + R.f64(bias), rtol=1e-7)
    outs = tuple(poison(cp.empty((B, H, T, D), cp.float32)) for _ in range(3))
    q, k, v = ops.split_heads(qb, H, out=outs)
    for got, want in zip((q, k, v), RF.split_heads(qb, H)):
        assert_close(got, want, rtol=0)
    m = ops.merge_heads(v, out=poison(cp.empty((B, T, C), cp.float32)))
    assert_close(m, RF.merge_heads(v), rtol=0)
    s = ops.add(qkv, qb, out=poison(cp.empty_like(qkv)))
    assert_close(s, R.f64(qkv) + R.f64(qb), rtol=1e-7)
    # in place (out is an input), as the over-fusion baseline runs bias_add_rows
    inplace = qkv.copy()
    assert ops.bias_add_rows(inplace, bias, out=inplace) is inplace
    assert_close(inplace, R.f64(qkv) + R.f64(bias), rtol=1e-7)
    assert ops.add(inplace, qb, out=inplace) is inplace
    assert_close(inplace, R.f64(qkv) + R.f64(bias) + R.f64(qb), rtol=1e-7)


SUBLAYER_SMALL = [(1, 1, 64, 1), (2, 67, 128, 2), (1, 130, 192, 3), (2, 45, 128, 4)]   # D = 64, 64, 64, 32


def _sublayer(fused, B, T, C, H, seed=0):
    ops = _ops()
    try:
        if fused:
            import step2_attention.flash  # noqa: F401
        else:
            from step2_attention.ops import attention_naive  # noqa: F401
    except ImportError as e:
        pytest.skip(f"step 2's attention is not available ({e}); the {'fused' if fused else 'unfused'} "
                    f"sublayer calls it")
    x = g(B, T, C, seed=seed + 100, low=-2, high=2)
    p = ops.sublayer_params(C, seed=seed)
    r, y = poison(cp.empty_like(x)), poison(cp.empty_like(x))
    fn = ops.attention_sublayer_fused if fused else ops.attention_sublayer_unfused
    got = fn(x, p, H, out_residual=r, out_ln=y)
    assert got[0] is r and got[1] is y
    return x, p, r, y


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("B,T,C,H", SUBLAYER_SMALL)
def test_attention_sublayer(fused, B, T, C, H):
    x, p, r, y = _sublayer(fused, B, T, C, H)
    want_r, want_y = RF.attention_sublayer(x, p, H)
    assert_close(r, want_r, rtol=2e-5, name="residual")
    assert_close(y, want_y, rtol=2e-5, name="ln_2")


@gpu
@pytest.mark.slow
def test_attention_sublayer_gpt2_size_pipelines_agree():
    """B=8, T=1024, C=768, H=12: both pipelines vs float64 on sequence 0, and vs each other everywhere."""
    B, T, C, H = 8, 1024, 768, 12
    x, p, r_f, y_f = _sublayer(True, B, T, C, H, seed=3)
    _, _, r_u, y_u = _sublayer(False, B, T, C, H, seed=3)
    want_r, want_y = RF.attention_sublayer(x[:1], p, H)
    for name, got in (("fused residual", r_f), ("unfused residual", r_u)):
        assert_close(got[:1], want_r, rtol=2e-5, name=name)
    for name, got in (("fused ln_2", y_f), ("unfused ln_2", y_u)):
        assert_close(got[:1], want_y, rtol=2e-5, name=name)
    assert_close(y_f, y_u.get(), rtol=2e-5, name="fused vs unfused")


def _decode_case(B, H, D, L, lengths, seed=0, bias=True):
    C = H * D
    q = g(B, H, D, seed=seed)
    kc, vc = g(B, H, L, D, seed=seed + 1), g(B, H, L, D, seed=seed + 2)
    x = g(B, C, seed=seed + 3, low=-2, high=2)
    bound = 1 / np.sqrt(C)
    w = g(C, C, seed=seed + 4, low=-bound, high=bound)
    pb = g(C, seed=seed + 5, low=-0.1, high=0.1) if bias else None
    lw, lb = _ln_params(C, seed=seed + 6)
    return q, kc, vc, cp.asarray(np.array(lengths, np.int32)), x, w, pb, lw, lb


DECODE_SMALL = [(1, 1, 64, 1, [1]), (3, 2, 64, 37, [1, 37, 20]), (2, 3, 32, 9, [9, 4]), (2, 2, 128, 70, [70, 33])]


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("schedule", ["separate", "separate-splitk", "two", "fused"])
@pytest.mark.parametrize("B,H,D,L,lengths", DECODE_SMALL)
def test_decode_sublayer_small(schedule, B, H, D, L, lengths):
    test_decode_sublayer(schedule, B, H, D, L, lengths)


@gpu
@pytest.mark.parametrize("schedule", ["separate", "separate-splitk", "two", "fused"])
@pytest.mark.parametrize("B,H,D,L,lengths", [(4, 12, 64, 1024, [1024, 777, 1, 513]),
                                             (16, 12, 64, 300, list(range(1, 300, 19))[:16])])
def test_decode_sublayer(schedule, B, H, D, L, lengths, bias=True):
    ops = _ops()
    q, kc, vc, lens, x, w, pb, lw, lb = _decode_case(B, H, D, L, lengths, bias=bias)
    want_r, want_y = RF.decode_sublayer(x, q, kc, vc, lengths, w, pb, lw, lb)
    assert_close(ops.decode_attention_merged(q, kc, vc, lens, out=poison(cp.empty((B, H * D), cp.float32))),
                 R.decode_attention(q, kc, vc, lengths).reshape(B, -1), rtol=1e-5, name="decode attention")
    for repeat in range(2):          # the second call checks that the kernels left their workspace clean
        r, y = poison(cp.empty_like(x)), poison(cp.empty_like(x))
        ops.decode_sublayer(x, q, kc, vc, lens, w, pb, lw, lb, schedule=schedule, out_residual=r, out_ln=y)
        assert_close(r, want_r, rtol=1e-5, name=f"{schedule} residual (call {repeat + 1})")
        assert_close(y, want_y, rtol=1e-5, name=f"{schedule} ln (call {repeat + 1})")
    accum, counter = ops.decode_workspace(B, H * D)
    assert not accum.any() and not counter.any(), "workspace not reset to zero"


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("schedule", ["two", "fused"])
def test_decode_sublayer_in_place_without_bias(schedule):
    ops = _ops()
    q, kc, vc, lens, x, w, pb, lw, lb = _decode_case(3, 2, 64, 20, [20, 5, 11], seed=5, bias=False)
    want_r, want_y = RF.decode_sublayer(x, q, kc, vc, [20, 5, 11], w, None, lw, lb)
    y = poison(cp.empty_like(x))
    ops.decode_sublayer(x, q, kc, vc, lens, w, None, lw, lb, schedule=schedule, out_residual=x, out_ln=y)
    assert_close(x, want_r, rtol=1e-5)
    assert_close(y, want_y, rtol=1e-5)


@gpu
def test_decode_fused_is_graph_capturable():
    ops = _ops()
    B, H, D, L = 4, 12, 64, 128
    q, kc, vc, lens, x, w, pb, lw, lb = _decode_case(B, H, D, L, [128, 1, 64, 100], seed=8)
    r, y = cp.empty_like(x), cp.empty_like(x)
    ws = (cp.zeros((B, H * D), cp.float32), cp.zeros(B, cp.int32))
    ops.decode_sublayer(x, q, kc, vc, lens, w, pb, lw, lb, out_residual=r, out_ln=y, workspace=ws)
    poison(r), poison(y)
    cp.cuda.Device().synchronize()     # the fills run on the default stream, which a non-blocking one does not wait for
    stream = cp.cuda.Stream(non_blocking=True)
    graph = capture_graph(lambda: ops.decode_sublayer(x, q, kc, vc, lens, w, pb, lw, lb, out_residual=r, out_ln=y,
                                                      workspace=ws), stream)
    for _ in range(3):
        graph.launch(stream)
    stream.synchronize()
    want_r, want_y = RF.decode_sublayer(x, q, kc, vc, [128, 1, 64, 100], w, pb, lw, lb)
    assert_close(r, want_r, rtol=1e-5)
    assert_close(y, want_y, rtol=1e-5)


@gpu
@pytest.mark.parametrize("schedule,graph", [("separate", False), ("two", True), ("fused", False), ("fused", True)])
def test_decode_benchmark_call_computes_the_tail(schedule, graph):
    """step3_fused.benchmarks.decode_call, what the decode rows and notebook 03c time: eager, or its CUDA graph
    replayed on the current stream, it writes the float64 reference's result into its buffers."""
    from step3_fused.benchmarks import decode_call, decode_case
    B, L = 3, 40
    case = decode_case(B, L, seed=2)
    fn = decode_call(schedule, case, graph)
    r, y = fn.outputs
    poison(r), poison(y)
    fn()
    cp.cuda.get_current_stream().synchronize()
    want_r, want_y = RF.decode_sublayer(case["x"], case["q"], case["k_cache"], case["v_cache"], [L] * B,
                                        case["w_proj"], case["b_proj"], case["ln_w"], case["ln_b"])
    assert_close(r, want_r, rtol=1e-5, name=f"{schedule} residual (graph={graph})")
    assert_close(y, want_y, rtol=1e-5, name=f"{schedule} ln (graph={graph})")


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1), (2, 3, 7, 5, 4), (2, 16, 19, 23, 8)])
def test_conv2d_bias_relu(fused, shape):
    N, Cin, H, W, Cout = shape
    x, w, b = g(N, Cin, H, W, seed=1), g(Cout, Cin, 3, 3, seed=2), g(Cout, seed=3, low=-0.5, high=0.5)
    y = _ops().conv2d_bias_relu(x, w, b, fused=fused, out=poison(cp.empty((N, Cout, H, W), cp.float32)))
    assert_close(y, RF.conv2d_bias_relu(x, w, b), rtol=1e-5)


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("rows,cols", [(8, 4), (4, 1), (16, 8)])
@pytest.mark.parametrize("N,C,M", [(1, 33, 5), (37, 100, 300)])
def test_ln_linear_overfused(rows, cols, N, C, M):
    x = g(N, C, seed=1, low=-1, high=2)
    lw, lb = _ln_params(C, seed=2)
    w, b = g(C, M, seed=4, low=-0.2, high=0.2), g(M, seed=5)
    y = _ops().ln_linear_overfused(x, lw, lb, w, b, rows=rows, cols=cols, out=poison(cp.empty((N, M), cp.float32)))
    assert_close(y, RF.ln_linear(x, lw, lb, w, b), rtol=1e-5)


@gpu
def test_occupancy_report():
    ops = _ops()
    light, heavy = ops.overfused_kernel(4, 1), ops.overfused_kernel(16, 8)
    a, b = occupancy(light, 128, 4 * 768), occupancy(heavy, 128, 16 * 768)
    assert heavy.num_regs > light.num_regs and b["warps_per_sm"] < a["warps_per_sm"], (a, b)


@gpu
def test_bad_inputs_are_named():
    ops = _ops()
    x = g(4, 8, seed=0)
    w, b = _ln_params(8, seed=1)
    with pytest.raises(TypeError, match=r"x: expected a cupy.ndarray.*NumPy"):
        ops.layernorm(x.get(), w, b)
    with pytest.raises(TypeError, match="x: expected dtype float32"):
        ops.layernorm(x.astype(cp.float64), w, b)
    with pytest.raises(ValueError, match="x: expected a 2-D array"):
        ops.layernorm(x.reshape(-1), w, b)
    with pytest.raises(ValueError, match=r"weight: expected shape \(8\)"):
        ops.layernorm(x, w[:7], b)
    with pytest.raises(ValueError, match="version"):
        ops.layernorm(x, w, b, version=5)
    with pytest.raises(ValueError, match="out: expected shape"):
        ops.layernorm(x, w, b, out=cp.empty((4, 9), cp.float32))
    with pytest.raises(ValueError, match=r"proj: expected shape \(4, 8\)"):
        ops.residual_layernorm(x, x[:3], None, w, b)
    with pytest.raises(ValueError, match="out_ln: must not share memory"):
        ops.residual_layernorm(x, x.copy(), None, w, b, out_residual=x, out_ln=x)
    with pytest.raises(ValueError, match="C-contiguous"):
        ops.residual_layernorm(x, g(8, 4, seed=2).T, None, w, b)
    q, kc, vc, lens, xd, wd, pb, lw, lb = _decode_case(2, 2, 64, 8, [8, 8])
    with pytest.raises(TypeError, match="lengths: expected dtype int32"):
        ops.decode_sublayer(xd, q, kc, vc, lens.astype(cp.int64), wd, pb, lw, lb)
    with pytest.raises(ValueError, match="k_cache: expected shape"):
        ops.decode_sublayer(xd, q, kc[:1], vc[:1], lens, wd, pb, lw, lb)
    with pytest.raises(ValueError, match="schedule"):
        ops.decode_sublayer(xd, q, kc, vc, lens, wd, pb, lw, lb, schedule="one")
    with pytest.raises(ValueError, match="n_head: expected a positive integer"):
        ops.split_heads(g(1, 2, 6, seed=3), 0)
    with pytest.raises(ValueError, match="n_head: expected a positive integer"):
        ops.split_heads(g(1, 2, 6, seed=3), -1)
    with pytest.raises(ValueError, match="rows: expected a positive integer"):
        ops.ln_linear_overfused(x, w, b, g(8, 5, seed=4), g(5, seed=5), rows=0)
    with pytest.raises(ValueError, match="cols: expected a positive integer"):
        ops.ln_linear_overfused(x, w, b, g(8, 5, seed=4), g(5, seed=5), cols=-2)
    with pytest.raises(ValueError, match="head dimension"):
        ops.decode_attention_merged(g(1, 1, 48, seed=1), g(1, 1, 4, 48, seed=2), g(1, 1, 4, 48, seed=3),
                             cp.ones(1, cp.int32))
    with pytest.raises(ValueError, match="n_head"):
        ops.attention_sublayer_fused(g(1, 4, 8, seed=1), ops.sublayer_params(8), 3)
    with pytest.raises(KeyError, match="missing"):
        ops.attention_sublayer_unfused(g(1, 4, 8, seed=1), {"ln1_w": w}, 2)
    with pytest.raises(ValueError, match=r"w: expected shape \(Cout, 2, 3, 3\)"):
        ops.conv2d_bias_relu(g(1, 2, 4, 4, seed=1), g(3, 2, 5, 5, seed=2), g(3, seed=3))
