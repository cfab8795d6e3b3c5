"""Step 4a's lab (step4_gpt2/lab/): the decoders the benchmarks switch (TunedDecoder, NoCacheDecoder) and the
marks between a decode step's ops (timeline.marked): that each switch gives the reading path's tokens, rejects bad
values by name, and that the marks name every op of a step. The reading path's own tests are in test_step4_gpt2.py."""
import numpy as np
import pytest

from step4_gpt2 import weights as W

SMALL = W.GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=50257, block_size=512)
gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    from common.device import skip_reason
    if skip_reason():
        pytest.skip(f"no GPU: {skip_reason()}")
    import cupy
    return cupy


@pytest.fixture(scope="module")
def model(cp, tmp_path_factory):
    from step4_gpt2.model import GPT
    d = tmp_path_factory.mktemp("gpt2_small_lab")
    W.save(W.random_weights(SMALL, seed=1, notice=False), SMALL, d)
    return GPT.from_file(d / "model.safetensors")


def test_tuned_decoder_names_bad_options():
    """Checked before any GPU work (so on any machine)."""
    from step4_gpt2.lab.decoders import TunedDecoder
    for bad, match in [(dict(pipeline_depth=0), "pipeline_depth: expected an integer >= 1"),
                       (dict(pipeline_depth=1.5), "pipeline_depth"),
                       (dict(attention_v1_max_len=-1), "attention_v1_max_len: expected None or an integer"),
                       (dict(attention_version=3), "attention_version: expected one of")]:
        with pytest.raises(ValueError, match=match):
            TunedDecoder(None, 1, 8, **bad)


FUSED_BLOCK = ["ln_1 + qkv GEMV + KV append", "decode attention", "attn proj GEMV + residual", "ln_2 + fc GEMV + GELU",
               "mlp proj GEMV + residual"]
SPLIT_BLOCK = ["qkv GEMV + KV append", "decode attention", "attn proj GEMV", "bias + residual + ln_2 (step 3)",
               "fc GEMV + GELU", "mlp proj GEMV", "bias + residual + next LayerNorm (step 3)"]


def _want_marks(plan: str, n_layer: int) -> list:
    if plan == "fused":
        return ["embedding"] + FUSED_BLOCK * n_layer + ["ln_f + LM head GEMV", "argmax"]
    return ["embedding", "ln_1 (step 3)"] + SPLIT_BLOCK * n_layer + ["LM head GEMV", "argmax"]


@pytest.mark.parametrize("plan", ["fused", "split"])
def test_marks_name_the_ops_of_model_decode_step_cpu(monkeypatch, plan):
    """model.py's decode_step itself, on stand-in arrays with every op of step4_gpt2.ops replaced by a no-op
    (no GPU): timeline.marked names its ops in order, and nothing is marked after the block."""
    from types import SimpleNamespace
    from step4_gpt2 import ops
    from step4_gpt2.lab.timeline import marked
    from step4_gpt2.model import GPT
    for op in ("embedding", "layernorm", "gemv_qkv", "decode_attention", "gemv", "residual_layernorm", "argmax"):
        monkeypatch.setattr(ops, op, lambda *a, **k: None)
    cfg = W.GPTConfig(n_layer=3, n_head=2, n_embd=8, vocab_size=11, block_size=16)
    arr = lambda *shape: np.zeros(shape, np.float32)             # noqa: E731
    blocks = [SimpleNamespace(ln_1=(arr(8), arr(8)), ln_2=(arr(8), arr(8)), c_attn=arr(24, 8), c_attn_b=arr(24),
                              c_proj=arr(8, 8), c_proj_b=arr(8), c_fc=arr(32, 8), c_fc_b=arr(32),
                              mlp_proj=arr(8, 32), mlp_proj_b=arr(8)) for _ in range(cfg.n_layer)]
    model = SimpleNamespace(config=cfg, h=blocks, wte=arr(11, 8), wpe=arr(16, 8), ln_f=(arr(8), arr(8)))
    model._ln_after = lambda i: GPT._ln_after(model, i)
    state = SimpleNamespace(batch=2, tokens=None, pos=None, lens=None, x=arr(2, 8), q=arr(2, 8), att=arr(2, 8),
                            a=arr(2, 8), y=arr(2, 8), h=arr(2, 32), logits=arr(2, 11),
                            cache=SimpleNamespace(k=[None] * 3, v=[None] * 3))
    names = []
    with marked(model, names.append):
        GPT.decode_step(model, state, greedy=True, plan=plan)
    assert names == _want_marks(plan, cfg.n_layer)
    GPT.decode_step(model, state, greedy=True, plan=plan)
    assert len(names) == len(_want_marks(plan, cfg.n_layer))


