"""Lesson 4b's fused kernels as PyTorch operators, from Python: torch.library.custom_op, no C++ extension.

    from step4_gpt2.torch_ops import ops as K
    y = K.layernorm(x, weight, bias)                             # x (..., C), like F.layer_norm
    resid, y = K.residual_layernorm(x, y0, ybias, weight, bias)  # resid = x + y0 + ybias; y = LayerNorm(resid)
    h = K.bias_gelu(pre, bias)                                   # gelu_tanh(pre + bias)
    out = K.attention(qkv, n_head)                               # causal, on the fused qkv (B, T, 3C)
    loss = K.cross_entropy(logits, targets)                      # the mean loss; dlogits in the same pass
    with K.cupy_stream(): ...                                    # CuPy launches on torch's current stream

Every tensor is float32, on the GPU and contiguous (targets: int64 or int32); anything else is a TypeError or
ValueError that names the argument, raised before any GPU work (the same checks run on FakeTensors, so
torch.compile reports them while tracing).

What makes a CuPy kernel a torch operator:
- memory: torch allocates every buffer, the outputs (torch.empty) and the kernels' scratch (the column sums'
  partial sums, the attention backward's row terms: CuPy's allocations go to torch's allocator inside a launch).
  CuPy works on views of torch's memory (DLPack: no copy). Inside a CUDA graph capture torch's allocator takes
  them from the graph's private pool, which the graph keeps for as long as it lives; memory from CuPy's own pool
  would go back to CuPy after the capture, and the next CuPy array could land where the graph still writes.
- streams: each kernel goes to torch's current stream (cupy_stream), so it is ordered after the
  torch work that made its inputs, and a stream capture sees it (a launch on another stream would not be in the
  graph, and would race the torch work around it).
- registration: custom_op gives each function a schema; register_fake its output shapes, all that torch.compile
  (which traces with FakeTensors: shapes, no memory) needs to trace through it; register_autograd its backward,
  which calls backward ops that are custom ops too, so torch.compile traces the backward pass whole as well.
"""
import contextlib
from typing import Optional

try:
    import torch
    import torch.utils.dlpack
except ImportError as e:        # the course runs without torch; this package is about torch
    raise ImportError("step4_gpt2.torch_ops needs PyTorch: docs/environment.md says which build to install") from e
from torch import Tensor

from common import require_gpu
from step4_gpt2.train import ops as T

HEAD_DIMS = T.HEAD_DIMS
MAX_GRID_Y = 65535                    # the attention kernels' grid: (query tiles, B * n_head)
TARGET_DTYPES = (torch.int64, torch.int32)


