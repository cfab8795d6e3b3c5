"""Step 4b (training GPT-2, step4_gpt2/train/): on the CPU the float64 references against torch autograd, AdamW,
clipping, the schedule, the checkpoint layout in transformers and the named errors; on the GPU every kernel of
train_gpt2.cu, attention.cu and attention_tc.cu against the references (awkward shapes, NaN-poisoned outputs),
whole-model gradients and 20 AdamW steps against PyTorch (fp32, TF32 off), determinism and a bit-identical
resume. The lab's experiments are tested in test_step4_train_lab.py."""
import math

import numpy as np
import pytest

from common import assert_close, max_rel_error, poison
from common.reference import train_gpt2 as R
from step4_gpt2.weights import GPTConfig, random_weights
from step4_gpt2.train import train as TR
from tests.views import misaligned

try:
    import torch
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed (pip install torch)")
gpu = pytest.mark.gpu

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=37, block_size=16)


def batch(cfg, B, T, seed=0):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    idx[0, :3] = idx[0, 0]                      # a repeated token: the embedding scatter must add them
    return idx, rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)


# ============================================================================ CPU: the references
@needs_torch
@pytest.mark.parametrize("cfg,B,T", [(TINY, 3, 11), (GPTConfig(n_layer=1, n_head=3, n_embd=48, vocab_size=19, block_size=9), 2, 9)])
def test_reference_model_matches_torch_autograd(cfg, B, T):
    from step4_gpt2.train import torch_gpt as TT
    P = random_weights(cfg, notice=False)
    idx, tgt = batch(cfg, B, T)
    loss, G = R.forward_backward(P, idx, tgt, cfg.n_head)
    tl, TG = TT.loss_and_grads(cfg, P, idx, tgt, torch.float64, device="cpu")
    assert abs(loss - tl) < 1e-12
    assert set(G) == set(TG)
    for k in G:
        assert max_rel_error(G[k], TG[k]) < 1e-10, k


def test_tf32_reference_rounds_to_nearest_ties_away():
    one = np.float32(1.0)
    ulp = np.float32(2.0 ** -10)                       # TF32's step just above 1
    x = np.array([1, 1 + 2.0 ** -11, 1 + 2.0 ** -10 + 2.0 ** -11, -(1 + 2.0 ** -11), 1 + 2.0 ** -12, 1 - 2.0 ** -24],
                 np.float32)
    want = np.array([1, 1 + ulp, 1 + 2 * ulp, -(1 + ulp), 1, 1], np.float32)   # ties go away from zero
    assert np.array_equal(R.tf32(x), want)
    r = np.random.default_rng(0).standard_normal(100_000).astype(np.float32) * np.float32(1e3)
    t = R.tf32(r)
    assert not np.any(t.view(np.uint32) & np.uint32(0x1FFF))                   # 10 mantissa bits left
    assert np.max(np.abs(r - t) / np.abs(r)) <= 2.0 ** -11
    assert np.array_equal(R.tf32(t), t) and one == R.tf32(one)
    small = R.tf32(r - t)                                                     # 3xTF32's split
    assert np.max(np.abs(r - (t + small)) / np.abs(r)) <= 2.0 ** -22


