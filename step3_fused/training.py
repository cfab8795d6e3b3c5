"""Step 3b: a next-token MLP on Shakespeare, trained with fused kernels (train_forward.cu, train_backward.cu,
train_update.cu) around cuBLAS GEMMs. The data (plays, split, vocabulary, windows) is step3_fused.shakespeare.

    from step3_fused.shakespeare import train_val_text, tokenize, Vocab, windows
    train_text, val_text = train_val_text()
    vocab = Vocab.build(tokenize(train_text), max_size=4096)
    model = Model(vocab=len(vocab), embed=128, hidden=512, context=3)
    opt = AdamW(model.params, lr=2e-3)
    loss = model.step(ctx, targets, opt)            # one fused training step: a 0-d CuPy array, float(loss) waits

Every GPU wrapper checks its arguments with common.expect_array and range-checks token ids with
common.expect_token_ids (check=False skips that range check, which costs a device-to-host transfer: the
Model checks a batch once and its kernels skip it; the kernels turn an id outside the table into NaN, never
into a read outside it). Errors name the argument that is wrong.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common import expect_array, expect_choice, expect_token_ids, launch_grid, get_kernel, null_or, out_array, \
    require_gpu
from common.reference import mlp as ref
from step3_fused.shakespeare import Vocab, tokenize

HERE = Path(__file__).resolve().parent
FWD, BWD, UPD = HERE / "train_forward.cu", HERE / "train_backward.cu", HERE / "train_update.cu"
# Compile-time constants, defined here only and passed to the .cu files as defines (they have no defaults),
# so the launch configurations below and the kernels agree by construction.
COLS, ROWS = 32, 8              # train_backward.cu column strips: 32 columns (one warp) x 8 warps per block
CHUNK = 4096                    # train_update.cu multi-tensor kernels: elements per block
BWD_DEFINES, UPD_DEFINES = {"COLS": COLS, "ROWS": ROWS}, {"CHUNK": CHUNK}
CU_DEFINES = {FWD: {}, BWD: BWD_DEFINES, UPD: UPD_DEFINES}    # every .cu of this module (tests compile them)
BLOCK = 256                     # the grid-stride kernels' threads per block


# ============================================================================ GPU wrappers
def _blocks(n: int) -> tuple:
    return launch_grid(n, BLOCK, per_sm=16)


def _feature_threads(E: int) -> tuple:
    """One block per sample, its threads walking the E features of a row: whole warps, at most 256."""
    return (min(256, max(32, -(-E // 32) * 32)),)


def _ids(ids, name: str, vocab: int, ndim: int, check: bool):
    """A C-contiguous int32 GPU array of token ids; with check, also in [0, vocab) (common.expect_token_ids)."""
    ids = expect_array(ids, name, dtype=np.int32, ndim=ndim)
    return expect_token_ids(ids, vocab, name, ndim=ndim, dtype=np.int32) if check else ids


def embed_mean(emb, ctx, out=None, check: bool = True):
    """x[b] = mean_j emb[ctx[b, j]]. emb (V, E) float32, ctx (B, K) int32 -> (B, E)."""
    emb = expect_array(emb, "emb", dtype=np.float32, ndim=2)
    ctx = _ids(ctx, "ctx", emb.shape[0], 2, check)
    B, K = ctx.shape
    if K < 1:
        raise ValueError(f"ctx: expected at least one context column, got shape {ctx.shape}")
    E = emb.shape[1]
    x = out_array(out, (B, E))
    if B:
        get_kernel(FWD, "embed_mean")((B,), _feature_threads(E),
                                     (emb, ctx, x, np.int32(B), np.int32(K), np.int32(E), np.int32(emb.shape[0])))
    return x


def _rowwise(kernel: str, name: str, y, bias):
    """Check y (rows, cols) and bias (cols,), then run an in-place per-element kernel of train_forward.cu."""
    y = expect_array(y, name, dtype=np.float32, ndim=2)
    bias = expect_array(bias, "bias", dtype=np.float32, shape=(y.shape[1],))
    if y.size:
        get_kernel(FWD, kernel)(_blocks(y.size), (BLOCK,), (y, bias, np.int64(y.size), np.int32(y.shape[1])))
    return y


def bias_add(y, bias):
    """v1 piece: y += bias (broadcast over rows), in place."""
    return _rowwise("bias_add", "y", y, bias)


def relu(y):
    """v1 piece: y = max(y, 0), in place."""
    y = expect_array(y, "y", dtype=np.float32)
    if y.size:
        get_kernel(FWD, "relu")(_blocks(y.size), (BLOCK,), (y, np.int64(y.size)))
    return y


def bias_relu(h, bias):
    """Fused: h = relu(h + bias), in place."""
    return _rowwise("bias_relu", "h", h, bias)


def _row_block(cols: int) -> int:
    return 1024 if cols >= 8192 else 512 if cols >= 2048 else 256 if cols >= 512 else 128 if cols >= 128 else 32


def softmax(z, out=None):
    """v1 piece: row softmax (max pass, sum pass, write pass)."""
    z = expect_array(z, "z", dtype=np.float32, ndim=2)
    p = out_array(out, z.shape)
    if z.shape[0] and z.shape[1]:
        get_kernel(FWD, "softmax_rows")((z.shape[0],), (_row_block(z.shape[1]),), (z, p, np.int32(z.shape[1])))
    return p


def _targets(targets, rows, cols, check):
    t = _ids(targets, "targets", cols, 1, check)
    if t.shape[0] != rows:
        raise ValueError(f"targets: expected shape ({rows},) (one per row), got {t.shape}")
    return t


def ce_loss(p, targets, out=None, check: bool = True):
    """v1 piece: loss[b] = -log p[b, targets[b]]."""
    p = expect_array(p, "p", dtype=np.float32, ndim=2)
    t = _targets(targets, p.shape[0], p.shape[1], check)
    loss = out_array(out, (p.shape[0],))
    if p.shape[0]:
        get_kernel(FWD, "ce_loss")(launch_grid(p.shape[0], 128), (128,),
                                   (p, t, loss, np.int32(p.shape[0]), np.int32(p.shape[1])))
    return loss


def ce_grad(p, targets, scale: float, out=None, check: bool = True):
    """v1 piece: d = (p - onehot(targets)) * scale (out may be p itself)."""
    p = expect_array(p, "p", dtype=np.float32, ndim=2)
    t = _targets(targets, p.shape[0], p.shape[1], check)
    d = out_array(out, p.shape)
    if p.size:
        get_kernel(FWD, "ce_grad")(_blocks(p.size), (BLOCK,),
                                   (p, t, d, np.int64(p.size), np.int32(p.shape[1]), np.float32(scale)))
    return d


CLASSIFIER_MODES = {"loss": 0, "grad": 1, "probs": 2}


def classifier(z, bias, targets=None, mode: str = "grad", scale: float | None = None, losses=None,
               check: bool = True):
    """Fused bias + softmax + cross-entropy (+ dlogits) over z (B, V), in place (train_forward.cu).

    mode "grad": returns per-sample losses and overwrites z with (softmax(z + bias) - onehot) * scale
    (scale defaults to 1/B, the gradient of the mean loss); "loss": losses only, z untouched;
    "probs": z <- softmax(z + bias), losses if targets are given. bias=None: no bias.
    """
    expect_choice(mode, "mode", CLASSIFIER_MODES)
    z = expect_array(z, "z", dtype=np.float32, ndim=2)
    B, V = z.shape
    if bias is not None:
        bias = expect_array(bias, "bias", dtype=np.float32, shape=(V,))
    if targets is None and mode != "probs":
        raise ValueError(f"targets: needed for mode={mode!r}")
    t = None if targets is None else _targets(targets, B, V, check)
    loss = None
    if t is not None:
        loss = out_array(losses, (B,), name="losses")
    if B and V:
        get_kernel(FWD, "classifier_fused")(
            (B,), (_row_block(V),), (z, null_or(bias), null_or(t), null_or(loss), np.int32(V),
                                    np.float32(1.0 / B if scale is None else scale), np.int32(CLASSIFIER_MODES[mode])))
    return loss


def column_sum(a, out=None):
    """v1 piece: out[c] = sum over rows of a[:, c] (a bias gradient), one block per COLS-column strip."""
    a = expect_array(a, "a", dtype=np.float32, ndim=2)
    rows, cols = a.shape
    out = out_array(out, (cols,))
    if cols:
        get_kernel(BWD, "column_sum", BWD_DEFINES)((-(-cols // COLS),), (COLS * ROWS,),
                                                   (a, out, np.int32(rows), np.int32(cols)))
    return out


def relu_backward(dh, h, out=None):
    """v1 piece: dhpre = dh where h > 0 else 0."""
    dh = expect_array(dh, "dh", dtype=np.float32)
    h = expect_array(h, "h", dtype=np.float32, shape=dh.shape)
    out = out_array(out, dh.shape)
    if dh.size:
        get_kernel(BWD, "relu_backward", BWD_DEFINES)(_blocks(dh.size), (BLOCK,), (dh, h, out, np.int64(dh.size)))
    return out


def bias_grads_relu_backward(dz, dh, h, db2, db1):
    """Fused: db2 = column sums of dz; dh <- dh * [h > 0] in place; db1 = its column sums. One launch."""
    dz = expect_array(dz, "dz", dtype=np.float32, ndim=2)
    B, V = dz.shape
    dh = expect_array(dh, "dh", dtype=np.float32, ndim=2)
    if dh.shape[0] != B:
        raise ValueError(f"dh: expected {B} rows like dz, got shape {dh.shape}")
    H = dh.shape[1]
    expect_array(h, "h", dtype=np.float32, shape=(B, H))
    expect_array(db2, "db2", dtype=np.float32, shape=(V,))
    expect_array(db1, "db1", dtype=np.float32, shape=(H,))
    vblocks, hblocks = -(-V // COLS), -(-H // COLS)
    if vblocks + hblocks:
        get_kernel(BWD, "bias_grads_relu_backward", BWD_DEFINES)(
            (vblocks + hblocks,), (COLS * ROWS,),
            (dz, db2, dh, h, db1, np.int32(B), np.int32(V), np.int32(H), np.int32(vblocks)))


def _emb_args(emb_like, dx, ctx, check, emb_name):
    V, E = emb_like.shape
    dx = expect_array(dx, "dx", dtype=np.float32, ndim=2)
    ctx = _ids(ctx, "ctx", V, 2, check)
    if dx.shape != (ctx.shape[0], E):
        raise ValueError(f"dx: expected shape ({ctx.shape[0]}, {E}) (one row per sample of ctx, E like {emb_name}), "
                         f"got {dx.shape}")
    return dx, ctx


def embedding_backward(dx, ctx, demb, zero: bool = True, check: bool = True):
    """demb[ctx[b, j]] += dx[b] / K (atomic scatter); demb is zeroed first unless zero=False."""
    demb = expect_array(demb, "demb", dtype=np.float32, ndim=2)
    dx, ctx = _emb_args(demb, dx, ctx, check, "demb")
    if zero:
        demb.fill(0)
    if ctx.shape[0]:
        get_kernel(BWD, "embedding_backward", BWD_DEFINES)(
            (ctx.shape[0],), _feature_threads(demb.shape[1]),
            (dx, ctx, demb, np.int32(ctx.shape[1]), np.int32(demb.shape[1]), np.int32(demb.shape[0])))
    return demb


def embedding_sgd(emb, dx, ctx, lr: float, check: bool = True):
    """emb[ctx[b, j]] -= lr * dx[b] / K: SGD on the embedding without a dense V x E gradient."""
    emb = expect_array(emb, "emb", dtype=np.float32, ndim=2)
    dx, ctx = _emb_args(emb, dx, ctx, check, "emb")
    if ctx.shape[0]:
        get_kernel(BWD, "embedding_sgd", BWD_DEFINES)(
            (ctx.shape[0],), _feature_threads(emb.shape[1]),
            (emb, dx, ctx, np.float32(lr), np.int32(ctx.shape[1]), np.int32(emb.shape[1]), np.int32(emb.shape[0])))
    return emb


# ---------------------------------------------------------------------------- optimisers
def _check_tensors(named: dict, what: str):
    for k, a in named.items():
        expect_array(a, f"{what}[{k!r}]", dtype=np.float32)


class _Table:
    """The device-side table of adamw_multi / sgd_multi: pointers, sizes, weight decays, first blocks."""

    def __init__(self, groups: list[list], sizes: list[int], wds: list[float]):
        import cupy as cp
        self.keep = groups                       # the arrays must outlive the table
        self.ptrs = cp.asarray(np.array([a.data.ptr for g in groups for a in g], dtype=np.uint64))
        self.sizes = cp.asarray(np.array(sizes, dtype=np.int64))
        self.wds = cp.asarray(np.array(wds, dtype=np.float32))
        nblocks = [-(-s // CHUNK) for s in sizes]
        self.first = cp.asarray(np.concatenate([[0], np.cumsum(nblocks)]).astype(np.int32))
        self.blocks, self.n = int(sum(nblocks)), len(sizes)


class _Optimizer:
    """What SGD and AdamW share: the check of `grads`, weight decay on `decayed` tensors only, and the
    tables of the one-launch kernels (cached per set of gradient buffers: a loop passes the same ones)."""

    def __init__(self, params: dict, lr: float, weight_decay: float, decayed):
        require_gpu()
        self.params, self.lr, self.wd, self.decayed = params, float(lr), float(weight_decay), tuple(decayed)
        self._tables = {}

    def _wd(self, k) -> float:
        return self.wd if k in self.decayed else 0.0

    def _names(self, grads: dict, skip=()) -> list:
        """The tensors to update (all but `skip`), each checked to have a float32 gradient of its shape."""
        _check_tensors(grads, "grads")
        names = [k for k in self.params if k not in skip]
        for k in names:
            shape = self.params[k].shape
            if k not in grads:
                raise ValueError(f"grads[{k!r}]: missing; expected a float32 array of shape {shape} "
                                 f"(one gradient per parameter: {names})")
            if grads[k].shape != shape:
                raise ValueError(f"grads[{k!r}]: expected shape {shape}, got {grads[k].shape}")
        return names

    def _arrays(self, k, grads: dict) -> list:
        """Tensor k's arrays in the order the multi-tensor kernel reads them from the table."""
        return [self.params[k], grads[k]]

    def prepare(self, grads: dict):
        """Build (and cache) the one-launch kernel's table for these gradient buffers now, e.g. before a CUDA
        graph capture, where nothing may be allocated."""
        self._table(grads, self._names(grads))

    def _table(self, grads: dict, names: list) -> _Table:
        key = (tuple(names), tuple(grads[k].data.ptr for k in names))
        if key not in self._tables:
            self._tables[key] = _Table([self._arrays(k, grads) for k in names],
                                       [self.params[k].size for k in names], [self._wd(k) for k in names])
        return self._tables[key]


