"""Step 4 benchmark rows: GPT-2 124M (random weights: same shapes, FLOPs and bytes as the real ones).

- decode, batch 1, 256 new tokens: tokens/s vs transformers `generate` (eager, KV cache, greedy, same
  weights, same GPU, same process, fp32 with TF32 off on both sides), and as a fraction of the
  weight-bandwidth bound. The bound: a decode step must read every weight once, so
      bound (tokens/s) = copy_bandwidth / bytes_read_per_token
  where copy_bandwidth is common.copy_bandwidth() (bytes read + written per second by a device copy,
  i.e. the DRAM traffic rate the GPU sustains) and bytes_read_per_token = GPT.weight_bytes_per_token()
  (494.6 MB for 124M: 123,654,144 fp32 parameters = every matrix, bias and LayerNorm parameter, wte once
  as the LM head, one row of wpe). fraction =
  achieved tokens/s / bound. KV-cache reads (<4 MB at 256 tokens) are left out of the bound.
- decode at batch 8 (same weights read once per step for 8 sequences).
- prefill 8 x 1024 tokens (logits of the last position, as generate needs) vs transformers eager.
- one decode step (batch 1, 128 cached tokens): time per op eagerly (CUDA events between ops: kernel +
  launch gaps) vs each op alone inside a CUDA graph, and the whole step eager vs graph replay.
- A/B of the decode choices: one greedy step replayed from a graph for each plan ("fused" = v5 with
  LayerNorm prologue, "split" = v4 + step 3's LayerNorm) x attention version at batch 1 and 8 and
  3 cache lengths; and whole generate() runs with each choice switched off in turn (the lab's
  TunedDecoder, step4_gpt2/lab/decoders.py).
- the GEMV versions on GPT-2 124M's five decode shapes (one launch, L2 flushed, batch 1 and 8) as a
  fraction of copy bandwidth, and step 2's decode_attention v1 (one launch) vs v2 (split-K + combine)
  at the cache sizes of the decode benchmark (generate.ATTN_V1_MAX_LEN picks between them).

    python -m step4_gpt2.benchmarks       # or: python -m common.benchmarks --only step4_gpt2
"""
from __future__ import annotations

import statistics
import tempfile

import numpy as np

from common.graphs import capture_graph
from common.timing import bench, copy_bandwidth   # not `from common import bench`: common.benchmarks shadows it
from common.benchmarks import Row

NEW_TOKENS = 256
PROMPT = [15496, 11, 314, 1101, 257, 3303, 2746, 11]     # "Hello, I'm a language model,"


def setup(seed: int = 0):
    """(our model, HF model or None, directory): 124M-shaped random weights saved in the HF layout."""
    from step4_gpt2 import weights as W
    from step4_gpt2.model import GPT
    cfg = W.GPTConfig()
    params = W.random_weights(cfg, seed=seed, notice=False)
    d = tempfile.mkdtemp(prefix="gpt2_bench_")
    W.save(params, cfg, d)
    model = GPT(cfg, params)
    hf = None
    try:
        from common import torch_cuda
        torch = torch_cuda()                 # TF32 off: an fp32 anchor
        if torch is None:
            raise ImportError("torch with CUDA is not installed")
        import transformers
        hf = transformers.GPT2LMHeadModel.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        hf = hf.eval().cuda()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
    except Exception as e:   # no torch/transformers: our rows still come, without the anchor
        print(f"transformers anchor unavailable: {type(e).__name__}: {e}")
    return model, hf, d


def random_ids(config, batch: int, length: int, seed: int = 0) -> np.ndarray:
    """(batch, length) int32 token ids drawn uniformly from the vocabulary: prompts for random weights."""
    return np.random.default_rng(seed).integers(0, config.vocab_size, (batch, length)).astype(np.int32)


def wall_s(fn, reps: int = 3) -> float:
    """Median seconds of one fn() call, host clock (the caller's view: of a whole generate(), the prefill, host
    loop and token reads included), after one warm-up call; the device is idle before and after each call."""
    import cupy as cp

    def synced():
        fn()
        cp.cuda.runtime.deviceSynchronize()
    cp.cuda.runtime.deviceSynchronize()
    return bench(synced, cpu=True, warmup=1, repeat=reps).median_ms / 1e3


def hf_generate_s(hf, batch: int, n: int, prompt=PROMPT) -> float:
    """Median seconds of transformers' greedy generate() of n tokens for `batch` copies of prompt (ids)."""
    import torch
    ids = torch.tensor([list(prompt)] * batch, device="cuda")

    def run():
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              do_sample=False, use_cache=True)
        assert out.shape[1] == len(prompt) + n
    return wall_s(run)


