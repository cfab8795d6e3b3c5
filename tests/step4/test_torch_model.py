"""The torch GPT on the course's kernels (step4_gpt2/torch_ops/model.py, train.py, benchmarks.py). On the CPU: the
pure-torch model trains and equals lesson 4b's torch twin in float64; the course-ops path, with PyTorch's own ops
in place of the kernels, computes the same loss and gradients (the fusion's wiring); on "meta" tensors it runs
forward and backward through the ops' fake implementations and compiles with no graph break; both variants share
one state_dict; the arguments are checked; the benchmark answers --help. On the GPU: 20 AdamW steps of the
course's ops against pure torch, torch.compile with no graph break, and a CUDA-graph run equal to the eager one.
The ops themselves are tested in test_torch_ops.py."""
import math
import subprocess
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from common import max_rel_error  # noqa: E402
from common.kernels import ROOT  # noqa: E402
from step4_gpt2.torch_ops import model as M  # noqa: E402
from step4_gpt2.torch_ops import train as TR  # noqa: E402
from step4_gpt2.weights import GPTConfig, expected_shapes, random_weights  # noqa: E402

gpu = pytest.mark.gpu
TINY = GPTConfig(n_layer=3, n_head=2, n_embd=64, vocab_size=80, block_size=32)


def batch(cfg, B, T, seed=0, device="cpu"):
    rng = np.random.default_rng(seed)
    idx, tgt = (torch.as_tensor(rng.integers(0, cfg.vocab_size, (B, T))) for _ in range(2))
    return idx.to(device), tgt.to(device)