class SGD(_Optimizer):
    """p -= lr * (g + wd * p) for every tensor; `multi=True`: one launch for all (sgd_multi)."""

    def __init__(self, params: dict, lr: float, weight_decay: float = 0.0, decayed=ref.DECAYED):
        super().__init__(params, lr, weight_decay, decayed)

    def step(self, grads: dict, multi: bool = True, skip=()):
        names = self._names(grads, skip)
        if not multi:
            for k in names:
                p, g = self.params[k], grads[k]
                get_kernel(UPD, "sgd_v1", UPD_DEFINES)(
                    _blocks(p.size), (BLOCK,), (p, g, np.int64(p.size), np.float32(self.lr), np.float32(self._wd(k))))
            return
        tab = self._table(grads, names)
        get_kernel(UPD, "sgd_multi", UPD_DEFINES)(
            (tab.blocks,), (BLOCK,), (tab.ptrs, tab.sizes, tab.wds, tab.first, np.int32(tab.n), np.float32(self.lr)))


class AdamW(_Optimizer):
    """AdamW (PyTorch's formula) over every tensor; `multi=True`: one launch for all (adamw_multi).

    The defaults are torch.optim.AdamW's (betas (0.9, 0.999), weight decay 0.01), so this MLP trains like the
    PyTorch replica it is checked against. Step 4b trains GPT with nanoGPT's settings for a small character
    model, betas (0.9, 0.99) and weight decay 0.1: a second moment averaged over about 100 steps instead of
    1000 suits a run of a few thousand steps, and the stronger decay regularises a transformer that sees the
    same small text again and again."""

    def __init__(self, params: dict, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, decayed=ref.DECAYED):
        import cupy as cp
        super().__init__(params, lr, weight_decay, decayed)
        self.betas, self.eps, self.t = tuple(betas), float(eps), 0
        self.m = {k: cp.zeros_like(v) for k, v in params.items()}
        self.v = {k: cp.zeros_like(v) for k, v in params.items()}

    def _arrays(self, k, grads: dict) -> list:
        return [self.params[k], grads[k], self.m[k], self.v[k]]

    def step(self, grads: dict, multi: bool = True, sched=None):
        """sched (multi only): a float32 CuPy array (lr, bc1, bc2, gs) that the kernel reads instead of self.lr and
        the bias corrections of self.t (a CUDA graph of the step must read them from the GPU); every gradient is
        multiplied by gs as it is read (gradient clipping's factor; 1 for none)."""
        names = self._names(grads)
        if sched is not None:
            if not multi:
                raise ValueError("sched: only the one-launch kernel (multi=True) reads its values from the GPU")
            expect_array(sched, "sched", dtype=np.float32, shape=(4,))
        self.t += 1
        b1, b2 = self.betas
        bc1, bc2 = 1.0 - b1 ** self.t, 1.0 - b2 ** self.t
        hyper = (np.float32(self.lr), np.float32(b1), np.float32(b2), np.float32(1.0 - b1), np.float32(1.0 - b2),
                 np.float32(self.eps))
        if not multi:
            for k in names:
                p = self.params[k]
                get_kernel(UPD, "adamw_v1", UPD_DEFINES)(
                    _blocks(p.size), (BLOCK,), (p, grads[k], self.m[k], self.v[k], np.int64(p.size), *hyper,
                                                np.float32(self._wd(k)), np.float32(bc1), np.float32(bc2)))
            return
        tab = self._table(grads, names)
        get_kernel(UPD, "adamw_multi", UPD_DEFINES)(
            (tab.blocks,), (BLOCK,), (tab.ptrs, tab.sizes, tab.wds, tab.first, np.int32(tab.n), *hyper,
                                      np.float32(bc1), np.float32(bc2), null_or(sched)))


