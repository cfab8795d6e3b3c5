"""Step 4b in bf16: mixed-precision training, and activation recomputation.

    model = MixedGPT(shakespeare_char(65))                    # precision="bf16": the GEMMs and attention in bf16
    trainer = Trainer(model, TrainConfig(batch_size=64), graph=True)    # the same trainer, AdamW and graph
    model = MixedGPT(cfg, recompute=True)                     # recompute LayerNorm and GELU outputs in the backward
    activation_bytes(cfg, B, T, recompute=True)               # what one batch shape keeps, exactly

What changes against model.py's fp32 TrainGPT, and what does not:
  * The parameters stay fp32 (the master weights, in the flat buffer AdamW updates); every forward first makes
    their bf16 copy: the LM head's padded copy of wte (head16, padded_vocab), and one cast over the rest of the
    flat buffer (ops_bf16.to_bf16; wte comes first in it, and its bf16 rows are head16's).
  * Every GEMM multiplies bf16 on the tensor cores and accumulates in fp32 (cuBLAS, ops_bf16.gemm_bf16); the
    attention forward and backward run on bf16 tensor cores (attention_bf16.cu, sm_80+). The activations a GEMM
    reads are stored in bf16 (LayerNorm outputs, qkv, the attention output, the GELU output): half the bytes.
  * LayerNorm, GELU, the softmax of the loss and their backward passes compute in fp32 (the residual stream and
    the gradients they read stay fp32; the gradients only a GEMM reads, dlogits, the attention's dO and the GELU's
    input gradient, are written in bf16 alone); weight gradients land in fp32 in the same flat grads buffer, so
    the gradient norm, clipping and AdamW are unchanged. Two inputs of theirs are bf16, as a GEMM wrote them (as
    torch.autocast's GEMMs write theirs), widened as read: the logits (the step's largest tensor, with its
    gradient), from which evaluation's losses and forward(idx)'s logits come too, and the MLP's pre-activation
    (the c_fc GEMM's output; its bias is added in fp32 by the GELU and the GELU backward).
  * Where an fp32 kernel's output goes to a GEMM, that kernel writes the bf16 copy itself (ops.py's out16, dpre16,
    dx16, ops_bf16.attention_backward_bf16's dqkv16), rounded as ops_bf16.to_bf16 rounds: no cast kernel reads
    the fp32 value back, and the bits are the same. The LayerNorm outputs and the GELU's input gradient exist
    only in bf16; the residual stream's gradient and dqkv are written in both, the fp32 values for the bias sums
    and the LayerNorm backward that adds into dres. Still cast after they are written: the weights (to_bf16). The
    qkv GEMM writes bf16 and its bias is added in place (bias_bf16): q, k, v are rounded twice, bf16(bf16(x W) + b),
    where torch.autocast rounds once after adding its bias.

No loss scaling. fp16 training multiplies the loss by a large factor (and divides the gradients back) because
fp16 has 5 exponent bits: gradients below about 6e-8 flush to zero. bf16 has fp32's 8 exponent bits, the same
range (down to about 1e-38), and only gives up mantissa bits; a small gradient loses precision, never its
value. So nothing here is scaled, and no step is skipped for an overflow.

Recomputation (recompute=True): the backward pass makes the LayerNorm outputs (ln_1, ln_2: from the stored
residual streams, with the forward's own kernels, so the same bits) and the GELU output (from the stored
pre-activation) again right where it needs them, instead of keeping them for every layer: 12 C bytes per token
and layer fewer, for one more LayerNorm pair and GELU per layer in the backward. activation_bytes counts both ways.
"""
from __future__ import annotations

import contextlib

import numpy as np

from common import expect_choice, require_gpu
from step2_attention.flash import bf16_to_float32
from step4_gpt2.train import ops
from step4_gpt2.train import ops_bf16 as bf
from step4_gpt2.train.model import TrainGPT
from step4_gpt2.weights import GPTConfig

