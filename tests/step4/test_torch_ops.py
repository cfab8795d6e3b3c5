"""The course's kernels as torch custom ops (step4_gpt2/torch_ops/ops.py). On the CPU: every op registers, the
fake implementations give the right shapes (FakeTensors on "cuda", meta tensors), torch.compile traces a
forward and backward through them without a graph break, opcheck's registration checks pass on meta tensors, and
each bad input raises an error that names the argument. On the GPU: torch.library.opcheck on every op (awkward
shapes), forward and backward against float64 torch (NaN-poisoned outputs), launches on a non-default torch
stream, inside a torch CUDA graph capture, and under torch.compile."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from common import assert_close, max_rel_error  # noqa: E402
from step4_gpt2.torch_ops import ops as K  # noqa: E402
from step4_gpt2.train import ops as T  # noqa: E402

gpu = pytest.mark.gpu
NAMES = ("layernorm", "residual_layernorm", "layernorm_backward", "column_sum", "bias_gelu", "bias_gelu_backward",
         "attention", "attention_backward", "cross_entropy", "cross_entropy_loss")


# ============================================================================ CPU: registration and fake tensors
def test_every_op_is_registered_without_mutation():
    assert tuple(op.__name__ for op in K.OPS) == NAMES
    for name, op in zip(NAMES, K.OPS):
        assert getattr(torch.ops.course, name) is op
        schema = op.default._schema
        assert not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments), schema


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode()


@pytest.mark.parametrize("lead", [(), (1,), (37,), (3, 7)])
@pytest.mark.parametrize("C", [1, 45, 384])
def test_fake_layernorm_gelu_and_sums_give_the_shapes(lead, C):
    with _fake_mode():
        e = lambda *s: torch.empty(*s, device="cuda")  # noqa: E731
        x, w = e(*lead, C), e(C)
        out, mean, rstd = torch.ops.course.layernorm(x, w, w, 1e-5)
        assert out.shape == x.shape and mean.shape == rstd.shape == x.shape[:-1]
        assert out.dtype == torch.float32 and out.device.type == "cuda" and out.is_contiguous()
        resid, out, mean, rstd = torch.ops.course.residual_layernorm(x, e(*lead, C), w, w, w, 1e-5)
        assert resid.shape == out.shape == x.shape and mean.shape == x.shape[:-1]
        assert [t.shape for t in torch.ops.course.residual_layernorm(x, x, None, w, w, 1e-5)] == \
            [x.shape, x.shape, x.shape[:-1], x.shape[:-1]]
        dx, dw, db = torch.ops.course.layernorm_backward(x, x, w, mean, rstd, None)
        assert dx.shape == x.shape and dw.shape == db.shape == (C,)
        assert K.layernorm(x, w, w).shape == x.shape
        assert [t.shape for t in K.residual_layernorm(x, x, w, w, w)] == [x.shape, x.shape]
        assert torch.ops.course.column_sum(x).shape == (C,)
        assert K.bias_gelu(x, w).shape == x.shape
        dh, dbias = torch.ops.course.bias_gelu_backward(x, x, w)
        assert dh.shape == x.shape and dbias.shape == (C,)


@pytest.mark.parametrize("B,Tn,H,D", [(1, 1, 1, 64), (3, 77, 2, 32), (2, 256, 6, 64)])
def test_fake_attention_gives_the_shapes(B, Tn, H, D):
    with _fake_mode():
        qkv = torch.empty(B, Tn, 3 * H * D, device="cuda")
        out, lse = torch.ops.course.attention(qkv, H)
        assert out.shape == (B, Tn, H * D) and lse.shape == (B, H, Tn)
        assert K.attention(qkv, H).shape == (B, Tn, H * D)
        assert torch.ops.course.attention_backward(out, qkv, out, lse, H).shape == qkv.shape


@pytest.mark.parametrize("lead", [(1,), (37,), (4, 9)])
@pytest.mark.parametrize("tdtype", [torch.int64, torch.int32])
def test_fake_cross_entropy_gives_the_shapes(lead, tdtype):
    with _fake_mode():
        logits, t = torch.empty(*lead, 65, device="cuda"), torch.empty(lead, dtype=tdtype, device="cuda")
        loss, dlogits = torch.ops.course.cross_entropy(logits, t)
        assert loss.shape == () and loss.dtype == torch.float32 and dlogits.shape == logits.shape
        assert torch.ops.course.cross_entropy_loss(logits, t).shape == ()
        assert K.cross_entropy(logits, t).shape == ()


def _meta(*shape, grad=True):
    t = torch.randn(*shape, device="meta")
    return t.requires_grad_() if grad else t


def _tiny_step(x, w, b, qkv_w, fc_w, fc_b, targets):
    """Every forward op once, with torch matmuls between them: a GPT block's shape, small."""
    h = K.layernorm(x, w, b)
    att = K.attention(h @ qkv_w, 2)
    resid, h2 = K.residual_layernorm(x, att, b, w, b)
    g = K.bias_gelu(h2 @ fc_w, fc_b)
    return K.cross_entropy(resid + g @ fc_w.T, targets)


def _tiny_args(make, B=2, Tn=5, C=64):
    return [make(B, Tn, C), make(C), make(C), make(C, 3 * C), make(C, 4 * C), make(4 * C)]