@gpu
def test_tf32_reference_matches_the_hardware():
    """R.tf32 is the rounding PTX's cvt.rna.tf32.f32 does on this GPU (attention_tc.cu splits with it)."""
    import cupy as cp
    skip_without_tensor_cores(3)
    k = cp.RawKernel(r"""extern "C" __global__ void k(const float* x, float* y, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x; unsigned r;
        if (i < n) { asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x[i])); y[i] = __uint_as_float(r); } }""", "k")
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(50_000).astype(np.float32) * np.float32(1e4),
                        (np.float32(1) + np.arange(-64, 64, dtype=np.float32) * np.float32(2.0 ** -11)),   # ties
                        -(np.float32(3) + np.arange(64, dtype=np.float32) * np.float32(2.0 ** -10))])
    y = poison(cp.empty(x.size, cp.float32))
    k((-(-x.size // 256),), (256,), (cuda(x), y, np.int32(x.size)))
    assert np.array_equal(y.get(), R.tf32(x))


@needs_torch
def test_reference_layers_match_torch_autograd():
    rng = np.random.default_rng(1)
    t = lambda a: torch.tensor(a, dtype=torch.float64, requires_grad=True)  # noqa: E731
    # LayerNorm
    x, w, b, dy = rng.standard_normal((7, 13)), rng.standard_normal(13), rng.standard_normal(13), rng.standard_normal((7, 13))
    tx, tw, tb = t(x), t(w), t(b)
    torch.nn.functional.layer_norm(tx, (13,), tw, tb, 1e-5).backward(torch.tensor(dy))
    y, mean, rstd = R.layernorm_forward(x, w, b)
    dx, dw, db = R.layernorm_backward(dy, x, w, mean, rstd)
    for ours, ref in ((dx, tx.grad), (dw, tw.grad), (db, tb.grad)):
        assert_close(ours, ref.numpy(), rtol=1e-12)
    # attention on the fused qkv buffer, with bias
    B, T, H, D = 2, 5, 3, 4
    qkv, bias, do = rng.standard_normal((B, T, 3 * H * D)), rng.standard_normal(3 * H * D), rng.standard_normal((B, T, H * D))
    tq, tbias = t(qkv), t(bias)
    q, k, v = ((tq + tbias)[..., j * H * D:(j + 1) * H * D].reshape(B, T, H, D).transpose(1, 2) for j in range(3))
    to = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, H * D)
    to.backward(torch.tensor(do))
    out, lse = R.attention_forward(qkv, bias, H)
    assert_close(out, to.detach().numpy(), rtol=1e-12)
    s = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    assert_close(lse, torch.logsumexp(s, -1).detach().numpy(), rtol=1e-12)
    dqkv = R.attention_backward(do, qkv, bias, H)
    assert_close(dqkv, tq.grad.numpy(), rtol=1e-12)
    assert_close(R.bias_grad(dqkv), tbias.grad.numpy(), rtol=1e-12)
    # GELU with bias, classifier, embeddings
    h, gb, dout = rng.standard_normal((6, 5)), rng.standard_normal(5), rng.standard_normal((6, 5))
    th, tgb = t(h), t(gb)
    torch.nn.functional.gelu(th + tgb, approximate="tanh").backward(torch.tensor(dout))
    dpre, dgb = R.gelu_bias_backward(dout, R.gelu_bias_forward(h, gb)[0])
    assert_close(dpre, th.grad.numpy(), rtol=1e-12)
    assert_close(dgb, tgb.grad.numpy(), rtol=1e-12)
    z, tg = rng.standard_normal((9, 11)), rng.integers(0, 11, 9)
    tz = t(z)
    torch.nn.functional.cross_entropy(tz, torch.tensor(tg), reduction="mean").backward()
    losses, dz = R.classifier(z, tg)
    assert_close(losses, torch.nn.functional.cross_entropy(torch.tensor(z), torch.tensor(tg), reduction="none").numpy(), rtol=1e-12)
    assert_close(dz, tz.grad.numpy(), rtol=1e-12)
    idx = np.array([[1, 1, 4], [4, 0, 1]])
    dxe = rng.standard_normal((2, 3, 5))
    dwte, dwpe = R.encoder_backward(dxe, idx, 6, 4)
    twte, twpe = t(rng.standard_normal((6, 5))), t(rng.standard_normal((4, 5)))
    (twte[torch.tensor(idx)] + twpe[:3]).backward(torch.tensor(dxe))
    assert_close(dwte, twte.grad.numpy(), rtol=1e-12)
    assert_close(dwpe, twpe.grad.numpy(), rtol=1e-12)


@needs_torch
def test_reference_adamw_clip_schedule_match_torch():
    cfg = TR.TrainConfig(lr=3e-3, min_lr=3e-4, warmup=3, max_steps=8, grad_clip=0.5)
    P = random_weights(TINY, notice=False)
    tp = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in P.items()}
    decay = [tp[k] for k in P if R.is_decayed(k)]
    rest = [tp[k] for k in P if not R.is_decayed(k)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    state, ours = R.adamw_init(P), {k: v.astype(np.float64) for k, v in P.items()}
    rng = np.random.default_rng(2)
    for step in range(10):
        grads = {k: rng.standard_normal(v.shape) * (0.1 if step % 2 else 3.0) for k, v in P.items()}
        clipped, norm = R.clip_grad_norm(grads, cfg.grad_clip)
        for k in P:
            tp[k].grad = torch.tensor(grads[k])
        tnorm = torch.nn.utils.clip_grad_norm_(list(tp.values()), cfg.grad_clip)
        assert abs(norm - tnorm.item()) < 1e-9 * norm
        for g in opt.param_groups:
            g["lr"] = cfg.lr_at(step)
        opt.step()
        ours, state = R.adamw_step(ours, clipped, state, cfg.lr_at(step), (cfg.beta1, cfg.beta2), cfg.eps, cfg.weight_decay)
        for k in P:
            assert_close(ours[k], tp[k].detach().numpy(), rtol=1e-12, name=k)
    lrs = [cfg.lr_at(s) for s in range(10)]
    assert lrs[0] == pytest.approx(1e-3) and lrs[2] == pytest.approx(3e-3)    # linear warm-up
    assert lrs[3] == pytest.approx(3e-3) and lrs[8] == lrs[9] == pytest.approx(3e-4)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))                       # then monotone decay


def test_decay_rule():
    assert R.is_decayed("h.0.attn.c_attn.weight") and R.is_decayed("wte.weight")
    assert not R.is_decayed("h.0.ln_1.weight") and not R.is_decayed("ln_f.weight")
    assert not R.is_decayed("h.3.mlp.c_fc.bias")


@pytest.mark.parametrize("lr", [0, -1e-3, float("nan"), float("inf"), "1e-3", None, True])
def test_learning_rate_must_be_positive_number(lr):
    with pytest.raises(ValueError, match="lr: the learning rate must be a positive number"):
        TR.TrainConfig(lr=lr)


def test_data_batches_are_deterministic_and_shifted():
    from step4_gpt2.tokenizer import CharTokenizer
    tok = CharTokenizer(list("abcdefgh"))
    d = TR.Data(np.arange(100) % 8, np.arange(50) % 8, tok)
    x, y = d.batch("train", 4, 10, step=3, seed=1)
    x2, y2 = d.batch("train", 4, 10, step=3, seed=1)
    assert x.shape == y.shape == (4, 10) and x.dtype == np.int32
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    assert np.array_equal(x[:, 1:], y[:, :-1]) and np.array_equal((x + 1) % 8, y)
    assert not np.array_equal(x, d.batch("train", 4, 10, step=4, seed=1)[0])
    with pytest.raises(ValueError, match="split"):
        d.batch("test", 4, 10, step=0)
    with pytest.raises(ValueError, match="T: 60 tokens"):
        d.batch("val", 4, 60, step=0)


def test_shakespeare_split_by_play():
    try:
        d = TR.Data.shakespeare("char")
    except ModuleNotFoundError as e:
        pytest.skip(f"the Shakespeare corpus is not installed: {e}")
    assert 60 <= d.vocab_size <= 100
    assert len(d.train) > 5 * len(d.val) > 0
    text = d.tokenizer.decode(d.train[:2000].tolist())
    assert "the" in text


