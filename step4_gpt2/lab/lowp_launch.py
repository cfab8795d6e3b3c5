"""The launch shape of gemv_v6 (bf16) and gemv_v7 (int8), timed: rows per block (ROWS) x 16-byte loads per row a
lane has in flight (UNROLL), on one GPT-2 shape's decode matrices, each GEMV alone with a cold L2 (common.bench),
against the course's choice (ops.V5_ROWS, and ops._v5_unroll's UNROLL) and fp32's gemv_v5 at its defaults.

    python -m step4_gpt2.lab.lowp_launch                         # GPT-2 XL's matrices, batch 1 and 8 (a GPU)
    python -m step4_gpt2.lab.lowp_launch --shape gpt2 --batch 1

The napkin math the sweep tests (GPT-2 XL's 1600-wide rows, an H100/H200 of 132 SMs):
- Little's law: to keep DRAM busy, bandwidth x latency must be in flight, about 4.8 TB/s x ~1 us = 5 MB, ~36 KB
  per SM. Bytes in flight live in registers: a lane holds ROWS x UNROLL 16-byte loads, 256 B at v5's 4 x 4.
- A 16-byte load holds 4 fp32, 8 bf16 or 16 int8 weights, so at UNROLL 4 a row takes 4, 2 or 1 warps, and
  after its round trip each lane widens and multiplies 64, 128 or 256 weights: the lowp blocks do 2-4x the work
  per lane on 2-4x fewer warps. UNROLL 1 gives int8 fp32's block shape (4 warps, 64 weights per lane).
- But registers are what bounds occupancy: NVRTC's sm_90 build of the batch module (MAXB 8) takes ~170
  registers per lane for int8 at UNROLL 4 and ~95 at UNROLL 1, i.e. 1.5 vs 0.67 bytes in flight per register
  (the batch-1 module, MAXB 1, which the b=1 rows time: ~100-128 and ~40-64). Spreading the widening over
  more warps holds 2.3x fewer bytes in flight on the same register file: a matrix whose tiles all fit at once
  (c_attn, c_proj) can gain, one that needs more waves (the LM head) needs more round trips. More ROWS keep the
  bytes per register and share each x load among more rows, with fewer, larger blocks.
Neither way is clear on paper, so the course keeps v5's ROWS and UNROLL for bf16 and int8, and this measures; but
a lone row behind the LayerNorm prologue takes 8 weights a lane (ops.V5_LN1_WEIGHTS; int8: one load, 16): the
warps that share the row's normalisation are what the whole decode step measured faster with.
"""
from __future__ import annotations

import argparse

from common.benchmarks import Row
from step4_gpt2 import ops

ROWS_CHOICES = (2, 4, 8)
UNROLL_CHOICES = (1, 2, 4)
MAX_LOADS_PER_LANE = ops.V5_ROWS * ops.V5_UNROLL        # ROWS x UNROLL 16-byte loads per lane: v5's register budget
KINDS = ("bf16", "int8")
BATCHES = (1, 8)


def choices() -> list[tuple[int, int]]:
    """(ROWS, UNROLL) pairs the sweep times: every pair within v5's register budget."""
    return [(r, u) for r in ROWS_CHOICES for u in UNROLL_CHOICES if r * u <= MAX_LOADS_PER_LANE]


def matrices(config) -> dict:
    """{name: (N, K, fusion)} of one decode step's GEMVs (c_attn as a plain GEMV with its LayerNorm prologue: the
    same loads as gemv_qkv, without the KV cache)."""
    C, V = config.n_embd, config.vocab_size
    return {"c_attn": (3 * C, C, "ln"), "c_proj": (C, C, "residual"), "c_fc": (4 * C, C, "ln+gelu"),
            "mlp_proj": (C, 4 * C, "residual"), "lm_head": (V, C, "ln")}


def launch_shape(kind: str, N: int, K: int, B: int, fusion: str, rows: int, unroll: int) -> str:
    """What the napkin math needs of one choice: registers per lane, the block and the grid (ops._v5_launch)."""
    epi = "EPI_RESID" if fusion == "residual" else "EPI_BIAS_GELU" if "gelu" in fusion else "EPI_BIAS"
    ln = "ln" in fusion
    maxb = ops.gemv_module(B)                              # the module ops.gemv launches from
    fn = ops.lowp_kernel(f"gemv_v{ops.LOWP_VERSION[kind]}<{epi}, {'true' if ln else 'false'}>", rows, unroll, maxb)
    grid, block, _ = ops._v5_launch(fn, N, K, min(B, maxb), ln, rows, unroll, ops.LOWP_PER_LOAD[kind])
    return f"{fn.num_regs} regs, {block[0] // 32} warps x {grid[0]} blocks"