def test_compile_traces_forward_and_backward_without_graph_breaks():
    """Meta tensors: dynamo and AOTAutograd trace through the fake implementations and the registered backward
    (the aot_eager backend then runs the graphs on meta tensors: the fake implementations again)."""
    import torch._dynamo
    args = _tiny_args(_meta) + [torch.zeros(2, 5, dtype=torch.long, device="meta")]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_tiny_step)(*args)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    loss = torch.compile(_tiny_step, backend="aot_eager", fullgraph=True)(*args)
    grads = torch.autograd.grad(loss, args[:6])
    assert loss.shape == () and [g.shape for g in grads] == [a.shape for a in args[:6]]
    torch._dynamo.reset()


def _opcheck_cases(make, targets):
    """(op, args) for every op in K.OPS; make(*shape, grad=...) makes a float32 tensor."""
    x, w, b = make(37, 45), make(45), make(45)
    out, mean, rstd = (t.detach() for t in torch.ops.course.layernorm(x, w, b, 1e-5))
    qkv = make(2, 77, 3 * 64)
    aout, lse = (t.detach() for t in torch.ops.course.attention(qkv, 2))
    h, bias = make(300, 37), make(37)
    return [
        (torch.ops.course.layernorm, (x, w, b, 1e-5)),
        (torch.ops.course.residual_layernorm, (make(3, 5, 45), make(3, 5, 45), make(45), make(45), make(45), 1e-5)),
        (torch.ops.course.layernorm_backward, (make(37, 45, grad=False), x.detach(), w.detach(), mean, rstd,
                                               make(37, 45, grad=False))),
        (torch.ops.course.column_sum, (make(300, 37, grad=False),)),
        (torch.ops.course.bias_gelu, (h, bias)),
        (torch.ops.course.bias_gelu_backward, (make(300, 37, grad=False), h.detach(), bias.detach())),
        (torch.ops.course.attention, (qkv, 2)),
        (torch.ops.course.attention_backward, (make(2, 77, 64, grad=False), qkv.detach(), aout, lse, 2)),
        (torch.ops.course.cross_entropy, (make(37, 65), targets(37, V=65))),
        (torch.ops.course.cross_entropy_loss, (make(37, 65, grad=False), targets(37, V=65))),
    ]


def test_opcheck_on_meta_tensors():
    """The schema, fake and autograd registrations agree with each other (shapes only: meta tensors run the
    fake implementations; the GPU test runs the kernels)."""
    cases = _opcheck_cases(_meta, lambda *s, V: torch.zeros(*s, dtype=torch.long, device="meta"))
    assert [op for op, _ in cases] == list(K.OPS)
    for op, args in cases:
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


# ============================================================================ CPU: named errors
# (what, call(e) with e(*shape, dtype=...) making a tensor, exception, message), run under FakeTensorMode
BAD = [
    ("x dtype", lambda e: K.layernorm(e(4, 8).double(), e(8), e(8)), TypeError,
     r"^x: expected dtype torch.float32, got torch.float64"),
    ("x strided", lambda e: K.layernorm(e(8, 4).T, e(8), e(8)), ValueError, r"^x: expected a contiguous tensor"),
    ("x no row", lambda e: K.layernorm(e(4, 0), e(0), e(0)), ValueError, r"^x: expected shape \(\.\.\., C\) with C >= 1"),
    ("weight shape", lambda e: K.layernorm(e(4, 8), e(7), e(8)), ValueError, r"^weight: expected shape \(8,\), got \(7,\)"),
    ("bias dtype", lambda e: K.layernorm(e(4, 8), e(8), e(8).half()), TypeError, r"^bias: expected dtype torch.float32"),
    ("bias device", lambda e: K.layernorm(e(4, 8), e(8), torch.empty(8, device="meta")), ValueError,
     r"^bias: on meta, but the other arguments are on cuda"),
    ("eps", lambda e: K.layernorm(e(4, 8), e(8), e(8), eps=0.0), ValueError, r"^eps: expected a positive number"),
    ("y shape", lambda e: K.residual_layernorm(e(4, 8), e(4, 9), e(8), e(8), e(8)), ValueError,
     r"^y: expected shape \(4, 8\)"),
    ("ybias shape", lambda e: K.residual_layernorm(e(4, 8), e(4, 8), e(9), e(8), e(8)), ValueError,
     r"^ybias: expected shape \(8,\)"),
    ("h dtype", lambda e: K.bias_gelu(e(4, 8).to(torch.bfloat16), e(8)), TypeError, r"^h: expected dtype torch.float32"),
    ("gelu bias", lambda e: K.bias_gelu(e(4, 8), e(4)), ValueError, r"^bias: expected shape \(8,\)"),
    ("qkv ndim", lambda e: K.attention(e(10, 192), 1), ValueError, r"^qkv: expected a 3-D tensor"),
    ("qkv not 3C", lambda e: K.attention(e(2, 5, 190), 1), ValueError, r"^qkv: last dimension 190 must be 3 \* C"),
    ("head dim", lambda e: K.attention(e(2, 5, 3 * 48), 1), ValueError, r"^n_head: head_dim = C / n_head = 48"),
    ("n_head", lambda e: K.attention(e(2, 5, 192), 0), ValueError, r"^n_head: expected a positive int"),
    ("grid", lambda e: K.attention(e(65536, 1, 192), 1), ValueError, r"^qkv: B \* n_head = 65536 is more than"),
    ("qkv strided", lambda e: K.attention(e(5, 2, 192).transpose(0, 1), 1), ValueError,
     r"^qkv: expected a contiguous tensor"),
    ("logits dtype", lambda e: K.cross_entropy(e(2, 5, 65, dtype=torch.float16), e(2, 5, dtype=torch.long)), TypeError,
     r"^logits: expected dtype torch.float32"),
    ("targets dtype", lambda e: K.cross_entropy(e(2, 5, 65), e(2, 5)), TypeError,
     r"^targets: expected dtype torch.int64 or torch.int32, got torch.float32"),
    ("targets shape", lambda e: K.cross_entropy(e(2, 5, 65), e(10, dtype=torch.long)), ValueError,
     r"^targets: expected shape \(2, 5\), got \(10,\)"),
]