def test_attention_cu_compiles_for_head_dim_32():
    from common.kernels import compile_offline, supported_archs
    arch = max(a for a in supported_archs() if a <= 90)
    from step4_gpt2.train import ops
    report = compile_offline(ops.CU_ATT, arch, defines={**ops.ATT_DEFINES, "HEAD_DIM": 32})
    assert not report.warnings and "attention_backward_dq" in report.kernels


# ============================================================================ GPU: kernels vs the references
def cuda(a):
    import cupy as cp
    return cp.asarray(a)


def rnd(*shape, seed=0, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


@gpu
@pytest.mark.parametrize("B,T,C,V", [(1, 1, 4, 3), (3, 7, 37, 11), (2, 130, 384, 65), (1, 5, 37, 11),
                                     (4, 256, 768, 50257)])
@pytest.mark.parametrize("version", [1, 2])
def test_encoder_forward_backward(B, T, C, V, version):
    import cupy as cp
    from step4_gpt2.train import ops
    rng = np.random.default_rng(B * T)
    idx = rng.integers(0, V, (B, T)).astype(np.int32)
    idx.ravel()[: min(3, idx.size)] = idx.ravel()[0]
    wte, wpe, dx = rnd(V, C, seed=1), rnd(T + 3, C, seed=2), rnd(B * T, C, seed=3)
    out = poison(cp.empty((B * T, C), cp.float32))
    ops.encoder_forward(cuda(idx), cuda(wte), cuda(wpe), out=out)
    assert_close(out, R.encoder_forward(wte, wpe, idx).reshape(B * T, C), rtol=1e-7)
    start = rnd(V, C, seed=4)                             # the LM head's share, already in dwte
    dwte, dwpe = cuda(start), poison(cp.empty((T + 3, C), cp.float32))
    ops.encoder_backward(cuda(dx), cuda(idx), dwte, dwpe, version=version)
    rw, rp = R.encoder_backward(dx, idx, V, T + 3)
    assert_close(dwte, rw + start, rtol=1e-6)
    assert_close(dwpe, rp, rtol=1e-6)
    if version == 2:                                      # deterministic: bit for bit the same again
        again = cuda(start)
        ops.encoder_backward(cuda(dx), cuda(idx), again, dwpe, version=2)
        assert cp.array_equal(again, dwte)


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("N,C,aligned", [(1, 4, True), (37, 45, True), (33, 132, True), (77, 384, True),
                                         (77, 384, False), (9, 768, True), (300, 1600, True)])
@pytest.mark.parametrize("fused", [False, True])
def test_layernorm_forward_backward(N, C, aligned, fused):
    """C % 4 == 0 with aligned buffers takes the _vec kernels (the row in registers) up to C = 1024, with a last
    float4 column that only some lanes hold at C = 132; misaligned inputs and C = 45 or 1600 the scalar ones."""
    import cupy as cp
    from step4_gpt2.train import ops
    x, y, yb, w, b, dy = rnd(N, C, seed=1), rnd(N, C, seed=2), rnd(C, seed=3), rnd(C, seed=4), rnd(C, seed=5), rnd(N, C, seed=6)
    cuda = globals()["cuda"] if aligned else misaligned
    assert (ops._ln_vec(C, cuda(x)) is not None) == (aligned and C % 4 == 0 and C <= 1024)
    out, mean, rstd = (poison(cp.empty(s, cp.float32)) for s in ((N, C), (N,), (N,)))
    if fused:
        resid = poison(cp.empty((N, C), cp.float32))
        ops.layernorm_forward(cuda(x), cuda(w), cuda(b), y=cuda(y), ybias=cuda(yb), resid=resid, out=out, mean=mean, rstd=rstd)
        r = x.astype(np.float64) + y + yb
        assert_close(resid, r, rtol=1e-7)
    else:
        ops.layernorm_forward(cuda(x), cuda(w), cuda(b), out=out, mean=mean, rstd=rstd)
        r = x
    ry, rm, rr = R.layernorm_forward(r, w, b)
    assert_close(out, ry, rtol=1e-6)
    assert_close(mean, rm, rtol=1e-6, atol=1e-6)
    assert_close(rstd, rr, rtol=1e-6)
    base = rnd(N, C, seed=7)
    for accumulate in (False, True):
        dx = cuda(base) if accumulate else poison(cp.empty((N, C), cp.float32))
        dw, db = poison(cp.empty(C, cp.float32)), poison(cp.empty(C, cp.float32))
        ops.layernorm_backward(cuda(dy), cuda(r.astype(np.float32)), cuda(w), mean, rstd, dx=dx, dweight=dw, dbias=db,
                               accumulate=accumulate)
        rdx, rdw, rdb = R.layernorm_backward(dy, r.astype(np.float32), w, rm, rr)
        assert_close(dx, rdx + (base if accumulate else 0), rtol=1e-5)
        assert_close(dw, rdw, rtol=1e-5)
        assert_close(db, rdb, rtol=1e-5)


@gpu
@pytest.mark.parametrize("rows,cols,aligned", [(1, 1, True), (300, 37, True), (7, 132, True), (513, 1536, True),
                                               (513, 1536, False)])
def test_gelu_bias_and_column_sums(rows, cols, aligned):
    """cols % 4 == 0 with aligned buffers takes the float4 kernels (132: a last block of one float4 column)."""
    import cupy as cp
    from step4_gpt2.train import ops
    h, bias, dout = rnd(rows, cols, seed=1, scale=2), rnd(cols, seed=2), rnd(rows, cols, seed=3)
    cuda = globals()["cuda"] if aligned else misaligned
    assert ops._elem(cols, cuda(h))[0] == ("float4" if aligned and cols % 4 == 0 else "float")
    hg, out = cuda(h), poison(cp.empty((rows, cols), cp.float32))
    ops.gelu_bias_forward(hg, cuda(bias), out=out)
    rpre, rout = R.gelu_bias_forward(h, bias)
    assert cp.array_equal(hg, cuda(h))                       # h is left for the backward pass
    assert_close(out, rout, rtol=1e-6)
    dpre, db = poison(cp.empty((rows, cols), cp.float32)), poison(cp.empty(cols, cp.float32))
    ops.gelu_bias_backward(cuda(dout), hg, cuda(bias), dpre=dpre, dbias=db)
    rd, rdb = R.gelu_bias_backward(dout, rpre)
    assert_close(dpre, rd, rtol=1e-6)
    assert_close(db, rdb, rtol=1e-5)
    inplace = cuda(dout)                                     # dpre may overwrite dout
    ops.gelu_bias_backward(inplace, hg, cuda(bias), dpre=inplace, dbias=db)
    assert_close(inplace, rd, rtol=1e-6)
    s = poison(cp.empty(cols, cp.float32))
    ops.column_sum(cuda(dout), out=s)
    assert_close(s, R.bias_grad(dout), rtol=1e-5)
    again = cuda(rnd(cols, seed=9))
    ops.column_sum(cuda(dout), out=again, accumulate=True)
    assert_close(again, R.bias_grad(dout) + rnd(cols, seed=9), rtol=1e-5)
    # the float4 kernels add each column in the float kernels' order: the same bits
    assert cp.array_equal(s, ops.column_sum(misaligned(dout)))
    scalar = misaligned(dout)
    ops.gelu_bias_backward(scalar, misaligned(h), misaligned(bias), dpre=scalar, dbias=(db2 := cp.empty_like(db)))
    assert cp.array_equal(scalar, inplace) and cp.array_equal(db2, db)
    assert cp.array_equal(ops.gelu_bias_forward(misaligned(h), misaligned(bias)), out)


@gpu
def test_weight_grad_of_the_mlp_projection_in_tf32():
    """In TF32 weight_grad makes the MLP c_proj's dW (n_in = 4 n_out) as dW^T = dy^T x and copies its transpose
    (the faster orientation for cuBLAS there): the same bits as that product, and dW within TF32's accuracy. Other
    shapes (the LM head's V x C among them) and fp32 take the direct product."""
    import cupy as cp
    from common.cublas import gemm, tf32_matmuls
    from step4_gpt2.train import ops
    for n_in, transposed in ((160, True), (97, False)):
        x, dy = cuda(rnd(1000, n_in, seed=1)), cuda(rnd(1000, 40, seed=2))
        ref = x.get().astype(np.float64).T @ dy.get()
        with tf32_matmuls():
            out = ops.weight_grad(x, dy, out=poison(cp.empty((n_in, 40), cp.float32)))
            assert cp.array_equal(out, gemm(dy.T, x).T if transposed else gemm(x.T, dy))
        assert max_rel_error(out.get(), ref) < 5e-3               # TF32: 10-bit mantissas
        out = ops.weight_grad(x, dy, out=poison(cp.empty((n_in, 40), cp.float32)))
        assert cp.array_equal(out, gemm(x.T, dy))
        assert_close(out, ref, rtol=1e-5)


@gpu
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (17, 33, 5), (1, 384, 1152), (1000, 385, 67), (16384, 384, 65)])
@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
def test_gemm_matches_float64(m, k, n, layout):
    """common.cublas.gemm (the training step's GEMMs): row-major operands and transposed views, in fp32."""
    import cupy as cp
    from common.cublas import gemm
    a, b = rnd(m, k, seed=m + k), rnd(k, n, seed=n + 7)
    ga = cuda(a) if layout[0] == "n" else cuda(a.T.copy()).T
    gb = cuda(b) if layout[1] == "n" else cuda(b.T.copy()).T
    out = poison(cp.empty((m, n), cp.float32))
    assert gemm(ga, gb, out) is out
    assert_close(out, a.astype(np.float64) @ b, rtol=2e-6)
    # strided views made on the GPU: rows with a gap between them (a column slice), and a transposed one
    assert_close(gemm(cuda(np.hstack([a, a]))[:, :k], gb), a.astype(np.float64) @ b, rtol=2e-6)
    assert_close(gemm(ga, cuda(np.hstack([b.T, b.T]))[:, :k].T), a.astype(np.float64) @ b, rtol=2e-6)


