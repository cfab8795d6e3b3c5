"""Step 4b's model: GPT-2 (the Hugging Face layout and names) with a forward and a backward pass on the course's
kernels, fp32 - the model half of llm.c's train_gpt2, in Python.

    model = TrainGPT(shakespeare_char(vocab_size=65))     # nanoGPT's shakespeare_char size, GPT-2's initialisation
    loss = model.forward(idx, targets)                    # the mean loss (a CuPy scalar on the GPU)
    model.backward()                                      # gradients into model.grads (one flat buffer, gflat)
    gpt = model.to_gpt()                                  # step 4's inference GPT on a copy of the weights

The forward pass: encoder -> L x (LayerNorm, qkv GEMM, flash attention saving lse, proj GEMM, residual+LayerNorm,
fc GEMM, bias+GELU, proj GEMM, residual+LayerNorm) -> LM-head GEMM (tied to wte) -> step 3's fused classifier.
The backward pass runs the same layers in reverse (train_gpt2.cu + cuBLAS), the weight gradients on a second
stream beside the rest of the pass. Parameters and gradients each live in ONE flat buffer, so the optimiser
and the gradient norm (train.py) see them as one tensor.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from common import expect_token_ids, require_gpu
from common.cublas import gemm, own_workspace
from step4_gpt2.train import ops
from step4_gpt2.weights import GPTConfig, expected_shapes


def shakespeare_char(vocab_size: int, block_size: int = 256) -> GPTConfig:
    """nanoGPT's shakespeare_char size: 6 layers, 6 heads, C = 384, context 256 (10.7M parameters)."""
    return GPTConfig(n_layer=6, n_head=6, n_embd=384, vocab_size=vocab_size, block_size=block_size)


