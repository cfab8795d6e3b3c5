"""Lesson 4f: GPT-2 decode with bf16 / int8 weights (step4_gpt2.model's precision=) and the quality measures
(step4_gpt2/precision/). CPU: perplexity against a float64 NumPy computation on a tiny model, teacher-forced
agreement, the exact bytes per token, argument errors, the benchmark family and its --help, the ladder's rows.
GPU: decode and prefill in bf16 / int8 against the same model on its widened / dequantized weights in fp32
(model.reference()), greedy tokens and logits; the graph decode replays; an int8 model with a bf16 LM head."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from common import assert_close, max_rel_error, poison
from step4_gpt2 import weights as W
from step4_gpt2.model import PRECISIONS, GPT, lm_head_precision, weight_bytes_per_token
from step4_gpt2.precision import quality as Q

ROOT = Path(__file__).resolve().parents[2]
gpu = pytest.mark.gpu


# ============================================================================ CPU
class TinyLM:
    """A bigram model in NumPy: logits[b, t] = E[idx[b, t]] @ U + (position term). Enough to score text."""

    def __init__(self, V=37, C=8, block_size=16, seed=0):
        rng = np.random.default_rng(seed)
        self.E, self.U = rng.standard_normal((V, C)).astype(np.float32), rng.standard_normal((C, V)).astype(np.float32)
        self.P = 0.1 * rng.standard_normal((block_size, V)).astype(np.float32)
        self.config = W.GPTConfig(n_layer=1, n_head=1, n_embd=C, vocab_size=V, block_size=block_size)
        self.calls = []

    def forward(self, idx):
        idx = np.asarray(idx)
        self.calls.append(idx.shape)
        return (self.E[idx] @ self.U + self.P[:idx.shape[1]]).astype(np.float32)


def nll_float64(model, ids, T):
    """The definition, token by token, in float64: every non-overlapping window of T + 1 tokens."""
    total, n = 0.0, 0
    for s in range(0, (len(ids) - 1) // T * T, T):
        x, y = ids[s:s + T], ids[s + 1:s + T + 1]
        z = (model.E.astype(np.float64)[x] @ model.U.astype(np.float64) + model.P.astype(np.float64)[:T])
        for t in range(T):
            row = z[t]
            total += np.log(np.exp(row - row.max()).sum()) + row.max() - row[y[t]]
            n += 1
    return total / n, n


@pytest.mark.parametrize("T, n_ids", [(16, 16 * 7 + 1), (5, 123), (1, 9), (16, 17)])
def test_perplexity_matches_a_float64_computation(T, n_ids):
    m = TinyLM()
    ids = np.random.default_rng(T).integers(0, 37, n_ids)
    want, count = nll_float64(m, ids, T)
    got, got_count = Q.mean_nll(m, ids, T, batch=3)
    assert all(s[0] <= 3 for s in m.calls)                 # at most batch=3 windows per forward call
    assert got_count == count == (n_ids - 1) // T * T
    assert abs(got - want) < 1e-6 * abs(want)             # the model's logits are float32; the sum float64
    assert Q.perplexity(m, ids, T) == pytest.approx(np.exp(want), rel=1e-6)


def test_windows_spread_and_shift():
    ids = np.arange(101)
    x, y = Q.windows(ids, 10)
    assert x.shape == y.shape == (10, 10) and x.dtype == np.int32
    assert np.array_equal(y, x + 1) and x[3, 0] == 30
    x4, _ = Q.windows(ids, 10, max_windows=4)
    assert [int(r[0]) for r in x4] == [0, 30, 60, 90]      # spread evenly over the text, first and last included


def test_token_nll_in_float64():
    logits = np.array([[[0.0, 1e3, 0.0]]], np.float32)    # large logits: no overflow (max subtracted first)
    nll = Q.token_nll(logits, np.array([[1]]))
    assert nll.dtype == np.float64 and nll[0, 0] == pytest.approx(2 * np.exp(-1e3), abs=1e-300)


def test_quality_argument_errors():
    m = TinyLM()
    ids = np.arange(50) % 37
    with pytest.raises(ValueError, match="T: 17 tokens exceed the model's context, block_size=16"):
        Q.mean_nll(m, ids, 17)
    with pytest.raises(ValueError, match="T: expected a window length >= 1"):
        Q.windows(ids, 0)
    with pytest.raises(ValueError, match="ids: 5 tokens hold no window"):
        Q.windows(ids[:5], 8)
    with pytest.raises(ValueError, match="ids: expected a 1-D array of token ids"):
        Q.windows(ids.reshape(5, 10), 4)
    with pytest.raises(ValueError, match="max_windows: expected an integer >= 1"):
        Q.windows(ids, 4, max_windows=0)
    with pytest.raises(ValueError, match="batch: expected an integer >= 1"):
        Q.mean_nll(m, ids, 4, batch=0)
    with pytest.raises(ValueError, match="targets: expected shape"):
        Q.token_nll(np.zeros((2, 3, 5), np.float32), np.zeros((2, 4), np.int64))
    with pytest.raises(ValueError, match="starts: expected one start per sequence"):
        Q.top1_agreement(m, m, [[1, 2, 3]], [1, 2])
    with pytest.raises(ValueError, match="starts: 3 is not inside a sequence of 3 tokens"):
        Q.top1_agreement(m, m, [[1, 2, 3]], [3])


def test_top1_agreement_counts_positions():
    a, b = TinyLM(seed=0), TinyLM(seed=1)
    seqs, starts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]], [2, 1]
    assert Q.top1_agreement(a, a, seqs, starts) == 1.0
    want = []
    for seq, st in zip(seqs, starts):
        za, zb = a.forward(np.array([seq]))[0], b.forward(np.array([seq]))[0]
        want += list(za[st - 1:len(seq) - 1].argmax(-1) == zb[st - 1:len(seq) - 1].argmax(-1))
    assert len(want) == 6 and Q.top1_agreement(a, b, seqs, starts) == pytest.approx(np.mean(want))


@pytest.mark.parametrize("name", ["gpt2", "gpt2-xl"])
def test_weight_bytes_per_token_by_precision(name):
    cfg = W.GPTConfig.from_name(name)
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    assert weight_bytes_per_token(cfg) == weight_bytes_per_token(cfg, "fp32") == cfg.weight_bytes_per_token()
    small = 4 * (L * (9 * C + 4 * C) + 2 * C + C)          # biases (3C + C + 4C + C), 2 LayerNorms, ln_f, a wpe row
    matrices, head = 12 * C * C * L, V * C
    assert weight_bytes_per_token(cfg, "bf16") == small + 2 * (matrices + head)
    assert weight_bytes_per_token(cfg, "int8") == small + matrices + head + 4 * (9 * C * L + V)
    assert weight_bytes_per_token(cfg, "int8", "bf16") == small + matrices + 4 * 9 * C * L + 2 * head
    if name == "gpt2":                                    # the numbers the lesson and gemv_lowp.cu quote
        assert [round(weight_bytes_per_token(cfg, p) / 1e6, 1) for p in PRECISIONS] == [494.6, 247.6, 124.6]


def test_precision_argument_errors_before_any_gpu_work():
    cfg = W.GPTConfig(n_layer=1, n_head=2, n_embd=64, vocab_size=100, block_size=16)
    with pytest.raises(ValueError, match="precision"):
        GPT(cfg, {}, precision="fp16")
    with pytest.raises(ValueError, match="lm_head: expected None or 'bf16' for precision='bf16'"):
        GPT(cfg, {}, precision="bf16", lm_head="int8")
    with pytest.raises(ValueError, match=r"lm_head: expected None or 'int8' for precision='int8' \(or 'bf16'\)"):
        lm_head_precision("int8", "fp32")
    assert lm_head_precision("int8") == "int8" and lm_head_precision("int8", "bf16") == "bf16"
    with pytest.raises(ValueError, match="precision"):
        weight_bytes_per_token(cfg, "int4")


def test_benchmark_family_is_discovered_and_its_help_runs(tmp_path):
    from common.benchmarks import select, valid_names
    assert "step4_gpt2:precision" in valid_names()
    assert ("step4_gpt2:precision", "step4_gpt2.precision.benchmarks", None) in select(["step4_gpt2:precision"])
    r = subprocess.run([sys.executable, "-m", "step4_gpt2.precision.benchmarks", "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "bound (steps/s)" in r.stdout, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_ladder_rows_carry_each_bound_and_the_xl_checks():
    from step4_gpt2.precision import benchmarks as B
    times = {(p, b): t * (2 if b == 8 else 1) for p, t in zip(PRECISIONS, (2e-3, 1.1e-3, 0.6e-3)) for b in (1, 8)}
    bw = 3000.0
    rows = B.ladder_rows("gpt2-xl", times, bw)
    cfg = W.GPTConfig.from_name("gpt2-xl")
    main = [r for r in rows if r.name.endswith("(CUDA graph)")]
    assert len(main) == 6
    for r in main:
        p = r.name.split()[1]
        assert r.ceiling == f"{p} weight-bw bound"
        assert r.fraction == pytest.approx(weight_bytes_per_token(cfg, p) / (r.ms / 1e3) / (bw * 1e9))
    targets = {r.name: r.target for r in rows if r.target}
    assert targets == {"decode bf16 b=1 vs fp32": "ratio >= 1.8", "decode bf16 b=1: bandwidth": "fraction >= 0.7",
                       "decode int8 b=1 vs fp32": "ratio >= 3", "decode int8 b=1: bandwidth": "fraction >= 0.7"}
    ratio = {r.name: r.ratio for r in rows if r.name.endswith("vs fp32")}
    assert ratio["decode int8 b=1 vs fp32"] == pytest.approx(2e-3 / 0.6e-3)
    assert not any(r.target for r in B.ladder_rows("gpt2", times, bw))     # the checks are the XL shape's


def test_the_lesson_notebook_is_in_place():
    import json
    nb = json.loads((ROOT / "step4_gpt2" / "precision" / "04f_fewer_bytes.ipynb").read_text())
    assert "".join(nb["cells"][0]["source"]).startswith("# Step 4f · Fewer bytes per token")


# ============================================================================ GPU
TINY = W.GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=1001, block_size=64)   # V: not a tile multiple
TOL = dict(rtol=1e-4, atol=2e-4)   # same weights: the order of fp32 sums differs (int8: where the scale applies)


def lowp_and_reference(precision, lm_head=None, cfg=TINY, seed=0):
    params = W.random_weights(cfg, seed=seed, notice=False)
    model = GPT(cfg, params, precision=precision, lm_head=lm_head)
    return model, model.reference()


def decode_logits(model, prompts, steps, feed=None):
    """Prefill, then `steps` decode steps (greedy, eager launches): each step's logits (host) and tokens. feed:
    the tokens (another run's, one (B,) array per step) each step decodes instead of the greedy ones."""
    import cupy as cp
    from step4_gpt2.model import DecodeState
    B, T = prompts.shape
    s = DecodeState(model.config, B, T + steps)
    logits = model.forward(prompts, cache=s.cache, last=np.full(B, T - 1))
    s.tokens[...] = cp.argmax(logits, axis=-1).astype(cp.int32)
    s.pos[...] = T
    s.lens[...] = T + 1
    out, toks = [logits.get()], [s.tokens.get()]
    for k in range(steps):
        if feed is not None:
            s.tokens[...] = cp.asarray(feed[k])
        poison(s.logits)
        model.decode_step(s, greedy=True)
        out.append(s.logits.get())
        toks.append(s.tokens.get())
    return out, toks


@gpu
@pytest.mark.parametrize("precision, lm_head", [("bf16", None), ("int8", None), ("int8", "bf16")])
@pytest.mark.parametrize("B", [1, 3, 8])
def test_decode_matches_the_dequantized_fp32_model(precision, lm_head, B):
    """On the CUDA cores (v6/v7: x in fp32) at every batch: the fp32 model's logits and tokens."""
    from step4_gpt2 import ops
    model, ref = lowp_and_reference(precision, lm_head)
    prompts = np.random.default_rng(B).integers(0, TINY.vocab_size, (B, 7)).astype(np.int32)
    with ops.tensor_cores(False):
        got, got_tok = decode_logits(model, prompts, 10)
    want, want_tok = decode_logits(ref, prompts, 10)
    for k, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w.astype(np.float64), **TOL, name=f"{precision} logits, step {k}, batch {B}")
    assert all(np.array_equal(a, b) for a, b in zip(got_tok, want_tok))


