"""Benchmarks of step 3b (the fused training step), at a realistic size: vocab 8192, E=256, H=1024, B=512, K=3.

Rows: the whole step fused vs the same step from one kernel per operation, the pieces (forward+backward,
optimiser) with their anchors, the cuBLAS GEMMs alone (the floor both versions share), tokens/s batched vs one
sample per step, and the same network in PyTorch eager when torch has CUDA.

    python -m step3_fused.benchmarks_training             # this table alone
    python -m common.benchmarks --only step3_fused:training  # the same rows, also written to the JSON
"""
from __future__ import annotations

import numpy as np

from common import bench, copy_bandwidth, torch_cuda
from common.benchmarks import Row

V, E, H, K, B = 8192, 256, 1024, 3, 512
SIZE = f"V{V} E{E} H{H} B{B}"


def _data(batch, seed=0):
    import cupy as cp
    rng = np.random.default_rng(seed)
    return (cp.asarray(rng.integers(0, V, (batch, K)).astype(np.int32)),
            cp.asarray(rng.integers(0, V, batch).astype(np.int32)))


def _tok_row(name, t, tokens, anchor=None):
    row = Row(name, f"{tokens} tok/step", t.median_ms, rate=tokens / (t.median_ms * 1e-3), unit="tok/s")
    if anchor:
        row.anchor, row.ratio = anchor[0], anchor[1].median_ms / t.median_ms
    return row


def _torch_step(init, ctx, tgt):
    """The same network and AdamW step in PyTorch eager (fp32, default foreach AdamW), or None."""
    torch = torch_cuda()
    if torch is None:
        return None
    dev = "cuda"
    tp = {k: torch.tensor(v, device=dev, requires_grad=True) for k, v in init.items()}
    opt = torch.optim.AdamW([{"params": [tp["emb"], tp["W1"], tp["W2"]], "weight_decay": 0.01},
                             {"params": [tp["b1"], tp["b2"]], "weight_decay": 0.0}], lr=1e-4)
    c = torch.as_tensor(ctx.get(), device=dev).long()
    t = torch.as_tensor(tgt.get(), device=dev).long()

    def step():
        x = tp["emb"][c].mean(dim=1)
        z = torch.relu(x @ tp["W1"] + tp["b1"]) @ tp["W2"] + tp["b2"]
        loss = torch.nn.functional.cross_entropy(z, t)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
    return step