# ---------------------------------------------------------------------------- the model
class Model:
    """embedding (V, E) -> mean of K context rows -> W1 (E, H) + b1, ReLU -> W2 (H, V) + b2 -> softmax.

    `params` is a dict of CuPy float32 arrays with common.reference.mlp's names and layouts; pass
    `init=` (a dict of NumPy arrays, e.g. mlp.init_params(...)) to start from given weights."""

    def __init__(self, vocab: int, embed: int, hidden: int, context: int, seed: int = 0, init: dict | None = None):
        require_gpu()
        import cupy as cp
        for name, v in (("vocab", vocab), ("embed", embed), ("hidden", hidden), ("context", context)):
            if int(v) < 1:
                raise ValueError(f"{name}: expected a positive size, got {v}")
        self.V, self.E, self.H, self.K = int(vocab), int(embed), int(hidden), int(context)
        init = init if init is not None else ref.init_params(self.V, self.E, self.H, seed)
        shapes = {"emb": (self.V, self.E), "W1": (self.E, self.H), "b1": (self.H,), "W2": (self.H, self.V), "b2": (self.V,)}
        for k, s in shapes.items():
            if k not in init or tuple(np.shape(init[k])) != s:
                raise ValueError(f"init[{k!r}]: expected shape {s}, got {None if k not in init else np.shape(init[k])}")
        self.params = {k: cp.asarray(init[k], dtype=cp.float32) for k in shapes}
        self.grads = {k: cp.empty_like(v) for k, v in self.params.items()}
        self._bufs = {}

    @property
    def n_params(self) -> int:
        return sum(int(p.size) for p in self.params.values())

    def _buffers(self, B: int) -> dict:
        import cupy as cp
        if B not in self._bufs:
            self._bufs[B] = {"x": cp.empty((B, self.E), cp.float32), "h": cp.empty((B, self.H), cp.float32),
                             "z": cp.empty((B, self.V), cp.float32), "p": cp.empty((B, self.V), cp.float32),
                             "dh": cp.empty((B, self.H), cp.float32), "dhpre": cp.empty((B, self.H), cp.float32),
                             "dx": cp.empty((B, self.E), cp.float32), "losses": cp.empty(B, cp.float32)}
        return self._bufs[B]

    def _check_batch(self, ctx, targets, check):
        ctx = _ids(ctx, "ctx", self.V, 2, check)
        if ctx.shape[1] != self.K or ctx.shape[0] < 1:
            raise ValueError(f"ctx: expected shape (B >= 1, {self.K}) (context={self.K}), got {ctx.shape}")
        if targets is not None:
            targets = _targets(targets, ctx.shape[0], self.V, check)
        return ctx, targets

    def forward_backward(self, ctx, targets, fused: bool = True, check: bool = True, sparse_embedding: bool = False):
        """The batch's mean loss, a new 0-d CuPy array (float(loss) waits for the GPU), and self.grads, which
        the next call overwrites. With sparse_embedding the embedding gradient is not formed (the caller
        applies it from self.last_dx, as the fused SGD step does)."""
        import cupy as cp
        ctx, targets = self._check_batch(ctx, targets, check)
        B, P, G, buf = ctx.shape[0], self.params, self.grads, self._buffers(ctx.shape[0])
        x, h, z = buf["x"], buf["h"], buf["z"]
        embed_mean(P["emb"], ctx, out=x, check=False)
        cp.matmul(x, P["W1"], out=h)
        if fused:
            bias_relu(h, P["b1"])
            cp.matmul(h, P["W2"], out=z)
            losses = classifier(z, P["b2"], targets, mode="grad", losses=buf["losses"], check=False)
            cp.matmul(h.T, z, out=G["W2"])
            dh = cp.matmul(z, P["W2"].T, out=buf["dh"])
            bias_grads_relu_backward(z, dh, h, G["b2"], G["b1"])
            dhpre = dh
        else:
            bias_add(h, P["b1"])
            relu(h)
            cp.matmul(h, P["W2"], out=z)
            bias_add(z, P["b2"])
            p = softmax(z, out=buf["p"])
            losses = ce_loss(p, targets, out=buf["losses"], check=False)
            dz = ce_grad(p, targets, 1.0 / B, out=z, check=False)
            cp.matmul(h.T, dz, out=G["W2"])
            column_sum(dz, out=G["b2"])
            dh = cp.matmul(dz, P["W2"].T, out=buf["dh"])
            dhpre = relu_backward(dh, h, out=buf["dhpre"])
            column_sum(dhpre, out=G["b1"])
        cp.matmul(x.T, dhpre, out=G["W1"])
        dx = cp.matmul(dhpre, P["W1"].T, out=buf["dx"])
        self.last_dx, self.last_ctx = dx, ctx
        if not sparse_embedding:
            embedding_backward(dx, ctx, G["emb"], check=False)
        return losses.mean()

    def step(self, ctx, targets, optimizer, fused: bool = True, check: bool = True):
        """One training step; returns the batch's mean loss before the update: a new 0-d CuPy array that no
        later call overwrites, still on the GPU (adding it up costs no sync; float(loss) waits for the step).

        fused=True: fused kernels + one-launch optimiser (SGD updates the embedding straight from dx).
        fused=False: one kernel per operation + one optimiser launch per tensor (the baseline)."""
        # SGD without decay on the embedding: the update is the scattered gradient itself, so the fused step
        # applies it straight from dx. (Decay touches every row, so then the dense gradient is needed.)
        sparse = fused and isinstance(optimizer, SGD) and not (optimizer.wd and "emb" in optimizer.decayed)
        loss = self.forward_backward(ctx, targets, fused=fused, check=check, sparse_embedding=sparse)
        if sparse:
            embedding_sgd(self.params["emb"], self.last_dx, self.last_ctx, optimizer.lr, check=False)
            optimizer.step(self.grads, multi=True, skip=("emb",))
        else:
            optimizer.step(self.grads, multi=fused)
        return loss

    def loss(self, ctx, targets, check: bool = True):
        """Mean loss (a new 0-d CuPy array) without gradients: the classifier in "loss" mode never writes z."""
        import cupy as cp
        ctx, targets = self._check_batch(ctx, targets, check)
        buf = self._buffers(ctx.shape[0])
        x = embed_mean(self.params["emb"], ctx, out=buf["x"], check=False)
        h = bias_relu(cp.matmul(x, self.params["W1"], out=buf["h"]), self.params["b1"])
        z = cp.matmul(h, self.params["W2"], out=buf["z"])
        return classifier(z, self.params["b2"], targets, mode="loss", losses=buf["losses"], check=False).mean()

    def probs(self, ctx, check: bool = True):
        """Next-token probabilities (B, V) for each context row, in a new array."""
        import cupy as cp
        ctx, _ = self._check_batch(ctx, None, check)
        x = embed_mean(self.params["emb"], ctx, check=False)
        h = bias_relu(cp.matmul(x, self.params["W1"]), self.params["b1"])
        z = cp.matmul(h, self.params["W2"])
        classifier(z, self.params["b2"], None, mode="probs")
        return z