@pytest.mark.parametrize("call,exc,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_each_bad_input_names_the_argument(call, exc, message):
    """Under FakeTensorMode (what torch.compile traces with) the fake implementations run the same checks as
    the kernels' implementations: the error comes while tracing, before any GPU work."""
    with _fake_mode():
        with pytest.raises(exc, match=message):
            call(lambda *s, dtype=torch.float32: torch.empty(*s, dtype=dtype, device="cuda"))


@pytest.mark.parametrize("call", [
    lambda c: K.layernorm(c(4, 8), c(8), c(8)),
    lambda c: torch.ops.course.layernorm(c(4, 8), c(8), c(8), 1e-5),
    lambda c: K.residual_layernorm(c(4, 8), c(4, 8), None, c(8), c(8)),
    lambda c: K.bias_gelu(c(4, 8), c(8)),
    lambda c: K.attention(c(2, 5, 192), 1),
    lambda c: K.cross_entropy(c(2, 5, 65), torch.zeros(2, 5, dtype=torch.long)),
    lambda c: torch.ops.course.column_sum(c(4, 8)),
    lambda c: torch.ops.course.attention_backward(c(2, 5, 64), c(2, 5, 192), c(2, 5, 64), c(2, 1, 5), 1),
])
def test_a_cpu_tensor_is_refused_by_name(call):
    """Real CPU tensors reach the ops' implementations (registered for every device so that the check, not the
    dispatcher, answers), which refuse them before any GPU work; with requires_grad too (the autograd path)."""
    for grad in (False, True):
        c = lambda *s: torch.randn(*s, requires_grad=grad)  # noqa: E731
        with pytest.raises(TypeError, match=r"^(x|h|qkv|logits|a): expected a CUDA tensor, got one on cpu"):
            call(c)


def test_meta_tensors_are_checked_too():
    with pytest.raises(ValueError, match=r"^weight: expected shape \(8,\)"):
        K.layernorm(_meta(4, 8), _meta(9), _meta(8))


def test_cupy_stream_wraps_torchs_stream_handle_without_a_warning():
    """K.cupy_stream: CuPy's Stream on the same cudaStream_t (no CUDA call to make it), through the CUDA stream
    protocol where the torch stream speaks it and through a handle otherwise; never the deprecated ExternalStream."""
    import types
    import warnings
    pytest.importorskip("cupy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        old = types.SimpleNamespace(cuda_stream=0x1234)                     # a torch stream without the protocol
        new = types.SimpleNamespace(cuda_stream=0x5678, __cuda_stream__=lambda: (0, 0x5678))
        assert K.cupy_stream(old).ptr == 0x1234 and K.cupy_stream(new).ptr == 0x5678


# ============================================================================ CPU: the wiring, with reference kernels
class ReferenceKernels:
    """Lesson 4b's wrappers as the ops call them, computed by the float64 references (common.reference) on
    NumPy views of CPU tensors. Each call is first bound to the real wrapper's signature, so an argument the
    real one would not take fails here as it would on the GPU."""

    NAMES = ("layernorm_forward", "layernorm_backward", "column_sum", "gelu_bias_forward", "gelu_bias_backward",
             "attention_forward", "attention_backward", "classifier")

    def __init__(self):
        import inspect
        from common.reference import train_gpt2 as R
        self.R = R
        self.signatures = {name: inspect.signature(getattr(T, name)) for name in self.NAMES}   # the real ones

    def bind(self, name, a, k):
        bound = self.signatures[name].bind(*a, **k)
        bound.apply_defaults()
        return bound.arguments

    def layernorm_forward(self, *a, **k):
        p = self.bind("layernorm_forward", a, k)
        x = p["x"]
        assert x.ndim == 2 and p["out"].shape == x.shape and p["mean"].shape == p["rstd"].shape == x.shape[:1]
        r = x if p["y"] is None else x + p["y"] + (0 if p["ybias"] is None else p["ybias"])
        p["out"][...], p["mean"][...], p["rstd"][...] = self.R.layernorm_forward(r, p["weight"], p["bias"], p["eps"])
        if p["y"] is not None:
            p["resid"][...] = r

    def layernorm_backward(self, *a, **k):
        p = self.bind("layernorm_backward", a, k)
        assert p["dy"].ndim == 2 and p["dx"].shape == p["dy"].shape
        dx, p["dweight"][...], p["dbias"][...] = self.R.layernorm_backward(p["dy"], p["x"], p["weight"], p["mean"],
                                                                           p["rstd"])
        p["dx"][...] = dx + (p["dx"] if p["accumulate"] else 0)

    def column_sum(self, *a, **k):
        p = self.bind("column_sum", a, k)
        assert p["a"].ndim == 2 and not p["accumulate"]
        p["out"][...] = self.R.bias_grad(p["a"])

    def gelu_bias_forward(self, *a, **k):
        p = self.bind("gelu_bias_forward", a, k)
        assert p["h"].ndim == 2
        p["out"][...] = self.R.gelu_bias_forward(p["h"], p["bias"])[1]

    def gelu_bias_backward(self, *a, **k):
        p = self.bind("gelu_bias_backward", a, k)
        assert p["dout"].ndim == 2
        p["dpre"][...], p["dbias"][...] = self.R.gelu_bias_backward(p["dout"], p["h"] + p["bias"])

    def attention_forward(self, *a, **k):
        p = self.bind("attention_forward", a, k)
        assert p["bias"] is None
        zero = np.zeros(p["qkv"].shape[-1], np.float32)
        p["out"][...], p["lse"][...] = self.R.attention_forward(p["qkv"], zero, p["n_head"])
        return p["out"], p["lse"]

    def attention_backward(self, *a, **k):
        p = self.bind("attention_backward", a, k)
        assert p["bias"] is None and p["lse"].shape == (p["qkv"].shape[0], p["n_head"], p["qkv"].shape[1])
        zero = np.zeros(p["qkv"].shape[-1], np.float32)
        p["dqkv"][...] = self.R.attention_backward(p["dout"], p["qkv"], zero, p["n_head"])
        return p["dqkv"]

    def classifier(self, *a, **k):
        p = self.bind("classifier", a, k)
        assert p["targets"].dtype == np.int32 and p["scale"] is None
        losses, dlogits = self.R.classifier(p["logits"], p["targets"])
        p["losses"][...] = losses
        if p["grad"]:
            p["logits"][...] = dlogits           # in place, as the kernel does
        return p["losses"]


@pytest.fixture
def reference_kernels(monkeypatch):
    """The ops on CPU tensors: 4b's wrappers -> ReferenceKernels, CuPy views -> NumPy views (shared memory
    too), no stream to enter; the argument checks run as on meta tensors (the device check aside)."""
    import contextlib
    ref = ReferenceKernels()
    for name in ref.NAMES:
        monkeypatch.setattr(T, name, getattr(ref, name))
    monkeypatch.setattr(T, "default_attention_version", lambda: 2)
    monkeypatch.setattr(K, "_on_torch_stream", lambda device: contextlib.nullcontext())

    def numpy_view(t, rows=None):
        a = t.detach().numpy()
        return a if rows is None else a.reshape(rows, t.shape[-1])
    monkeypatch.setattr(K, "_cp", numpy_view)
    expect = K._expect

    def lenient(t, name, *a, **k):
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            t = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return expect(t, name, *a, **{**k, "fake": True, "device": None})
    monkeypatch.setattr(K, "_expect", lenient)


def cpu(*shape, seed=0, scale=1.0, grad=True):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).requires_grad_(grad)


def _cpu_against_float64(ours, ref, inputs, douts, names, rtol=1e-6):
    x64 = [t.detach().double().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) and t.is_floating_point()
           else t for t in inputs]
    o, r = ours(*inputs), ref(*x64)
    outs, refs = (list(o) if isinstance(o, tuple) else [o]), (list(r) if isinstance(r, tuple) else [r])
    for i, (a, b) in enumerate(zip(outs, refs)):
        assert_close(a.detach().double().numpy(), b.detach().numpy(), rtol=rtol, name=f"output {i}")
    leaves = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    g32 = torch.autograd.grad(outs, [inputs[i] for i in leaves], douts)
    g64 = torch.autograd.grad(refs, [x64[i] for i in leaves], [d.double() for d in douts])
    for i, a, b in zip(leaves, g32, g64):
        assert_close(a.double().numpy(), b.numpy(), rtol=10 * rtol, name=f"d{names[i]}")