def reference_ops():
    """The five functions of step4_gpt2.torch_ops.ops written with PyTorch's own ops (any dtype, any device)."""
    def layernorm(x, weight, bias, eps=1e-5):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    def residual_layernorm(x, y, ybias, weight, bias, eps=1e-5):
        resid = x + y + ybias
        return resid, layernorm(resid, weight, bias, eps)

    def attention(qkv, n_head):
        B, T, C3 = qkv.shape
        q, k, v = (t.view(B, T, n_head, -1).transpose(1, 2) for t in qkv.split(C3 // 3, dim=2))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C3 // 3)

    return types.SimpleNamespace(
        layernorm=layernorm, residual_layernorm=residual_layernorm, attention=attention,
        bias_gelu=lambda h, bias: F.gelu(h + bias, approximate="tanh"),
        cross_entropy=lambda logits, targets: F.cross_entropy(logits.flatten(0, -2), targets.flatten()))


def course_op_calls(explained) -> int:
    """Calls of the course's ops in the graphs torch._dynamo.explain recorded."""
    return sum(str(n.target).startswith("course.") for g in explained.graphs for n in g.graph.nodes
               if n.op == "call_function")


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


# ============================================================================ CPU
def test_pure_torch_model_trains_on_the_cpu():
    losses = TR.train(M.GPT(TINY), steps=4, batch=2, block=16, seed=1)
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    assert abs(losses[0] - math.log(TINY.vocab_size)) < 0.5        # GPT-2's initialisation: near uniform at first
    assert TR.train(M.GPT(TINY), steps=4, batch=2, block=16, seed=1) == losses    # batches and init fixed by seed


def test_both_variants_share_one_state_dict():
    cfg = M.shakespeare_char(TR.shakespeare().vocab_size)
    plain, course = M.GPT(cfg, course_ops=False), M.GPT(cfg, course_ops=True)
    a, b = plain.state_dict(), course.state_dict()
    assert list(a) == list(b) and set(a) == set(expected_shapes(cfg))        # GPT-2's names, the LM head tied
    assert all(torch.equal(a[k], b[k]) for k in a)                           # 4b's initialisation on both
    other = M.GPT(cfg, course_ops=True, seed=1)
    assert not torch.equal(other.state_dict()["h.0.attn.c_attn.weight"], a["h.0.attn.c_attn.weight"])
    other.load_state_dict(a)
    plain.load_state_dict(other.state_dict())
    assert all(torch.equal(other.state_dict()[k], a[k]) for k in a)
    assert sum(p.numel() for p in plain.parameters()) == cfg.n_params()


def test_pure_torch_model_equals_lesson_4bs_torch_twin_in_float64():
    from step4_gpt2.train import torch_gpt as TT
    P = random_weights(TINY, seed=2, notice=False)                 # random biases and LayerNorms too
    idx, tgt = batch(TINY, 3, 19, seed=3)
    want_loss, want = TT.loss_and_grads(TINY, P, idx.numpy(), tgt.numpy(), torch.float64, device="cpu")
    model = M.GPT(TINY).double().load_gpt2_params(P)
    _, loss = model(idx, tgt)
    loss.backward()
    assert abs(loss.item() - want_loss) < 1e-12
    ours = {n: p.grad.numpy().T if p.dim() == 2 and "c_" in n else p.grad.numpy() for n, p in model.named_parameters()}
    assert set(ours) == set(want)
    for k in want:
        assert max_rel_error(ours[k], want[k]) < 1e-10, k
    back = model.gpt2_params()
    assert all(np.array_equal(back[k], np.asarray(P[k], np.float32)) for k in P)


def test_course_path_computes_what_pure_torch_computes(monkeypatch):
    """The fused order (each residual add inside the next LayerNorm, biases moved into the kernels that follow
    their matmuls), with PyTorch's ops standing in for the kernels: the same loss and gradients in float64."""
    monkeypatch.setattr(M, "K", reference_ops())
    P = random_weights(TINY, seed=4, notice=False)
    idx, tgt = batch(TINY, 2, 23, seed=5)
    out = {}
    for course in (False, True):
        model = M.GPT(TINY, course_ops=course).double().load_gpt2_params(P)
        logits, loss = model(idx, tgt)
        loss.backward()
        out[course] = logits.detach(), loss.item(), grads(model)
    assert abs(out[True][1] - out[False][1]) < 1e-12
    assert max_rel_error(out[True][0].numpy(), out[False][0].numpy()) < 1e-12
    for k, g in out[False][2].items():
        assert max_rel_error(out[True][2][k].numpy(), g.numpy()) < 1e-10, k


def test_course_model_runs_on_meta_tensors_and_compiles_without_graph_breaks():
    """On "meta" tensors (shapes, no data) the ops run their fake implementations: the model's calls type-check
    forward and backward, and dynamo traces the whole forward pass as one graph, on any machine."""
    model = M.GPT(TINY, course_ops=True).to("meta")
    idx, tgt = (torch.zeros(2, 16, dtype=torch.long, device="meta") for _ in range(2))
    logits, loss = model(idx, tgt)
    assert logits.shape == (2, 16, TINY.vocab_size) and loss.shape == ()
    loss.backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(idx, tgt)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    assert course_op_calls(explained) == 2 + 4 * TINY.n_layer      # layernorm, 4 per block, cross_entropy
    torch._dynamo.reset()
    _, loss = torch.compile(model, backend="aot_eager", fullgraph=True)(idx, tgt)
    loss.backward()                                  # the backward graph goes through the backward ops' fakes
    torch._dynamo.reset()


def test_course_model_names_the_argument_of_a_cpu_tensor():
    model = M.GPT(TINY, course_ops=True)
    with pytest.raises(TypeError, match=r"^x: expected a CUDA tensor"):
        model(*batch(TINY, 2, 8))


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="^config: head_dim"):
        M.GPT(GPTConfig(n_layer=1, n_head=4, n_embd=64, vocab_size=10, block_size=8), course_ops=True)
    with pytest.raises(ValueError, match="^idx: T=9"):
        M.GPT(GPTConfig(n_layer=1, n_head=1, n_embd=32, vocab_size=10, block_size=8))(*batch(TINY, 1, 9))
    with pytest.raises(ValueError, match="^params: no wte.weight"):
        M.GPT(TINY).load_gpt2_params({})
    P = dict(random_weights(TINY, notice=False))
    P["h.0.mlp.c_fc.weight"] = P["h.0.mlp.c_fc.weight"].T
    with pytest.raises(ValueError, match=r"^params: h.0.mlp.c_fc.weight has shape \(256, 64\)"):
        M.GPT(TINY).load_gpt2_params(P)
    model = M.GPT(TINY)
    with pytest.raises(ValueError, match="^graph: a CUDA graph needs the model on a CUDA device"):
        TR.train(model, steps=1, batch=1, block=8, graph=True)
    with pytest.raises(ValueError, match="^block: 33 tokens"):
        TR.train(model, steps=1, batch=1, block=33)
    with pytest.raises(ValueError, match="^steps: expected a positive integer"):
        TR.train(model, steps=0)
    with pytest.raises(ValueError, match=r"^data: \d+ tokens"):
        TR.train(M.GPT(GPTConfig(n_layer=1, n_head=1, n_embd=32, vocab_size=10, block_size=8)), steps=1, batch=1,
                 block=8)


def test_adamw_decays_the_matrices_and_embeddings_as_lesson_4b():
    model = M.GPT(TINY)
    opt = TR.adamw(model, TR.TrainConfig(weight_decay=0.3, beta1=0.8, beta2=0.95, eps=1e-7, lr=2e-3))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in opt.param_groups[0]["params"]}
    assert opt.param_groups[0]["weight_decay"] == 0.3 and opt.param_groups[1]["weight_decay"] == 0.0
    assert decayed == {n for n, p in model.named_parameters() if p.dim() == 2}          # nanoGPT's rule
    assert opt.defaults["betas"] == (0.8, 0.95) and opt.defaults["eps"] == 1e-7          # the config's, not defaults
    assert opt.defaults["lr"] == 2e-3 and not opt.defaults["capturable"]                 # eager: a float lr
    graphed = TR.adamw(model, TR.TrainConfig(lr=2e-3), capturable=True)                 # for a CUDA graph:
    assert graphed.defaults["capturable"] and isinstance(graphed.param_groups[0]["lr"], torch.Tensor)  # lr a tensor
    assert graphed.param_groups[0]["lr"].item() == pytest.approx(2e-3)
    TR.set_lr(opt, 3e-4)
    assert all(g["lr"] == 3e-4 for g in opt.param_groups)
    with pytest.raises(ValueError, match="^graph: a CUDA graph needs the model on a CUDA device"):
        TR.stepper(model, TR.TrainConfig(), graph=True)


