"""Benchmarks of step 4b (training GPT-2 on the course's kernels), at nanoGPT's shakespeare_char size:
6 layers, 6 heads, C = 384, context 256, batch 64, a 65-character vocabulary, fp32 everywhere (cuBLAS GEMMs
through common.cublas in plain fp32; torch with TF32 switched off by common.torch_cuda()).

Rows: tokens/s of a whole training step (forward, backward, clipping, AdamW), ours launched one by one and
replayed as one CUDA graph, against the same model and step in PyTorch eager and torch.compile (same batch,
same GPU, same run); the lab's variants of the graph (one stream, cuBLAS's memsets in place); where the time
of one step goes (GEMMs vs every other kernel family, each timed as a CUDA graph; the lab's split-K weight
gradients); attention forward v2 vs v3 and backward v1 (materialised probabilities) vs v2 (flash-style, FMA
units) vs v3 (tensor cores, 3xTF32), beside PyTorch's SDPA, at T = 256 and 1024, and v3's TF32 splits (the
lab's). `quality()` trains ours and PyTorch's for the same steps on the same batches and reports the validation
loss and wall time of each. The lab's variants come from step4_gpt2.train.lab, imported only by the functions
that measure them.

    python -m step4_gpt2.train.benchmarks            # or: python -m common.benchmarks --only step4_gpt2:train
    python -m step4_gpt2.train.benchmarks --tf32     # the step rows with TF32 GEMMs on both sides
    python -m step4_gpt2.train.benchmarks --timeline # inside the TF32 step's CUDA graph: idle gaps, kernel times
"""
from __future__ import annotations

import contextlib
import time                   # quality(): PyTorch's training loop keeps its wall clock, as Trainer.fit does

import numpy as np

import common
from common import bench, max_rel_error, torch_cuda
from common.benchmarks import Row
from common.cublas import tf32_matmuls

B, T, V = 64, 256, 65
SIZE = f"6L C384 B{B} T{T}"


def _config(vocab_size: int = V):
    from step4_gpt2.train.model import shakespeare_char
    return shakespeare_char(vocab_size)