@pytest.mark.parametrize("shape", [(45,), (37, 45), (3, 7, 64)])
def test_layernorm_wiring_on_the_cpu(reference_kernels, shape):
    C = shape[-1]
    _cpu_against_float64(K.layernorm, lambda x, w, b: F.layer_norm(x, (C,), w, b, 1e-5),
                         [cpu(*shape, seed=1), cpu(C, seed=2), cpu(C, seed=3)], [cpu(*shape, seed=4, grad=False)],
                         ["x", "weight", "bias"])


@pytest.mark.parametrize("with_ybias", [True, False])
def test_residual_layernorm_wiring_on_the_cpu(reference_kernels, with_ybias):
    """The gradient reaching resid directly and the one through the LayerNorm add up, for x, y and ybias."""
    shape, C = (3, 7, 64), 64
    ins = [cpu(*shape, seed=1), cpu(*shape, seed=2), cpu(C, seed=3) if with_ybias else None, cpu(C, seed=4),
           cpu(C, seed=5)]
    ref = ref_residual_layernorm if with_ybias else lambda x, y, _, w, b: ref_residual_layernorm(x, y, 0.0, w, b)
    _cpu_against_float64(K.residual_layernorm, ref, ins, [cpu(*shape, seed=6, grad=False),
                                                           cpu(*shape, seed=7, grad=False)],
                         ["x", "y", "ybias", "weight", "bias"])