def ours_generate_s(model, batch: int, n: int, prompt=PROMPT, fresh: bool = False, **options) -> float:
    """Median seconds of generate() of n tokens for `batch` copies of prompt (ids); options go to generate
    (decoder, cuda_graph and the decoder's options). fresh: free the decoder generate() keeps on the model
    before each call, so every call allocates its state and captures its graphs again."""
    from step4_gpt2.generate import generate, release

    def run():
        if fresh:
            release(model)
        gen = generate(model, [list(prompt)] * batch, n, stop_at_eos=False, **options)
        assert len(gen.tokens[0]) == n
    return wall_s(run)


def decode_rows(model, hf) -> list[Row]:
    bw = copy_bandwidth()
    bytes_tok = model.weight_bytes_per_token()
    rows = []
    for batch in (1, 8):
        hf_s = hf_generate_s(hf, batch, NEW_TOKENS) if hf is not None else None
        for mode in ("graph", "eager"):
            s = ours_generate_s(model, batch, NEW_TOKENS, cuda_graph=mode == "graph")
            tps = batch * NEW_TOKENS / s
            label = "CUDA graph" if mode == "graph" else "eager launches"
            row = Row(f"decode b={batch} ({label})", f"124M, {NEW_TOKENS} tok",
                      s / NEW_TOKENS * 1e3, tps, "tok/s", "weight-bw bound",
                      bytes_tok * (tps / batch) / (bw * 1e9))
            if hf_s is not None:
                row.anchor, row.ratio = "HF generate eager", hf_s / s
            rows.append(row)
        if hf_s is not None:
            rows.append(Row(f"decode b={batch} HF generate (anchor)", f"124M, {NEW_TOKENS} tok",
                            hf_s / NEW_TOKENS * 1e3, batch * NEW_TOKENS / hf_s, "tok/s"))
    return rows


def filled_state(model, B: int, ctx: int):
    """A decode state whose caches already hold ctx random rows per sequence (the step's input state)."""
    import cupy as cp
    from step4_gpt2.model import DecodeState
    s = DecodeState(model.config, B, ctx + 1)
    for a in s.cache.k + s.cache.v:
        a[...] = cp.random.default_rng(0).standard_normal(a.shape, dtype=cp.float32) * 0.1
    s.pos[...] = ctx
    s.lens[...] = ctx + 1
    # The state is filled on the current stream; its users run on their own non-blocking streams, which do
    # not wait for it. Without this, a step could read pos/lens (and the cache) before they are written.
    cp.cuda.get_current_stream().synchronize()
    return s


def replay_ms(model, B: int, ctx: int, plan: str, version: int):
    """Timing of one decode step (B sequences, ctx cached rows) replayed from a CUDA graph."""
    import cupy as cp
    s = filled_state(model, B, ctx)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        model.decode_step(s, attention_version=version, plan=plan)        # compile, allocate workspaces
        g = capture_graph(lambda: model.decode_step(s, attention_version=version, plan=plan), stream)
        t = bench(lambda: g.launch(stream), name=f"step replay b={B} {plan} attn v{version} ctx={ctx}",
                  warmup=3, repeat=30)
    return t


def ab_rows(model) -> list[Row]:
    """Direct A/B of each decode choice: the step alone (graph replay) and whole generate() runs."""
    from step4_gpt2.generate import attention_version_for
    from step4_gpt2.lab.decoders import TunedDecoder
    from step4_gpt2.model import plan_for
    rows = []
    for B in (1, 8):
        for ctx in (9, 128, 263):
            ts = {(plan, v): replay_ms(model, B, ctx, plan, v) for plan in ("fused", "split") for v in (1, 2)}
            best = min(ts.values(), key=lambda t: t.median_ms)
            for (plan, v), t in ts.items():
                chosen = plan == plan_for(B) and v == attention_version_for(ctx + 1)
                r = Row.of(t, f"b={B}, {ctx} cached" + (" (chosen)" if chosen else ""), anchor=("best", best))
                rows.append(r)
    variants = [("all choices on", {}),
                ("attention v2 only", {"decoder": TunedDecoder, "attention_v1_max_len": None}),
                ("no host pipelining", {"decoder": TunedDecoder, "pipeline_depth": 1}),
                ("no graph/state reuse across calls", {"fresh": True})]
    for B in (1, 8):
        vs = variants + [(f"plan {p}", {"plan": p}) for p in ("fused", "split")] if B == 8 else variants
        base = None
        for label, options in vs:
            s = ours_generate_s(model, B, NEW_TOKENS, **options)
            base = base or s
            r = Row(f"A/B generate b={B}: {label}", f"124M, {NEW_TOKENS} tok", s / NEW_TOKENS * 1e3,
                    B * NEW_TOKENS / s, "tok/s")
            r.anchor, r.ratio = "all choices on", base / s
            rows.append(r)
    return rows