def random_batches(n: int, batch: int = B, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """n (inputs, targets) int32 batches of random ids, lower ids more frequent (no dataset needed)."""
    rng = np.random.default_rng(seed)
    p = np.arange(V, 0, -1, dtype=np.float64)
    out = []
    for _ in range(n):
        ids = rng.choice(V, size=(batch, T + 1), p=p / p.sum()).astype(np.int32)
        out.append((ids[:, :-1].copy(), ids[:, 1:].copy()))
    return out


def _sync(torch) -> None:
    """Wait until the GPU has finished CuPy's work and, with `torch` (torch_cuda()'s module, or None), torch's."""
    import cupy as cp
    cp.cuda.Device().synchronize()
    if torch is not None:
        torch.cuda.synchronize()


def loop_wall_s(step, batches, warmup: int = 3) -> float:
    """Seconds per step of a loop that runs `step` on each batch, host clock, after `warmup` steps, until the
    GPU has finished them: what a training loop sees (launch overheads included, no sync inside the loop).
    Not one call between syncs (bench's wall_ms): a training loop queues steps on distinct batches."""
    torch = torch_cuda()
    for x, y in batches[:warmup]:
        step(x, y)
    _sync(torch)

    def loop():
        for x, y in batches[warmup:]:
            step(x, y)
        _sync(torch)
    return bench(loop, name="training loop", cpu=True, warmup=0, repeat=1).median_ms * 1e-3 / (len(batches) - warmup)


def queue_s(step, batches, warmup: int = 2) -> float:
    """Seconds of host time to queue one step (the mean over the batches after `warmup`, queued back to back),
    the GPU idle before the first (anything in the step that waits for the GPU counts too, a full launch queue included): when it
    exceeds the step's GPU time, the training loop is host-bound and a faster GPU does not make it faster."""
    torch = torch_cuda()
    for x, y in batches[:warmup]:
        step(x, y)
    _sync(torch)

    def queue():                          # the steps queued back to back, as a training loop queues them
        for x, y in batches[warmup:]:
            step(x, y)
    t = bench(queue, name="queue the steps", cpu=True, warmup=0, repeat=1)
    _sync(torch)
    return t.median_ms * 1e-3 / (len(batches) - warmup)


def ours_step(config=None, tc=None, graph: bool = False, model_class=None, trainer_class=None):
    """(trainer, step(x, y)) for our model; x, y NumPy batches copied to the GPU inside the step. graph=True:
    the step replayed as one CUDA graph (Trainer(graph=True)). model_class / trainer_class: a lab variant
    (step4_gpt2.train.lab.variants) instead of TrainGPT / Trainer."""
    import cupy as cp
    from step4_gpt2.train.train import Trainer, TrainConfig, TrainGPT
    model = (model_class or TrainGPT)(config or _config(), seed=0)
    trainer = (trainer_class or Trainer)(model, tc or TrainConfig(batch_size=B), graph=graph)
    return trainer, lambda x, y: trainer.step(cp.asarray(x), cp.asarray(y), check=False)


def torch_step(config=None, tc=None, compiled: bool = False, params=None):
    """(model, step(x, y)) for the same model and step in PyTorch, or (None, None) without torch+CUDA."""
    torch = torch_cuda()
    if torch is None:
        return None, None
    from step4_gpt2.train import torch_gpt as TT
    from step4_gpt2.train.train import TrainConfig, init_params
    cfg, tc = config or _config(), tc or TrainConfig(batch_size=B)
    model = TT.build(cfg).load(params or init_params(cfg, 0))
    opt = TT.adamw(model, tc)
    fwd = torch.compile(model) if compiled else model
    state = {"i": 0}

    def step(x, y):
        loss = TT.step(fwd, opt, tc, state["i"], torch.as_tensor(x, device="cuda").long(),
                       torch.as_tensor(y, device="cuda").long())
        state["i"] += 1
        return loss
    return model, step


def train_throughput_rows(compile_torch: bool = True, steps: int = 20, vocab_size: int = V,
                          tf32: bool = False) -> list[Row]:
    """Our training step against PyTorch eager (and torch.compile) on the same batches: the shakespeare_char
    model with a vocabulary of vocab_size tokens (65 characters by default; the notebook passes its own).
    tf32: every float32 GEMM on TF32 tensor cores, on both sides (rows marked TF32); else plain fp32."""
    with tf32_matmuls() if tf32 else contextlib.nullcontext():
        return _throughput_rows(compile_torch, steps, vocab_size, "train step TF32" if tf32 else "train step")


def train_variant_rows(steps: int = 20, vocab_size: int = V, tf32: bool = False) -> list[Row]:
    """The step's CUDA graph against the lab's variants of it (step4_gpt2.train.lab.variants), same batches:
    the weight gradients on the pass's own stream ("one stream") and cuBLAS's memsets where the capture put
    them ("cuBLAS memsets in place"); tok/s of each and the graph's ratio to each."""
    from step4_gpt2.train.lab.variants import MemsetsInPlaceTrainer, OneStreamGPT
    what = "train step TF32" if tf32 else "train step"
    batches, tokens, config = random_batches(steps + 3), B * T, _config(vocab_size)
    rows, t = [], {}
    with tf32_matmuls() if tf32 else contextlib.nullcontext():
        for label, kw in (("one stream", dict(model_class=OneStreamGPT)),
                          ("cuBLAS memsets in place", dict(trainer_class=MemsetsInPlaceTrainer)), (None, {})):
            _, ours = ours_step(config, graph=True, **kw)
            t[label] = loop_wall_s(ours, batches)
            if label is not None:
                rows.append(Row(f"{what}, ours, CUDA graph, {label} (tok/s)", SIZE, t[label] * 1e3,
                                rate=tokens / t[label], unit="tok/s"))
    best = t[None]
    for anchor in ("one stream", "cuBLAS memsets in place"):
        rows.append(Row(f"{what}, CUDA graph vs {anchor}", SIZE, best * 1e3, rate=tokens / best, unit="tok/s",
                        anchor=anchor, ratio=t[anchor] / best))
    return rows


def _throughput_rows(compile_torch: bool, steps: int, vocab_size: int, what: str) -> list[Row]:
    batches = random_batches(steps + 3)
    tokens = B * T
    config = _config(vocab_size)
    rows, t_ours = [], {}
    for graph, label in ((False, "ours"), (True, "ours, CUDA graph")):
        _, ours = ours_step(config, graph=graph)
        t = t_ours[graph] = loop_wall_s(ours, batches)
        rows.append(Row(f"{what}, {label} (tok/s)", SIZE, t * 1e3, rate=tokens / t, unit="tok/s"))
        rows.append(Row(f"{what}, {label}: host time to queue it", SIZE, queue_s(ours, batches[:7]) * 1e3))
    anchors = [("torch eager", False)] + ([("torch.compile", True)] if compile_torch else [])
    for label, compiled in anchors:
        _, step = torch_step(config, compiled=compiled)
        if step is None:
            print("torch with CUDA not installed: no torch rows")
            break
        t = loop_wall_s(step, batches, warmup=3)
        rows.append(Row(f"{what}, {label} (tok/s)", SIZE, t * 1e3, rate=tokens / t, unit="tok/s"))
        for graph, name in ((False, "ours"), (True, "ours (graph)")):
            ours = t_ours[graph]
            r = Row(f"{what}, {name} vs {label}", SIZE, ours * 1e3, rate=tokens / ours, unit="tok/s", anchor=label,
                    ratio=t / ours)
            rows.append(r.check("ratio", 1.5 if not compiled else 1.0))
    return rows


def _as_graph(fn, node_priority: bool = False):
    """fn's GPU work recorded once as a CUDA graph, and a function that replays it on the current stream, or fn
    itself where it cannot be recorded (cupy.matmul): a piece made of many short launches is then timed without
    the host's gaps between them, as it runs inside the step's own graph. Temporaries come from a memory pool of
    the graph's own, which a first run fills (nothing may be allocated during a capture). node_priority: kernels
    keep their streams' priorities, as in the step's graph (the backward pass's weight-gradient stream)."""
    import cupy as cp
    from common import capture_graph
    pool, stream = cp.cuda.MemoryPool(), cp.cuda.Stream(non_blocking=True)
    try:
        with cp.cuda.using_allocator(pool.malloc):
            with stream:
                fn()
            stream.synchronize()
            graph = capture_graph(fn, stream, node_priority=node_priority)
    except Exception:               # CuPy refuses to capture its cuBLAS calls
        return fn, False

    def replay(_keep=(graph, pool)):
        graph.launch(cp.cuda.get_current_stream())
    return replay, True


def step_phases(config=None, tf32: bool = False) -> tuple[dict, object]:
    """The timeline of one training step at batch 64: ({phase: Timing}, Timing of the whole step). The whole
    step is replayed as one CUDA graph (Trainer(graph=True)); each phase - the forward pass with the loss and
    dlogits, the backward pass, the update (gradient norm, schedule, AdamW) - is recorded as a CUDA graph of its
    own on the step's buffers and timed alone (CUDA events, median, no host time inside). tf32: the GEMMs on
    TF32 tensor cores (tf32_matmuls)."""
    import cupy as cp
    config = config or _config()
    x, y = (cp.asarray(a) for a in random_batches(1)[0])
    with tf32_matmuls() if tf32 else contextlib.nullcontext():
        trainer, _ = ours_step(config, graph=True)
        m = trainer.model
        for _ in range(3):                        # the first step runs eagerly and records the step's graph
            trainer.step(x, y, check=False)
        whole = bench(lambda: trainer.step(x, y, check=False), name="whole step, one CUDA graph")
        m.forward(x, y, check=False)
        saved = m._a                              # what the forward pass keeps for the backward pass

        def backward():                           # backward() consumes that record; each replay reuses it
            m._a = saved
            m.backward()
        phases = {"forward + loss": (lambda: m.forward(x, y, check=False), False), "backward": (backward, True),
                  "update (norm, AdamW)": (trainer._update, False)}
        times = {}
        for name, (fn, priority) in phases.items():
            fn, graphed = _as_graph(fn, node_priority=priority)
            times[name] = bench(fn, name=name if graphed else f"{name}, launched one by one")
    del trainer, _, m, saved, phases, fn, backward
    import gc
    gc.collect()                                  # the graphs' memory pools and the model's activations go now
    cp.get_default_memory_pool().free_all_blocks()
    return times, whole


def train_breakdown_rows() -> list[Row]:
    """Where one step's GPU time goes: each kernel family recorded as a CUDA graph (as the step runs, one graph
    per step) and timed alone on the step's own buffers, as many calls as one step makes, and its share of the
    whole step (CUDA events, median)."""
    import cupy as cp
    from common.cublas import gemm
    from step4_gpt2.train import ops
    from step4_gpt2.train.lab.split_k import weight_grad_split
    trainer, _ = ours_step(graph=True)
    m = trainer.model
    cfg, P, G = m.config, m.params, m.grads
    L, C, H, N = cfg.n_layer, cfg.n_embd, cfg.n_head, B * T
    x, y = (cp.asarray(a) for a in random_batches(1)[0])
    whole = bench(lambda: trainer.step(x, y, check=False), name="whole step")
    rows = []
    m.forward(x, y)                               # fills the activations the pieces below read
    a = m._a
    p = lambda i, n: P[f"h.{i}.{n}"]  # noqa: E731

    def dw(x_, dy_, out, split):
        return weight_grad_split(x_, dy_, out=out, splits=None) if split else ops.weight_grad(x_, dy_, out=out)

    def gemms(split=False, forward=True, dx=True):
        dq = a.dqkv.reshape(N, 3 * C)
        for i in range(L):
            if forward:
                gemm(a.ln1[i], p(i, "attn.c_attn.weight"), a.qkv[i])
                gemm(a.atty[i].reshape(N, C), p(i, "attn.c_proj.weight"), a.tmp)
                gemm(a.ln2[i], p(i, "mlp.c_fc.weight"), a.dh)
                gemm(a.h[i], p(i, "mlp.c_proj.weight"), a.tmp)
            if dx:
                gemm(a.dres, p(i, "mlp.c_proj.weight").T, a.dh)
                gemm(a.dh, p(i, "mlp.c_fc.weight").T, a.dln)
                gemm(a.dres, p(i, "attn.c_proj.weight").T, a.datty.reshape(N, C))
                gemm(dq, p(i, "attn.c_attn.weight").T, a.dln)
            if split is not None:
                dw(a.h[i], a.dres, G[f"h.{i}.mlp.c_proj.weight"], split)
                dw(a.ln2[i], a.dh, G[f"h.{i}.mlp.c_fc.weight"], split)
                dw(a.atty[i].reshape(N, C), a.dres, G[f"h.{i}.attn.c_proj.weight"], split)
                dw(a.ln1[i], dq, G[f"h.{i}.attn.c_attn.weight"], split)
        if forward:
            gemm(a.lnf, P["wte.weight"].T, a.logits)
        if dx:
            gemm(a.logits, P["wte.weight"], a.dln)
        if split is not None:
            dw(a.logits, a.lnf, G["wte.weight"], split)

    third = 2.0 * N * (12 * C * C * L + C * V)             # FLOPs of one of forward / dx / dW
    for label, kw in (("forward GEMMs", dict(split=None, dx=False)), ("input-gradient GEMMs (dx)", dict(split=None, forward=False)),
                      ("weight-gradient GEMMs (dW), one GEMM each", dict(split=False, forward=False, dx=False)),
                      ("dW GEMMs split over rows (split-K)", dict(split=True, forward=False, dx=False))):
        fn, graphed = _as_graph(lambda kw=kw: gemms(**kw))
        t = bench(fn, name=label if graphed else f"{label}, launched one by one", flops=third)
        rows.append(Row.of(t, SIZE, ceiling=("fp32 peak", common.fp32_peak_tflops())))
    torch = torch_cuda()
    if torch is not None:                         # what PyTorch's own dW GEMMs (one torch.mm each) take
        tt = lambda a_: torch.as_tensor(a_, device="cuda")  # noqa: E731  (zero-copy view of the CuPy array)
        pairs = [(tt(a.h[i]), tt(a.dres)) for i in range(L)] + [(tt(a.ln2[i]), tt(a.dh)) for i in range(L)] + \
                [(tt(a.atty[i].reshape(N, C)), tt(a.dres)) for i in range(L)] + \
                [(tt(a.ln1[i]), tt(a.dqkv.reshape(N, 3 * C))) for i in range(L)] + [(tt(a.logits), tt(a.lnf))]
        t = bench(lambda: [torch.mm(u.T, v) for u, v in pairs], name="torch.mm weight-gradient GEMMs", flops=third)
        rows.append(Row.of(t, SIZE, ceiling=("fp32 peak", common.fp32_peak_tflops())))

    qkv = [q.reshape(B, T, 3 * C) for q in a.qkv]
    av = m.attention_version
    pieces = {
        "all GEMMs (cuBLAS, 12 per layer + LM head x3)": (gemms, 3 * third),
        f"attention forward v{av} (saves lse)": (lambda: [ops.attention_forward(qkv[i], p(i, "attn.c_attn.bias"), H, out=a.atty[i], lse=a.lse[i], version=av) for i in range(L)], None),
        f"attention backward v{av}": (lambda: [ops.attention_backward(a.datty, qkv[i], p(i, "attn.c_attn.bias"), a.atty[i], a.lse[i], H, dqkv=a.dqkv, version=av) for i in range(L)], None),
        "LayerNorm forward (+residual)": (lambda: [ops.layernorm_forward(a.resid[i], p(i, "ln_2.weight"), p(i, "ln_2.bias"), y=a.tmp, ybias=p(i, "attn.c_proj.bias"), resid=a.resid2[i], out=a.ln2[i], mean=a.m2[i], rstd=a.r2[i]) for i in range(L) for _ in range(2)], None),
        "LayerNorm backward": (lambda: [ops.layernorm_backward(a.dln, a.resid2[i], p(i, "ln_2.weight"), a.m2[i], a.r2[i], dx=a.dres, dweight=G[f"h.{i}.ln_2.weight"], dbias=G[f"h.{i}.ln_2.bias"], accumulate=True) for i in range(L) for _ in range(2)], None),
        "bias + GELU forward and backward": (lambda: [(ops.gelu_bias_forward(a.pre[i], p(i, "mlp.c_fc.bias"), out=a.h[i]), ops.gelu_bias_backward(a.h[i], a.pre[i], p(i, "mlp.c_fc.bias"), dpre=a.dh, dbias=G[f"h.{i}.mlp.c_fc.bias"])) for i in range(L)], None),
        "bias gradients (column sums)": (lambda: [(ops.column_sum(a.dres, out=G[f"h.{i}.mlp.c_proj.bias"]), ops.column_sum(a.dres, out=G[f"h.{i}.attn.c_proj.bias"]), ops.column_sum(a.dqkv.reshape(N, 3 * C), out=G[f"h.{i}.attn.c_attn.bias"])) for i in range(L)], None),
        "embeddings forward + backward": (lambda: (ops.encoder_forward(x, P["wte.weight"], P["wpe.weight"], out=a.tmp), ops.encoder_backward(a.dres, x, G["wte.weight"], G["wpe.weight"])), None),
        "fused classifier": (lambda: ops.classifier(a.logits, y.reshape(N), losses=a.losses, grad=False), None),
        "gradient norm + schedule + AdamW (clipping inside AdamW)": (lambda: trainer._update(), None),
    }
    rows.insert(0, Row("whole training step (ours, one CUDA graph)", SIZE, whole.median_ms, rate=N / (whole.median_ms * 1e-3),
                       unit="tok/s"))
    rows.insert(1, Row("whole step, host clock from idle", SIZE, whole.wall_median_ms, rate=N / (whole.wall_median_ms * 1e-3),
                       unit="tok/s"))
    total = 0.0
    for name, (fn, flops) in pieces.items():
        fn, graphed = _as_graph(fn)
        t = bench(fn, name=name if graphed else f"{name}, launched one by one", flops=flops)
        total += t.median_ms
        r = Row.of(t, SIZE)
        r.ceiling, r.fraction = "of the step", t.median_ms / whole.median_ms
        rows.append(r)
    rows.append(Row("sum of the pieces", SIZE, total, ceiling="of the step", fraction=total / whole.median_ms))
    return rows


ATT_H, ATT_D = 6, 64                  # the attention rows: shakespeare_char's heads, 16,384 tokens at each T


def train_timeline_rows(steps: int = 5, top: int = 12) -> list[Row]:
    """Inside the CUDA graph of our TF32 step, from the profiler's timeline: how long the GPU sat idle between
    kernels, with cuBLAS's memsets left where the capture put them and moved off the path (common.graphs), and
    the kernels' own times in the step (concurrent kernels share the GPU, so their times add up to more than
    the step). Needs torch (its profiler: step4_gpt2.train.lab.timeline); medians over `steps` steps."""
    import re
    from step4_gpt2.train.lab.timeline import idle_time, kernel_records
    from step4_gpt2.train.lab.variants import MemsetsInPlaceTrainer
    if torch_cuda() is None:
        print("torch with CUDA not installed: no timeline rows")
        return []
    rows, batches = [], random_batches(steps + 4)
    with tf32_matmuls():
        for hoist in (False, True):
            _, step = ours_step(graph=True, trainer_class=None if hoist else MemsetsInPlaceTrainer)
            records = kernel_records(step, batches, steps)
            span, idle, gaps = (float(np.median(v)) for v in zip(*map(idle_time, records)))
            label = "cuBLAS memsets moved off the path" if hoist else "cuBLAS memsets in place"
            memsets = sum(e["cat"] == "gpu_memset" for e in records[0])
            rows.append(Row(f"step timeline, {label}: span", SIZE, span))
            rows.append(Row(f"step timeline, {label}: GPU idle in {gaps:.0f} gaps ({memsets} memsets)", SIZE, idle,
                            ceiling="of the span", fraction=idle / span))
    per = {}
    for e in (e for rec in records for e in rec if e["cat"] == "kernel"):
        name = re.sub(r"\(.*", "", e["name"])
        name = "cuBLAS GEMM kernels" if re.search(r"gemm|cutlass|splitK|nvjet", name) else name
        n, t = per.get(name, (0, 0.0))
        per[name] = (n + 1, t + e["dur"])
    for name, (n, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
        rows.append(Row(f"in the step: {name} ({n // steps} per step)", SIZE, t / steps / 1e3, ceiling="of the span",
                        fraction=t / steps / 1e3 / span))
    return rows


def _attention_inputs():
    """(T, B, qkv, bias, dout) at T = 256 and 1024, B*T = 16384: random, the same for every attention row."""
    import cupy as cp
    C = ATT_H * ATT_D
    for T_, B_ in ((256, 64), (1024, 16)):
        rng = np.random.default_rng(0)
        yield (T_, B_, cp.asarray(rng.standard_normal((B_, T_, 3 * C), dtype=np.float32)),
               cp.asarray(0.1 * rng.standard_normal(3 * C, dtype=np.float32)),
               cp.asarray(rng.standard_normal((B_, T_, C), dtype=np.float32)))


def train_attention_rows() -> list[Row]:
    """Attention backward v1 (materialised P, cuBLAS batched GEMMs) vs v2 (flash-style, FMA units) vs v3
    (flash-style, tensor cores at fp32 accuracy), and the forward v2 vs v3, 6 heads of 64, B*T = 16384 tokens at
    T = 256 and at T = 1024, beside PyTorch's fp32 scaled_dot_product_attention (v3 where the GPU has sm_80+)."""
    import cupy as cp
    from step4_gpt2.train import ops
    rows, H, D = [], ATT_H, ATT_D
    for T_, B_, qkv, bias, dout in _attention_inputs():
        C = H * D
        out, lse = ops.attention_forward(qkv, bias, H, version=2)
        dqkv = cp.empty_like(qkv)
        causal = B_ * H * T_ * (T_ + 1) / 2 * D * 2       # FLOPs of one causal T x T x D product
        size = f"B{B_} H{H} T{T_} D{D}"
        tc = [3] if ops.default_attention_version() == 3 else []
        fwd, bwd = {}, {}
        for v in [2] + tc:
            fwd[v] = bench(lambda v=v: ops.attention_forward(qkv, bias, H, out=out, lse=lse, version=v),
                           name=f"attention forward v{v} T={T_}", flops=2 * causal)
            rows.append(Row.of(fwd[v], size))
        for v in [1, 2] + tc:
            bwd[v] = bench(lambda v=v: ops.attention_backward(dout, qkv, bias, out, lse, H, dqkv=dqkv, version=v),
                           name=f"attention backward v{v} T={T_}", flops=5 * causal)
            rows.append(Row.of(bwd[v], size, anchor=("v1 (materialised)", bwd[1]) if v > 1 else None))
        torch = torch_cuda()
        if torch is not None:
            q, k, v = (torch.as_tensor(qkv[..., j * C:(j + 1) * C] + bias[j * C:(j + 1) * C], device="cuda")
                       .reshape(B_, T_, H, D).transpose(1, 2).contiguous().requires_grad_() for j in range(3))
            sdpa = torch.nn.functional.scaled_dot_product_attention
            o = sdpa(q, k, v, is_causal=True)
            g = torch.as_tensor(dout, device="cuda").reshape(B_, T_, H, D).transpose(1, 2)
            with torch.no_grad():
                tf = bench(lambda: sdpa(q, k, v, is_causal=True), name=f"torch SDPA forward T={T_}", flops=2 * causal)
            tb = bench(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True),
                       name=f"torch SDPA backward T={T_}", flops=5 * causal)
            rows += [Row.of(tf, size), Row.of(tb, size)]
            newest = max(bwd)                   # the training step's default on this GPU
            rows.append(Row(f"attention forward v{newest} vs torch T={T_}", size, fwd[newest].median_ms,
                            anchor="torch SDPA fp32", ratio=tf.median_ms / fwd[newest].median_ms))
            rows.append(Row(f"attention backward v{newest} vs torch T={T_}", size, bwd[newest].median_ms,
                            anchor="torch SDPA fp32", ratio=tb.median_ms / bwd[newest].median_ms))
    return rows


def train_split_rows() -> list[Row]:
    """Attention v3's kernels with each way of splitting an operand into TF32 parts, on the inputs of
    train_attention_rows (step4_gpt2.train.lab.tf32_split; sm_80+ only)."""
    from step4_gpt2.train.lab.tf32_split import split_rows
    return split_rows(_attention_inputs(), ATT_H)


def quality(steps: int = 300, eval_every: int = 100, data=None, batch: int = B, torch_too: bool = True,
            progress: bool = False) -> tuple[dict, object]:
    """Ours (one CUDA graph per step, as the notebook trains) and PyTorch eager trained for the same steps on the
    same batches from the same weights: ({name: {"val": [...], "val_steps": [...], "train": [...], "seconds": s}},
    our trainer), val loss on the same fixed validation batches. Needs the Shakespeare corpus (step 3's loader)."""
    import cupy as cp
    from step4_gpt2.train import torch_gpt as TT
    from step4_gpt2.train.train import EVAL_SEED, Data, Trainer, TrainConfig, TrainGPT, init_params, shakespeare_char
    data = data or Data.shakespeare("char")
    cfg = shakespeare_char(data.vocab_size)
    tc = TrainConfig(batch_size=batch, max_steps=steps, warmup=min(100, steps // 10), eval_every=eval_every)
    P = init_params(cfg, 0)
    out = {}
    # Neither clock should include one-time costs: compiling our kernels (NVRTC, on a first run) and PyTorch's
    # first launches. One forward and backward of a throwaway model on each side does them before timing.
    x0, y0 = data.batch("train", tc.batch_size, cfg.block_size, step=0, seed=tc.seed)
    TrainGPT(cfg, P).loss_and_grads(cp.asarray(x0), cp.asarray(y0))
    torch = torch_cuda()
    if torch_too and torch is not None:
        TT.build(cfg).load(P)(torch.as_tensor(x0, device="cuda").long(), torch.as_tensor(y0, device="cuda").long()).backward()
    trainer = Trainer(TrainGPT(cfg, P), tc, graph=True)
    h = trainer.fit(data, steps, progress=progress)
    out["ours"] = {"val": h.val, "val_steps": h.val_steps, "train": h.train, "steps": h.steps,
                   "seconds": h.seconds, "tokens_per_s": h.tokens_per_s}
    if not torch_too or torch is None:
        return out, trainer
    model = TT.build(cfg).load(P)
    opt = TT.adamw(model, tc)

    def val_loss():
        with torch.no_grad():
            tot = 0.0
            for i in range(tc.eval_batches):
                x, y = data.batch("val", tc.batch_size, cfg.block_size, step=i, seed=tc.seed + EVAL_SEED)
                tot += model(torch.as_tensor(x, device="cuda").long(), torch.as_tensor(y, device="cuda").long()).item()
            return tot / tc.eval_batches
    res = {"val": [], "val_steps": [], "train": [], "steps": [], "seconds": 0.0}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in range(steps):
        x, y = data.batch("train", tc.batch_size, cfg.block_size, step=s, seed=tc.seed)
        loss = TT.step(model, opt, tc, s, torch.as_tensor(x, device="cuda").long(), torch.as_tensor(y, device="cuda").long())
        if (s + 1) % 10 == 0 or (s + 1) % eval_every == 0 or s + 1 == steps:
            res["train"].append(loss.item())
            res["steps"].append(s + 1)
        if (s + 1) % eval_every == 0 or s + 1 == steps:
            torch.cuda.synchronize()
            res["seconds"] += time.perf_counter() - t0
            res["val"].append(val_loss())
            res["val_steps"].append(s + 1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
    res["tokens_per_s"] = steps * tc.batch_size * cfg.block_size / res["seconds"]
    out["torch eager"] = res
    cp.cuda.Device().synchronize()
    return out, trainer


def gradient_check(B_: int = 4, seed: int = 1) -> list[tuple]:
    """[(tensor group, max rel error vs torch fp32, vs torch float64, torch fp32 vs float64)] at the
    shakespeare_char size on one batch: how close our gradients are, next to PyTorch's own fp32 error."""
    import cupy as cp
    torch = torch_cuda()
    from step4_gpt2.train import torch_gpt as TT
    from step4_gpt2.train.model import TrainGPT
    from step4_gpt2.weights import random_weights
    cfg = _config()
    P = random_weights(cfg, seed, notice=False)   # random biases and LayerNorm parameters too
    x, y = random_batches(1, batch=B_, seed=seed)[0]
    m = TrainGPT(cfg, P)
    m.loss_and_grads(cp.asarray(x), cp.asarray(y))
    ours = {k: v.get() for k, v in m.grads.items()}
    ref = {dt: TT.loss_and_grads(cfg, P, x, y, dt)[1] for dt in (torch.float32, torch.float64)}
    groups = {}
    for k in ours:
        g = k.split(".", 2)[-1] if k.startswith("h.") else k
        e = (max_rel_error(ours[k], ref[torch.float32][k]), max_rel_error(ours[k], ref[torch.float64][k]),
             max_rel_error(ref[torch.float32][k], ref[torch.float64][k]))
        old = groups.get(g, (0.0, 0.0, 0.0))
        groups[g] = tuple(max(a, b) for a, b in zip(old, e))
    return [(g, *e) for g, e in groups.items()]


def run(compile_torch: bool = True) -> list[Row]:
    common.require_gpu()
    return (train_throughput_rows(compile_torch=compile_torch) + train_variant_rows() + train_breakdown_rows()
            + train_attention_rows() + train_split_rows())


def report(directory, quality_steps: int = 600, compile_torch: bool = True) -> str:
    """Everything measured in one run, as Markdown (report.md) and JSON (report.json) in `directory`: device
    and date, the gradient check, the benchmark tables, the loss trajectories of ours vs PyTorch on the same
    batches with their wall times, and a sample of text from the model just trained."""
    import datetime
    import json
    from pathlib import Path
    from common.benchmarks import table
    from step4_gpt2.generate import generate
    common.require_gpu()                          # before anything is written
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lines = [f"device: {common.device.describe()}", f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             "precision: fp32 everywhere; cuBLAS plain fp32, torch with TF32 off", ""]
    rec = {"device": lines[0], "date": lines[1]}
    if torch_cuda() is not None:
        grads = gradient_check()
        rec["gradient_check"] = grads
        lines += ["| tensor (max over layers) | ours vs torch fp32 | ours vs torch fp64 | torch fp32 vs fp64 |", "|---|---|---|---|"]
        lines += [f"| {g} | {a:.1e} | {b:.1e} | {c:.1e} |" for g, a, b, c in grads] + [""]
    print("\n".join(lines), flush=True)
    from step4_gpt2.train.train import Data
    try:
        data = Data.shakespeare("char")
    except (ModuleNotFoundError, FileNotFoundError) as e:
        data = None
        print(f"no quality run and no sample: {e}", flush=True)
    if data is not None:
        q, trainer = quality(quality_steps, eval_every=max(1, quality_steps // 6), data=data)
        rec["quality"] = q
        names = list(q)
        part = ["| step | " + " | ".join(f"val loss {n}" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
        for k, st in enumerate(q[names[0]]["val_steps"]):
            part.append(f"| {st} | " + " | ".join(f"{q[n]['val'][k]:.4f}" for n in names) + " |")
        part += ["", "| run | training wall time (s) | tokens/s |", "|---|---|---|"]
        part += [f"| {n} | {q[n]['seconds']:.1f} | {q[n]['tokens_per_s']:,.0f} |" for n in names]
        prompt = data.tokenizer.encode("To be, or not to be")
        gen = generate(trainer.model.to_gpt(), [prompt], temperature=0.8, eos=None,
                       max_new_tokens=trainer.model.config.block_size - len(prompt))   # its context window
        text = data.tokenizer.decode(prompt + list(gen.tokens[0]))
        rec["sample"] = text
        part += ["", "sample (temperature 0.8):", "```", text, "```", ""]
        trainer.save(directory / "checkpoint", data.tokenizer)
        del trainer
        lines += part
        print("\n".join(part), flush=True)
    rows = []
    for fn in (train_breakdown_rows, train_attention_rows, train_split_rows,
               lambda: train_throughput_rows(compile_torch=compile_torch) + train_variant_rows()):
        new = fn()
        rows += new
        print(table(new), flush=True)
        rec["rows"] = [r.record() for r in rows]
        (directory / "report.json").write_text(json.dumps(rec, indent=1, default=float))
    lines += [table(rows), ""]
    md = "\n".join(lines)
    (directory / "report.md").write_text(md)
    (directory / "report.json").write_text(json.dumps(rec, indent=1, default=float))
    return md


def main(argv=None) -> int:
    import argparse
    from common.benchmarks import module_main
    ap = argparse.ArgumentParser(prog="python -m step4_gpt2.train.benchmarks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", metavar="DIR", help="also the gradient check, the quality run and a sample, "
                                                    "written to DIR/report.md and DIR/report.json")
    ap.add_argument("--quality-steps", type=int, default=600)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile anchor (it compiles for a minute)")
    ap.add_argument("--tf32", action="store_true", help="only the training-step rows, with TF32 GEMMs on both sides")
    ap.add_argument("--timeline", action="store_true", help="only the timeline of the TF32 step's CUDA graph "
                                                            "(idle gaps, each kernel's time in the step; needs torch)")

    def validate(args, ap):
        if args.tf32 and args.report:
            ap.error("--tf32 runs the training-step rows only; run --report without it")
        if args.quality_steps < 1:
            ap.error(f"--quality-steps: expected a positive number of steps, got {args.quality_steps}")

    def chosen(args):
        if args.timeline:
            return train_timeline_rows()
        if args.tf32:
            return train_throughput_rows(compile_torch=not args.no_compile, tf32=True) + train_variant_rows(tf32=True)
        if args.report:
            return report(args.report, args.quality_steps, not args.no_compile)
        return run(compile_torch=not args.no_compile)

    return module_main("step4_gpt2.train.benchmarks", __doc__, chosen, argv, ap, validate)


if __name__ == "__main__":
    raise SystemExit(main())