def test_bias_gelu_attention_and_cross_entropy_wiring_on_the_cpu(reference_kernels):
    _cpu_against_float64(K.bias_gelu, lambda h, b: F.gelu(h + b, approximate="tanh"),
                         [cpu(5, 9, 37, seed=1, scale=2.0), cpu(37, seed=2)], [cpu(5, 9, 37, seed=3, grad=False)],
                         ["h", "bias"])
    _cpu_against_float64(lambda q: K.attention(q, 3), lambda q: ref_attention(q, 3), [cpu(2, 9, 3 * 96, seed=4)],
                         [cpu(2, 9, 96, seed=5, grad=False)], ["qkv"])
    V = 11
    targets = torch.randint(0, V, (4, 6), generator=torch.Generator().manual_seed(6))
    _cpu_against_float64(K.cross_entropy, lambda z, t: F.cross_entropy(z.reshape(-1, V), t.reshape(-1)),
                         [cpu(4, 6, V, seed=7, scale=3.0), targets], [torch.tensor(0.7)], ["logits", "targets"])
    logits = cpu(4, 6, V, seed=7, scale=3.0, grad=False)
    before = logits.clone()
    with torch.no_grad():
        loss = K.cross_entropy(logits, targets.int())
    assert torch.equal(logits, before)                   # the loss-only path leaves the logits alone
    assert abs(float(loss) - float(F.cross_entropy(before.reshape(-1, V), targets.reshape(-1)))) < 1e-5


def test_compiled_step_matches_eager_on_the_cpu(reference_kernels):
    """torch.compile (aot_eager: AOTAutograd's graphs, run op by op) through every op and its backward gives
    eager's loss and gradients."""
    import torch._dynamo
    args = [cpu(*a.shape, seed=i, scale=1.0 if i < 3 else 0.1) for i, a in enumerate(_tiny_args(_meta))]
    targets = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(9))
    torch._dynamo.reset()
    results = []
    for step in (_tiny_step, torch.compile(_tiny_step, backend="aot_eager", fullgraph=True)):
        loss = step(*args, targets)
        results.append([loss.detach(), *torch.autograd.grad(loss, args)])
    torch._dynamo.reset()
    for i, (a, b) in enumerate(zip(*results)):
        assert_close(a.double().numpy(), b.double().numpy(), rtol=1e-6, name=f"output {i}")


# ============================================================================ GPU helpers
@pytest.fixture
def tc():
    """torch with CUDA (TF32 off: common.torch_cuda), or a skip where torch has no CUDA."""
    from common import torch_cuda
    t = torch_cuda()
    if t is None:
        pytest.skip("this torch has no CUDA (a CPU build): the ops need torch on the GPU")
    return t


@pytest.fixture
def poisoned(monkeypatch):
    """Every output the ops allocate starts as NaN, so an element a kernel leaves unwritten shows."""
    monkeypatch.setattr(K, "_empty", lambda shape, device, dtype=torch.float32:
                        torch.full(tuple(shape), math.nan, dtype=dtype, device=device))


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def cuda(*shape, seed=0, scale=1.0, grad=False, misaligned=False):
    """Fresh random float32 on the GPU; misaligned: a contiguous view one float past a 16-byte boundary (the
    kernels' scalar path)."""
    n = math.prod(shape)
    base = torch.empty(n + 1, device="cuda")
    t = (base[1:] if misaligned else base[:n]).view(shape)
    with torch.no_grad():
        t.copy_(scale * torch.randn(shape, device="cuda", generator=_gen(seed)))
    if misaligned:
        assert t.data_ptr() % 16 != 0
    else:
        t = t.clone()
    return t.requires_grad_(grad)


def ids(*shape, V, seed=0, dtype=torch.long):
    return torch.randint(0, V, shape, device="cuda", generator=_gen(seed)).to(dtype)


def host(t):
    return t.detach().double().cpu().numpy()


def check(name, got, ref, rtol):
    """Relative-norm error <= rtol and max-abs error <= 10 rtol times the reference's largest value."""
    g, r = host(got), host(ref)
    assert_close(g, r, rtol=rtol, atol=10 * rtol * max(float(np.abs(r).max(initial=0.0)), 1e-30), name=name)
    return max_rel_error(g, r)


def against_float64(ours, ref, inputs, douts, rtol_fwd, rtol_bwd, names):
    """Run ours on the float32 inputs (as they are: a misaligned view stays one) and ref on float64 copies;
    compare the outputs, and the gradients of every input that requires grad for the output gradients douts."""
    x64 = [t.detach().double().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) and t.is_floating_point()
           else t for t in inputs]
    o, r = ours(*inputs), ref(*x64)
    outs, refs = (list(o) if isinstance(o, tuple) else [o]), (list(r) if isinstance(r, tuple) else [r])
    assert len(outs) == len(refs) == len(douts)
    for i, (a, b) in enumerate(zip(outs, refs)):
        check(f"output {i}", a, b, rtol_fwd)
    leaves = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    g32 = torch.autograd.grad(outs, [inputs[i] for i in leaves], douts)
    g64 = torch.autograd.grad(refs, [x64[i] for i in leaves], [d.double() for d in douts])
    for i, a, b in zip(leaves, g32, g64):
        check(f"d{names[i]}", a, b, rtol_bwd)


