"""Lesson 4c, the megakernel: the whole GPT-2 decode step in one persistent kernel (step4_gpt2/megakernel/:
megakernel_v1.cu, megakernel_v2.cu and their headers; the decoder in megakernel.py).

CPU (CI): the kernel compiles for every arch and the shapes the decoder builds, with no warnings or spills;
argument checks that need no GPU; the reading path imports nothing from the lab. GPU: logits of decode steps vs
the float64 reference (124M shape and a 4-layer C=256 model, batch 1/2/8, both versions); 200 greedy tokens
identical to the course's graph decode and to transformers; several steps per launch; sampling; the fallback
when the kernel cannot be resident; a launch with too little shared memory reported; attention chunks merged by
the projection or by the last unit of a head. The lab's builds and hooks (timeline, keep-in-L2, knobs, hops,
the forced timeout, the compute-sanitizer case) are tested in tests/step4/test_step4_megakernel_lab.py."""
import numpy as np
import pytest

from common import max_rel_error as max_rel
from common.kernels import ARCHS, compile_offline, supported_archs
from common.reference import gpt2 as ref
from step4_gpt2 import weights as W
from step4_gpt2.megakernel import megakernel as M
from step4_gpt2.generate import pad_prompts

gpu = pytest.mark.gpu
G124 = W.GPTConfig()
SMALL4 = W.GPTConfig(n_layer=4, n_head=4, n_embd=256, vocab_size=50257, block_size=512)
TINY = W.GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=300, block_size=64)   # head_dim 32
LENS = [8, 3, 12, 5, 1, 9, 7, 2]          # prompt lengths of a batch of 8 (batch 1, 2: the first ones)


# ============================================================================ CPU
def _compiles_without_spills(arch, defines, source):
    if arch not in supported_archs():
        pytest.skip(f"the installed NVRTC cannot target sm_{arch}; CI checks it with NVRTC 12.9")
    r = compile_offline(source, arch, defines)
    k = r.kernels[M.KERNEL]
    assert not r.warnings, r.warnings
    assert (k.spill_stores, k.spill_loads) == (0, 0), r.table()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg,batch,version", [(G124, 1, 2), (G124, 1, 1), (G124, 8, 1), (G124, 8, 2),
                                               (SMALL4, 2, 2), (TINY, 3, 1), (TINY, 1, 2)])
def test_compiles_for_every_arch_without_spills(arch, cfg, batch, version):
    _compiles_without_spills(arch, M.defines(cfg, batch, sm=arch), M.SOURCES[version])     # as the decoder builds it


def test_unsupported_shapes_are_named():
    assert M.unsupported_reason(G124, 1) is None and M.unsupported_reason(TINY, 8) is None
    assert "batch" in M.unsupported_reason(G124, 9) and "batch" in M.unsupported_reason(G124, 0)
    assert "head_dim" in M.unsupported_reason(W.GPTConfig(n_head=6, n_embd=768), 1)      # head_dim 128
    # the shared memory the decoder asks for grows with the batch (the stage inputs)
    assert M.smem_bytes(G124, 8) > M.smem_bytes(G124, 1) > 0


def test_stage_names():
    assert M.STAGES == ("QKV", "attention", "attn proj", "mlp", "LM head") and M.PER_LAYER == 4
    assert M.stages_per_step(12) == 49


def test_supports_asks_for_greedy_and_a_batch_it_takes():
    """supports() says no without asking the GPU where the call is not greedy or the batch is not one the
    kernel takes (the GPU test below covers the occupancy side)."""
    from types import SimpleNamespace
    model = SimpleNamespace(config=G124)
    assert M.supports(model, 1, False) is False
    assert M.supports(model, M.AUTO_MAX_BATCH + 1, True) is False and M.supports(model, 0, True) is False
    assert M.supports(SimpleNamespace(config=G124, precision="bf16"), 1, True) is False    # no GPU asked


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_low_precision_models_are_refused_by_v1_only(precision):
    """v1 reads fp32 weights: a GPT(precision="bf16"/"int8") model is refused by name before any GPU call (it
    would read bf16 bits or int8 codes as floats); v2 takes it (tests/step4/test_megakernel_lowp.py), and
    auto-selection keeps to AUTO_PRECISIONS."""
    from types import SimpleNamespace
    model = SimpleNamespace(config=G124, precision=precision, lm_head_precision=precision)
    assert M.precision_reason(SimpleNamespace(config=G124, precision="fp32")) is None
    assert M.precision_reason(SimpleNamespace(config=G124)) is None            # models before lesson 4f: fp32
    assert M.precision_reason(model) is None and M.precision_reason(model, 2) is None
    with pytest.raises(ValueError, match=rf"version: megakernel v1 reads fp32 weights.*{precision}"):
        M.MegakernelDecoder(model, 1, 40, version=1)
    assert precision not in M.AUTO_PRECISIONS and M.supports(model, 1, True) is False      # no GPU asked


