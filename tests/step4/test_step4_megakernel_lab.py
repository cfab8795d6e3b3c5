"""Lesson 4c's lab (step4_gpt2/megakernel/lab/): the megakernel's measurement builds and test hooks, not the
kernel the notebook teaches from (tests/step4/test_step4_megakernel.py tests that one).

CPU (CI): the lab's builds (the timeline, the stall build, weights kept in L2, other block sizes and unrolls)
compile without warnings or spills; the timeline's breakdown; the lab decoder's own argument checks. GPU: the
in-kernel timeline stamps every stage in order; the floor's model (every layer = layer 0) with its weights
streamed or kept in L2 matches the float64 reference; hops.cu's costs; a block that never signals (the stall
build, launch(stall_block=b)) makes the others time out instead of hanging, the decoder raises and recovers.
`sanitize`: a capped grid (max_blocks) small enough for compute-sanitizer (tests/sanitize.py)."""
import types

import numpy as np
import pytest

from common.kernels import ARCHS, compile_offline, supported_archs
from step4_gpt2.generate import pad_prompts
from step4_gpt2.megakernel import megakernel as M
from step4_gpt2.megakernel.lab import decoder as LD
from tests.step4.test_step4_megakernel import (G124, LENS, SMALL4, TINY, _check_steps, _compiles_without_spills,  # noqa: F401
                                         _model, _prompts, cp)

gpu = pytest.mark.gpu


# ============================================================================ CPU
@pytest.mark.parametrize("cfg,batch,version", [(G124, 1, 2), (G124, 1, 1), (G124, 8, 1), (G124, 8, 2),
                                               (SMALL4, 2, 2), (TINY, 3, 1), (TINY, 1, 2)])
def test_timeline_build_compiles(cfg, batch, version):
    """lab/megakernel_timeline.cu: the mainline version with %globaltimer stamps (sm_90, as CI builds it)."""
    if 90 not in supported_archs():
        pytest.skip("the installed NVRTC cannot target sm_90")
    d = LD.lab_defines(cfg, batch, version, timeline=True, sm=90)
    assert M.KERNEL in compile_offline(LD.TIMELINE, 90, d).kernels


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("version", [1, 2])
def test_stall_build_compiles_without_spills(arch, version):
    """lab/megakernel_stall.cu: the mainline version with one block that never signals (MK_STALL_BLOCK)."""
    d = {**M.defines(G124, 8, sm=arch), "MK_VERSION": version, "MK_STALL_BLOCK": 3}
    _compiles_without_spills(arch, d, LD.STALL)


@pytest.mark.parametrize("arch", [a for a in ARCHS if a >= 80])
@pytest.mark.parametrize("threads,unroll", [(256, 3), (384, 1), (384, 2), (384, 4)])
def test_batch_1_knob_builds_compile_without_spills(arch, threads, unroll):
    """The benchmark's knobs at batch 1 (rows() keeps 2 rows per item for them; 4 only for the defaults)."""
    _compiles_without_spills(arch, M.defines(G124, 1, sm=arch, threads=threads, unroll=unroll), M.SOURCES[2])


@pytest.mark.parametrize("arch", [a for a in ARCHS if a >= 80])
@pytest.mark.parametrize("batch", [1, 8])
def test_keep_layers_in_l2_build_compiles_without_spills(arch, batch):
    """The floor measurement's build (evict-last weight loads) and its l2_evict_normal kernel."""
    d = M.defines(G124, batch, sm=arch)
    _compiles_without_spills(arch, d, LD.KEEP_L2)
    assert "l2_evict_normal" in compile_offline(LD.KEEP_L2, arch, d).kernels


def test_stage_kinds_and_breakdown():
    assert [LD.stage_kind(j, 2) for j in range(10)] == [0, 1, 2, 3, 0, 1, 2, 3, 4, 0]
    t = np.zeros((2, 9, 3))
    t[:, :, 1], t[:, :, 2] = 1.0, 3.0                    # 1 ms waiting, 2 ms working per stage
    b = LD.breakdown(t, 2)
    assert b["QKV"] == {"wait_ms": 2.0, "work_ms": 4.0} and b["LM head"] == {"wait_ms": 1.0, "work_ms": 2.0}


