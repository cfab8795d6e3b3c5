"""Step 4's megakernel: the whole GPT-2 decode step in one persistent kernel (step4_gpt2/megakernel.cu).

CPU (CI): the kernel compiles for every arch and the shapes the decoder builds, with no warnings or spills;
argument checks that need no GPU. GPU: logits of decode steps vs the float64 reference (124M shape and a
4-layer C=256 model, batch 1/2/8, both versions); 200 greedy tokens identical to the course's graph decode
and to transformers; several steps per launch; sampling; the fallback when the kernel cannot be resident;
a forced timeout raising an exception (not hanging); the in-kernel timeline; attention chunks merged by the
projection or by the last unit of a head. `sanitize`: tiny cases for compute-sanitizer (tests/sanitize.py)."""
import numpy as np
import pytest

from common import max_rel_error as max_rel
from common.kernels import ARCHS, compile_offline, supported_archs
from common.reference import gpt2 as ref
from step4_gpt2 import megakernel as M
from step4_gpt2 import weights as W
from step4_gpt2.generate import pad_prompts

gpu = pytest.mark.gpu
G124 = W.GPTConfig()
SMALL4 = W.GPTConfig(n_layer=4, n_head=4, n_embd=256, vocab_size=50257, block_size=512)
TINY = W.GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=300, block_size=64)   # head_dim 32
LENS = [8, 3, 12, 5, 1, 9, 7, 2]          # prompt lengths of a batch of 8 (batch 1, 2: the first ones)


# ============================================================================ CPU
def _compiles_without_spills(arch, defines):
    if arch not in supported_archs():
        pytest.skip(f"the installed NVRTC cannot target sm_{arch}; CI checks it with NVRTC 12.9")
    r = compile_offline(M.SOURCE, arch, defines)
    k = r.kernels[M.KERNEL]
    assert not r.warnings, r.warnings
    assert (k.spill_stores, k.spill_loads) == (0, 0), r.table()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg,batch,version", [(G124, 1, 2), (G124, 1, 1), (G124, 8, 1), (G124, 8, 2),
                                               (SMALL4, 2, 2), (TINY, 3, 1), (TINY, 1, 2)])
def test_compiles_for_every_arch_without_spills(arch, cfg, batch, version):
    _compiles_without_spills(arch, M.defines(cfg, batch, version, sm=arch))     # as _fit builds it there
    if arch == 90:      # the timeline build too
        assert M.KERNEL in compile_offline(M.SOURCE, arch, M.defines(cfg, batch, version, timeline=True, sm=arch)).kernels


@pytest.mark.parametrize("arch", [a for a in ARCHS if a >= 80])
@pytest.mark.parametrize("threads,unroll", [(256, 3), (384, 1), (384, 2), (384, 4)])
def test_batch_1_knob_builds_compile_without_spills(arch, threads, unroll):
    """The benchmark's knobs at batch 1 (rows() keeps 2 rows per item for them; 4 only for the defaults)."""
    _compiles_without_spills(arch, M.defines(G124, 1, 2, threads=threads, unroll=unroll, sm=arch))


@pytest.mark.parametrize("arch", [a for a in ARCHS if a >= 80])
@pytest.mark.parametrize("batch", [1, 8])
def test_keep_layers_in_l2_build_compiles_without_spills(arch, batch):
    """The floor measurement's build (evict-last weight loads) and its l2_evict_normal kernel."""
    d = M.defines(G124, batch, 2, sm=arch, keep_layers_in_l2=True)
    _compiles_without_spills(arch, d)
    assert "l2_evict_normal" in compile_offline(M.SOURCE, arch, d).kernels


def test_unsupported_shapes_are_named():
    assert M.unsupported_reason(G124, 1) is None and M.unsupported_reason(TINY, 8) is None
    assert "batch" in M.unsupported_reason(G124, 9) and "batch" in M.unsupported_reason(G124, 0)
    assert "head_dim" in M.unsupported_reason(W.GPTConfig(n_head=6, n_embd=768), 1)      # head_dim 128
    # the shared memory the decoder asks for grows with the batch (the stage inputs)
    assert M.smem_bytes(G124, 8) > M.smem_bytes(G124, 1) > 0


