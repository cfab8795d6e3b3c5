"""Step 4b's lab (step4_gpt2/train/lab/): the experiments kept apart from the lesson's reading path, tested here.
The variants must give the mainline's bits (weight gradients on one stream, cuBLAS's memsets left in place in the
step's graph), attention v3's other TF32 splits must agree with each other, split-K weight gradients must match
float64; on the CPU, the timeline's idle-time arithmetic, the TF32 splits' compile, and the reading path's
independence from the lab."""
from pathlib import Path

import numpy as np
import pytest

from common import assert_close, poison
from step4_gpt2.train import train as TR
from step4_gpt2.weights import GPTConfig
from tests.step4.test_step4_train import batch, cuda, rnd, skip_without_tensor_cores

gpu = pytest.mark.gpu
TRAIN = Path(__file__).resolve().parents[2] / "step4_gpt2" / "train"


@pytest.mark.parametrize("split", [1, 2])
def test_tf32_split_variants_compile(split):
    """attention_tc.cu with the lab's TF32_SPLIT (tests/test_compile.py compiles the mainline's, 0)."""
    from common.kernels import compile_offline, supported_archs
    arch = max(a for a in supported_archs() if a <= 90)
    report = compile_offline(TRAIN / "attention_tc.cu", arch, defines={"HEAD_DIM": 64, "TF32_SPLIT": split})
    assert not report.warnings
    assert {"attention_forward_tc", "attention_dkv_tc", "attention_dq_tc"} <= set(report.kernels)


@gpu
@pytest.mark.parametrize("B,T,H,D", [(3, 77, 6, 64), (2, 33, 3, 32)])
def test_attention_v3_integer_rounding_is_cvt_rna(B, T, H, D):
    """attention_tc.cu rounds to TF32 with an integer add and a mask where PTX's cvt.rna.tf32.f32 costs about
    five instructions after ptxas: with both parts of each split rounded (TF32_SPLIT=1, integer; 2, cvt.rna), the
    same bits from all three kernels. (The default, 0, leaves the small part to the tensor core's truncation: the
    tests against the float64 references check it.)"""
    import cupy as cp
    from step4_gpt2.train.lab import tf32_split
    skip_without_tensor_cores(3)
    C = H * D
    qkv, bias, dout = cuda(rnd(B, T, 3 * C, seed=T)), cuda(rnd(3 * C, seed=1, scale=0.5)), cuda(rnd(B, T, C, seed=2))
    outs = []
    for split in (1, 2):
        out, lse = poison(cp.empty((B, T, C), cp.float32)), poison(cp.empty((B, H, T), cp.float32))
        tf32_split.attention_forward(qkv, bias, H, out=out, lse=lse, split=split)
        dqkv = poison(cp.empty((B, T, 3 * C), cp.float32))
        tf32_split.attention_backward(dout, qkv, bias, out, lse, H, dqkv=dqkv, split=split)
        outs.append((out, lse, dqkv))
    for name, a, b in zip(("out", "lse", "dqkv"), *outs):
        assert not bool(cp.isnan(a).any()), name
        assert bool(cp.array_equal(a, b)), f"{name}: the integer rounding changed bits"


@gpu
@pytest.mark.parametrize("N,n_in,n_out", [(37, 45, 19), (16384, 384, 65), (4096, 384, 384)])
def test_weight_grad_split_over_rows(N, n_in, n_out):
    import cupy as cp
    from step4_gpt2.train.lab import split_k
    x, dy = rnd(N, n_in, seed=1), rnd(N, n_out, seed=2)
    ref = x.astype(np.float64).T @ dy
    S = split_k.weight_splits(N, n_in, n_out)
    assert N % S == 0 and N // S >= min(N, 256)
    assert (S > 1) == (N >= 4096)                            # few output tiles over many rows: split
    for splits in (None, 1, 2 if N % 2 == 0 else 1):
        out = poison(cp.empty((n_in, n_out), cp.float32))
        split_k.weight_grad_split(cuda(x), cuda(dy), out=out, splits=splits)
        assert_close(out, ref, rtol=1e-5)                    # fp32 sums over up to 16384 rows
    with pytest.raises(ValueError, match="splits: expected a positive divisor"):
        split_k.weight_grad_split(cuda(x), cuda(dy), splits=N + 1)