def test_lab_options_are_checked_before_the_gpu():
    model = None                                         # never reached: the lab's own checks come first
    for kw, name in [(dict(threads=100), "threads"), (dict(unroll=5), "unroll"), (dict(max_blocks=0), "max_blocks"),
                     (dict(blocks_per_sm=0), "blocks_per_sm"),
                     (dict(timeline=True, keep_layers_in_l2=True), "timeline, keep_layers_in_l2"),
                     (dict(version=1, keep_layers_in_l2=True), "keep_layers_in_l2")]:
        with pytest.raises(ValueError, match=name):
            LD.LabMegakernelDecoder(model, 1, 40, **kw)
    for precision in ("bf16", "int8"):                   # their loads take no KEEP hint: refused, not ignored
        with pytest.raises(ValueError, match=f"keep_layers_in_l2: fp32 weights only .* got a {precision} model"):
            LD.LabMegakernelDecoder(types.SimpleNamespace(precision=precision), 1, 40, keep_layers_in_l2=True)


# ============================================================================ GPU
@gpu
@pytest.mark.parametrize("version", [1, 2])
def test_timeline_stamps_every_stage(cp, version):
    import matplotlib
    matplotlib.use("Agg")
    model, _, _ = _model(SMALL4)
    prompts = _prompts(SMALL4, 1)
    dec = LD.LabMegakernelDecoder(model, 1, 40, version=version, timeline=True)
    dec.prefill(pad_prompts(prompts), [len(prompts[0])])
    dec.launch(2)
    dec.stream.synchronize()
    dec.check()
    t = dec.timeline_ms()
    n = M.stages_per_step(SMALL4.n_layer)
    assert t.shape == (dec.grid, 2 * n, 3)
    assert not np.isnan(t[:, :, 0]).any() and not np.isnan(t[:, :, 2]).any()
    ready = np.where(np.isnan(t[:, :, 1]), t[:, :, 0], t[:, :, 1])
    assert (t[:, :, 0] <= ready).all() and (ready <= t[:, :, 2]).all()
    assert (np.diff(t[:, :, 0], axis=1) >= 0).all(), "stages run in order in every block"
    b = LD.breakdown(t, SMALL4.n_layer)
    assert b["span_ms"] > 0 and all(b[s]["work_ms"] >= 0 for s in M.STAGES)
    assert len(dec.stage_names(2)) == 2 * n
    LD.plot_timeline(t, SMALL4.n_layer, title="test", blocks=range(min(8, dec.grid)))


@gpu
@pytest.mark.parametrize("keep", [False, True], ids=["streamed", "kept in L2"])
def test_tied_layers_share_weights_in_the_kernel_and_match_the_reference(cp, keep):
    """The benchmark's floor model (every layer = layer 0): one copy of each weight in the decoder's pointer
    table (c_proj^T included), a KV cache per layer, and logits within 1e-4 of the float64 GPT-2 whose
    layers all hold layer 0's parameters; also with the weights loaded evict-last (keep_layers_in_l2)."""
    from common.device import device_info
    from step4_gpt2.megakernel.lab.floor import tied_layers
    if keep and device_info()["sm"] < 80:
        with pytest.raises(ValueError, match="keep_layers_in_l2: needs"):
            LD.LabMegakernelDecoder(_model(SMALL4)[0], 1, 16, keep_layers_in_l2=True)
        pytest.skip(f"keep_layers_in_l2 needs sm_80+ (checked that it says so); this GPU is sm_{device_info()['sm']}")
    model, params, _ = _model(SMALL4)
    tied = tied_layers(model)
    assert model.h[1] is not model.h[0] and all(b is tied.h[0] for b in tied.h)
    dec = _check_steps(cp, SMALL4, 2, _prompts(SMALL4, 2), max(LENS[:2]) + 4, model=tied,
                       params={k: params["h.0." + k.split(".", 2)[2]] if k.startswith("h.") else v
                               for k, v in params.items()}, cls=LD.LabMegakernelDecoder, keep_layers_in_l2=keep)
    table = dec.ptrs.get().reshape(SMALL4.n_layer, M.LW_COUNT)
    assert (table[:, :12] == table[0, :12]).all()                    # weights: layer 0's, c_proj^T copied once
    assert len(set(table[:, 12])) == len(set(table[:, 13])) == SMALL4.n_layer       # caches: one per layer
    if keep:
        dec.release_l2()