def test_stage_names_and_kinds():
    assert M.STAGES == ("QKV", "attention", "attn proj", "mlp", "LM head") and M.PER_LAYER == 4
    assert M.stages_per_step(12) == 49
    assert [M.stage_kind(j, 2) for j in range(10)] == [0, 1, 2, 3, 0, 1, 2, 3, 4, 0]
    t = np.zeros((2, 9, 3))
    t[:, :, 1], t[:, :, 2] = 1.0, 3.0                    # 1 ms waiting, 2 ms working per stage
    b = M.breakdown(t, 2)
    assert b["QKV"] == {"wait_ms": 2.0, "work_ms": 4.0} and b["LM head"] == {"wait_ms": 1.0, "work_ms": 2.0}


def test_ladder_prompts_leave_room_for_the_decoded_rows():
    from step4_gpt2 import benchmarks_megakernel as BM
    assert BM.prompt_len(G124, 32) == 32
    assert BM.prompt_len(G124, 1000) == 991         # the decoder's cache: 991 + 32 + 1 = 1024 rows, block_size
    assert BM.STEPS == 32 and max(BM.CTXS) == 1000


# ============================================================================ GPU
@pytest.fixture(scope="module")
def cp():
    from common.device import skip_reason
    if skip_reason():
        pytest.skip(f"no GPU: {skip_reason()}")
    import cupy
    return cupy


_models = {}


def _model(cfg, seed=3):
    """(GPT, params, directory) with random weights, made once per config."""
    import tempfile
    from pathlib import Path
    from step4_gpt2.model import GPT
    key = (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size, seed)
    if key not in _models:
        d = Path(tempfile.mkdtemp(prefix="mk_"))
        params = W.random_weights(cfg, seed=seed, notice=False)
        W.save(params, cfg, d)
        _models[key] = (GPT(cfg, params), params, d)
    return _models[key]


def _prompts(cfg, batch, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab_size, n).tolist() for n in LENS[:batch]]


_refs = {}


def _ref_last_logits(cfg, params, seq):
    key = (id(params), tuple(seq))             # the params stay referenced below, so their id is not reused
    if key not in _refs:
        _refs[key] = (params, ref.forward(params, np.array([seq]), cfg.n_layer, cfg.n_head, cfg.eps)[0, -1])
    return _refs[key][1]


@gpu
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("batch", [1, 2, 8])
@pytest.mark.parametrize("cfg", [G124, SMALL4], ids=["124M", "4L-4H-256"])
def test_step_logits_match_float64_reference(cp, cfg, batch, version):
    """Three decode steps (teacher-forced tokens) after prompts of different lengths: every row's logits
    within 1e-4 (max abs error / max |logit|) of the float64 NumPy GPT-2."""
    _check_steps(cp, cfg, version, _prompts(cfg, batch), max(LENS[:batch]) + 4)


@gpu
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("cfg", [W.GPTConfig(n_layer=2, n_head=16, n_embd=1024, vocab_size=300, block_size=64),
                                 W.GPTConfig(n_layer=2, n_head=25, n_embd=1600, vocab_size=300, block_size=64),
                                 W.GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=300, block_size=64)],
                         ids=["2L-16H-1024", "2L-25H-1600", "2L-2H-64"])
def test_other_widths_split_the_mlp_down_projection_other_ways(cp, cfg, version):
    """gpt2-medium's width (C = 1024: one group of threads, a float4 column each, no cross-group sum),
    gpt2-xl's (C = 1600: more float4 columns than threads, taken in turns), and C = 64, where a full grid has
    more blocks than the MLP has row pairs (block 0 owns none: another block adds the bias); logits as above."""
    _check_steps(cp, cfg, version, _prompts(cfg, 2), max(LENS[:2]) + 4)


@gpu
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("batch,prompt,length,proj_merges", [(1, 70, 100, True), (2, 40, 64, True),
                                                             (1, 150, 160, False), (2, 90, 100, False)])
@pytest.mark.parametrize("cfg", [G124, SMALL4], ids=["124M", "4L-4H-256"])
def test_attention_chunks_merge_either_way(cp, cfg, batch, prompt, length, proj_merges, version):
    """Caches long enough to split attention into chunks: merged by the attention projection's blocks (few
    chunks, one of them empty here) or by the last unit of each (sequence, head); logits as above."""
    rng = np.random.default_rng(prompt)
    prompts = [rng.integers(0, cfg.vocab_size, prompt - 7 * b).tolist() for b in range(batch)]
    dec = _check_steps(cp, cfg, version, prompts, length)
    assert dec.nch > 1 and (batch * dec.nch <= M.MERGE_MAX) == proj_merges, dec.nch