# ---------------------------------------------------------------------------------------- argument checks
def _expect(t, name: str, shape=None, ndim=None, dtype=torch.float32, device=None, fake: bool = False):
    """Check one tensor argument like common.expect_array: a TypeError or ValueError that starts with its name.
    shape may hold None for a free dimension; device: the device the other arguments are on. fake: also take
    "meta" tensors (shape-only tracing, where the fake implementations run as the meta kernels)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__module__}.{type(t).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.device.type != "cuda" and not (fake and t.device.type == "meta"):
        raise TypeError(f"{name}: expected a CUDA tensor, got one on {t.device} (move it with .cuda())")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}, but the other arguments are on {device}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if shape is not None and (len(shape) != t.dim() or any(s is not None and s != d for s, d in zip(shape, t.shape))):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
        raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (got strides {t.stride()}); use {name}.contiguous()")
    return t


def _rows(x, name: str, fake: bool) -> int:
    """C of an (..., C) float32 input, the row length the kernels normalise or add a bias along."""
    _expect(x, name, fake=fake)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"{name}: expected shape (..., C) with C >= 1, got {tuple(x.shape)}")
    return x.shape[-1]


def _eps(eps):
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps: expected a positive number, got {eps!r}")


def _check_layernorm(x, weight, bias, eps, fake=False):
    C = _rows(x, "x", fake)
    _expect(weight, "weight", shape=(C,), device=x.device, fake=fake)
    _expect(bias, "bias", shape=(C,), device=x.device, fake=fake)
    _eps(eps)


def _check_residual_layernorm(x, y, ybias, weight, bias, eps, fake=False):
    _check_layernorm(x, weight, bias, eps, fake)
    _expect(y, "y", shape=tuple(x.shape), device=x.device, fake=fake)
    if ybias is not None:
        _expect(ybias, "ybias", shape=(x.shape[-1],), device=x.device, fake=fake)


def _check_bias_gelu(h, bias, fake=False):
    _expect(bias, "bias", shape=(_rows(h, "h", fake),), device=h.device, fake=fake)


def _check_attention(qkv, n_head, fake=False):
    """(B, T, C, D) of a fused qkv (B, T, 3C) with n_head heads of D = C / n_head."""
    _expect(qkv, "qkv", ndim=3, fake=fake)
    B, Tn, C3 = qkv.shape
    if isinstance(n_head, bool) or not isinstance(n_head, (int, torch.SymInt)) or n_head < 1:
        raise ValueError(f"n_head: expected a positive int, got {n_head!r}")
    if C3 % 3 or (C3 // 3) % n_head:
        raise ValueError(f"qkv: last dimension {C3} must be 3 * C with C a multiple of n_head={n_head}")
    C = C3 // 3
    if C // n_head not in HEAD_DIMS:
        raise ValueError(f"n_head: head_dim = C / n_head = {C // n_head}; the attention kernels support {HEAD_DIMS}")
    if B * n_head > MAX_GRID_Y:     # one block row per (sequence, head)
        raise ValueError(f"qkv: B * n_head = {B * n_head} is more than a grid's {MAX_GRID_Y} (gridDim.y); "
                         f"split the batch")
    return B, Tn, C, C // n_head


def _check_cross_entropy(logits, targets, fake=False):
    _rows(logits, "logits", fake)
    _expect(targets, "targets", shape=tuple(logits.shape[:-1]), dtype=TARGET_DTYPES, device=logits.device, fake=fake)


# ---------------------------------------------------------------------------------------- torch memory, torch's stream
def _empty(shape, device, dtype=torch.float32) -> Tensor:
    """Every output: torch's allocator owns it (a test replaces this to poison outputs)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _torch_memory(device):
    """A CuPy allocator that takes each block from torch's caching allocator (on torch's current stream)."""
    import cupy as cp

    def malloc(size: int):
        block = torch.empty(size, dtype=torch.uint8, device=device)
        # the CuPy pointer keeps `block` alive; when CuPy drops it, the block goes back to torch
        return cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(block.data_ptr(), size, block, device.index), 0)
    return malloc


class _StreamHandle:
    """The CUDA stream protocol (__cuda_stream__) for a torch stream of a torch that does not speak it yet."""

    def __init__(self, stream):
        self.stream = stream

    def __cuda_stream__(self):
        return (0, self.stream.cuda_stream)


def cupy_stream(stream=None):
    """CuPy's handle of a torch stream (default: torch's current one), for `with`: the same cudaStream_t, no new
    stream. cupy.cuda.Stream.from_external reads it through the CUDA stream protocol; it never destroys it.
    (cupy.cuda.ExternalStream(stream.cuda_stream) does the same, with a DeprecationWarning since CuPy 14.)"""
    import cupy as cp
    stream = torch.cuda.current_stream() if stream is None else stream
    return cp.cuda.Stream.from_external(stream if hasattr(stream, "__cuda_stream__") else _StreamHandle(stream))


@contextlib.contextmanager
def _on_torch_stream(device):
    """Inside: CuPy launches on torch's current stream of `device` and allocates from torch (the docstring says why)."""
    import cupy as cp
    require_gpu()
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        with cp.cuda.Device(device.index), cupy_stream(stream), cp.cuda.using_allocator(_torch_memory(device)):
            yield