def test_benchmark_family_and_help():
    from common.benchmarks import valid_names
    assert "step4_gpt2:torch_ops" in valid_names()
    r = subprocess.run([sys.executable, "-m", "step4_gpt2.torch_ops.benchmarks", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "--no-compile" in r.stdout, r.stderr


# ============================================================================ GPU
def _cuda_models(course_ops=(False, True), vocab=None):
    import common
    assert common.torch_cuda() is not None, "torch with CUDA"          # TF32 off: fp32 on both sides
    cfg = M.shakespeare_char(vocab or TR.shakespeare().vocab_size)
    return [M.GPT(cfg, course_ops=c).cuda() for c in course_ops]


def _rel(a, b):
    return [abs(x - y) / abs(y) for x, y in zip(a, b)]


@gpu
def test_twenty_adamw_steps_of_the_course_ops_match_pure_torch():
    plain, course = _cuda_models()
    want = TR.train(plain, steps=20, batch=8, block=256, seed=3)
    got = TR.train(course, steps=20, batch=8, block=256, seed=3)
    bad = [(s, g, w, r) for s, (g, w, r) in enumerate(zip(got, want, _rel(got, want))) if not r <= 1e-5]
    assert not bad, f"steps whose loss differs by more than 1e-5 relative (step, course, torch, rel): {bad}"
    assert got[-1] < got[0]


@gpu
def test_torch_compile_sees_the_course_ops_without_graph_breaks():
    (course,) = _cuda_models((True,))
    idx, tgt = batch(course.config, 4, 256, device="cuda")
    torch._dynamo.reset()
    explained = torch._dynamo.explain(course)(idx, tgt)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert course_op_calls(explained) == 2 + 4 * course.config.n_layer       # every op inside the graph
    torch._dynamo.reset()
    eager = TR.train(_cuda_models((True,))[0], steps=6, batch=8, block=256, seed=5)
    compiled = TR.train(course, steps=6, batch=8, block=256, seed=5, compile=True)
    torch._dynamo.reset()
    assert max(_rel(compiled, eager)) <= 1e-5, (compiled, eager)


@gpu
@pytest.mark.parametrize("course_ops", [True, False])
def test_a_cuda_graph_replays_the_eager_steps(course_ops):
    """WARMUP_STEPS eager steps, the capture, then replays: the same losses as the same steps run eagerly."""
    steps = TR.WARMUP_STEPS + 5
    eager = TR.train(_cuda_models((course_ops,))[0], steps=steps, batch=8, block=256, seed=7)
    graphed = TR.train(_cuda_models((course_ops,))[0], steps=steps, batch=8, block=256, seed=7, graph=True)
    assert max(_rel(graphed, eager)) <= 1e-6, (graphed, eager)
    assert graphed[-1] != graphed[TR.WARMUP_STEPS]                  # the replays train: each step its own batch


@gpu
def test_the_benchmark_times_every_mode():
    """A short run of the benchmark's rows (2 timed steps per mode, torch.compile left out): each mode trains and
    is timed, the ratios are there."""
    from step4_gpt2.torch_ops import benchmarks as BM
    rows = BM.train_rows(compile_torch=False, steps=2)
    names = [r.name for r in rows]
    assert [n for n in names if n.endswith("(tok/s)")] == [f"torch GPT step, {m[0]} (tok/s)" for m in BM.MODES
                                                            if not m[2]]
    assert "torch GPT step, course ops vs torch eager" in names
    assert "torch GPT step, course ops, CUDA graph vs torch eager" in names
    assert not torch.backends.cuda.matmul.allow_tf32, "TF32 is switched back off after the benchmark"
    assert all(r.ms > 0 and math.isfinite(r.ms) for r in rows)