@gpu
def test_gemm_is_captured_in_a_cuda_graph_and_checks_its_arguments():
    """The reason common.cublas exists: cupy.matmul refuses to be captured, gemm is recorded and replayed."""
    import cupy as cp
    from common import capture_graph
    from common.cublas import gemm
    a, b = cuda(rnd(300, 200, seed=1)), cuda(rnd(200, 100, seed=2))
    eager = gemm(a, b)
    out = poison(cp.empty((300, 100), cp.float32))
    stream = cp.cuda.Stream(non_blocking=True)
    graph = capture_graph(lambda: gemm(a, b, out), stream)
    assert bool(cp.isnan(out).all())                         # recorded, not run
    graph.launch(stream)
    stream.synchronize()
    assert cp.array_equal(out, eager)
    with pytest.raises(ValueError, match="b: expected 200 rows"):
        gemm(a, a)
    with pytest.raises(TypeError, match="a: expected dtype float32"):
        gemm(a.astype(cp.float64), b)
    with pytest.raises(ValueError, match="a: expected rows or columns with unit stride"):
        gemm(cuda(rnd(300, 400))[:, ::2], b)
    with pytest.raises(ValueError, match="out: expected shape"):
        gemm(a, b, cp.empty((300, 99), cp.float32))


@gpu
def test_a_graph_with_node_priorities_keeps_both_branches():
    """capture_graph(node_priority=True), as the training step uses it: work forked onto a stream of the highest
    priority and joined back is recorded as a second branch, and the replay gives the eager bits, the branch's
    GEMM included."""
    import cupy as cp
    from common import capture_graph, stream_priorities
    from common.cublas import gemm, own_workspace
    lowest, highest = stream_priorities()
    assert highest <= lowest
    side = cp.cuda.Stream(non_blocking=True, priority=highest)
    own_workspace(side)
    main = cp.cuda.Stream(non_blocking=True)
    a, b, c = cuda(rnd(257, 130, seed=1)), cuda(rnd(130, 70, seed=2)), cuda(rnd(257, 70, seed=3))
    out1, out2 = poison(cp.empty((257, 70), cp.float32)), poison(cp.empty((257, 70), cp.float32))

    def body():
        side.wait_event(main.record())
        with side:
            gemm(a, b, out1)
        cp.multiply(c, 2.0, out=out2)
        main.wait_event(side.record())
        cp.add(out1, out2, out=out2)

    graph = capture_graph(body, main, node_priority=True)
    assert bool(cp.isnan(out2).all())                        # recorded, not run
    graph.launch(main)
    main.synchronize()
    assert cp.array_equal(out2, gemm(a, b) + 2 * c)