# ============================================================================ training loops
@dataclass
class History:
    """A training run's loss curves (step 4b's Trainer.fit fills the same fields)."""
    steps: list = field(default_factory=list)        # step index of each train-loss point
    train: list = field(default_factory=list)        # mean train loss since the previous point
    val: list = field(default_factory=list)
    val_steps: list = field(default_factory=list)    # step index of each val-loss point
    seconds: float = 0.0                             # the run's wall-clock time (host clock, evaluation excluded)
    tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")


def batches(ctx: np.ndarray, targets: np.ndarray, batch: int, steps: int, seed: int = 0):
    """`steps` random minibatches (without replacement inside an epoch), as NumPy int32 arrays."""
    if batch < 1 or batch > len(ctx):
        raise ValueError(f"batch: expected 1 <= batch <= {len(ctx)} (the number of samples), got {batch}")
    rng = np.random.default_rng(seed)
    order, pos = rng.permutation(len(ctx)), 0
    for _ in range(steps):
        if pos + batch > len(order):
            order, pos = rng.permutation(len(ctx)), 0
        idx = order[pos:pos + batch]
        pos += batch
        yield ctx[idx], targets[idx]


def evaluate(model: Model, ctx, targets, batch: int = 4096) -> float:
    """Mean loss over a whole (GPU) split, in batches (no gradients)."""
    import cupy as cp
    total = cp.zeros((), cp.float64)
    for i in range(0, len(ctx), batch):
        total += model.loss(ctx[i:i + batch], targets[i:i + batch], check=False).astype(cp.float64) * len(ctx[i:i + batch])
    return float(total) / len(ctx)