def test_the_reading_path_imports_nothing_from_the_lab():
    """The package, its decoder and its benchmarks module (which the notebook reads) load without lab/; no
    import cycle with lesson 4a (4c imports 4a, never the reverse)."""
    import subprocess
    import sys
    code = ("import sys, step4_gpt2.megakernel, step4_gpt2.megakernel.benchmarks, step4_gpt2.generate; "
            "print(sorted(m for m in sys.modules if '.lab' in m and m.startswith('step4_gpt2.megakernel')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    out = subprocess.run([sys.executable, "-c", "import sys, step4_gpt2.generate; "
                          "print('step4_gpt2.megakernel' in sys.modules)"], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False", "lesson 4a's generate imports the megakernel"


def test_the_ladder_has_a_pdl_rung_on_sm_90_only(monkeypatch):
    """The graph with programmatic dependent launch is a rung of the ladder where the GPU runs it (sm_90+),
    right after the plain graph it is compared with, and left out below."""
    from common import device
    from step4_gpt2.megakernel import benchmarks as BM
    for sm, has in ((90, True), (100, True), (80, False), (70, False)):
        monkeypatch.setattr(device, "device_info", lambda sm=sm: {"sm": sm})
        labels = [label for label, _, _ in BM.rungs()]
        assert ("CUDA graph + PDL" in labels) == has, sm
        assert labels[:2] == ["eager launches", "CUDA graph"] and labels[-1].startswith("megakernel v2")
        if has:
            assert labels[2] == "CUDA graph + PDL" and BM.rungs()[2][1:] == ("graph", {"programmatic": True})


def test_ladder_prompts_leave_room_for_the_decoded_rows():
    from step4_gpt2.megakernel import benchmarks as BM
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


def _check_steps(cp, cfg, version, prompts, length, model=None, params=None, cls=None, **options):
    """Three teacher-forced steps of a decoder (cls, default MegakernelDecoder) for `model` (default:
    _model(cfg); options: the decoder's) against the float64 GPT-2 with `params` (default: the model's)."""
    from common import poison
    if model is None:
        model, params, _ = _model(cfg)
    batch = len(prompts)
    dec = (cls or M.MegakernelDecoder)(model, batch, length, version=version, **options)
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
    """200 new tokens through generate(decoder=MegakernelDecoder): identical to the course's graph decode and
    to transformers' generate on the same weights (each prompt alone)."""
    from step4_gpt2.generate import generate
    model, _, d = _model(cfg)
    prompts = _prompts(cfg, batch, seed=1)
    got = generate(model, prompts, 200, stop_at_eos=False, decoder=M.MegakernelDecoder, version=version,
                   steps_per_launch=steps_per_launch)
    assert got.mode == "megakernel" and got.info["version"] == version
    want = generate(model, prompts, 200, stop_at_eos=False)
    assert want.mode == "graph"
    for b in range(batch):
        assert len(got.tokens[b]) == 200
        assert got.tokens[b] == want.tokens[b], f"row {b}: differs from the graph decode"
        hf = _hf_greedy(cfg, d, prompts[b], 200)
        if hf is not None:
            assert got.tokens[b] == hf, f"row {b}: differs from transformers"


@gpu
def test_eos_stop_sampling_and_decoder_reuse(cp):
    from step4_gpt2.generate import generate
    model, _, _ = _model(SMALL4)
    prompts = _prompts(SMALL4, 2, seed=2)
    MK = M.MegakernelDecoder
    want = generate(model, prompts, 60, stop_at_eos=False).tokens
    stop = want[0][25]
    gen = generate(model, prompts, 60, eos=stop, decoder=MK)
    assert gen.tokens[0] == want[0][:want[0].index(stop) + 1]
    # seeded sampling: the same draws as the graph decoder's (one launch per token, token chosen on the host)
    kw = dict(temperature=0.8, top_k=40, seed=5, stop_at_eos=False)
    assert generate(model, prompts, 40, decoder=MK, **kw).tokens == generate(model, prompts, 40, **kw).tokens
    # a decoder kept by generate() decodes a second call from its counters' state
    a = generate(model, prompts, 60, stop_at_eos=False, decoder=MK)
    b = generate(model, prompts, 60, stop_at_eos=False, decoder=MK)
    assert a.tokens == b.tokens == want


@gpu
def test_fallback_when_the_blocks_cannot_all_be_resident(cp, monkeypatch):
    """supports() (what `--decode auto` asks) says no when not one block fits on an SM; the course's graph
    decode still runs, and the megakernel asked for by name raises MegakernelUnavailable."""
    from step4_gpt2.generate import generate
    model, _, _ = _model(SMALL4)
    prompts = _prompts(SMALL4, 1)
    monkeypatch.setattr(M, "AUTO_MAX_BATCH", 8)
    assert M.supports(model, 1, True)
    monkeypatch.setattr(M, "occupancy", lambda fn, block, smem: {"blocks_per_sm": 0})   # nothing fits
    assert not M.supports(model, 1, True)
    gen = generate(model, prompts, 30, stop_at_eos=False)
    assert gen.mode == "graph"
    with pytest.raises(M.MegakernelUnavailable, match="resident"):
        generate(model, prompts, 30, stop_at_eos=False, decoder=M.MegakernelDecoder)


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
                     (dict(timeout_s=0), "timeout_s")]:
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