@gpu
@pytest.mark.parametrize("precision, lm_head", [("bf16", None), ("int8", None), ("int8", "bf16")])
@pytest.mark.parametrize("B", [1, 8])
def test_decode_on_tensor_cores_stays_near_the_fp32_model(precision, lm_head, B):
    """Batch 8, and batch 1 with rows as short as TINY's, take the tensor-core GEMVs by default (ops.lowp_version),
    which round x to bf16 (bf16 weights) or fp16 (int8): every step's logits within that rounding of the fp32
    model's (max abs error over max |logit|; an fp16 step is 8x finer than a bf16 one). Greedy tokens may part at
    a near tie, so the model decodes the reference's tokens (teacher forcing); the CUDA-core test above compares
    the tokens."""
    from common import device_info
    from step4_gpt2 import ops
    from step4_gpt2.quantize import KIND_OF_DTYPE
    model, ref = lowp_and_reference(precision, lm_head)
    kinds = {KIND_OF_DTYPE[np.dtype(model.h[0].c_attn.dtype)], KIND_OF_DTYPE[np.dtype(model.lm_head.dtype)]}
    sm = device_info()["sm"]
    if any(sm < ops.TC_ARCH[k] for k in kinds):
        pytest.skip(f"the tensor-core GEMVs for {sorted(kinds)} need sm_{max(ops.TC_ARCH[k] for k in kinds)}; "
                    f"this GPU is sm_{sm}")
    assert {ops.lowp_version(k, B, K) for k in kinds for K in (TINY.n_embd, 4 * TINY.n_embd)} == \
        {ops.TC_VERSION[k] for k in kinds}
    prompts = np.random.default_rng(B).integers(0, TINY.vocab_size, (B, 7)).astype(np.int32)
    want, want_tok = decode_logits(ref, prompts, 10)
    got, _ = decode_logits(model, prompts, 10, feed=want_tok)
    limit = 2e-2 if "bf16" in kinds else 4e-3
    for k, (g, w) in enumerate(zip(got, want)):
        err = max_rel_error(g, w.astype(np.float64))
        assert err <= limit, f"{precision} logits, step {k}: max error {err:.2e} of max |logit| (limit {limit:.0e})"