@gpu
def test_weight_grads_beside_the_pass_are_the_same_bits():
    """backward() with the weight gradients on a second stream gives the bits of the one-stream pass, eager and
    inside a CUDA graph: a missing wait would let the pass overwrite dres, dh or dqkv while a weight-gradient
    GEMM still reads it. Big enough that those GEMMs take a while (the shakespeare_char width). The one-stream
    pass is the lab's OneStreamGPT, on the same weights."""
    import cupy as cp
    from step4_gpt2.train.lab.variants import OneStreamGPT
    cfg = GPTConfig(n_layer=3, n_head=6, n_embd=384, vocab_size=65, block_size=256)
    model = TR.TrainGPT(cfg, seed=2)
    idx, tgt = (cuda(a) for a in batch(cfg, 8, 250, seed=3))
    one = OneStreamGPT(cfg, seed=2)
    one.loss_and_grads(idx, tgt)
    assert one._side is None
    want = one.gflat.copy()
    for _ in range(3):
        model.gflat.fill(float("nan"))
        model.loss_and_grads(idx, tgt)
        assert cp.array_equal(want, model.gflat)
    assert model._side is not None
    from step4_gpt2.train.benchmarks import _as_graph
    replay, captured = _as_graph(lambda: model.loss_and_grads(idx, tgt, check=False))
    assert captured
    model.gflat.fill(float("nan"))
    replay()
    cp.cuda.get_current_stream().synchronize()
    assert cp.array_equal(want, model.gflat)


@gpu
def test_tf32_graph_step_with_cublas_memsets_moved_is_the_eager_step_bit_for_bit():
    """In TF32 at the shakespeare_char width, cuBLAS's Hopper GEMM kernels come with memsets into its workspace,
    which the step's graph moves off its critical path (common.graphs): the same losses and weights, bit for bit,
    as the step launched one by one and as the graph with the memsets where the capture put them (the lab's
    MemsetsInPlaceTrainer)."""
    import cupy as cp
    import common
    from common.cublas import tf32_matmuls
    from step4_gpt2.train.lab.variants import MemsetsInPlaceTrainer
    sm = common.device_info()["sm"]
    if sm < 80:
        pytest.skip("TF32 tensor cores need sm_80 or newer")
    cfg = TR.shakespeare_char(65)
    tc = TR.TrainConfig(batch_size=16, warmup=2, max_steps=8)
    with tf32_matmuls():
        trainers = [cls(TR.TrainGPT(cfg, seed=5), tc, graph=g)
                    for cls, g in ((TR.Trainer, False), (TR.Trainer, True), (MemsetsInPlaceTrainer, True))]
        for s in range(3):
            idx, tgt = batch(cfg, 16, 256, seed=s)
            for t in trainers:
                t.step(cuda(idx), cuda(tgt))
            losses = [float(t.last_loss) for t in trainers]
            assert losses[0] == losses[1] == losses[2], (s, losses)
            for t in trainers[1:]:
                assert cp.array_equal(trainers[0].model.flat, t.model.flat), s
    moved = trainers[1]._step_graph.graph.hoisted
    print(f"cuBLAS memsets moved off the step's critical path: {moved}")
    assert trainers[2]._step_graph.graph.hoisted == 0
    if sm == 90:                       # what cuBLAS 12 and 13 do on Hopper (docs/training.md's timeline)
        assert moved > 0


def test_timeline_idle_counts_only_time_when_nothing_runs():
    """benchmarks --timeline (lab/timeline.py): idle time is the time between records when no kernel, memset or
    copy runs; overlapping records (two streams) leave no gap, a record inside another's span does not end it."""
    from step4_gpt2.train.lab.timeline import idle_time as _idle
    rec = lambda ts, dur: {"ts": ts, "dur": dur}           # noqa: E731  (us, as the profiler's trace)
    events = [rec(0, 10), rec(5, 20), rec(8, 2), rec(27, 3), rec(30, 1), rec(40, 10)]
    span, idle, gaps = _idle(events)
    assert (span, gaps) == (0.05, 2) and idle == pytest.approx((2 + 9) / 1e3)
    assert _idle([rec(3, 4)]) == (0.004, 0.0, 0)