def _check_steps(cp, cfg, version, prompts, length, model=None, params=None, **options):
    """Three teacher-forced steps of a decoder for `model` (default: _model(cfg); options: the decoder's)
    against the float64 GPT-2 with `params` (default: the model's)."""
    from common import poison
    if model is None:
        model, params, _ = _model(cfg)
    batch = len(prompts)
    dec = M.MegakernelDecoder(model, batch, length, version=version, **options)
    dec.prefill(pad_prompts(prompts), [len(p) for p in prompts])
    rng = np.random.default_rng(batch)
    seqs = [list(p) for p in prompts]
    for step in range(3):
        feed = rng.integers(0, cfg.vocab_size, batch).astype(np.int32)
        with dec.stream:                   # the decoder's own (non-blocking) stream, like its launches
            dec.state.tokens[...] = cp.asarray(feed)
            poison(dec.state.logits)
        dec.launch(1)
        dec.stream.synchronize()
        dec.check()
        got = dec.state.logits.get()
        for b in range(batch):
            seqs[b].append(int(feed[b]))
            want = _ref_last_logits(cfg, params, seqs[b])
            assert max_rel(got[b], want) <= 1e-4, (step, b, max_rel(got[b], want))
            assert dec.state.tokens[b].get() == np.argmax(got[b]), "the kernel's argmax"
        assert (dec.state.pos.get() == np.array([len(s) for s in seqs])).all()
    return dec


_hf_cache, _hf_models = {}, {}


def _hf_greedy(cfg, directory, prompt, n):
    """transformers' greedy tokens for one prompt (GPU torch), or None when torch/transformers are missing."""
    key = (str(directory), tuple(prompt), n)
    if key in _hf_cache:
        return _hf_cache[key]
    try:
        import torch
        import transformers
    except ImportError:
        return None
    from common import torch_cuda
    if torch_cuda() is None:
        return None
    if str(directory) not in _hf_models:
        hf = transformers.GPT2LMHeadModel.from_pretrained(str(directory), dtype=torch.float32).eval().cuda()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        _hf_models[str(directory)] = hf
    hf = _hf_models[str(directory)]
    x = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=0,
                          do_sample=False, use_cache=True)
    _hf_cache[key] = out[0, len(prompt):].tolist()
    return _hf_cache[key]


@gpu
@pytest.mark.parametrize("version,steps_per_launch", [(1, 1), (2, 1), (2, 50), (1, 199)])
@pytest.mark.parametrize("batch", [1, 2, 8])
@pytest.mark.parametrize("cfg", [G124, SMALL4], ids=["124M", "4L-4H-256"])
def test_greedy_200_tokens_identical(cp, cfg, batch, version, steps_per_launch):
    """200 new tokens through generate(mode="megakernel"): identical to the course's graph decode and to
    transformers' generate on the same weights (each prompt alone)."""
    from step4_gpt2.generate import generate
    model, _, d = _model(cfg)
    prompts = _prompts(cfg, batch, seed=1)
    got = generate(model, prompts, 200, stop_at_eos=False, mode="megakernel", reuse=False, version=version,
                   steps_per_launch=steps_per_launch)
    assert got.mode == "megakernel" and got.info["version"] == version
    want = generate(model, prompts, 200, stop_at_eos=False, mode="graph", reuse=False)
    for b in range(batch):
        assert len(got.tokens[b]) == 200
        assert got.tokens[b] == want.tokens[b], f"row {b}: differs from the graph decode"
        hf = _hf_greedy(cfg, d, prompts[b], 200)
        if hf is not None:
            assert got.tokens[b] == hf, f"row {b}: differs from transformers"