@gpu
def test_gemms_on_two_streams_at_once_with_their_own_workspaces():
    """own_workspace gives a stream a cuBLAS handle and workspace of its own; GEMMs queued on it and on another
    stream at the same time (a shape whose split-K sums go through the workspace) give the one-stream bits."""
    import cupy as cp
    from common import cublas
    from common.cublas import gemm, own_workspace
    x, dy = cuda(rnd(16384, 384, seed=3)), cuda(rnd(16384, 1536, seed=4))
    want = gemm(x.T, dy)
    side = cp.cuda.Stream(non_blocking=True)
    own_workspace(side)
    own_workspace(side)                                       # once is enough: the same handle
    dev = cp.cuda.Device().id
    assert (dev, side.ptr) in cublas._handles and cublas._handles[(dev, side.ptr)] is not cublas._handles[dev]
    outs = [poison(cp.empty_like(want)) for _ in range(6)]
    main = cp.cuda.get_current_stream()
    side.wait_event(main.record())
    for i, out in enumerate(outs):
        with side if i % 2 else main:
            gemm(x.T, dy, out)
    main.wait_event(side.record())
    for out in outs:
        assert cp.array_equal(out, want)


ATT_SHAPES = [(1, 1, 1, 64), (3, 77, 1, 64), (1, 130, 3, 64), (2, 65, 2, 32), (1, 256, 5, 64), (1, 1031, 1, 32)]


def skip_without_tensor_cores(version):
    from step4_gpt2.train import ops
    if version == 3 and ops.default_attention_version() != 3:
        pytest.skip("attention version 3 needs TF32 tensor cores (sm_80+)")


@gpu
@pytest.mark.parametrize("B,T,H,D", ATT_SHAPES)
@pytest.mark.parametrize("version", [2, 3])
def test_attention_forward_saves_lse(B, T, H, D, version):
    import cupy as cp
    from step4_gpt2.train import ops
    skip_without_tensor_cores(version)
    C = H * D
    qkv, bias = rnd(B, T, 3 * C, seed=T), rnd(3 * C, seed=1, scale=0.5)
    out, lse = poison(cp.empty((B, T, C), cp.float32)), poison(cp.empty((B, H, T), cp.float32))
    ops.attention_forward(cuda(qkv), cuda(bias), H, out=out, lse=lse, version=version)
    ro, rl = R.attention_forward(qkv, bias, H)
    assert_close(out, ro, rtol=2e-6)
    # at T = 1 the lse is one dot product: measured at 6.1e-7 (v2) and 6.8e-8 (v3, whose k bias term is an FMA dot
    # product beside the tensor cores' 3xTF32 one) on an H100
    assert_close(lse, rl, rtol=1e-6)


@gpu
@pytest.mark.parametrize("B,T,H,D", ATT_SHAPES)
@pytest.mark.parametrize("version", [1, 2, 3])
def test_attention_backward(B, T, H, D, version):
    import cupy as cp
    from step4_gpt2.train import ops
    skip_without_tensor_cores(version)
    C = H * D
    qkv, bias, dout = rnd(B, T, 3 * C, seed=T), rnd(3 * C, seed=1, scale=0.5), rnd(B, T, C, seed=2)
    out, lse = ops.attention_forward(cuda(qkv), cuda(bias), H, version=2)
    dqkv = poison(cp.empty((B, T, 3 * C), cp.float32))
    ops.attention_backward(cuda(dout), cuda(qkv), cuda(bias), out, lse, H, dqkv=dqkv, version=version)
    assert_close(dqkv, R.attention_backward(dout, qkv, bias, H), rtol=1e-5)


@gpu
def test_attention_v3_refuses_a_sequence_longer_than_its_offsets():
    import cupy as cp
    from step4_gpt2.train import ops
    skip_without_tensor_cores(3)
    T = ops.V3_MAX_T + 1
    qkv, dout = cp.zeros((1, T, 3 * 64), cp.float32), cp.zeros((1, T, 64), cp.float32)
    out, lse = cp.zeros((1, T, 64), cp.float32), cp.zeros((1, 1, T), cp.float32)
    with pytest.raises(ValueError, match="version=2"):
        ops.attention_backward(dout, qkv, None, out, lse, 1, version=3)


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("version", [2, 3])
def test_attention_without_bias(version):
    """bias=None (a qkv buffer that already holds its bias): the same as a zero bias."""
    import cupy as cp
    from step4_gpt2.train import ops
    skip_without_tensor_cores(version)
    B, T, H, D = 2, 70, 3, 64
    qkv, dout, zero = rnd(B, T, 3 * H * D, seed=7), rnd(B, T, H * D, seed=8), np.zeros(3 * H * D, np.float32)
    out, lse = poison(cp.empty((B, T, H * D), cp.float32)), poison(cp.empty((B, H, T), cp.float32))
    ops.attention_forward(cuda(qkv), None, H, out=out, lse=lse, version=version)
    ro, rl = R.attention_forward(qkv, zero, H)
    assert_close(out, ro, rtol=2e-6)
    assert_close(lse, rl, rtol=2e-6)
    dqkv = poison(cp.empty((B, T, 3 * H * D), cp.float32))
    ops.attention_backward(cuda(dout), cuda(qkv), None, out, lse, H, dqkv=dqkv, version=version)
    assert_close(dqkv, R.attention_backward(dout, qkv, zero, H), rtol=1e-5)