PRECISIONS = ("bf16",)        # TrainGPT is the fp32 model; MixedGPT adds bf16 (make_model picks)
F32, BF16 = np.float32, np.uint16
BF16_NEG_INF = 0xFF80         # -inf's bf16 bits (the pad logits)
VOCAB_ALIGN = 64              # the logits' rows are padded to a multiple of this many columns (padded_vocab)


def padded_vocab(V: int) -> int:
    """V rounded up to VOCAB_ALIGN: the LM head's forward and input-gradient GEMMs run over this many vocabulary
    rows (dwte's too, into a padded fp32 buffer, dhead, whose first V rows are copied out). cuBLAS's
    fast tensor-core kernels read and write 16 bytes at a time along a matrix's contiguous dimension, which must
    then be a multiple of 8 bf16 values; GPT-2's V = 50257 is odd, and the unpadded logits GEMMs ran on a
    fallback kernel several times slower. So MixedGPT keeps a bf16 copy of wte with zero rows past V (head16),
    the logits and dlogits rows are padded_vocab(V) long, and the classifier sees -inf in the pad columns
    (softmax weight exactly 0, gradient 0). llm.c pads GPT-2's vocabulary to 50304 for the same reason."""
    return -(-V // VOCAB_ALIGN) * VOCAB_ALIGN


def _buffers(cfg: GPTConfig, B: int, T: int, recompute: bool) -> dict:
    """{name: (count, shape, dtype)}: every buffer _MixedActivations allocates for one (B, T), a list of `count`
    arrays (the per-layer ones: count = n_layer, or n_layer + 1), or one array for count 0. activation_bytes
    sums the same table, so it is exact."""
    N, C, L, H, V = B * T, cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.vocab_size
    kept = 0 if recompute else L          # per layer without recomputation; one shared buffer with it
    return {
        "resid": (L + 1, (N, C), F32), "resid2": (L, (N, C), F32),            # the residual stream, fp32
        "m1": (L + 1, (N,), F32), "r1": (L + 1, (N,), F32), "m2": (L, (N,), F32), "r2": (L, (N,), F32),
        "ln1": (kept, (N, C), BF16), "ln2": (kept, (N, C), BF16),            # what the GEMMs read: bf16
        "qkv": (L, (B, T, 3 * C), BF16), "atty": (L, (B, T, C), BF16), "lse": (L, (B, H, T), F32),
        "pre": (L, (N, 4 * C), BF16),                                         # GELU's input, before its bias
        "h": (kept, (N, 4 * C), BF16),
        "lnf": (0, (N, C), BF16),
        "tmp": (0, (N, C), F32),
        "dres": (0, (N, C), F32), "dln": (0, (N, C), F32), "dh": (0, (N, 4 * C), F32),
        "dres16m": (0, (N, C), BF16), "dres16a": (0, (N, C), BF16), "dh16": (0, (N, 4 * C), BF16),   # for the GEMMs
        "dqkv16": (0, (N, 3 * C), BF16),
        "datty": (0, (B, T, C), BF16), "dqkv": (0, (B, T, 3 * C), F32),
        "delta": (0, (B, H, T), F32), "logits": (0, (N, padded_vocab(V)), BF16),
        "dlogits": (0, (N, padded_vocab(V)), BF16),
        "losses": (0, (N,), F32), "mt": (0, (N,), F32), "rt": (0, (N,), F32),    # recomputation's mean, rstd
    }


def activation_bytes(cfg: GPTConfig, B: int, T: int | None = None, recompute: bool = False) -> int:
    """The bytes a MixedGPT keeps for one batch shape (B, T) (default T: block_size), exactly what it allocates
    (_buffers). recompute=True drops ln_1, ln_2 and the GELU output of every layer (12 C bytes per token and
    layer) and keeps one shared buffer of each for the backward."""
    T = cfg.block_size if T is None else T
    if isinstance(B, bool) or int(B) != B or B < 1 or int(T) != T or T < 1:
        raise ValueError(f"B, T: expected positive integers, got B={B!r}, T={T!r}")
    total = 0
    for count, shape, dtype in _buffers(cfg, int(B), int(T), recompute).values():
        total += max(1, count) * int(np.prod(shape)) * np.dtype(dtype).itemsize
    return total


class _MixedActivations:
    """The buffers of _buffers, as attributes (lists for the per-layer ones). With recompute, ln1, ln2 and h are
    the one shared buffer each, repeated for every layer index (the backward refills it before each use)."""

    def __init__(self, cfg: GPTConfig, B: int, T: int, recompute: bool):
        import cupy as cp
        self.B, self.T, self.N = B, T, B * T
        L = cfg.n_layer
        for name, (count, shape, dtype) in _buffers(cfg, B, T, recompute).items():
            if count:
                setattr(self, name, [cp.empty(shape, dtype) for _ in range(count)])
            elif name in ("ln1", "ln2", "h"):
                setattr(self, name, [cp.empty(shape, dtype)] * L)
            else:
                setattr(self, name, cp.empty(shape, dtype))
        self.idx = None


class MixedGPT(TrainGPT):
    """TrainGPT with bf16 GEMMs and attention (fp32 master weights, fp32 LayerNorm, GELU and loss), and
    optionally activation recomputation. The same params / grads / flat / gflat, so Trainer, AdamW, clipping,
    checkpoints and to_gpt() work unchanged. Needs sm_80 (bf16 tensor cores): a clear error before."""

    def __init__(self, config: GPTConfig, params: dict | None = None, seed: int = 0, precision: str = "bf16",
                 recompute: bool = False):
        import cupy as cp
        require_gpu()
        expect_choice(precision, "precision", PRECISIONS)
        bf.require_bf16()
        if config.head_dim not in bf.HEAD_DIMS:
            raise ValueError(f"config: head_dim = n_embd / n_head = {config.head_dim}; attention_bf16.cu "
                             f"supports {bf.HEAD_DIMS}")
        super().__init__(config, params, seed)
        self.precision, self.recompute = precision, bool(recompute)
        V, C = config.vocab_size, config.n_embd                   # the LM head's: wte's rows, then zeros
        self.head16 = cp.zeros((padded_vocab(V), C), cp.uint16)
        self.dhead = cp.empty((padded_vocab(V), C), cp.float32)   # dwte's GEMM output over the padded rows
        names = list(self.shapes)
        if names[0] != "wte.weight":
            raise RuntimeError("MixedGPT: expected wte first in the flat buffer (weights.expected_shapes' order)")
        self.flat16 = cp.empty(self.flat.size - V * C, cp.uint16)   # the rest's bf16 copy, remade every forward
        self.params16, off = {"wte.weight": self.head16[:V]}, 0     # wte's bf16 copy is the LM head's, once
        for k in names[1:]:
            n = int(np.prod(self.shapes[k]))
            self.params16[k] = self.flat16[off:off + n].reshape(self.shapes[k])
            off += n

    def _activations(self, B: int, T: int) -> _MixedActivations:
        if (B, T) not in self._acts:
            if len(self._acts) >= 2:
                self._acts.pop(next(iter(self._acts)))
            self._acts[(B, T)] = _MixedActivations(self.config, B, T, self.recompute)
        return self._acts[(B, T)]

    def _ln(self, x, w, b, out16, mean, rstd, y=None, ybias=None, resid=None):
        """A LayerNorm in fp32 (train_gpt2.cu's kernel) that writes its output in bf16 only, for the next GEMM."""
        ops.layernorm_forward(x, w, b, self.config.eps, y=y, ybias=ybias, resid=resid, out16=out16, mean=mean,
                              rstd=rstd)
        return out16

    def forward(self, idx, targets=None, grad: bool = True, check: bool = True):
        """As TrainGPT.forward, in mixed precision: the bf16 weights are made from the fp32 ones first."""
        if check:
            idx, targets = self.check_batch(idx, targets)
        cfg, P, W = self.config, self.params, self.params16
        B, T = idx.shape
        a = self._activations(B, T)
        a.idx, N, C, L, H = idx, B * T, cfg.n_embd, cfg.n_layer, cfg.n_head
        p = lambda i, n: P[f"h.{i}.{n}"]  # noqa: E731
        w = lambda i, n: W[f"h.{i}.{n}"]  # noqa: E731
        bf.to_bf16(self.flat[P["wte.weight"].size:], out=self.flat16)
        bf.to_bf16(P["wte.weight"], out=self.head16[:cfg.vocab_size])
        x = ops.encoder_forward(idx, P["wte.weight"], P["wpe.weight"], out=a.resid[0])
        self._ln(x, p(0, "ln_1.weight"), p(0, "ln_1.bias"), a.ln1[0], a.m1[0], a.r1[0])
        for i in range(L):
            bf.bias_bf16(bf.gemm_bf16(a.ln1[i], w(i, "attn.c_attn.weight"), a.qkv[i].reshape(N, 3 * C)),
                         p(i, "attn.c_attn.bias"))
            bf.attention_forward_bf16(a.qkv[i], H, out=a.atty[i], lse=a.lse[i])
            bf.gemm_bf16(a.atty[i].reshape(N, C), w(i, "attn.c_proj.weight"), a.tmp)
            self._ln(a.resid[i], p(i, "ln_2.weight"), p(i, "ln_2.bias"), a.ln2[i], a.m2[i], a.r2[i], y=a.tmp,
                     ybias=p(i, "attn.c_proj.bias"), resid=a.resid2[i])
            bf.gemm_bf16(a.ln2[i], w(i, "mlp.c_fc.weight"), a.pre[i])
            bf.gelu_bias_bf16(a.pre[i], p(i, "mlp.c_fc.bias"), out=a.h[i])
            bf.gemm_bf16(a.h[i], w(i, "mlp.c_proj.weight"), a.tmp)
            last = i + 1 == L
            lw, lb = (P["ln_f.weight"], P["ln_f.bias"]) if last else (p(i + 1, "ln_1.weight"), p(i + 1, "ln_1.bias"))
            self._ln(a.resid2[i], lw, lb, a.lnf if last else a.ln1[i + 1], a.m1[i + 1], a.r1[i + 1], y=a.tmp,
                     ybias=p(i, "mlp.c_proj.bias"), resid=a.resid[i + 1])
        V = cfg.vocab_size
        bf.gemm_bf16(a.lnf, self.head16.T, a.logits)  # in bf16, as torch.autocast's: the step's largest tensor
        a.logits[:, V:].fill(BF16_NEG_INF)       # the pad columns (zeros from head16's zero rows): out of the softmax
        if targets is None:
            return bf16_to_float32(a.logits[:, :V]).reshape(B, T, V)
        # fp32 arithmetic on the widened logits; the gradient straight to bf16, where the GEMMs read it
        losses = bf.classifier_bf16(a.logits, targets.reshape(N), losses=a.losses, dlogits=a.dlogits if grad else None,
                                    grad=grad)
        self._a = a if grad else None
        return losses.mean()

    def _again(self, a, i: int, what: str):
        """Recomputation: ln_1 or ln_2 of layer i from its stored residual stream (the forward's LayerNorm kernel
        on the same fp32 input: the same bits; mean and rstd go to scratch, the stored ones stay), or its GELU
        output from the stored pre-activation."""
        P = self.params
        if what == "h":
            return bf.gelu_bias_bf16(a.pre[i], P[f"h.{i}.mlp.c_fc.bias"], out=a.h[i])
        x, out = (a.resid[i], a.ln1[i]) if what == "ln_1" else (a.resid2[i], a.ln2[i])
        return self._ln(x, P[f"h.{i}.{what}.weight"], P[f"h.{i}.{what}.bias"], out, a.mt, a.rt)

    def backward(self):
        """Gradients of the last forward(grad=True) into self.grads (overwritten), in mixed precision. Each GEMM
        reads a bf16 copy of the fp32 gradient before it, written by the kernel that computes that gradient, with
        no cast between: the classifier writes dlogits in bf16, the attention's dO comes out of its GEMM in bf16,
        the GELU backward writes its input gradient in bf16 only, and the LayerNorm and attention backward write
        dres and dqkv in fp32 (the bias sums and the next LayerNorm read those) and in bf16. LayerNorm and GELU
        backward compute in fp32. As in TrainGPT.backward, the weight gradients (and bias column sums) run on a
        second stream beside the pass: each buffer they read is noted with an event, and the pass waits for that
        event before its next kernel that writes the buffer (_Readers), which for a bf16 copy is the kernel that
        makes the gradient: side.writing comes before it."""
        import cupy as cp
        a, cfg, P, G, W = self._a, self.config, self.params, self.grads, self.params16
        if a is None:
            raise RuntimeError("backward: call forward(idx, targets, grad=True) first (once per backward)")
        self._a = None
        B, T, N, C, L, H = a.B, a.T, a.N, cfg.n_embd, cfg.n_layer, cfg.n_head
        p = lambda i, n: P[f"h.{i}.{n}"]  # noqa: E731
        g = lambda i, n: G[f"h.{i}.{n}"]  # noqa: E731
        w = lambda i, n: W[f"h.{i}.{n}"]  # noqa: E731
        side = _Readers(self._weight_grad_stream(), cp.cuda.get_current_stream())
        dqkv = a.dqkv.reshape(N, 3 * C)
        bf.gemm_bf16(a.dlogits, self.head16, a.dln)                     # pad columns 0 times zero rows
        with side.reading(a.dlogits, a.lnf):                             # the LM head's share of dwte
            bf.gemm_bf16(a.dlogits.T, a.lnf, self.dhead)                 # padded rows: zero gradient columns
            G["wte.weight"][...] = self.dhead[:cfg.vocab_size]
        side.writing(a.dres16m)
        ops.layernorm_backward(a.dln, a.resid[L], P["ln_f.weight"], a.m1[L], a.r1[L], dx=a.dres, dx16=a.dres16m,
                               dweight=G["ln_f.weight"], dbias=G["ln_f.bias"])
        for i in reversed(range(L)):
            # MLP: dres (dres16m in bf16) is the gradient of c_proj's output (and bias)
            if self.recompute:
                side.writing(a.h[i])
                self._again(a, i, "h")
            bf.gemm_bf16(a.dres16m, w(i, "mlp.c_proj.weight").T, a.dh)
            with side.reading(a.h[i], a.dres16m, a.dres):
                bf.gemm_bf16(a.h[i].T, a.dres16m, g(i, "mlp.c_proj.weight"))
                ops.column_sum(a.dres, out=g(i, "mlp.c_proj.bias"))
            side.writing(a.dh16)
            ops.gelu_bias_backward(a.dh, a.pre[i], p(i, "mlp.c_fc.bias"), dpre16=a.dh16, dbias=g(i, "mlp.c_fc.bias"))
            if self.recompute:
                side.writing(a.ln2[i])
                self._again(a, i, "ln_2")
            bf.gemm_bf16(a.dh16, w(i, "mlp.c_fc.weight").T, a.dln)
            with side.reading(a.ln2[i], a.dh16):
                bf.gemm_bf16(a.ln2[i].T, a.dh16, g(i, "mlp.c_fc.weight"))
            side.writing(a.dres)
            side.writing(a.dres16a)
            ops.layernorm_backward(a.dln, a.resid2[i], p(i, "ln_2.weight"), a.m2[i], a.r2[i], dx=a.dres,
                                   dx16=a.dres16a, dweight=g(i, "ln_2.weight"), dbias=g(i, "ln_2.bias"),
                                   accumulate=True)
            # attention
            bf.gemm_bf16(a.dres16a, w(i, "attn.c_proj.weight").T, a.datty.reshape(N, C))     # dO, in bf16
            with side.reading(a.atty[i], a.dres16a, a.dres):
                bf.gemm_bf16(a.atty[i].reshape(N, C).T, a.dres16a, g(i, "attn.c_proj.weight"))
                ops.column_sum(a.dres, out=g(i, "attn.c_proj.bias"))
            side.writing(a.dqkv)
            side.writing(a.dqkv16)
            bf.attention_backward_bf16(a.datty, a.qkv[i], a.atty[i], a.lse[i], H, dqkv=a.dqkv, delta=a.delta,
                                       dqkv16=a.dqkv16.reshape(B, T, 3 * C))
            if self.recompute:
                side.writing(a.ln1[i])
                self._again(a, i, "ln_1")
            bf.gemm_bf16(a.dqkv16, w(i, "attn.c_attn.weight").T, a.dln)
            with side.reading(a.ln1[i], a.dqkv16, a.dqkv):
                bf.gemm_bf16(a.ln1[i].T, a.dqkv16, g(i, "attn.c_attn.weight"))
                ops.column_sum(dqkv, out=g(i, "attn.c_attn.bias"))
            side.writing(a.dres)
            if i:                       # layer 0's dres goes to the embeddings, which read it in fp32
                side.writing(a.dres16m)
            ops.layernorm_backward(a.dln, a.resid[i], p(i, "ln_1.weight"), a.m1[i], a.r1[i], dx=a.dres,
                                   dx16=a.dres16m if i else None, dweight=g(i, "ln_1.weight"), dbias=g(i, "ln_1.bias"),
                                   accumulate=True)
        side.all_done()                 # the embedding adds into dwte, the optimiser reads every dW
        ops.encoder_backward(a.dres, a.idx, G["wte.weight"], G["wpe.weight"], version=self.embedding_version)
        return G


class _Readers:
    """The weight-gradient stream of MixedGPT.backward and what its work reads: `with reading(*arrays):` runs the
    block on the side stream (after the pass's work so far) and notes an event for each array; writing(array)
    makes the pass wait for the last such event before it overwrites that array."""

    def __init__(self, side, main):
        self.side, self.main, self.last = side, main, {}

    @contextlib.contextmanager
    def reading(self, *arrays):
        import cupy as cp
        with ops.beside(self.side):
            yield
        if self.side is None:           # one stream (a lab variant's _weight_grad_stream): already in order
            return
        event = self.side.record(cp.cuda.Event(disable_timing=True))
        for x in arrays:
            self.last[x.data.ptr] = event

    def writing(self, x):
        event = self.last.pop(x.data.ptr, None)
        if event is not None:
            self.main.wait_event(event)

    def all_done(self):
        import cupy as cp
        if self.side is not None:
            self.main.wait_event(self.side.record(cp.cuda.Event(disable_timing=True)))
        self.last.clear()


def make_model(config: GPTConfig, params: dict | None = None, seed: int = 0, precision: str = "fp32",
               recompute: bool = False) -> TrainGPT:
    """The training model for a precision: "fp32" (model.py's TrainGPT, 4b's lesson, unchanged) or "bf16"
    (MixedGPT). recompute applies to the bf16 model (the fp32 one keeps every activation)."""
    expect_choice(precision, "precision", ("fp32",) + PRECISIONS)
    if precision == "fp32":
        if recompute:
            raise ValueError("recompute: activation recomputation is a MixedGPT option; use precision='bf16'")
        return TrainGPT(config, params, seed)
    return MixedGPT(config, params, seed, precision=precision, recompute=recompute)