@gpu
def test_every_switch_decodes_the_same_tokens(cp, model):
    """Each switch the A/B rows flip changes how the tokens are made, never which: greedy tokens identical
    to the reading path's Decoder, and the attention versions each setting runs."""
    from step4_gpt2.generate import generate, release
    from step4_gpt2.lab.decoders import NoCacheDecoder, TunedDecoder
    prompts = [[5, 6, 7, 8], [900, 901]]
    base = generate(model, prompts, max_new_tokens=150, stop_at_eos=False)
    assert base.info["attention_versions"] == {1, 2}
    for options, versions in [({}, {1, 2}), ({"attention_v1_max_len": None}, {2}), ({"pipeline_depth": 1}, {1, 2}),
                              ({"pipeline_depth": 4}, {1, 2}), ({"attention_version": 1}, {1}),
                              ({"attention_v1_max_len": 0, "cuda_graph": False}, {2})]:
        gen = generate(model, prompts, max_new_tokens=150, stop_at_eos=False, decoder=TunedDecoder, **options)
        assert gen.tokens == base.tokens, options
        assert gen.info["attention_versions"] == versions, options
    release(model)
    assert model._kept_decoder is None
    again = generate(model, prompts, max_new_tokens=150, stop_at_eos=False)
    assert again.tokens == base.tokens and model._kept_decoder is not None
    stop = base.tokens[0][20]                    # early stop through a pipelined depth of 4
    gen = generate(model, prompts, max_new_tokens=150, eos=stop, decoder=TunedDecoder, pipeline_depth=4)
    assert gen.tokens[0] == base.tokens[0][:base.tokens[0].index(stop) + 1]
    short = generate(model, prompts, max_new_tokens=30, stop_at_eos=False, decoder=NoCacheDecoder)
    assert short.mode == "no cache" and short.tokens == [t[:30] for t in base.tokens]
    kw = dict(max_new_tokens=20, temperature=0.9, top_k=50, seed=3, stop_at_eos=False)
    assert generate(model, prompts, decoder=TunedDecoder, pipeline_depth=1, **kw).tokens == \
        generate(model, prompts, **kw).tokens


@gpu
@pytest.mark.parametrize("plan", ["fused", "split"])
def test_marks_name_every_op_of_a_decode_step(cp, model, plan):
    """timeline.marked names each op model.decode_step runs, in order, as the per-op breakdown's rows do;
    after the block the ops are the course's again and no mark is made."""
    from step4_gpt2 import ops
    from step4_gpt2.benchmarks import filled_state, step_ops
    from step4_gpt2.lab.timeline import marked
    originals = {n: getattr(ops, n) for n in ("gemv", "gemv_qkv", "embedding", "argmax", "decode_attention")}
    s = filled_state(model, 2, 20)
    names = []
    with marked(model, names.append):
        model.decode_step(s, greedy=True, plan=plan)
    assert names == _want_marks(plan, SMALL.n_layer)
    assert {n: getattr(ops, n) for n in originals} == originals
    model.decode_step(filled_state(model, 2, 20), plan=plan)          # outside the block: no marks
    assert len(names) == len(_want_marks(plan, SMALL.n_layer))
    got, launches = step_ops(model, filled_state(model, 1, 20), greedy=True, attention_version=1, plan=plan)
    assert got == names and launches == len(names)
    assert np.isfinite(s.logits.get()).all()