@gpu
def test_matmul_backward_and_classifier():
    import cupy as cp
    from step4_gpt2.train import ops
    x, w, dy = rnd(37, 45, seed=1), rnd(45, 19, seed=2), rnd(37, 19, seed=3)
    dx, dw, db = (poison(cp.empty(s, cp.float32)) for s in ((37, 45), (45, 19), (19,)))
    ops.matmul_backward(cuda(dy), cuda(x), cuda(w), dx=dx, dweight=dw, dbias=db)
    for ours, ref in zip((dx, dw, db), R.matmul_backward(dy, x, w)):
        assert_close(ours, ref, rtol=1e-6)
    z, t = rnd(37, 65, seed=4, scale=3), np.random.default_rng(5).integers(0, 65, 37).astype(np.int32)
    zz, losses = cuda(z), poison(cp.empty(37, cp.float32))
    ops.classifier(zz, cuda(t), losses=losses)
    rl, rd = R.classifier(z, t)
    assert_close(losses, rl, rtol=1e-6)
    assert_close(zz, rd, rtol=1e-5)


# ============================================================================ GPU: the whole model
def whole_model_errors(cfg, B, T, attention_version=None):
    """({name: max relative error vs torch fp32}, relative loss difference)."""
    import common
    assert common.torch_cuda() is not None
    from step4_gpt2.train import torch_gpt as TT
    P = random_weights(cfg, seed=1, notice=False)
    idx, tgt = batch(cfg, B, T, seed=2)
    model = TR.TrainGPT(cfg, P)
    if attention_version is not None:
        model.attention_version = attention_version
    loss = float(model.loss_and_grads(cuda(idx), cuda(tgt)))
    ours = {k: v.get() for k, v in model.grads.items()}
    l32, g32 = TT.loss_and_grads(cfg, P, idx, tgt)
    return {k: max_rel_error(ours[k], g32[k]) for k in ours}, abs(loss - l32) / l32


@gpu
@needs_torch
@pytest.mark.parametrize("size", ["small", "shakespeare_char"])
@pytest.mark.parametrize("attention_version", [2, 3])
def test_whole_model_gradients_match_torch(size, attention_version):
    skip_without_tensor_cores(attention_version)
    if size == "small":
        cfg, B, T = GPTConfig(n_layer=2, n_head=3, n_embd=192, vocab_size=65, block_size=64), 3, 50
    else:
        cfg, B, T = TR.shakespeare_char(65), 4, 256
    err, loss_err = whole_model_errors(cfg, B, T, attention_version)
    assert loss_err < 1e-5
    bad = {k: e for k, e in err.items() if not e <= 1e-4}
    assert not bad, f"max relative error > 1e-4: {bad}"


@gpu
@needs_torch
def test_attention_backward_versions_agree_in_the_model():
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=128, vocab_size=50, block_size=96)
    e1 = whole_model_errors(cfg, 3, 70, attention_version=1)[0]
    assert max(e1.values()) <= 1e-4


@gpu
def test_gradients_are_deterministic():
    import cupy as cp
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=11, block_size=64)
    model = TR.TrainGPT(cfg, random_weights(cfg, notice=False))
    idx, tgt = batch(cfg, 5, 64)
    model.loss_and_grads(cuda(idx), cuda(tgt))
    first = model.gflat.copy()
    model.loss_and_grads(cuda(idx), cuda(tgt))
    assert cp.array_equal(first, model.gflat)


@gpu
@needs_torch
def test_twenty_adamw_steps_match_torch():
    import common
    from step4_gpt2.train import torch_gpt as TT
    common.torch_cuda()
    cfg = TR.shakespeare_char(65)
    tc = TR.TrainConfig(batch_size=8, lr=1e-3, warmup=5, max_steps=20, grad_clip=1.0)
    P = TR.init_params(cfg, seed=3)
    trainer = TR.Trainer(TR.TrainGPT(cfg, P), tc)
    tm = TT.build(cfg).load(P)
    opt = TT.adamw(tm, tc)
    from step4_gpt2.train import benchmarks as BT
    rows = []
    # text-like batches: a few frequent tokens, so the embedding rows repeat as in real data
    for s, (x, y) in enumerate(BT.random_batches(20, batch=8, seed=4)):
        trainer.step(cuda(x), cuda(y))
        ours = float(trainer.last_loss)
        theirs = TT.step(tm, opt, tc, s, torch.as_tensor(x, device="cuda").long(),
                         torch.as_tensor(y, device="cuda").long()).item()
        rows.append((s, ours, theirs, abs(ours - theirs) / theirs))
    bad = [r for r in rows if not r[3] <= 1e-4]
    assert not bad, f"steps whose loss differs by more than 1e-4 relative: {bad}"