def ref_attention(qkv, n_head):
    B, Tn, C3 = qkv.shape
    C = C3 // 3
    q, k, v = (t.reshape(B, Tn, n_head, C // n_head).transpose(1, 2) for t in qkv.split(C, dim=2))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, Tn, C)


def ref_residual_layernorm(x, y, ybias, weight, bias, eps=1e-5):
    resid = x + y + ybias
    return resid, F.layer_norm(resid, (x.shape[-1],), weight, bias, eps)


# ============================================================================ GPU: opcheck
@gpu
def test_opcheck_every_op(tc):
    """torch.library.opcheck: the schema (no input written, outputs new), the fake implementation against the
    kernels (shapes, strides, dtypes), the autograd registration, and AOTAutograd with dynamic shapes."""
    cases = _opcheck_cases(lambda *s, grad=True: cuda(*s, seed=sum(s), grad=grad), ids)
    more = [   # awkward shapes: a 1-D row, C % 4 != 0 and misaligned (scalar kernels), T = 1, head_dim 64, int32 ids
        (torch.ops.course.layernorm, (cuda(45, grad=True), cuda(45, grad=True), cuda(45, grad=True), 1e-5)),
        (torch.ops.course.layernorm, (cuda(2, 7, 384, grad=True, misaligned=True), cuda(384, grad=True),
                                      cuda(384, grad=True), 1e-5)),
        (torch.ops.course.residual_layernorm, (cuda(130, 384, grad=True), cuda(130, 384, grad=True), None,
                                               cuda(384, grad=True), cuda(384, grad=True), 1e-5)),
        (torch.ops.course.bias_gelu, (cuda(2, 5, 1536, grad=True), cuda(1536, grad=True))),
        (torch.ops.course.attention, (cuda(1, 1, 192, grad=True), 1)),
        (torch.ops.course.attention, (cuda(1, 130, 3 * 384, grad=True), 6)),
        (torch.ops.course.cross_entropy, (cuda(2, 5, 65, grad=True), ids(2, 5, V=65, dtype=torch.int32))),
    ]
    for op, args in cases + more:
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


# ============================================================================ GPU: against float64 torch
@gpu
@pytest.mark.parametrize("shape,misaligned", [((1, 4), False), ((37, 45), False), ((3, 7, 384), False),
                                              ((3, 7, 384), True), ((9, 768), False), ((300, 1600), False), ((45,), False)])
def test_layernorm_matches_float64(tc, poisoned, shape, misaligned):
    C = shape[-1]
    x = cuda(*shape, seed=1, grad=True, misaligned=misaligned)
    w, b = cuda(C, seed=2, grad=True), cuda(C, seed=3, grad=True)
    against_float64(K.layernorm, lambda x, w, b: F.layer_norm(x, (C,), w, b, 1e-5), [x, w, b],
                    [cuda(*shape, seed=4)], 1e-5, 1e-4, ["x", "weight", "bias"])


@gpu
@pytest.mark.parametrize("shape", [(1, 4), (37, 45), (3, 7, 384), (300, 1600)])
@pytest.mark.parametrize("with_ybias", [True, False])
def test_residual_layernorm_matches_float64(tc, poisoned, shape, with_ybias):
    """Both outputs get a gradient (resid feeds the next residual add, out the next matmul)."""
    C = shape[-1]
    ins = [cuda(*shape, seed=1, grad=True), cuda(*shape, seed=2, grad=True),
           cuda(C, seed=3, grad=True) if with_ybias else None, cuda(C, seed=4, grad=True), cuda(C, seed=5, grad=True)]
    ref = (ref_residual_layernorm if with_ybias else
           lambda x, y, _, w, b: ref_residual_layernorm(x, y, 0.0, w, b))
    against_float64(K.residual_layernorm, ref, ins, [cuda(*shape, seed=6), cuda(*shape, seed=7)], 1e-5, 1e-4,
                    ["x", "y", "ybias", "weight", "bias"])


@gpu
@pytest.mark.parametrize("shape,misaligned", [((1, 1), False), ((300, 37), False), ((7, 132), False),
                                              ((2, 257, 1536), False), ((513, 1536), True)])
def test_bias_gelu_matches_float64(tc, poisoned, shape, misaligned):
    C = shape[-1]
    h, bias = cuda(*shape, seed=1, scale=2.0, grad=True, misaligned=misaligned), cuda(C, seed=2, grad=True)
    against_float64(K.bias_gelu, lambda h, b: F.gelu(h + b, approximate="tanh"), [h, bias], [cuda(*shape, seed=3)],
                    1e-5, 1e-4, ["h", "bias"])


@gpu
@pytest.mark.parametrize("B,Tn,H,D", [(1, 1, 1, 64), (3, 77, 1, 64), (1, 130, 3, 64), (2, 65, 2, 32),
                                      (2, 256, 6, 64), (1, 1031, 1, 32)])
def test_attention_matches_float64(tc, poisoned, B, Tn, H, D):
    """T = 1, and T not a multiple of the kernels' 64-row tiles; the default version for this GPU (3 on sm_80+)."""
    qkv = cuda(B, Tn, 3 * H * D, seed=Tn, grad=True)
    against_float64(lambda q: K.attention(q, H), lambda q: ref_attention(q, H), [qkv], [cuda(B, Tn, H * D, seed=2)],
                    1e-5, 1e-4, ["qkv"])
    out, lse = torch.ops.course.attention(qkv.detach(), H)                     # the saved log-sum-exp too
    q, k = (t.double().reshape(B, Tn, H, D).transpose(1, 2) for t in qkv.detach().split(H * D, dim=2)[:2])
    s = (q @ k.transpose(-1, -2)) / math.sqrt(D) + torch.full((Tn, Tn), -math.inf, device="cuda").triu(1).double()
    check("lse", lse, torch.logsumexp(s, dim=-1), 1e-5)


@gpu
@pytest.mark.parametrize("lead,V", [((1,), 3), ((37,), 65), ((4, 64), 65), ((2, 3), 50257)])
@pytest.mark.parametrize("tdtype", [torch.int64, torch.int32])
def test_cross_entropy_matches_float64(tc, poisoned, lead, V, tdtype):
    """The fused classifier's loss and gradient (scaled by the loss's incoming gradient, 0.7 here)."""
    logits, t = cuda(*lead, V, seed=1, scale=3.0, grad=True), ids(*lead, V=V, seed=2, dtype=tdtype)
    against_float64(K.cross_entropy, lambda z, t: F.cross_entropy(z.reshape(-1, V), t.reshape(-1).long()),
                    [logits, t], [torch.tensor(0.7, device="cuda")], 1e-5, 1e-4, ["logits", "targets"])
    with torch.no_grad():                       # evaluation: the loss-only op, the same loss
        assert torch.equal(K.cross_entropy(logits, t), torch.ops.course.cross_entropy(logits, t)[0])


@gpu
def test_a_target_out_of_range_gives_nan_not_a_bad_read(tc):
    logits, t = cuda(4, 10, seed=1), ids(4, V=10, seed=2)
    t[2] = 10
    loss, dlogits = torch.ops.course.cross_entropy(logits, t)
    assert torch.isnan(loss) and torch.isnan(dlogits[2]).all() and not torch.isnan(dlogits[[0, 1, 3]]).any()


@gpu
def test_column_sum_and_backward_ops_match_float64(tc, poisoned):
    a = cuda(513, 37, seed=1)
    check("column_sum", torch.ops.course.column_sum(a), a.double().sum(0), 1e-5)
    dout, h, bias = cuda(300, 37, seed=2), cuda(300, 37, seed=3), cuda(37, seed=4)
    dh, dbias = torch.ops.course.bias_gelu_backward(dout, h, bias)
    h64 = (h.double() + bias.double()).requires_grad_()
    (ref,) = torch.autograd.grad(F.gelu(h64, approximate="tanh"), h64, dout.double())
    check("dh", dh, ref, 1e-5)
    check("dbias", dbias, ref.sum(0), 1e-5)


# ============================================================================ GPU: streams, graphs, compile
def refuse(size):
    """A CuPy allocator that fails the test: where it is set, CuPy allocates only inside the ops (from torch)."""
    raise AssertionError(f"a CuPy allocation of {size} B outside the ops' allocator (torch's)")


def _ops_only(x, y, w, b, qkv, logits, targets):
    """Every forward op, no torch matmul: the same kernels on the same inputs give the same bits."""
    h = K.layernorm(x, w, b)
    resid, h2 = K.residual_layernorm(x, y, b, w, b)
    g = K.bias_gelu(h2, b)
    att = K.attention(qkv, 2)
    return (h * g).sum() + resid.sum() + att.sum() + K.cross_entropy(logits, targets)


def _ops_only_args():
    return [cuda(8, 33, 64, seed=1, grad=True), cuda(8, 33, 64, seed=2, grad=True), cuda(64, seed=3, grad=True),
            cuda(64, seed=4, grad=True), cuda(8, 33, 192, seed=5, grad=True), cuda(8, 33, 65, seed=6, grad=True),
            ids(8, 33, V=65, seed=7)]


@gpu
def test_kernels_launch_on_torchs_current_stream(tc, monkeypatch):
    """Under torch.cuda.stream(s) every kernel goes to s, forward and backward, with the same bits as on the
    default stream; and its scratch comes from torch, not from CuPy's memory pool."""
    import cupy as cp
    args = _ops_only_args()
    leaves = args[:6]
    loss = _ops_only(*args)
    want = [loss.detach(), *torch.autograd.grad(loss, leaves)]
    seen = []
    for name in ("layernorm_forward", "layernorm_backward", "column_sum", "gelu_bias_forward", "gelu_bias_backward",
                 "attention_forward", "attention_backward", "classifier"):
        def spy(*a, _real=getattr(T, name), _name=name, **k):
            seen.append((_name, cp.cuda.get_current_stream().ptr))
            return _real(*a, **k)
        monkeypatch.setattr(T, name, spy)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), cp.cuda.using_allocator(refuse):
        fresh = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]   # made on s, just before
        loss = _ops_only(*fresh)
        got = [loss.detach(), *torch.autograd.grad(loss, fresh[:6])]
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert {n for n, _ in seen} == {"layernorm_forward", "layernorm_backward", "column_sum", "gelu_bias_forward",
                                    "gelu_bias_backward", "attention_forward", "attention_backward", "classifier"}
    assert all(ptr == s.cuda_stream for _, ptr in seen), seen
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def _small_gpt_args():
    """_tiny_step's float arguments at a size of several tiles: B=4, T=70, C=128 (2 heads of 64); weights small
    enough that the attention's softmax is not one-hot."""
    shapes = [a.shape for a in _tiny_args(_meta, B=4, Tn=70, C=128)]
    return [cuda(*s, seed=i, scale=1.0 if i < 3 else 0.1, grad=True) for i, s in enumerate(shapes)]