@gpu
@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_prefill_matches_the_dequantized_fp32_model(precision):
    model, ref = lowp_and_reference(precision, seed=2)
    idx = np.random.default_rng(5).integers(0, TINY.vocab_size, (3, 37)).astype(np.int32)   # T: not a tile multiple
    assert_close(model.forward(idx), ref.forward(idx).get().astype(np.float64), **TOL, name=f"{precision} prefill")


@gpu
@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_weights_are_stored_in_their_precision(precision):
    import cupy as cp
    from step4_gpt2 import quantize
    params = W.random_weights(TINY, seed=3, notice=False)
    model = GPT(TINY, params, precision=precision)
    w = cp.ascontiguousarray(cp.asarray(params["h.1.mlp.c_fc.weight"]).T)          # (out, in)
    blk = model.h[1]
    if precision == "bf16":
        assert blk.c_fc.dtype == cp.uint16 and blk.c_fc_s is None and model.lm_head.dtype == cp.uint16
        assert cp.array_equal(blk.c_fc, quantize.to_bf16(w))
    else:
        q, scale = quantize.quantize_int8(w)
        assert blk.c_fc.dtype == cp.int8 and cp.array_equal(blk.c_fc, q) and cp.array_equal(blk.c_fc_s, scale)
        assert model.lm_head.dtype == cp.int8 and model.lm_head_s.shape == (TINY.vocab_size,)
    assert model.wte.dtype == cp.float32 and blk.c_fc_b.dtype == cp.float32      # embeddings and biases: fp32
    assert model.weight_bytes_per_token() == weight_bytes_per_token(TINY, precision)