@gpu
def test_adamw_schedule_kernel_matches_the_host_schedule():
    """The GPU's learning rate and bias corrections equal the host's (lr_at in double, 1 - b^t), in float32 bits,
    through warm-up, the cosine and past max_steps; the counters step on. The clipping factor is
    torch.nn.utils.clip_grad_norm_'s min(1, max_norm / (norm + 1e-6)) in float32, 1 without clipping."""
    import cupy as cp
    from step4_gpt2.train import ops
    tc = TR.TrainConfig(lr=1e-3, min_lr=1e-4, warmup=7, max_steps=40, beta1=0.9, beta2=0.999)
    counters, sched = cp.array([0, 5], cp.int64), poison(cp.empty(4, cp.float32))
    norms = np.random.default_rng(3).uniform(0.1, 3.0, 50).astype(np.float32)
    for step in range(50):
        max_norm = (1.0, 0.0)[step % 2]
        ops.adamw_schedule(counters, sched, tc.lr, tc.min_lr, tc.warmup, tc.max_steps, (tc.beta1, tc.beta2),
                           cp.asarray(norms[step]), max_norm)
        t = step + 6
        clip = min(np.float32(1), np.float32(max_norm) / (norms[step] + np.float32(1e-6))) if max_norm else 1.0
        want = np.array([tc.lr_at(step), 1.0 - tc.beta1 ** t, 1.0 - tc.beta2 ** t, clip], np.float32)
        assert np.array_equal(sched.get(), want), (step, sched.get(), want)
    assert counters.get().tolist() == [50, 55]
    assert (norms[::2] > 1).any() and (norms[::2] < 1).any()        # both sides of the threshold were seen


@gpu
def test_graph_step_is_the_eager_step_bit_for_bit():
    """Trainer(graph=True) replays one CUDA graph per step: the same losses, norms and weights, bit for bit, as
    the launches one by one, across a learning-rate schedule, a change of batch shape and back (new graphs;
    the memory the old one used is reused and overwritten meanwhile), and a step count set by hand."""
    import gc
    import cupy as cp
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=23, block_size=32)
    tc = TR.TrainConfig(batch_size=3, warmup=2, max_steps=8, grad_clip=0.5)
    eager, graphed = (TR.Trainer(TR.TrainGPT(cfg, seed=5), tc, graph=g) for g in (False, True))
    for s in range(9):
        T = 32 if s != 4 else 17                             # step 4: another shape, step 5: back
        if s == 6:
            eager.step_count = graphed.step_count = 2        # the schedule goes back; the GPU's counters follow
        idx, tgt = batch(cfg, 3, T, seed=s)
        eager.step(cuda(idx), cuda(tgt))
        graphed.step(cuda(idx), cuda(tgt))
        la, lb = eager.last_loss, graphed.last_loss
        assert float(la) == float(lb), (s, float(la), float(lb))
        assert float(eager.last_norm) == float(graphed.last_norm), s
        assert cp.array_equal(eager.model.flat, graphed.model.flat), s
        gc.collect()
        junk = [poison(cp.empty(n, cp.float32)) for n in (1 << 10, 1 << 16, 1 << 20)]   # reuse freed memory
        del junk
    assert graphed.step_count == 5 and graphed.opt.t == 9
    assert graphed._step_graph is not None and graphed._step_graph.key[0] == (3, 32)
    graphed.model.attention_version = 1
    with pytest.raises(ValueError, match="attention_version must be 2 or 3"):
        graphed.step(cuda(idx), cuda(tgt))


def tiny_data(cfg):
    from step4_gpt2.tokenizer import CharTokenizer
    rng = np.random.default_rng(7)
    tok = CharTokenizer([chr(ord("a") + i) for i in range(cfg.vocab_size)])
    return TR.Data(rng.integers(0, cfg.vocab_size, 5000), rng.integers(0, cfg.vocab_size, 800), tok)


@gpu
def test_save_reload_continue_is_bit_identical(tmp_path):
    import cupy as cp
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=23, block_size=32)
    tc = TR.TrainConfig(batch_size=4, warmup=2, max_steps=10, eval_every=100, eval_batches=1)
    data = tiny_data(cfg)
    a = TR.Trainer(TR.TrainGPT(cfg, seed=5), tc)
    a.fit(data, 3, progress=False)
    a.save(tmp_path / "ckpt", data.tokenizer)
    la = a.fit(data, 2, progress=False, log_every=1).train
    b = TR.Trainer.from_checkpoint(tmp_path / "ckpt")
    assert b.step_count == 3 and b.opt.t == 3
    lb = b.fit(data, 2, progress=False, log_every=1).train
    assert la == lb, (la, lb)                                   # Python floats: bit for bit
    assert cp.array_equal(a.model.flat, b.model.flat)
    assert (tmp_path / "ckpt" / "char_vocab.json").is_file()


@gpu
def test_checkpoint_loads_in_step4_gpt_and_transformers(tmp_path):
    import cupy as cp
    from step4_gpt2.model import GPT
    from step4_gpt2 import weights
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=23, block_size=32)
    model = TR.TrainGPT(cfg, random_weights(cfg, seed=6, notice=False))
    TR.Trainer(model).save(tmp_path)
    idx, _ = batch(cfg, 2, 20)
    ours = model.forward(cuda(idx)).get()
    theirs = cp.asnumpy(GPT(*weights.load_file(tmp_path)).forward(cuda(idx)))
    assert_close(theirs, ours, rtol=1e-5)
    if torch is not None:
        transformers = pytest.importorskip("transformers")
        m = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
        with torch.no_grad():
            hf = m(torch.as_tensor(idx).long()).logits.numpy()
        assert_close(hf, ours, rtol=1e-5)