@gpu
@pytest.mark.parametrize("keep", [False, True], ids=["streamed", "kept in L2"])
def test_tied_layers_share_weights_in_the_kernel_and_match_the_reference(cp, keep):
    """The benchmark's floor model (every layer = layer 0): one copy of each weight in the decoder's pointer
    table (c_proj^T included), a KV cache per layer, and logits within 1e-4 of the float64 GPT-2 whose
    layers all hold layer 0's parameters; also with the weights loaded evict-last (keep_layers_in_l2)."""
    from common.device import device_info
    from step4_gpt2 import benchmarks_megakernel as BM
    if keep and device_info()["sm"] < 80:
        with pytest.raises(ValueError, match="keep_layers_in_l2: needs"):
            M.MegakernelDecoder(_model(SMALL4)[0], 1, 16, keep_layers_in_l2=True)
        pytest.skip(f"keep_layers_in_l2 needs sm_80+ (checked that it says so); this GPU is sm_{device_info()['sm']}")
    model, params, _ = _model(SMALL4)
    tied = BM.tied_layers(model)
    assert model.h[1] is not model.h[0] and all(b is tied.h[0] for b in tied.h)
    dec = _check_steps(cp, SMALL4, 2, _prompts(SMALL4, 2), max(LENS[:2]) + 4, model=tied,
                       params={k: params["h.0." + k.split(".", 2)[2]] if k.startswith("h.") else v
                               for k, v in params.items()}, keep_layers_in_l2=keep)
    table = dec.ptrs.get().reshape(SMALL4.n_layer, M.LW_COUNT)
    assert (table[:, :12] == table[0, :12]).all()                    # weights: layer 0's, c_proj^T copied once
    assert len(set(table[:, 12])) == len(set(table[:, 13])) == SMALL4.n_layer       # caches: one per layer
    if keep:
        dec.release_l2()


@gpu
def test_hop_costs_are_measured_and_ordered(cp):
    """hops.cu: positive, finite and in the order their chains imply (a hop is at least one L2 round trip)."""
    from step4_gpt2 import benchmarks_megakernel as BM
    h = BM.hop_costs(rounds=200, repeats=2)
    assert set(h) == {"hop", "all", "l2", "hop_sms"}
    a, b = h.pop("hop_sms")
    assert a != b, f"the ping-pong's two blocks ran on the same SM ({a})"
    assert all(np.isfinite(v) and 0 < v < 1e5 for v in h.values()), h      # ns: under 100 us
    assert h["l2"] < h["hop"] and h["l2"] < h["all"], h


@gpu
def test_eos_stop_sampling_and_decoder_reuse(cp):
    from step4_gpt2.generate import generate
    model, _, _ = _model(SMALL4)
    prompts = _prompts(SMALL4, 2, seed=2)
    want = generate(model, prompts, 60, stop_at_eos=False, mode="graph", reuse=False).tokens
    stop = want[0][25]
    gen = generate(model, prompts, 60, eos=stop, mode="megakernel", reuse=False)
    assert gen.tokens[0] == want[0][:want[0].index(stop) + 1]
    # seeded sampling: the same draws as the graph decoder's (one launch per token, token chosen on the host)
    kw = dict(temperature=0.8, top_k=40, seed=5, stop_at_eos=False, reuse=False)
    assert generate(model, prompts, 40, mode="megakernel", **kw).tokens == generate(model, prompts, 40, mode="graph", **kw).tokens
    # a decoder kept by generate() decodes a second call from its counters' state
    a = generate(model, prompts, 60, stop_at_eos=False, mode="megakernel")
    b = generate(model, prompts, 60, stop_at_eos=False, mode="megakernel")
    assert a.tokens == b.tokens == want


@gpu
def test_fallback_when_the_blocks_cannot_all_be_resident(cp, monkeypatch):
    from step4_gpt2.generate import choose_mode, generate
    model, _, _ = _model(SMALL4)
    prompts = _prompts(SMALL4, 1)
    monkeypatch.setattr(M, "AUTO_MAX_BATCH", 8)
    assert choose_mode(model, "auto", 1, 40, True) == "megakernel"
    monkeypatch.setattr(M, "occupancy", lambda fn, block, smem: {"blocks_per_sm": 0})   # nothing fits
    assert choose_mode(model, "auto", 1, 40, True) == "graph"
    gen = generate(model, prompts, 30, stop_at_eos=False, reuse=False)
    assert gen.mode == "graph"
    with pytest.raises(M.MegakernelUnavailable, match="resident"):
        generate(model, prompts, 30, stop_at_eos=False, mode="megakernel", reuse=False)