def prefill_rows(model, hf, B: int = 8, T: int = 1024) -> list[Row]:
    import cupy as cp
    from step4_gpt2.model import KVCache
    idx = random_ids(model.config, B, T)
    cache = KVCache(model.config, B, T)
    last = np.full(B, T - 1)
    flops = 2 * B * T * (model.config.n_layer * 12 * model.config.n_embd ** 2)
    ours = bench(lambda: model.forward(idx, cache=cache, last=last), name=f"prefill {B}x{T} (ours)",
                 flops=flops, warmup=2, repeat=10)
    rows = []
    if hf is not None:
        import torch
        ids = torch.tensor(idx, dtype=torch.int64, device="cuda")

        def run_hf():
            with torch.no_grad():
                hf(ids, use_cache=True, logits_to_keep=1)
        anchor = bench(run_hf, name="HF eager prefill", flops=flops, warmup=2, repeat=10)
        rows.append(Row.of(ours, f"{B}x{T}", anchor=("HF eager", anchor)))
        rows.append(Row.of(anchor, f"{B}x{T}"))
        cp.cuda.runtime.deviceSynchronize()
    else:
        rows.append(Row.of(ours, f"{B}x{T}"))
    return rows


def step_ops(model, s, greedy: bool = False, attention_version: int = 2, plan: str | None = None):
    """The ops one decode step runs, in order (named by the lab's timeline.marked), and how many kernel
    launches they are: one per op, except step 2's decode attention v2, which adds a combine kernel when it
    splits the cache (decode_split_count). Runs the step once, eagerly, on state s."""
    from step4_gpt2 import ops
    from step4_gpt2.lab.timeline import marked
    names = []
    with marked(model, names.append):
        model.decode_step(s, greedy=greedy, attention_version=attention_version, plan=plan)
    B, H, L = s.batch, model.config.n_head, s.cache.length
    combine = attention_version == 2 and ops.decode_split_count(B, H, L)[0] > 1
    return names, len(names) + (names.count("decode attention") if combine else 0)


def step_breakdown(model, ctx: int = 128, B: int = 1, attention_version: int = 2):
    """{op: (eager ms per step, in-graph ms per step)}, eager step ms, graph step ms; "fused" plan."""
    import cupy as cp
    from step4_gpt2.lab.timeline import marked
    from step4_gpt2.ops import decode_attention, embedding, gemv, gemv_qkv
    av = attention_version
    cfg = model.config
    s = filled_state(model, B, ctx)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        model.decode_step(s, plan="fused", attention_version=av)
        # eager: CUDA events between ops, summed over the layers, median over runs
        per, count = {}, {}
        for _ in range(7):
            marks = []

            def mark(name):
                e = cp.cuda.Event()
                e.record()
                marks.append((name, e))
            mark("start")
            with marked(model, mark):
                model.decode_step(s, plan="fused", attention_version=av)
            marks[-1][1].synchronize()
            acc = {}
            for (_, e0), (name, e1) in zip(marks, marks[1:]):
                acc[name] = acc.get(name, 0.0) + cp.cuda.get_elapsed_time(e0, e1)
                count[name] = sum(1 for n, _ in marks if n == name)          # times the op runs per step
            for k, v in acc.items():
                per.setdefault(k, []).append(v)
        eager = {k: statistics.median(v) for k, v in per.items()}
        # in a graph: each op of layer 0 alone, captured 20 times back to back. These calls repeat
        # decode_step's (fused plan): the check below fails loudly when the two lists drift apart.
        blk, H, D, eps = model.h[0], cfg.n_head, cfg.head_dim, cfg.eps
        single = {
            "embedding": lambda: embedding(s.tokens, s.pos, model.wte, model.wpe, s.x),
            "ln_1 + qkv GEMV + KV append": lambda: gemv_qkv(
                s.x, blk.c_attn, blk.c_attn_b, s.q, s.cache.k[0], s.cache.v[0], s.pos, ln=blk.ln_1, eps=eps),
            "decode attention": lambda: decode_attention(
                s.q.reshape(B, H, D), s.cache.k[0], s.cache.v[0], s.lens, out=s.att.reshape(B, H, D), version=av),
            "attn proj GEMV + residual": lambda: gemv(s.att, blk.c_proj, blk.c_proj_b, out=s.x, residual=True),
            "ln_2 + fc GEMV + GELU": lambda: gemv(s.x, blk.c_fc, blk.c_fc_b, out=s.h, gelu=True, ln=blk.ln_2, eps=eps),
            "mlp proj GEMV + residual": lambda: gemv(s.h, blk.mlp_proj, blk.mlp_proj_b, out=s.x, residual=True),
            "ln_f + LM head GEMV": lambda: gemv(s.x, model.wte, out=s.logits, ln=model.ln_f, eps=eps),
        }
        if set(single) != set(eager):
            raise RuntimeError(f"step_breakdown's ops {sorted(single)} differ from decode_step's marks "
                               f"{sorted(eager)}: update step_breakdown to match decode_step")
        graphed = {}
        for name, fn in single.items():
            fn()
            g = capture_graph(lambda: [fn() for _ in range(20)], stream)
            t = bench(lambda: g.launch(stream), name=name, warmup=2, repeat=20)
            graphed[name] = count[name] * t.median_ms / 20
        step = lambda: model.decode_step(s, plan="fused", attention_version=av)   # noqa: E731
        t_eager = bench(step, name="decode step, eager", warmup=2, repeat=30)
        graph = capture_graph(step, stream)
        t_graph = bench(lambda: graph.launch(stream), name="decode step, CUDA graph", warmup=2, repeat=30)
    table = {k: (eager[k], graphed[k]) for k in eager}
    return table, t_eager, t_graph


