"""Step 4e's benchmark rows (step4_gpt2/parallel/benchmarks.py).

On the CPU: the entry point's --help, the family's discovery by common.benchmarks, the one-GPU path (one line, no
rows), and the whole of run() with the measurements replaced by stand-ins whose numbers are known (every row's
name has a note on the results page, each ratio, fraction and recorded reference value is the right one). On 2
or more GPUs: run() on tiny models, for real."""
import math
import subprocess
import sys
from pathlib import Path

import pytest

from common.benchmarks import SECTIONS, STEP_LABELS, family_of, note_of, select, valid_names
from step4_gpt2.parallel import benchmarks as PB
from step4_gpt2.parallel import launch, measure, tensor_parallel as tp

ROOT = Path(__file__).resolve().parents[2]
FAMILY = "step4_gpt2:parallel"
MODULE = "step4_gpt2.parallel.benchmarks"
LINK = (300.0, 20.0)             # the stand-in link: bus GB/s, latency us


# ============================================================================ the entry point and the family
def test_help_without_a_gpu_writes_nothing(tmp_path):
    r = subprocess.run([sys.executable, "-m", MODULE, "--help"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: python -m {MODULE}") and "--only step4_gpt2:parallel" in r.stdout
    assert "target" not in r.stdout.lower() and list(tmp_path.iterdir()) == []


def test_the_family_is_found_and_has_its_section():
    assert FAMILY in valid_names()
    assert select([FAMILY]) == [(FAMILY, MODULE, None)]
    assert (MODULE, None) in [j[1:] for j in select(["step4_gpt2"])]          # --only step4_gpt2 runs it too
    assert family_of(FAMILY, MODULE, None) == FAMILY
    assert FAMILY in SECTIONS and STEP_LABELS[FAMILY] == "4e"


# ============================================================================ run() with stand-ins
def _one_gpu_path(monkeypatch, gpus):
    monkeypatch.setattr(PB, "require_gpu", lambda: None)
    monkeypatch.setattr(PB, "gpu_count", lambda: gpus)
    monkeypatch.setattr(PB, "_free", lambda: None)


def test_one_gpu_prints_one_line_and_returns_no_rows(monkeypatch, capsys):
    _one_gpu_path(monkeypatch, 1)

    def measured(*a, **k):
        raise AssertionError("nothing is measured on one GPU")
    for name in ("measure_all_reduce", "measure_data_parallel"):
        monkeypatch.setattr(measure, name, measured)
    assert PB.run() == []
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "2 or more GPUs" in out and PB.COMMAND in out


def _dp_step(world, bucket_mb):
    """The stand-in's data-parallel step: 2% slower per extra GPU, and on several GPUs 1% slower per factor of 2
    away from 4 MB buckets (the sweep's best)."""
    return 0.1 * (1 + 0.02 * (world - 1)) * (1 + 0.01 * abs(math.log2(bucket_mb / 4)) * (world > 1))


def _stand_ins(monkeypatch):
    """Measurements with known numbers: the all-reduce on LINK exactly, a data-parallel step as _dp_step, ZeRO-1's
    state 1/world, losses 1e-7 apart, tensor parallelism's transfers 10% slower than predicted and half as much
    again spent waiting."""
    def all_reduce(world, sizes, timeout_s=300):
        nbytes = [4 * n for n in sizes]
        return {"nbytes": nbytes, "seconds": [tp.ring_all_reduce_seconds(n, world, *LINK) for n in nbytes]}

    def data_parallel(cfg, B, T, world, zero1=False, bucket_mb=25, timeout_s=300):
        step = _dp_step(world, bucket_mb)
        return {"tokens_s": B * world * T / step, "step_s": step,
                "optimizer_bytes": 8 * cfg.n_params() // (world if zero1 else 1)}

    def buckets(cfg, B, T, world, sweep, zero1=False, timeout_s=300):
        return {mb: data_parallel(cfg, B, T, world, zero1, mb) for mb in sweep}

    def tensor_parallel(cfg, B, T, world, timeout_s=300):
        transfer = 1.1 * tp.predict_comm_seconds(cfg, B, T, world, *LINK) if world > 1 else 0.0
        comm = 1.5 * transfer
        return {"step_s": 0.2 / world + comm, "comm_s": comm, "transfer_s": transfer, "wait_s": comm - transfer}

    def train_rank(rank, world, unique_id, opts):
        assert opts["steps"] == PB.LOSS_STEPS and not opts["zero1"] and opts["batch"] % 4 == 0
        losses = [4.0 - 0.1 * k for k in range(opts["steps"])]
        return {"rank": rank, "losses": [v * (1 + 1e-7 * (world > 1)) for v in losses], "tokens_per_s": 1e6,
                "optimizer_bytes": 1}

    def spawn(fn, nprocs, *args, timeout_s=600, backend="nccl"):
        return [fn(r, nprocs, None, *args) for r in range(nprocs)]
    import step4_gpt2.parallel.__main__ as cli
    monkeypatch.setattr(measure, "measure_all_reduce", all_reduce)
    monkeypatch.setattr(measure, "measure_data_parallel", data_parallel)
    monkeypatch.setattr(measure, "measure_buckets", buckets)
    monkeypatch.setattr(tp, "measure_tensor_parallel", tensor_parallel)
    monkeypatch.setattr(cli, "train_rank", train_rank)
    monkeypatch.setattr(launch, "spawn", spawn)


@pytest.mark.parametrize("gpus", [2, 3, 4, 8])
def test_run_rows_from_known_measurements(monkeypatch, gpus):
    _one_gpu_path(monkeypatch, gpus)
    _stand_ins(monkeypatch)
    rows = PB.run()
    worlds = [w for w in (2, 4) if w <= gpus]
    by = {}
    for r in rows:
        assert note_of(FAMILY, r.name)[0] >= 0, f"no note for {r.name!r}"
        assert all(math.isfinite(v) for v in (r.ms, r.rate, r.fraction, r.ratio) if v is not None), r
        by.setdefault(r.name, []).append(r)
    for w in worlds:
        big, small = by[f"all-reduce {w} GPUs"]
        assert big.size == "1 GiB" and small.size == "1 KiB" and big.rate == pytest.approx(
            2 * (w - 1) / w * 2**30 / tp.ring_all_reduce_seconds(2**30, w, *LINK) / 1e9)
        (fit,) = by[f"all-reduce fit {w} GPUs"]
        assert fit.rate == pytest.approx(LINK[0]) and fit.ms == pytest.approx(LINK[1] * 1e-3)
        # the sweep at shakespeare_char's size, then data parallel there with its best bucket, GPT-2's with 25 MB
        for mb in PB.BUCKET_SWEEP:
            (r,) = by[f"data parallel {w} GPUs, {mb:g} MB buckets"]
            step = _dp_step(w, mb)
            assert r.size == "6L C384 B64/GPU T256" and r.ratio == pytest.approx(w * 0.1 / step) and not r.target
            assert r.fraction == pytest.approx((step - 0.1) / step)
        for name, sizes, mb in ((f"data parallel {w} GPUs, best bucket 4 MB", ["6L C384 B64/GPU T256"], 4),
                                (f"data parallel {w} GPUs", ["12L C768 B4/GPU T1024"], 25),
                                (f"ZeRO-1 {w} GPUs", ["6L C384 B64/GPU T256", "12L C768 B4/GPU T1024"], 25)):
            dp = by[name]
            assert [r.size for r in dp] == sizes, name
            step = _dp_step(w, mb)
            for r in dp:
                assert r.anchor == "1 GPU" and r.ratio == pytest.approx(w * 0.1 / step)
                assert r.fraction == pytest.approx((step - 0.1) / step)
                assert r.target == f"ratio >= {PB.SPEEDUP[w]:g}"
        for r in by[f"ZeRO-1 AdamW state per GPU, {w} GPUs"]:
            assert r.fraction == pytest.approx(1 / w, rel=1e-6) and r.target == f"fraction <= {1.01 / w:g}"
        (loss,) = by[f"loss over {PB.LOSS_STEPS} steps, {w} GPUs vs 1 GPU"]
        assert loss.unit == "ppm" and loss.rate == pytest.approx(0.1) and loss.target == "rate <= 10"
        # the transfer against the prediction (the target), the wait for the slower rank beside it
        for r in by[f"tensor parallel all-reduces {w} GPUs, transfer"]:
            assert r.ratio == pytest.approx(1 / 1.1) and r.target == "ratio >= 0.8 and ratio <= 1.33333"
        for r, t in zip(by[f"tensor parallel all-reduces {w} GPUs, waiting"],
                        by[f"tensor parallel all-reduces {w} GPUs, transfer"]):
            assert r.ms == pytest.approx(0.5 * t.ms) and r.fraction == pytest.approx(1 / 3) and not r.target
    # 6 heads split over 2 GPUs, not 4; GPT-2's 12 over both
    assert [r.size for r in by["tensor parallel all-reduces 2 GPUs, transfer"]] == ["6L C384 B64 T256",
                                                                                   "12L C768 B8 T1024"]
    if 4 in worlds:
        assert [r.size for r in by["tensor parallel all-reduces 4 GPUs, transfer"]] == ["12L C768 B8 T1024"]
    assert len(by["data parallel 1 GPU"]) == 2 and len(by["tensor parallel step 1 GPU"]) == 2
    assert not any(" 3 GPUs" in r.name or " 8 GPUs" in r.name for r in rows)


def test_without_the_plays_the_loss_rows_are_left_out(monkeypatch, capsys):
    _one_gpu_path(monkeypatch, 2)
    _stand_ins(monkeypatch)
    import step4_gpt2.parallel.__main__ as cli

    def no_plays(*a):
        raise FileNotFoundError("no Markdown plays under /nowhere")
    monkeypatch.setattr(cli, "train_rank", no_plays)
    rows = PB.run()
    assert rows and not any(r.name.startswith("loss") for r in rows)
    assert "no loss-trajectory rows: no Markdown plays" in capsys.readouterr().out


# ============================================================================ on the GPUs
@pytest.mark.gpu
def test_run_on_two_gpus_tiny():
    """The whole module on tiny models and messages, on 2 GPUs (4 where there are): every row measured and
    finite, the loss trajectories close, ZeRO-1's state a share of one GPU's."""
    if PB.gpu_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {PB.gpu_count()}")
    rows = PB.run(small=True)
    names = {r.name for r in rows}
    assert {"all-reduce 2 GPUs", "all-reduce fit 2 GPUs", "ZeRO-1 2 GPUs", "tensor parallel all-reduces 2 GPUs, "
            "transfer", "tensor parallel all-reduces 2 GPUs, waiting", "tensor parallel step 2 GPUs"} <= names
    assert {f"data parallel 2 GPUs, {mb:g} MB buckets" for mb in PB.BUCKET_SWEEP} <= names
    assert any(n.startswith("data parallel 2 GPUs, best bucket ") for n in names), names
    for r in rows:
        assert note_of(FAMILY, r.name)[0] >= 0, r.name
        assert all(math.isfinite(v) and v >= 0 for v in (r.ms, r.rate, r.ratio) if v is not None), r
    for r in rows:
        if r.name.startswith("ZeRO-1 AdamW state"):
            world = int(r.name.split(", ")[1].split()[0])
            assert r.fraction <= 1.01 / world, r
        if r.name.startswith("loss over"):
            assert r.rate <= 10 * PB.LOSS_PPM, r          # tiny and short: the same trajectory, loosely