def _cp(t: Tensor, rows: int | None = None):
    """A CuPy view of t's memory (DLPack, no copy); rows: as (rows, -1), the 2-D shape lesson 4b's wrappers take.
    to_dlpack hands over the bare capsule: `cupy.from_dlpack(t)` would first ask torch to order its stream
    before CuPy's (an event per tensor), and here both are the same stream."""
    import cupy as cp
    a = cp.from_dlpack(torch.utils.dlpack.to_dlpack(t.detach()))
    return a if rows is None else a.reshape(rows, t.shape[-1])


def _n(x: Tensor) -> int:
    """Rows of an (..., C) tensor."""
    return x.numel() // x.shape[-1]


# ---------------------------------------------------------------------------------------- LayerNorm
@torch.library.custom_op("course::layernorm", mutates_args=())
def _layernorm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(out, mean, rstd): LayerNorm over the last dimension, saving each row's mean and 1/std for the backward."""
    _check_layernorm(x, weight, bias, eps)
    out, mean, rstd = _empty(x.shape, x.device), _empty(x.shape[:-1], x.device), _empty(x.shape[:-1], x.device)
    N = _n(x)
    with _on_torch_stream(x.device):
        T.layernorm_forward(_cp(x, N), _cp(weight), _cp(bias), eps, out=_cp(out, N), mean=_cp(mean).reshape(N),
                            rstd=_cp(rstd).reshape(N))
    return out, mean, rstd


@_layernorm.register_fake
def _(x, weight, bias, eps):
    _check_layernorm(x, weight, bias, eps, fake=True)
    return torch.empty_like(x), x.new_empty(x.shape[:-1]), x.new_empty(x.shape[:-1])