@gpu
def test_named_errors(tmp_path):
    import cupy as cp
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=64, vocab_size=23, block_size=32)
    model = TR.TrainGPT(cfg, seed=0)
    idx = cp.zeros((2, 33), cp.int32)
    with pytest.raises(ValueError, match="idx: a batch of T=33 tokens .* longer than the model's block_size=32"):
        model.forward(idx, idx)
    bad = cp.full((2, 8), 23, cp.int32)
    with pytest.raises(ValueError, match=r"idx: token ids must be in \[0, 23\).*got values in \[23, 23\]"):
        model.forward(bad, cp.zeros((2, 8), cp.int32))
    with pytest.raises(ValueError, match=r"targets: token ids must be in \[0, 23\).*got values in \[-1, -1\]"):
        model.forward(cp.zeros((2, 8), cp.int32), cp.full((2, 8), -1, cp.int32))
    with pytest.raises(RuntimeError, match="backward: call forward"):
        TR.TrainGPT(cfg, seed=0).backward()
    TR.Trainer(model).save(tmp_path / "small")
    other = TR.Trainer(TR.TrainGPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=23, block_size=32)))
    with pytest.raises(TR.CheckpointError, match="another model config: n_layer=1 \\(this model: 2\\)"):
        other.load(tmp_path / "small")
    with pytest.raises(ValueError, match="head_dim"):
        TR.TrainGPT(GPTConfig(n_layer=1, n_head=4, n_embd=64, vocab_size=5, block_size=8))


@gpu
def test_returned_logits_and_losses_are_not_overwritten():
    """forward() without targets returns its own logits (the model's buffer is overwritten by the next call);
    Trainer.step returns nothing, and last_loss is each step's own array, which later steps (graph replays
    included) leave as it was; to_gpt() is step 4's GPT on the same weights."""
    import cupy as cp
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=64, vocab_size=23, block_size=32)
    model = TR.TrainGPT(cfg, seed=0)
    a, b = batch(cfg, 2, 8, seed=1)[0], batch(cfg, 2, 8, seed=2)[0]
    za = model.forward(cuda(a))
    keep = za.copy()
    model.forward(cuda(b))
    assert cp.array_equal(za, keep)
    assert_close(model.to_gpt().forward(cuda(a)), keep.get(), rtol=1e-5)
    tr = TR.Trainer(model, TR.TrainConfig(batch_size=2, warmup=1, max_steps=6), graph=True)
    seen = []
    for s in range(4):
        x, y = batch(cfg, 2, 8, seed=s)
        assert tr.step(cuda(x), cuda(y)) is None
        seen.append((tr.last_loss, float(tr.last_loss)))
    assert all(float(loss) == value for loss, value in seen)
    assert len({id(loss) for loss, _ in seen}) == len(seen)


@gpu
def test_fit_improves_and_generates():
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=8, block_size=32)
    from step4_gpt2.tokenizer import CharTokenizer
    tok = CharTokenizer(list("abcdefgh"))
    ids = np.arange(4000) % 8                                  # a trivially learnable stream
    data = TR.Data(ids, ids[:500], tok)
    tr = TR.Trainer(TR.TrainGPT(cfg, seed=0), TR.TrainConfig(batch_size=8, lr=3e-3, warmup=5, max_steps=60, eval_every=30, eval_batches=2))
    hist = tr.fit(data, 60, progress=False)
    assert hist.val[-1] < 0.5 * math.log(8) and hist.tokens == 60 * 8 * 32 and hist.tokens_per_s > 0
    from step4_gpt2.generate import generate                  # 4a's sampler, on the trained weights
    gen = generate(tr.model.to_gpt(), [tok.encode("abc")], max_new_tokens=10, temperature=0, eos=None)
    text = tok.decode(tok.encode("abc") + list(gen.tokens[0]))
    assert text == "abcdefghabcde"


@gpu
def test_tf32_matmuls_switches_both_sides_and_restores():
    """benchmarks --tf32: inside, CuPy's and torch's float32 GEMMs (and common.cublas.gemm, which follows
    CuPy's switch) round their inputs to TF32 (errors near 1e-3, not 1e-6); outside, all are plain fp32 again."""
    import cupy as cp
    import common
    from common.cublas import gemm
    from step4_gpt2.train import benchmarks as BT
    if common.device_info()["sm"] < 80:
        pytest.skip("TF32 tensor cores need sm_80 or newer: this GPU computes float32 GEMMs in fp32 either way")
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((257, 301)), rng.standard_normal((301, 263))
    ref = a @ b
    torch = common.torch_cuda()

    def errors():
        ga, gb = cp.asarray(a, cp.float32), cp.asarray(b, cp.float32)
        e = {"cupy": max_rel_error(cp.asnumpy(ga @ gb), ref), "gemm": max_rel_error(cp.asnumpy(gemm(ga, gb)), ref)}
        if torch is not None:
            ta, tb = (torch.as_tensor(m, dtype=torch.float32, device="cuda") for m in (a, b))
            e["torch"] = max_rel_error((ta @ tb).double().cpu().numpy(), ref)
        return e
    before = errors()
    with BT.tf32_matmuls():
        inside = errors()
    after = errors()
    for side in before:
        assert before[side] < 1e-5 and after[side] < 1e-5, (side, before, after)
        assert inside[side] > 1e-4, f"{side}: TF32 was not used inside tf32_matmuls(): {inside}"



@gpu
def test_step_phases_times_each_phase_as_a_graph():
    """The notebook's timeline (benchmarks.step_phases): forward, backward and update each recorded as a CUDA
    graph (the backward's second stream included) and timed, next to the whole step replayed as one graph."""
    from step4_gpt2.train import benchmarks as BT
    phases, whole = BT.step_phases(BT._config())
    assert list(phases) == ["forward + loss", "backward", "update (norm, AdamW)"]
    for name, t in phases.items():
        assert t.name == name, f"{name} was not recorded as a CUDA graph ({t.name!r})"
        assert 0 < t.median_ms < whole.median_ms * 1.5
    assert whole.median_ms > 0