@gpu
def test_a_torch_cuda_graph_captures_forward_and_backward(tc):
    """Capture one forward and backward (torch.cuda.graph), replay it on new inputs: the eager results. CuPy
    arrays made after the capture keep their contents through replays (the graph's scratch is torch's)."""
    import cupy as cp
    params = _small_gpt_args()
    static_x = params[0].detach().clone()
    targets = ids(4, 70, V=128, seed=9)

    def step():
        loss = _tiny_step(static_x.requires_grad_(), *params[1:], targets)
        return [loss.detach(), *torch.autograd.grad(loss, [static_x, *params[1:]])]

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                  # warm-up: kernels compiled, torch's allocator primed
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph, capture = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with cp.cuda.using_allocator(refuse), torch.cuda.graph(graph, stream=capture):
        static_out = step()
    with K.cupy_stream(capture):                # CuPy's pool keeps free blocks per stream: this one's
        junk = [cp.full(n, cp.nan, cp.float32) for n in (1 << 10, 1 << 16, 1 << 20)]
    for seed in (11, 12):
        new_x = cuda(*static_x.shape, seed=seed, scale=0.5)
        static_x.detach().copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        loss = _tiny_step(new_x.requires_grad_(), *params[1:], targets)
        want = [loss.detach(), *torch.autograd.grad(loss, [new_x, *params[1:]])]
        for i, (a, b) in enumerate(zip(static_out, want)):
            check(f"replayed output {i}", a, b, 1e-5)
    assert all(bool(cp.isnan(j).all()) for j in junk)