def breakdown_rows(model) -> list[Row]:
    table, t_eager, t_graph = step_breakdown(model)
    rows = [Row.of(t_eager, "b=1, 128 cached"), Row.of(t_graph, "b=1, 128 cached", anchor=("eager step", t_eager))]
    rows.append(Row("launch overhead removed by the graph", "per step", t_eager.median_ms - t_graph.median_ms))
    for name, (e, g) in table.items():
        rows.append(Row(f"  {name}: eager", "per step", e))
        rows.append(Row(f"  {name}: in graph", "per step", g))
    return rows


GEMV_SHAPES = {"c_attn": (2304, 768), "attn c_proj": (768, 768), "c_fc": (3072, 768),
               "mlp c_proj": (768, 3072), "LM head": (50257, 768)}


def gemv_rows() -> list[Row]:
    """Each GEMV version alone on the decode shapes (N outputs, K inputs): one launch, L2 flushed."""
    import cupy as cp
    from common import rand
    from step4_gpt2.ops import gemv
    bw = copy_bandwidth()
    variants = [("v3", dict(version=3)), ("v4", dict(version=4))]
    variants += [(f"v5 ROWS={r} UNROLL={u}", dict(version=5, rows=r, unroll=u))
                 for r, u in [(1, 4), (2, 4), (4, 4), (2, 2)]]
    rows = []
    for label, (N, K) in GEMV_SHAPES.items():
        W = cp.asarray(rand(N, K, seed=1))
        for B in (1, 8):
            x, y = cp.asarray(rand(B, K, seed=2)), cp.empty((B, N), cp.float32)
            for name, kw in variants if B == 1 else [variants[1], variants[2], variants[4]]:
                t = bench(lambda: gemv(x, W, out=y, **kw), name=f"GEMV {label} b={B} {name}",
                          bytes=W.nbytes + x.nbytes + y.nbytes, warmup=3, repeat=30)
                rows.append(Row.of(t, f"{N}x{K}", ceiling=("copy bw", bw)))
        W = None                 # free this matrix before the next one is made
    return rows


def attention_rows(model) -> list[Row]:
    """step 2's decode_attention v1 vs v2 on one layer's cache at the decode benchmark's sizes."""
    import cupy as cp
    from common import rand
    from step4_gpt2.ops import decode_attention
    cfg = model.config
    H, D = cfg.n_head, cfg.head_dim
    rows = []
    for B in (1, 8):
        Lmax = len(PROMPT) + NEW_TOKENS - 1
        q = cp.asarray(rand(B, H, D, seed=3))
        k, v = cp.asarray(rand(B, H, Lmax, D, seed=4)), cp.asarray(rand(B, H, Lmax, D, seed=5))
        out = cp.empty_like(q)
        for n in (len(PROMPT) + 1, 128, Lmax):
            lens = cp.full(B, n, cp.int32)
            for ver in (1, 2):
                t = bench(lambda: decode_attention(q, k, v, lens, out=out, version=ver),
                          name=f"decode attention v{ver} b={B} L={n}", bytes=2 * B * H * n * D * 4, warmup=3, repeat=30)
                rows.append(Row.of(t, f"cache {Lmax}"))
    return rows


def run() -> list[Row]:
    model, hf, _ = setup()
    rows = gemv_rows() + attention_rows(model)
    rows += decode_rows(model, hf)
    rows += ab_rows(model)
    rows += prefill_rows(model, hf)
    rows += breakdown_rows(model)
    return rows


def main(argv=None) -> int:
    from common.benchmarks import module_main
    return module_main("step4_gpt2.benchmarks", __doc__, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