@gpu
def test_hop_costs_are_measured_and_ordered(cp):
    """hops.cu: positive, finite and in the order their chains imply (a hop is at least one L2 round trip)."""
    from step4_gpt2.megakernel.lab.hops import hop_costs
    h = hop_costs(rounds=200, repeats=2)
    assert set(h) == {"hop", "all", "l2", "hop_sms"}
    a, b = h.pop("hop_sms")
    assert a != b, f"the ping-pong's two blocks ran on the same SM ({a})"
    assert all(np.isfinite(v) and 0 < v < 1e5 for v in h.values()), h      # ns: under 100 us
    assert h["l2"] < h["hop"] and h["l2"] < h["all"], h


@gpu
@pytest.mark.parametrize("version", [1, 2])
def test_forced_timeout_raises_and_the_decoder_recovers(cp, version):
    import time
    model, _, _ = _model(SMALL4)
    prompts = _prompts(SMALL4, 2)
    dec = LD.LabMegakernelDecoder(model, 2, 40, version=version, timeout_s=0.05)
    first = dec.prefill(pad_prompts(prompts), [len(p) for p in prompts])
    dec.stall_kernel(dec.grid - 1)                       # compiled before the clock starts
    t0 = time.perf_counter()
    dec.launch(1, stall_block=dec.grid - 1)               # that block never signals: everyone else times out
    with pytest.raises(M.MegakernelTimeout, match=r"block \d+ waited more than 0.05 s at stage"):
        dec.stream.synchronize()
        dec.check()
    assert time.perf_counter() - t0 < 10
    assert int(dec.err.get()[0]) == 0 and int(dec.sync.get().max()) == 0          # reset for the next run
    # after the reset the same decoder decodes correctly again
    from step4_gpt2.generate import generate
    want = generate(model, prompts, 20, stop_at_eos=False).tokens
    got_first = dec.prefill(pad_prompts(prompts), [len(p) for p in prompts])
    assert got_first.tolist() == first.tolist() == [w[0] for w in want]
    steps = list(dec.decode(19))
    assert [[int(s[b]) for s in steps] for b in range(2)] == [w[1:] for w in want]


@gpu
def test_lab_options_are_named(cp):
    model, _, _ = _model(SMALL4)
    for kw, name in [(dict(threads=100), "threads"), (dict(max_blocks=0), "max_blocks")]:
        with pytest.raises(ValueError, match=name):
            LD.LabMegakernelDecoder(model, 1, 40, **kw)


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("version", [1, 2])
def test_sanitize_tiny(cp, version):
    """A 2-layer model, 3 sequences, 4 blocks, 3 steps in one launch: small enough for compute-sanitizer."""
    from step4_gpt2.generate import generate
    model, _, _ = _model(TINY)
    prompts = _prompts(TINY, 3)
    want = generate(model, prompts, 4, stop_at_eos=False).tokens
    dec = LD.LabMegakernelDecoder(model, 3, 20, version=version, max_blocks=4, steps_per_launch=3, timeout_s=60)
    first = dec.prefill(pad_prompts(prompts), [len(p) for p in prompts])
    steps = list(dec.decode(3))
    got = [[int(first[b])] + [int(s[b]) for s in steps] for b in range(3)]
    assert got == want