def train(model: Model, optimizer, train_data, val_data, steps: int, batch: int, eval_every: int = 200,
          fused: bool = True, seed: int = 0, progress: bool = True) -> History:
    """Batched training with a tqdm progress bar; train/val loss every `eval_every` steps.

    train_data / val_data: (ctx, targets) NumPy int32 arrays. Ids are range-checked once here, so the
    steps skip the per-call check (it costs a device-to-host sync). History.seconds is the run's wall-clock
    time on the host clock, evaluation excluded: the rate of a whole run (tokens/s), not a kernel timing."""
    import cupy as cp
    from tqdm.auto import tqdm
    for name, data in (("train_data", train_data), ("val_data", val_data)):
        for i, ids in enumerate(data):
            expect_token_ids(ids, model.V, f"{name}[{i}]")
    vctx, vt = cp.asarray(val_data[0]), cp.asarray(val_data[1])
    hist, acc, n_acc = History(), cp.zeros((), cp.float32), 0
    bar = tqdm(total=steps, disable=not progress, desc="training", unit="step")
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for i, (c, t) in enumerate(batches(*train_data, batch, steps, seed), start=1):
        acc += model.step(cp.asarray(c), cp.asarray(t), optimizer, fused=fused, check=False)
        n_acc += 1
        if i % eval_every == 0 or i == steps:
            cp.cuda.Device().synchronize()
            hist.seconds += time.perf_counter() - t0
            hist.steps.append(i)
            hist.train.append(float(acc) / n_acc)
            hist.val_steps.append(i)
            hist.val.append(evaluate(model, vctx, vt))
            acc, n_acc = cp.zeros((), cp.float32), 0
            bar.set_postfix(train=f"{hist.train[-1]:.3f}", val=f"{hist.val[-1]:.3f}")
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
        bar.update(1)
    bar.close()
    hist.tokens = steps * batch
    return hist


def predict(model: Model, vocab: Vocab, contexts: list[str], top: int = 3) -> list[tuple[str, list]]:
    """For each context string (its last K tokens are used): the `top` next tokens with probabilities."""
    import cupy as cp
    rows = []
    for text in contexts:
        ids = vocab.encode(tokenize(text))[-model.K:]
        if len(ids) < model.K:
            raise ValueError(f"contexts: {text!r} has fewer than {model.K} tokens")
        rows.append(ids)
    p = model.probs(cp.asarray(np.stack(rows).astype(np.int32))).get()
    out = []
    for text, row in zip(contexts, p):
        best = np.argsort(row)[::-1][:top]
        out.append((text, [(vocab.words[i], float(row[i])) for i in best]))
    return out