def run() -> list[Row]:
    import cupy as cp
    from common.reference import mlp
    from step3_fused import training as T

    init = mlp.init_params(V, E, H, seed=0)
    ctx, tgt = _data(B)
    rows = []

    def model_and(opt_name):
        m = T.Model(V, E, H, K, init=init)
        opt = T.AdamW(m.params, lr=1e-4) if opt_name == "adamw" else T.SGD(m.params, lr=1e-3)
        return m, opt

    # ---- the whole step, fused vs unfused, both optimisers
    steps = {}
    for opt_name in ("adamw", "sgd"):
        for fused in (False, True):
            m, opt = model_and(opt_name)
            steps[opt_name, fused] = bench(lambda: m.step(ctx, tgt, opt, fused=fused, check=False),
                                           name=f"step {'fused' if fused else 'unfused'} ({opt_name})")
        rows.append(_tok_row(f"train step fused ({opt_name})", steps[opt_name, True], B,
                             anchor=("unfused kernels", steps[opt_name, False]))
                    .check("ratio", 1.3))
        rows.append(_tok_row(f"train step unfused ({opt_name})", steps[opt_name, False], B))

    # ---- where the time goes: GEMMs alone (shared floor), forward+backward, the optimiser
    m, opt = model_and("adamw")
    P, G, buf = m.params, m.grads, m._buffers(B)

    def gemms():
        cp.matmul(buf["x"], P["W1"], out=buf["h"])
        cp.matmul(buf["h"], P["W2"], out=buf["z"])
        cp.matmul(buf["h"].T, buf["z"], out=G["W2"])
        cp.matmul(buf["z"], P["W2"].T, out=buf["dh"])
        cp.matmul(buf["x"].T, buf["dh"], out=G["W1"])
        cp.matmul(buf["dh"], P["W1"].T, out=buf["dx"])
    flops = 2.0 * B * (E * H * 3 + H * V * 3)
    m.forward_backward(ctx, tgt, check=False)
    t_gemm = bench(gemms, name="GEMMs only (cuBLAS, fp32)", flops=flops)
    rows.append(Row.of(t_gemm, SIZE))
    # Both steps make the same GEMM calls, so fusion can only change the rest. Two derived rows make that
    # visible: the non-GEMM time of each step (step median - GEMMs-only median), and the best step ratio
    # any fusion of the non-GEMM work could reach (unfused step / GEMMs alone).
    for opt_name in ("adamw", "sgd"):
        rest_f = steps[opt_name, True].median_ms - t_gemm.median_ms
        rest_u = steps[opt_name, False].median_ms - t_gemm.median_ms
        row = Row(f"non-GEMM part of fused step ({opt_name})", "step - GEMMs only", rest_f,
                  anchor="non-GEMM part, unfused")
        row.ratio = rest_u / rest_f if rest_f > 0 else None
        rows.append(row)
        cap = Row(f"step ratio if non-GEMM took 0 ({opt_name})", "unfused / GEMMs", t_gemm.median_ms,
                  anchor="unfused step")
        cap.ratio = steps[opt_name, False].median_ms / t_gemm.median_ms
        rows.append(cap)
    fb = {f: bench(lambda f=f: m.forward_backward(ctx, tgt, fused=f, check=False),
                   name=f"forward+backward {'fused' if f else 'unfused'}") for f in (False, True)}
    rows.append(Row.of(fb[True], SIZE, anchor=("unfused kernels", fb[False])))
    rows.append(Row.of(fb[False], SIZE))
    n = m.n_params
    bw = copy_bandwidth()
    sgd = T.SGD(m.params, lr=1e-6)
    for name, nbytes, run_multi, run_each in (
            ("AdamW", 28 * n, lambda: opt.step(G, multi=True), lambda: opt.step(G, multi=False)),
            ("SGD", 12 * n, lambda: sgd.step(G, multi=True), lambda: sgd.step(G, multi=False))):
        each = bench(run_each, name=f"{name} one launch per tensor", bytes=nbytes)
        multi = bench(run_multi, name=f"{name} one launch, all tensors", bytes=nbytes)
        rows.append(Row.of(multi, f"{n / 1e6:.1f}M params", ceiling=("copy bw", bw),
                           anchor=("per-tensor launches", each)))
        rows.append(Row.of(each, f"{n / 1e6:.1f}M params", ceiling=("copy bw", bw)))

    # ---- one sample per step: launch-bound
    m1, opt1 = model_and("sgd")
    c1, t1 = _data(1, seed=1)
    per = bench(lambda: m1.step(c1, t1, opt1, fused=True, check=False), name="per-sample step fused (sgd)")
    rows.append(_tok_row("per-sample step fused (sgd), B=1", per, 1))
    rows.append(_tok_row("batched step fused (sgd)", steps["sgd", True], B, anchor=("per-sample", _per_token(per, B))))

    # ---- PyTorch eager, same network and AdamW
    tstep = _torch_step(init, ctx, tgt)
    if tstep is not None:
        t_torch = bench(tstep, name="torch eager step (adamw)")
        rows.append(_tok_row("torch eager step (adamw)", t_torch, B))
        rows.append(_tok_row("train step fused (adamw) vs torch", steps["adamw", True], B,
                             anchor=("torch eager", t_torch)))
    else:
        print("torch with CUDA not installed: no torch row")
    return rows


def _per_token(per, tokens):
    """A Timing-like object for `tokens` per-sample steps, so the ratio compares time per token."""
    class _T:
        median_ms = per.median_ms * tokens
    return _T()


def main(argv=None) -> int:
    from common.benchmarks import module_main
    return module_main("step3_fused.benchmarks_training", __doc__, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