@gpu
def test_torch_compile_matches_eager(tc):
    """torch.compile (inductor) with fullgraph=True: no graph break on the ops, the eager loss and gradients."""
    import torch._dynamo
    args = _small_gpt_args() + [ids(4, 70, V=128, seed=9)]
    torch._dynamo.reset()
    compiled = torch.compile(_tiny_step, fullgraph=True)
    for step in (_tiny_step, compiled):
        loss = step(*args)
        got = [loss.detach(), *torch.autograd.grad(loss, args[:6])]
        if step is _tiny_step:
            want = got
    for i, (a, b) in enumerate(zip(got, want)):
        check(f"compiled output {i}", a, b, 1e-5)
    torch._dynamo.reset()


@gpu
def test_errors_on_gpu_tensors_come_before_any_launch(tc, monkeypatch):
    """Bad CUDA inputs (dtype, strides, another shape) raise the named error and launch nothing."""
    monkeypatch.setattr(T, "layernorm_forward", lambda *a, **k: pytest.fail("launched"))
    x, w = cuda(4, 8), cuda(8)
    with pytest.raises(TypeError, match=r"^x: expected dtype torch.float32"):
        K.layernorm(x.double(), w, w)
    with pytest.raises(ValueError, match=r"^x: expected a contiguous tensor"):
        K.layernorm(cuda(8, 4).T, w, w)
    with pytest.raises(ValueError, match=r"^bias: expected shape \(8,\)"):
        K.layernorm(x, w, cuda(9))


# ============================================================================ exercise 4d.1: the stub and the solution
def _exercise_sources():
    """(stub cell, check cell, solution) of exercise 4d.1: the notebook's cells and docs/torch_ops.md's listing."""
    import json
    import re
    from common.kernels import ROOT
    cells = ["".join(c["source"]) for c in json.loads(
        (ROOT / "step4_gpt2" / "torch_ops" / "04d_torch_ops.ipynb").read_text())["cells"] if c["cell_type"] == "code"]
    stub = next(c for c in cells if '@torch.library.custom_op("mine::bias_add"' in c)
    check_cell = next(c for c in cells if "def check_bias_add" in c)
    doc = (ROOT / "docs" / "torch_ops.md").read_text()
    solution = re.search(r"## Exercise 4d\.1: a solution.*?```python\n(.*?)```", doc, re.S).group(1)
    return stub, check_cell, solution


def test_exercise_sources_are_found_and_compile():
    for name, src in zip(("stub", "check", "solution"), _exercise_sources()):
        compile(src, name, "exec")


@gpu
def test_exercise_4d1_check_fails_the_stub_and_passes_the_solution(tc, capsys):
    """The notebook's check cell, run as the notebook runs it (its `rel` helper, torch from torch_cuda): FAIL on
    the stub as shipped, PASS on docs/torch_ops.md's solution."""
    stub, check_cell, solution = _exercise_sources()

    def rel(got, want):
        return max_rel_error(host(got), host(want))
    results = {}
    for name, src in (("stub", stub), ("solution", solution)):
        ns = {"torch": torch, "rel": rel}
        exec(compile(src, name, "exec"), ns)
        exec(compile(check_cell, "check", "exec"), ns)
        results[name] = (ns["ok"], capsys.readouterr().out)
    assert results["stub"][0] is False and "FAIL" in results["stub"][1], results["stub"]
    assert results["solution"][0] is True and "PASS" in results["solution"][1], results["solution"]