@gpu
@pytest.mark.parametrize("version", [1, 2])
def test_forced_timeout_raises_and_the_decoder_recovers(cp, version):
    import time
    model, _, _ = _model(SMALL4)
    prompts = _prompts(SMALL4, 2)
    dec = M.MegakernelDecoder(model, 2, 40, version=version, timeout_s=0.05)
    first = dec.prefill(pad_prompts(prompts), [len(p) for p in prompts])
    t0 = time.perf_counter()
    dec.launch(1, stall_block=dec.grid - 1)               # that block never signals: everyone else times out
    with pytest.raises(M.MegakernelTimeout, match=r"block \d+ waited more than 0.05 s at stage"):
        dec.stream.synchronize()
        dec.check()
    assert time.perf_counter() - t0 < 10
    assert int(dec.err.get()[0]) == 0 and int(dec.sync.get().max()) == 0          # reset for the next run
    # after the reset the same decoder decodes correctly again
    from step4_gpt2.generate import generate
    want = generate(model, prompts, 20, stop_at_eos=False, mode="graph", reuse=False).tokens
    got_first = dec.prefill(pad_prompts(prompts), [len(p) for p in prompts])
    assert got_first.tolist() == first.tolist() == [w[0] for w in want]
    steps = list(dec.decode(19))
    assert [[int(s[b]) for s in steps] for b in range(2)] == [w[1:] for w in want]


@gpu
def test_a_launch_with_too_little_shared_memory_reports_it(cp):
    model, _, _ = _model(TINY)
    prompts = _prompts(TINY, 1)
    dec = M.MegakernelDecoder(model, 1, 20)
    dec.prefill(pad_prompts(prompts), [len(prompts[0])])
    need = dec.smem
    dec.smem -= 16                                         # as if smem_bytes and the .cu's layout disagreed
    dec.launch(1)
    with pytest.raises(RuntimeError, match=f"needs {need:,} B"):
        dec.stream.synchronize()
        dec.check()
    assert int(dec.err.get()[0]) == 0


@gpu
def test_bad_arguments_are_named(cp):
    model, _, _ = _model(SMALL4)
    with pytest.raises(M.MegakernelUnavailable, match="batch"):
        M.MegakernelDecoder(model, 9, 40)
    for kw, name in [(dict(version=3), "version"), (dict(steps_per_launch=0), "steps_per_launch"),
                     (dict(threads=100), "threads"), (dict(timeout_s=0), "timeout_s"), (dict(max_blocks=0), "max_blocks")]:
        with pytest.raises(ValueError, match=name):
            M.MegakernelDecoder(model, 1, 40, **kw)
    with pytest.raises(ValueError, match="length"):
        M.MegakernelDecoder(model, 1, SMALL4.block_size + 1)
    with pytest.raises(ValueError, match="steps_per_launch"):
        M.MegakernelDecoder(model, 1, 40, greedy=False, steps_per_launch=4)
    dec = M.MegakernelDecoder(model, 1, 12)
    with pytest.raises(ValueError, match="prefill"):
        next(dec.decode(3))
    dec.prefill(np.array([[1, 2, 3]], np.int32), [3])
    with pytest.raises(ValueError, match="n_steps"):
        next(dec.decode(10))                          # 3 + 10 rows > 12
    with pytest.raises(ValueError, match="choose"):
        next(dec.decode(2, choose=lambda logits: logits.argmax(-1)))


@gpu
@pytest.mark.parametrize("version", [1, 2])
def test_timeline_stamps_every_stage(cp, version):
    import matplotlib
    matplotlib.use("Agg")
    model, _, _ = _model(SMALL4)
    prompts = _prompts(SMALL4, 1)
    dec = M.MegakernelDecoder(model, 1, 40, version=version, timeline=True)
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
    b = M.breakdown(t, SMALL4.n_layer)
    assert b["span_ms"] > 0 and all(b[s]["work_ms"] >= 0 for s in M.STAGES)
    assert len(dec.stage_names(2)) == 2 * n
    M.plot_timeline(t, SMALL4.n_layer, title="test", blocks=range(min(8, dec.grid)))


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("version", [1, 2])
def test_sanitize_tiny(cp, version):
    """A 2-layer model, 3 sequences, 4 blocks, 3 steps in one launch: small enough for compute-sanitizer."""
    from step4_gpt2.generate import generate
    model, _, _ = _model(TINY)
    prompts = _prompts(TINY, 3)
    want = generate(model, prompts, 4, stop_at_eos=False, mode="graph", reuse=False).tokens
    dec = M.MegakernelDecoder(model, 3, 20, version=version, max_blocks=4, steps_per_launch=3, timeout_s=60)
    first = dec.prefill(pad_prompts(prompts), [len(p) for p in prompts])
    steps = list(dec.decode(3))
    got = [[int(first[b])] + [int(s[b]) for s in steps] for b in range(3)]
    assert got == want