def _call(x, W, bias, y, ln, fusion, **launch):
    """One GEMV with the decode step's fusion for this matrix."""
    return ops.gemv(x, W, bias, out=y, ln=ln if "ln" in fusion else None, gelu="gelu" in fusion,
                    residual=fusion == "residual", **launch)


def sweep(shape: str = "gpt2-xl", batches=BATCHES, kinds=KINDS) -> list[Row]:
    """Rows: each (matrix, batch, kind, ROWS, UNROLL) against the course's choice for that kind, and fp32's v5."""
    import cupy as cp
    from common import assert_close, poison
    from common.timing import bench, copy_bandwidth
    from step4_gpt2 import quantize
    from step4_gpt2.weights import GPTConfig
    cfg = GPTConfig.from_name(shape)
    bw = copy_bandwidth()
    rng = cp.random.default_rng(0)
    rows = []
    for name, (N, K, fusion) in matrices(cfg).items():
        w = rng.standard_normal((N, K), dtype=cp.float32) * cp.float32(0.02)
        bias = rng.standard_normal(N, dtype=cp.float32) * cp.float32(0.02)
        ln = (rng.standard_normal(K, dtype=cp.float32) * cp.float32(0.1) + 1, rng.standard_normal(K, dtype=cp.float32))
        for B in batches:
            x = rng.standard_normal((B, K), dtype=cp.float32)
            y = cp.zeros((B, N), cp.float32)
            size = f"{cfg.n_layer}L C={cfg.n_embd}: {name} {N}x{K}, b={B}"
            t32 = bench(lambda: _call(x, w, bias, y, ln, fusion), name=f"fp32 v5 {name}", bytes=4 * N * K)
            rows.append(Row.of(t32, size, ceiling=("copy bandwidth", bw)))
            for kind in kinds:
                lw = quantize.quantize(w, kind)
                nbytes = lw.nbytes
                maxb, per_load = ops.gemv_module(B), ops.LOWP_PER_LOAD[kind]
                course = (ops.V5_ROWS, ops._v5_unroll(None, "ln" in fusion, maxb, per_load))
                v = ops.LOWP_VERSION[kind]                 # v6/v7 at every batch: their launch shapes are swept
                want = _call(x, lw, bias, cp.zeros((B, N), cp.float32), ln, fusion, version=v)
                base = bench(lambda: _call(x, lw, bias, y, ln, fusion, version=v), name="", bytes=nbytes)
                for r, u in choices():
                    out = cp.zeros((B, N), cp.float32) if fusion == "residual" else poison(cp.empty((B, N), cp.float32))
                    got = _call(x, lw, bias, out, ln, fusion, rows=r, unroll=u, version=v)
                    assert_close(got, want, rtol=1e-5, name=f"{kind} {name} ROWS={r} UNROLL={u}")
                    label = f"{kind} {name} ROWS={r} UNROLL={u}" + (" (course)" if (r, u) == course else "")
                    t = bench(lambda: _call(x, lw, bias, y, ln, fusion, rows=r, unroll=u, version=v),  # noqa: B023
                              name=f"{label} [{launch_shape(kind, N, K, B, fusion, r, u)}]", bytes=nbytes)
                    rows.append(Row.of(t, size, ceiling=("copy bandwidth", bw),
                                       anchor=(f"ROWS={course[0]} UNROLL={course[1]}", base)))
                del lw
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m step4_gpt2.lab.lowp_launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=("gpt2", "gpt2-xl"), default="gpt2-xl", help="GPT-2 shape (default XL)")
    p.add_argument("--batch", type=int, choices=BATCHES, action="append", help="batch (repeatable; default 1 and 8)")
    p.add_argument("--kind", choices=KINDS, action="append", help="weight format (repeatable; default both)")
    return p


def main(argv=None) -> int:
    from common.benchmarks import module_main
    return module_main("step4_gpt2.lab.lowp_launch", __doc__,
                       lambda a: sweep(a.shape, tuple(a.batch or BATCHES), tuple(a.kind or KINDS)), argv, _parser())


if __name__ == "__main__":
    raise SystemExit(main())