def init_params(cfg: GPTConfig, seed: int = 0) -> dict:
    """GPT-2's initialisation (as nanoGPT): N(0, 0.02) matrices and embeddings, the residual projections
    scaled by 1/sqrt(2 n_layer), zero biases, LayerNorm weights 1. NumPy float32, HF names."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if ".ln_" in name or name.startswith("ln_"):
            t = np.ones(shape) if name.endswith("weight") else np.zeros(shape)
        elif name.endswith("bias"):
            t = np.zeros(shape)
        else:
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
            t = std * rng.standard_normal(shape)
        out[name] = t.astype(np.float32)
    return out



# ============================================================================ the model
@functools.lru_cache(maxsize=None)
def weight_grad_stream(device_id: int):
    """The stream TrainGPT.backward runs its weight gradients on, one per device and shared by every model:
    its cuBLAS workspace (common.cublas.own_workspace, 32 MB) lives as long as the process, so a stream per
    model would keep one per model ever built. Models run their backward passes one after another, and the
    events of each pass order its work on the shared stream.

    It has the GPU's highest stream priority (the pass runs at the default, the lowest): where both have blocks
    waiting for an SM, a weight gradient's go first. They have the least of the pass left beside them to hide
    in if they start late (docs/training.md measured the three choices). Inside the step's CUDA graph the
    priorities hold because the graph is instantiated with node priorities (common.capture_graph)."""
    import cupy as cp
    from common import stream_priorities
    with cp.cuda.Device(device_id):
        stream = cp.cuda.Stream(non_blocking=True, priority=stream_priorities()[1])
        own_workspace(stream)
    return stream


class _Activations:
    """Everything the backward pass reads, for one (B, T): per layer the residual streams, LayerNorm
    outputs and statistics, qkv, attention output and lse, the MLP pre-activation and GELU output."""

    def __init__(self, cfg: GPTConfig, B: int, T: int):
        import cupy as cp
        N, C, L, H = B * T, cfg.n_embd, cfg.n_layer, cfg.n_head
        e = lambda *s: cp.empty(s, cp.float32)  # noqa: E731
        self.B, self.T, self.N = B, T, N
        self.resid = [e(N, C) for _ in range(L + 1)]       # block inputs; resid[L] feeds ln_f
        self.ln1 = [e(N, C) for _ in range(L)]
        self.lnf = e(N, C)
        self.m1, self.r1 = [e(N) for _ in range(L + 1)], [e(N) for _ in range(L + 1)]   # [L]: ln_f
        self.qkv = [e(N, 3 * C) for _ in range(L)]
        self.atty = [e(B, T, C) for _ in range(L)]
        self.lse = [e(B, H, T) for _ in range(L)]
        self.resid2 = [e(N, C) for _ in range(L)]
        self.ln2 = [e(N, C) for _ in range(L)]
        self.m2, self.r2 = [e(N) for _ in range(L)], [e(N) for _ in range(L)]
        self.pre = [e(N, 4 * C) for _ in range(L)]             # c_fc output, before its bias
        self.h = [e(N, 4 * C) for _ in range(L)]
        self.tmp, self.dres, self.dln, self.datty = e(N, C), e(N, C), e(N, C), e(B, T, C)
        self.dh, self.dqkv = e(N, 4 * C), e(B, T, 3 * C)
        self.logits, self.losses = e(N, cfg.vocab_size), e(N)
        self.idx = None


class TrainGPT:
    """GPT-2 (HF layout and names) with a forward and a backward pass on the course's kernels.

    params / grads: {name: CuPy float32 view} into one flat buffer each (flat, gflat).
    attention_version: the attention, ops.ATTENTION_VERSIONS: 1 (the backward materialises P), 2 (flash-style
    on the FMA units), 3 (flash-style on tensor cores at fp32 accuracy; the default on sm_80+, else 2);
    embedding_version: the token-embedding backward, 1 (atomics) or 2 (deterministic, default)."""

    def __init__(self, config: GPTConfig, params: dict | None = None, seed: int = 0):
        import cupy as cp
        require_gpu()
        if config.head_dim not in ops.HEAD_DIMS:
            raise ValueError(f"config: head_dim = n_embd / n_head = {config.head_dim}; the attention kernels "
                             f"support {ops.HEAD_DIMS}")
        self.config = config
        self.shapes = expected_shapes(config)
        params = init_params(config, seed) if params is None else params
        from step4_gpt2.weights import validate
        validate(params, config)
        total = sum(int(np.prod(s)) for s in self.shapes.values())
        self.flat, self.gflat = cp.empty(total, cp.float32), cp.zeros(total, cp.float32)
        self.params, self.grads, off = {}, {}, 0
        for k, s in self.shapes.items():
            n = int(np.prod(s))
            self.params[k] = self.flat[off:off + n].reshape(s)
            self.grads[k] = self.gflat[off:off + n].reshape(s)
            self.params[k][...] = cp.asarray(np.asarray(params[k], dtype=np.float32))
            off += n
        self.attention_version, self.embedding_version = ops.default_attention_version(), 2
        self._acts: dict = {}
        self._a = None
        self._side = None

    @property
    def n_params(self) -> int:
        return int(self.flat.size)

    def host_params(self) -> dict:
        """{name: NumPy float32 copy}, e.g. to save or to load into PyTorch."""
        return {k: v.get() for k, v in self.params.items()}

    def check_batch(self, idx, targets=None):
        """idx (and targets) (B, T) int32 on the GPU, T <= block_size, every id in [0, vocab_size)."""
        import cupy as cp
        cfg = self.config
        out = []
        for name, a in (("idx", idx), ("targets", targets)):
            if a is None:
                out.append(None)
                continue
            a = expect_token_ids(cp.asarray(a) if isinstance(a, np.ndarray) else a, cfg.vocab_size, name, ndim=2,
                                 dtype=np.int32)
            if a.shape[1] > cfg.block_size:
                raise ValueError(f"{name}: a batch of T={a.shape[1]} tokens per sequence is longer than the "
                                 f"model's block_size={cfg.block_size}")
            if a.shape[0] < 1 or a.shape[1] < 1:
                raise ValueError(f"{name}: expected shape (B >= 1, T >= 1), got {a.shape}")
            out.append(a)
        if targets is not None and out[1].shape != out[0].shape:
            raise ValueError(f"targets: expected shape {out[0].shape} like idx, got {out[1].shape}")
        return out

    def _activations(self, B: int, T: int) -> _Activations:
        if (B, T) not in self._acts:
            if len(self._acts) >= 2:                 # training and evaluation shapes; drop the oldest
                self._acts.pop(next(iter(self._acts)))
            self._acts[(B, T)] = _Activations(self.config, B, T)
        return self._acts[(B, T)]

    def forward(self, idx, targets=None, grad: bool = True, check: bool = True):
        """With targets: the mean loss (a CuPy 0-d array, computed on the GPU: float() waits for it); grad=True
        also leaves dlogits for backward(). Without targets: the logits (B, T, V), a new array (the model's own
        logits buffer is overwritten by the next call, and by a backward pass)."""
        if check:
            idx, targets = self.check_batch(idx, targets)
        cfg, P = self.config, self.params
        B, T = idx.shape
        a = self._activations(B, T)
        a.idx, N, C, L, H = idx, B * T, cfg.n_embd, cfg.n_layer, cfg.n_head
        p = lambda i, n: P[f"h.{i}.{n}"]  # noqa: E731
        x = ops.encoder_forward(idx, P["wte.weight"], P["wpe.weight"], out=a.resid[0])
        ops.layernorm_forward(x, p(0, "ln_1.weight"), p(0, "ln_1.bias"), cfg.eps, out=a.ln1[0], mean=a.m1[0], rstd=a.r1[0])
        for i in range(L):
            gemm(a.ln1[i], p(i, "attn.c_attn.weight"), a.qkv[i])
            ops.attention_forward(a.qkv[i].reshape(B, T, 3 * C), p(i, "attn.c_attn.bias"), H, out=a.atty[i], lse=a.lse[i],
                                  version=self.attention_version)
            gemm(a.atty[i].reshape(N, C), p(i, "attn.c_proj.weight"), a.tmp)
            ops.layernorm_forward(a.resid[i], p(i, "ln_2.weight"), p(i, "ln_2.bias"), cfg.eps, y=a.tmp,
                                  ybias=p(i, "attn.c_proj.bias"), resid=a.resid2[i], out=a.ln2[i], mean=a.m2[i], rstd=a.r2[i])
            gemm(a.ln2[i], p(i, "mlp.c_fc.weight"), a.pre[i])
            ops.gelu_bias_forward(a.pre[i], p(i, "mlp.c_fc.bias"), out=a.h[i])
            gemm(a.h[i], p(i, "mlp.c_proj.weight"), a.tmp)
            last = i + 1 == L
            w, b = (P["ln_f.weight"], P["ln_f.bias"]) if last else (p(i + 1, "ln_1.weight"), p(i + 1, "ln_1.bias"))
            ops.layernorm_forward(a.resid2[i], w, b, cfg.eps, y=a.tmp, ybias=p(i, "mlp.c_proj.bias"),
                                  resid=a.resid[i + 1], out=a.lnf if last else a.ln1[i + 1], mean=a.m1[i + 1], rstd=a.r1[i + 1])
        gemm(a.lnf, P["wte.weight"].T, a.logits)
        if targets is None:
            return a.logits.reshape(B, T, cfg.vocab_size).copy()
        losses = ops.classifier(a.logits, targets.reshape(N), losses=a.losses, grad=grad)
        self._a = a if grad else None
        return losses.mean()

    def backward(self):
        """Gradients of the last forward(grad=True) into self.grads (overwritten).

        Each linear layer's weight gradient dW = x^T dy (and its bias's column sums) is needed only by the
        optimiser; the pass goes on with dx = dy W^T alone. So they run on a second stream
        (_weight_grad_stream), beside the rest of the pass (those GEMMs reduce over all N = B*T rows into a few output tiles,
        and leave SMs idle that the other stream's kernels can use). An event after each of them makes the
        pass wait before it overwrites what they read (dres, dh, dqkv); the last one before the embedding's
        gradient, which adds into wte's, and before returning. The same kernels and bits as on one stream."""
        import cupy as cp
        a, cfg, P, G = self._a, self.config, self.params, self.grads
        if a is None:
            raise RuntimeError("backward: call forward(idx, targets, grad=True) first (once per backward)")
        self._a = None
        B, T, N, C, L, H = a.B, a.T, a.N, cfg.n_embd, cfg.n_layer, cfg.n_head
        p = lambda i, n: P[f"h.{i}.{n}"]  # noqa: E731
        g = lambda i, n: G[f"h.{i}.{n}"]  # noqa: E731
        side = self._weight_grad_stream()
        main = cp.cuda.get_current_stream()

        def done():                     # an event after the weight-gradient stream's work so far
            return side.record(cp.cuda.Event(disable_timing=True)) if side is not None else None

        def wait(event):                # the pass goes on only once that work has read its inputs
            if event is not None:
                main.wait_event(event)

        gemm(a.logits, P["wte.weight"], a.dln)                          # a.logits now holds dlogits
        with ops.beside(side):
            ops.weight_grad(a.logits, a.lnf, out=G["wte.weight"])        # the LM head's share of dwte
        ops.layernorm_backward(a.dln, a.resid[L], P["ln_f.weight"], a.m1[L], a.r1[L], dx=a.dres,
                               dweight=G["ln_f.weight"], dbias=G["ln_f.bias"])
        dqkv = a.dqkv.reshape(N, 3 * C)
        dh_read = dqkv_read = None
        for i in reversed(range(L)):
            # MLP: the residual's gradient a.dres is also the gradient of c_proj's output (and bias)
            wait(dh_read)
            ops.matmul_backward(a.dres, a.h[i], p(i, "mlp.c_proj.weight"), dx=a.dh, dweight=g(i, "mlp.c_proj.weight"),
                                dbias=g(i, "mlp.c_proj.bias"), stream=side)
            dres_read = done()
            ops.gelu_bias_backward(a.dh, a.pre[i], p(i, "mlp.c_fc.bias"), dpre=a.dh, dbias=g(i, "mlp.c_fc.bias"))
            ops.matmul_backward(a.dh, a.ln2[i], p(i, "mlp.c_fc.weight"), dx=a.dln, dweight=g(i, "mlp.c_fc.weight"),
                                dbias=False, stream=side)        # c_fc's bias gradient came with the GELU's
            dh_read = done()
            wait(dres_read)
            ops.layernorm_backward(a.dln, a.resid2[i], p(i, "ln_2.weight"), a.m2[i], a.r2[i], dx=a.dres,
                                   dweight=g(i, "ln_2.weight"), dbias=g(i, "ln_2.bias"), accumulate=True)
            # attention
            ops.matmul_backward(a.dres, a.atty[i].reshape(N, C), p(i, "attn.c_proj.weight"), dx=a.datty.reshape(N, C),
                                dweight=g(i, "attn.c_proj.weight"), dbias=g(i, "attn.c_proj.bias"), stream=side)
            dres_read = done()
            wait(dqkv_read)
            ops.attention_backward(a.datty, a.qkv[i].reshape(B, T, 3 * C), p(i, "attn.c_attn.bias"), a.atty[i],
                                   a.lse[i], H, dqkv=a.dqkv, version=self.attention_version)
            ops.matmul_backward(dqkv, a.ln1[i], p(i, "attn.c_attn.weight"), dx=a.dln, dweight=g(i, "attn.c_attn.weight"),
                                dbias=g(i, "attn.c_attn.bias"), stream=side)
            dqkv_read = done()
            wait(dres_read)
            ops.layernorm_backward(a.dln, a.resid[i], p(i, "ln_1.weight"), a.m1[i], a.r1[i], dx=a.dres,
                                   dweight=g(i, "ln_1.weight"), dbias=g(i, "ln_1.bias"), accumulate=True)
        wait(done())                    # all of it: the embedding adds into dwte, the optimiser reads every dW
        ops.encoder_backward(a.dres, a.idx, G["wte.weight"], G["wpe.weight"], version=self.embedding_version)
        return G

    def _weight_grad_stream(self):
        """The second stream of backward(): the device's (weight_grad_stream), taken on first use. (None would
        keep the weight gradients on the pass's own stream: lab/variants.py's OneStreamGPT measures that.)"""
        import cupy as cp
        if self._side is None:
            self._side = weight_grad_stream(cp.cuda.Device().id)
        return self._side

    def loss_and_grads(self, idx, targets, check: bool = True):
        """forward(idx, targets) then backward(): the mean loss (a CuPy 0-d array), the gradients in self.grads."""
        loss = self.forward(idx, targets, grad=True, check=check)
        self.backward()
        return loss

    def to_gpt(self):
        """Step 4's inference model (step4_gpt2.model.GPT) on a copy of the weights as they are now: sample
        from it with step4_gpt2.generate.generate (KV cache, CUDA graphs). Training on does not change it."""
        from step4_gpt2.model import GPT
        return GPT(self.config, self.host_params())