@torch.library.custom_op("course::residual_layernorm", mutates_args=())
def _residual_layernorm(x: Tensor, y: Tensor, ybias: Optional[Tensor], weight: Tensor, bias: Tensor,
                        eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(resid, out, mean, rstd): the residual add (resid = x + y + ybias, the bias of the matmul that made y)
    and the LayerNorm of its result, in one pass over the row."""
    _check_residual_layernorm(x, y, ybias, weight, bias, eps)
    resid, out = _empty(x.shape, x.device), _empty(x.shape, x.device)
    mean, rstd = _empty(x.shape[:-1], x.device), _empty(x.shape[:-1], x.device)
    N = _n(x)
    with _on_torch_stream(x.device):
        T.layernorm_forward(_cp(x, N), _cp(weight), _cp(bias), eps, y=_cp(y, N),
                            ybias=None if ybias is None else _cp(ybias), resid=_cp(resid, N), out=_cp(out, N),
                            mean=_cp(mean).reshape(N), rstd=_cp(rstd).reshape(N))
    return resid, out, mean, rstd


@_residual_layernorm.register_fake
def _(x, y, ybias, weight, bias, eps):
    _check_residual_layernorm(x, y, ybias, weight, bias, eps, fake=True)
    return torch.empty_like(x), torch.empty_like(x), x.new_empty(x.shape[:-1]), x.new_empty(x.shape[:-1])


@torch.library.custom_op("course::layernorm_backward", mutates_args=())
def _layernorm_backward(dout: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor,
                        dresid: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias) of LayerNorm from the saved mean and rstd. dresid: the gradient that reaches the
    residual stream directly (the residual_layernorm's resid output), added into dx by the same kernel."""
    C = _rows(x, "x", False)
    for name, t in (("dout", dout), ("dresid", dresid)):
        if t is not None:
            _expect(t, name, shape=tuple(x.shape), device=x.device)
    _expect(weight, "weight", shape=(C,), device=x.device)
    for name, t in (("mean", mean), ("rstd", rstd)):
        _expect(t, name, shape=tuple(x.shape[:-1]), device=x.device)
    dx = _empty(x.shape, x.device) if dresid is None else dresid.clone()   # the kernel adds into it: a copy
    dweight, dbias = _empty((C,), x.device), _empty((C,), x.device)
    N = _n(x)
    with _on_torch_stream(x.device):
        T.layernorm_backward(_cp(dout, N), _cp(x, N), _cp(weight), _cp(mean).reshape(N), _cp(rstd).reshape(N),
                             dx=_cp(dx, N), dweight=_cp(dweight), dbias=_cp(dbias), accumulate=dresid is not None)
    return dx, dweight, dbias


@_layernorm_backward.register_fake
def _(dout, x, weight, mean, rstd, dresid):
    C = _rows(x, "x", True)
    return torch.empty_like(x), x.new_empty((C,)), x.new_empty((C,))


@torch.library.custom_op("course::column_sum", mutates_args=())
def _column_sum(a: Tensor) -> Tensor:
    """The sums over every row of an (..., C) tensor: a bias's gradient (a fixed order of additions)."""
    C = _rows(a, "a", False)
    out = _empty((C,), a.device)
    with _on_torch_stream(a.device):
        T.column_sum(_cp(a, _n(a)), out=_cp(out))
    return out


@_column_sum.register_fake
def _(a):
    return a.new_empty((_rows(a, "a", True),))


def _layernorm_setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    out, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.mark_non_differentiable(mean, rstd)


def _layernorm_grad(ctx, dout, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = torch.ops.course.layernorm_backward(dout.contiguous(), x, weight, mean, rstd, None)
    return dx, dweight, dbias, None


_layernorm.register_autograd(_layernorm_grad, setup_context=_layernorm_setup)


def _residual_layernorm_setup(ctx, inputs, output):
    x, y, ybias, weight, bias, eps = inputs
    resid, out, mean, rstd = output
    ctx.save_for_backward(resid, weight, mean, rstd)        # LayerNorm's input is resid: x and y are not kept
    ctx.has_ybias = ybias is not None
    ctx.mark_non_differentiable(mean, rstd)


def _residual_layernorm_grad(ctx, dresid, dout, _dmean, _drstd):
    resid, weight, mean, rstd = ctx.saved_tensors
    # d resid = what reaches resid directly + what comes back through the LayerNorm; x, y and ybias each get it
    dx, dweight, dbias = torch.ops.course.layernorm_backward(dout.contiguous(), resid, weight, mean, rstd,
                                                             None if dresid is None else dresid.contiguous())
    dybias = torch.ops.course.column_sum(dx) if ctx.has_ybias and ctx.needs_input_grad[2] else None
    return dx, dx, dybias, dweight, dbias, None


_residual_layernorm.register_autograd(_residual_layernorm_grad, setup_context=_residual_layernorm_setup)


# ---------------------------------------------------------------------------------------- bias + GELU
@torch.library.custom_op("course::bias_gelu", mutates_args=())
def _bias_gelu(h: Tensor, bias: Tensor) -> Tensor:
    """gelu_tanh(h + bias) in one pass; the backward recomputes h + bias rather than storing it."""
    _check_bias_gelu(h, bias)
    out = _empty(h.shape, h.device)
    N = _n(h)
    with _on_torch_stream(h.device):
        T.gelu_bias_forward(_cp(h, N), _cp(bias), out=_cp(out, N))
    return out


@_bias_gelu.register_fake
def _(h, bias):
    _check_bias_gelu(h, bias, fake=True)
    return torch.empty_like(h)


@torch.library.custom_op("course::bias_gelu_backward", mutates_args=())
def _bias_gelu_backward(dout: Tensor, h: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """(dh, dbias): dh = dout * gelu'(h + bias), and dbias its column sums, from the same read of dout."""
    _check_bias_gelu(h, bias)
    _expect(dout, "dout", shape=tuple(h.shape), device=h.device)
    dh, dbias = _empty(h.shape, h.device), _empty(bias.shape, h.device)
    N = _n(h)
    with _on_torch_stream(h.device):
        T.gelu_bias_backward(_cp(dout, N), _cp(h, N), _cp(bias), dpre=_cp(dh, N), dbias=_cp(dbias))
    return dh, dbias


@_bias_gelu_backward.register_fake
def _(dout, h, bias):
    return torch.empty_like(h), torch.empty_like(bias)


def _bias_gelu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)                          # h and bias: the backward's gelu' needs h + bias


def _bias_gelu_grad(ctx, dout):
    h, bias = ctx.saved_tensors
    return torch.ops.course.bias_gelu_backward(dout.contiguous(), h, bias)


_bias_gelu.register_autograd(_bias_gelu_grad, setup_context=_bias_gelu_setup)


# ---------------------------------------------------------------------------------------- causal attention
@torch.library.custom_op("course::attention", mutates_args=())
def _attention(qkv: Tensor, n_head: int) -> tuple[Tensor, Tensor]:
    """(out (B, T, C), lse (B, n_head, T)): causal flash attention on the fused qkv (B, T, 3C), saving each
    query row's log-sum-exp, from which the backward recomputes the probabilities tile by tile."""
    B, Tn, C, D = _check_attention(qkv, n_head)
    out, lse = _empty((B, Tn, C), qkv.device), _empty((B, n_head, Tn), qkv.device)
    with _on_torch_stream(qkv.device):
        version = T.default_attention_version()
        if version == 3 and Tn > T.V3_MAX_T:        # said now, not at the backward pass
            raise ValueError(f"qkv: T = {Tn} is longer than the tensor-core attention takes ({T.V3_MAX_T})")
        T.attention_forward(_cp(qkv), None, n_head, out=_cp(out), lse=_cp(lse), version=version)
    return out, lse


@_attention.register_fake
def _(qkv, n_head):
    B, Tn, C, D = _check_attention(qkv, n_head, fake=True)
    return qkv.new_empty((B, Tn, C)), qkv.new_empty((B, n_head, Tn))


@torch.library.custom_op("course::attention_backward", mutates_args=())
def _attention_backward(dout: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, n_head: int) -> Tensor:
    """dqkv (B, T, 3C) from dout and the forward's out and lse."""
    B, Tn, C, D = _check_attention(qkv, n_head)
    for name, t, shape in (("dout", dout, (B, Tn, C)), ("out", out, (B, Tn, C)), ("lse", lse, (B, n_head, Tn))):
        _expect(t, name, shape=shape, device=qkv.device)
    dqkv = _empty(qkv.shape, qkv.device)
    with _on_torch_stream(qkv.device):
        T.attention_backward(_cp(dout), _cp(qkv), None, _cp(out), _cp(lse), n_head, dqkv=_cp(dqkv))
    return dqkv


@_attention_backward.register_fake
def _(dout, qkv, out, lse, n_head):
    return torch.empty_like(qkv)


def _attention_setup(ctx, inputs, output):
    qkv, n_head = inputs
    out, lse = output
    ctx.save_for_backward(qkv, out, lse)
    ctx.n_head = n_head
    ctx.mark_non_differentiable(lse)


def _attention_grad(ctx, dout, _dlse):
    qkv, out, lse = ctx.saved_tensors
    return torch.ops.course.attention_backward(dout.contiguous(), qkv, out, lse, ctx.n_head), None


_attention.register_autograd(_attention_grad, setup_context=_attention_setup)


# ---------------------------------------------------------------------------------------- the fused classifier
def _classifier(logits: Tensor, targets: Tensor, grad: bool):
    """(mean loss, dlogits or None) through step 3's fused classifier: one block per row finds the softmax's
    max and sum in one online pass, writes the row's loss and, with grad, (softmax - onehot) / N over a copy of
    the logits (the op may not overwrite its input). A target outside [0, V) makes its row's loss NaN; the
    kernel never reads outside the row (there is no ignore_index)."""
    _check_cross_entropy(logits, targets)
    N = _n(logits)
    losses = _empty((N,), logits.device)
    dlogits = logits.clone() if grad else None
    t32 = targets.reshape(N).to(torch.int32)        # the kernel's ids are int32 (a copy for int64 targets)
    with _on_torch_stream(logits.device):
        T.classifier(_cp(logits if dlogits is None else dlogits, N), _cp(t32), losses=_cp(losses), grad=grad)
    return losses.mean(), dlogits


@torch.library.custom_op("course::cross_entropy", mutates_args=())
def _cross_entropy(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """(loss, dlogits): the mean cross-entropy and its gradient, from one pass over the logits (the backward
    only scales dlogits by the loss's incoming gradient)."""
    return _classifier(logits, targets, grad=True)


@_cross_entropy.register_fake
def _(logits, targets):
    _check_cross_entropy(logits, targets, fake=True)
    return logits.new_empty(()), torch.empty_like(logits)


@torch.library.custom_op("course::cross_entropy_loss", mutates_args=())
def _cross_entropy_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """The mean cross-entropy alone (evaluation: no dlogits written)."""
    return _classifier(logits, targets, grad=False)[0]


@_cross_entropy_loss.register_fake
def _(logits, targets):
    _check_cross_entropy(logits, targets, fake=True)
    return logits.new_empty(())


def _cross_entropy_setup(ctx, inputs, output):
    loss, dlogits = output
    ctx.save_for_backward(dlogits)
    ctx.mark_non_differentiable(dlogits)


def _cross_entropy_grad(ctx, dloss, _ddlogits):
    (dlogits,) = ctx.saved_tensors
    return dlogits * dloss, None


_cross_entropy.register_autograd(_cross_entropy_grad, setup_context=_cross_entropy_setup)


def _cross_entropy_loss_grad(ctx, dloss):
    raise RuntimeError("course::cross_entropy_loss has no dlogits: K.cross_entropy picks course::cross_entropy "
                       "when the logits require grad")


_cross_entropy_loss.register_autograd(_cross_entropy_loss_grad)


# ---------------------------------------------------------------------------------------- the functions to call
def layernorm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dimension of x (..., C): F.layer_norm(x, (C,), weight, bias, eps)."""
    return torch.ops.course.layernorm(x, weight, bias, eps)[0]


def residual_layernorm(x: Tensor, y: Tensor, ybias: Optional[Tensor], weight: Tensor, bias: Tensor,
                       eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """(resid, out): resid = x + y + ybias (the residual stream after a block's matmul y, ybias its bias),
    out = LayerNorm(resid), from one read of x and y."""
    resid, out, _, _ = torch.ops.course.residual_layernorm(x, y, ybias, weight, bias, eps)
    return resid, out


def bias_gelu(h: Tensor, bias: Tensor) -> Tensor:
    """F.gelu(h + bias, approximate="tanh") for h (..., C), bias (C,), in one pass."""
    return torch.ops.course.bias_gelu(h, bias)


def attention(qkv: Tensor, n_head: int) -> Tensor:
    """Causal self-attention on the fused qkv (B, T, 3C) = [q | k | v] (c_attn's output, heads side by side in
    each third) -> (B, T, C), heads merged: what c_proj takes. The T x T scores never leave the chip."""
    return torch.ops.course.attention(qkv, n_head)[0]


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """F.cross_entropy over the last dimension of logits (..., V), targets (...) in [0, V): the mean loss, 0-d.
    Where autograd will need dlogits, the same pass makes them (course::cross_entropy); else only the loss."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return torch.ops.course.cross_entropy(logits, targets)[0]
    return torch.ops.course.cross_entropy_loss(logits, targets)


OPS = (torch.ops.course.layernorm, torch.ops.course.residual_layernorm, torch.ops.course.layernorm_backward,
       torch.ops.course.column_sum, torch.ops.course.bias_gelu, torch.ops.course.bias_gelu_backward,
       torch.ops.course.attention, torch.ops.course.attention_backward, torch.ops.course.cross_entropy,
       torch.ops.course.cross_entropy_loss)
