"""Benchmarks of mixed-precision training (step4_gpt2/train/mixed.py): tokens/s of a whole training step
(forward, backward, clipping, AdamW), ours in fp32 and in bf16 (each replayed as one CUDA graph), against the same
model and step in PyTorch with autocast(bf16), eager and torch.compile, same batches, same GPU, same run; at
nanoGPT's shakespeare_char size and at GPT-2 124M's (T = 1024, a batch the fp32 model fits). Then activation
recomputation: the bytes of activations kept per batch shape (mixed.activation_bytes, exact) with and without it,
beside each variant's step time. Precisions are named in every row: fp32 here is plain fp32 (no TF32).

    python -m step4_gpt2.train.benchmarks_bf16
"""
from __future__ import annotations

import numpy as np

import common
from common import torch_cuda
from common.benchmarks import Row
from step4_gpt2.weights import GPTConfig

STEPS = 20
SIZES = {"shakespeare_char": dict(cfg=GPTConfig(n_layer=6, n_head=6, n_embd=384, vocab_size=65, block_size=256),
                                  batch=64),
         "GPT-2 124M": dict(cfg=GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024),
                            batch=16)}


def _batches(cfg: GPTConfig, B: int, n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, (n, B, cfg.block_size + 1)).astype(np.int32)
    return [(x[:, :-1].copy(), x[:, 1:].copy()) for x in ids]


def fitting_batch(cfg: GPTConfig, most: int) -> int:
    """The batch of a size's rows: `most`, halved until the fp32 model's activations fit (train.batch_that_fits)."""
    from step4_gpt2.train.train import batch_that_fits
    return batch_that_fits(cfg, cfg.block_size, max_batch=most)


def ours_step(cfg: GPTConfig, B: int, precision: str, recompute: bool = False):
    """step(x, y) of Trainer(graph=True) around mixed.make_model(cfg, precision=, recompute=)."""
    import cupy as cp
    from step4_gpt2.train.mixed import make_model
    from step4_gpt2.train.train import Trainer, TrainConfig
    trainer = Trainer(make_model(cfg, seed=0, precision=precision, recompute=recompute), TrainConfig(batch_size=B),
                      graph=True)
    return lambda x, y: trainer.step(cp.asarray(x), cp.asarray(y), check=False)


def torch_autocast_step(cfg: GPTConfig, B: int, compiled: bool = False):
    """step(x, y) of the same model and step in PyTorch (torch_gpt.py, fp32 parameters and AdamW), the forward
    under torch.autocast(bf16), eager or torch.compile; None without torch+CUDA."""
    torch = torch_cuda()
    if torch is None:
        return None
    from step4_gpt2.train import torch_gpt as TT
    from step4_gpt2.train.train import TrainConfig, init_params
    tc = TrainConfig(batch_size=B)
    model = TT.build(cfg).load(init_params(cfg, 0))
    opt = TT.adamw(model, tc)
    fwd = torch.compile(model) if compiled else model
    state = {"i": 0}

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(torch.as_tensor(x, device="cuda").long(), torch.as_tensor(y, device="cuda").long())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        for g in opt.param_groups:
            g["lr"] = tc.lr_at(state["i"])
        opt.step()
        state["i"] += 1
        return loss.detach()
    return step


def _release():
    """Give back what the last model held before the next one is built (the 124M rows fill the GPU)."""
    import gc

    import cupy as cp
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    torch = torch_cuda()
    if torch is not None:
        torch.cuda.empty_cache()


def _size_rows(label: str, cfg: GPTConfig, B: int, steps: int) -> list[Row]:
    from step4_gpt2.train.benchmarks import loop_wall_s
    size = f"{label}: {cfg.n_layer}L C{cfg.n_embd} V{cfg.vocab_size} B{B} T{cfg.block_size}"
    batches, tokens, t, rows = _batches(cfg, B, steps + 3), B * cfg.block_size, {}, []
    runs = [("ours fp32", lambda: ours_step(cfg, B, "fp32")), ("ours bf16", lambda: ours_step(cfg, B, "bf16")),
            ("ours bf16 + recompute", lambda: ours_step(cfg, B, "bf16", recompute=True)),
            ("torch autocast bf16 eager", lambda: torch_autocast_step(cfg, B)),
            ("torch.compile autocast bf16", lambda: torch_autocast_step(cfg, B, compiled=True))]
    for name, make in runs:
        step = make()
        if step is None:
            print("torch with CUDA not installed: no torch rows")
            break
        t[name] = loop_wall_s(step, batches)
        rows.append(Row(f"train step, {name}, CUDA graph (tok/s)" if name.startswith("ours") else
                        f"train step, {name} (tok/s)", size, t[name] * 1e3, rate=tokens / t[name], unit="tok/s"))
        del step
        _release()
    best = t["ours bf16"]
    for anchor, at_least in (("ours fp32", None), ("torch autocast bf16 eager", 1.5), ("torch.compile autocast bf16", 1.0)):
        if anchor in t:
            r = Row(f"train step, ours bf16 vs {anchor}", size, best * 1e3, rate=tokens / best, unit="tok/s",
                    anchor=anchor, ratio=t[anchor] / best)
            rows.append(r.check("ratio", at_least) if at_least else r)
    rc = t["ours bf16 + recompute"]
    rows.append(Row("train step, bf16 + recompute vs bf16 (time paid)", size, rc * 1e3, rate=tokens / rc,
                    unit="tok/s", anchor="ours bf16", ratio=best / rc))
    return rows + memory_rows(label, cfg, B, {k: v * 1e3 for k, v in t.items()})


def memory_rows(label: str, cfg: GPTConfig, B: int, step_ms: dict | None = None) -> list[Row]:
    """The activations one batch shape keeps (exact counts: mixed.activation_bytes, train.activation_bytes), in
    MB in the rate column, fp32, bf16 and bf16 with recomputation, the last against bf16 (bytes saved); the time
    column holds that variant's step time when step_ms ({run name: ms}) has it, else 0 (no GPU work here)."""
    from step4_gpt2.train.mixed import activation_bytes
    from step4_gpt2.train.train import activation_bytes as fp32_bytes
    step_ms = step_ms or {}
    size = f"{label}: B{B} T{cfg.block_size}"
    kept = {"ours fp32": fp32_bytes(cfg, B), "ours bf16": activation_bytes(cfg, B),
            "ours bf16 + recompute": activation_bytes(cfg, B, recompute=True)}
    rows = []
    for name, n in kept.items():
        r = Row(f"activations kept, {name.removeprefix('ours ')} (MB)", size, step_ms.get(name, 0.0), rate=n / 1e6,
                unit="MB")
        if name.endswith("recompute"):
            r.anchor, r.ratio = "bf16's bytes", kept["ours bf16"] / n
        rows.append(r)
    return rows


def bf16_train_rows(steps: int = STEPS) -> list[Row]:
    """The step's tokens/s, ours fp32 and bf16 (and bf16 with recomputation) against torch autocast(bf16) eager
    and torch.compile, at both sizes, each followed by its activation bytes with and without recomputation."""
    common.require_gpu()
    from step4_gpt2.train.ops_bf16 import require_bf16
    require_bf16()
    rows = []
    for label, s in SIZES.items():
        rows += _size_rows(label, s["cfg"], fitting_batch(s["cfg"], s["batch"]), steps)
    return rows


def run() -> list[Row]:
    return bf16_train_rows()


def main(argv=None) -> int:
    from common.benchmarks import module_main
    return module_main("step4_gpt2.train.benchmarks_bf16", __doc__, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