@gpu
@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_graph_decode_replays_the_eager_tokens(precision):
    from step4_gpt2.generate import generate, release
    model, _ = lowp_and_reference(precision, seed=4)
    prompts = [[5, 17, 300], [999, 2, 4, 8, 16]]
    eager = generate(model, prompts, 20, cuda_graph=False, eos=None)
    release(model)
    graph = generate(model, prompts, 20, eos=None)
    again = generate(model, prompts, 20, eos=None)                # the kept graphs, replayed
    assert graph.mode == "graph" and graph.tokens == eager.tokens == again.tokens


@gpu
def test_perplexity_of_a_gpt_on_the_gpu_matches_its_own_logits():
    model = GPT(TINY, W.random_weights(TINY, seed=6, notice=False), precision="int8")
    ids = np.random.default_rng(0).integers(0, TINY.vocab_size, 3 * 64 + 5)
    x, y = Q.windows(ids, 64)
    z = model.forward(x).get().astype(np.float64)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    want = (lse - np.take_along_axis(z, y[..., None].astype(np.int64), -1)[..., 0]).mean()
    assert Q.mean_nll(model, ids, 64)[0] == pytest.approx(want, rel=1e-10)


@gpu
def test_greedy_agreement_of_a_model_with_itself():
    model, ref = lowp_and_reference("bf16", seed=7)
    a = Q.greedy_agreement(ref, model, [[1, 2, 3], [400, 5]], n=12)
    assert a.n == 12 and a.top1 > 0.9 and all(0 <= k <= 12 for k in a.same_prefix)
    assert Q.greedy_agreement(ref, ref, [[1, 2, 3]], n=8).same_prefix == [8]


@gpu
def test_a_checkpoint_loaded_as_bf16_keeps_its_bits(tmp_path):
    """weights.load_file(dtype="bf16") hands the matrices over as uint16 bit patterns: the bf16 model stores those
    very bits (no second rounding), the fp32 model widens them exactly, and both decode the same tokens."""
    import cupy as cp
    params = W.random_weights(TINY, seed=8, notice=False)
    W.save(params, TINY, tmp_path)
    cfg, bits = W.load_file(tmp_path, dtype="bf16")
    assert bits["h.0.attn.c_attn.weight"].dtype == np.uint16
    bf16, wide = GPT(cfg, bits, precision="bf16"), GPT(cfg, bits)
    want = cp.ascontiguousarray(cp.asarray(bits["h.0.attn.c_attn.weight"]).T)
    assert cp.array_equal(bf16.h[0].c_attn, want) and wide.h[0].c_attn.dtype == cp.float32
    from step4_gpt2.generate import generate
    prompts = [[3, 1, 4, 1, 5]]
    assert generate(bf16, prompts, 12, eos=None, tensor_cores=False).tokens == \
        generate(wide, prompts, 12, eos=None).tokens                  # v6 at batch 1: x stays fp32
