"""Text generation: prefill the prompt with flash attention, then one token at a time from the KV cache.

    gen = generate(model, [ids], max_new_tokens=64, temperature=0.8, top_k=40, seed=0, on_token=print)
    gen.tokens[0]          # the new token ids of prompt 0

- The KV cache and every buffer of a decode step are allocated before the first token (DecodeState).
- Prompts of different lengths share one batch: they are right-padded; causal attention never lets a
  real token see the padding, and each sequence's position (pos) and cache length (lens) live on the
  device, so a new token is written at its own sequence's position.
- cuda_graph=True: the first decode step runs eagerly (compiles and warms every kernel), then the step
  is captured into a CUDA graph (CuPy stream capture, `capture`) and every later step replays it: all
  the step's kernel launches (5 per block with the "fused" plan, 7 with "split", one more per block when
  attention v2 splits the cache; the notebook counts them) become one. One graph per attention version
  (step 2's v1 while the cache is short, v2 when long; the host knows each step's cache length and
  replays the right one). Greedy decoding keeps the choice
  (argmax) and the position update inside the graph too, so the host queues the next step before it
  reads the last one's tokens. With model.keep_graphs the state and graphs are kept for the next call
  with the same batch, cache length and greedy flag (as a server keeps its captured graphs).
- Sampling (temperature > 0, top-k, top-p) draws one uniform number per sequence per step from a NumPy
  Generator seeded with `seed`, so a seed gives the same text on every run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from step4_gpt2.tokenizer import EOT

PIPELINE_DEPTH = 2     # greedy decode steps queued ahead of the host's token read (1 = none ahead)


def capture(stream, fn):
    """A CUDA graph of the work fn() enqueues on `stream` (recorded, not run). The capture is ended even
    when fn raises, so the stream is usable again; fn must not allocate or sync (nothing a graph can't hold)."""
    stream.begin_capture()
    try:
        with stream:
            fn()
    except BaseException:
        stream.end_capture()
        raise
    return stream.end_capture()


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not (temperature >= 0 and np.isfinite(temperature)):
        raise ValueError(f"temperature: expected a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, (int, np.integer)) or top_k < 1):
        raise ValueError(f"top_k: expected an integer >= 1 or None, got {top_k!r}")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p: expected a probability in (0, 1] or None, got {top_p!r}")


def sample(logits, u, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
    """Next token per row of logits (B, V) (NumPy or CuPy) from uniforms u (B,) in [0, 1).

    Softmax of logits / temperature, restricted to the top_k most likely tokens and then to the smallest
    set whose probability reaches top_p (the most likely token always stays), sampled by inverse CDF."""
    try:
        import cupy as cp
        xp = cp.get_array_module(logits)
    except ImportError:
        xp = np
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return xp.argmax(logits, axis=-1)
    z = logits.astype(xp.float64 if xp is np else xp.float32) / temperature
    B, V = z.shape
    order = xp.argsort(-z, axis=-1)                                   # most likely first
    zs = xp.take_along_axis(z, order, axis=-1)
    if top_k is not None and top_k < V:
        zs[:, top_k:] = -xp.inf
    p = xp.exp(zs - zs[:, :1])
    p /= p.sum(axis=-1, keepdims=True)
    if top_p is not None and top_p < 1.0:
        before = xp.cumsum(p, axis=-1) - p                            # mass of the more likely tokens
        p = xp.where(before < top_p, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    cdf = xp.cumsum(p, axis=-1)
    u = xp.asarray(u, dtype=cdf.dtype).reshape(B, 1)
    j = xp.minimum((cdf <= u * cdf[:, -1:]).sum(axis=-1), V - 1)
    return order[xp.arange(B), j]


@dataclass
class Generation:
    tokens: list                      # new token ids per prompt (EOS included when it stopped there)
    prompt_lens: list
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0                    # decode steps run (tokens per sequence after the first)
    graph: bool = False
    info: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput over all sequences (the first token comes from the prefill)."""
        return self.steps * len(self.tokens) / self.decode_s if self.decode_s > 0 else float("nan")


def _prompts(prompts) -> list[list[int]]:
    if isinstance(prompts, str):
        prompts = [prompts]
    if len(prompts) and isinstance(prompts[0], (int, np.integer)):
        prompts = [prompts]
    if len(prompts) == 0:
        raise ValueError("prompts: expected at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            from step4_gpt2.tokenizer import encode
            p = encode(p)
        p = [int(t) for t in (p.tolist() if hasattr(p, "tolist") else p)]
        if not p:
            raise ValueError(f"prompts[{i}]: empty prompt; GPT-2 needs at least one token to condition on "
                             f"(use [{EOT}] = <|endoftext|> to start from nothing)")
        out.append(p)
    return out


def generate(model, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = 0, stop_at_eos: bool = True, kv_cache: bool = True,
             cuda_graph: bool = True, on_token=None, eos: int = EOT) -> Generation:
    """New tokens for a batch of prompts (lists of ids, or strings). on_token(b, id) is called as each
    token is made (streaming). temperature=0 is greedy. Raises ValueError if a prompt plus the new
    tokens would not fit the context (block_size)."""
    import cupy as cp
    from step4_gpt2.model import DecodeState, advance, argmax

    check_sampling(temperature, top_k, top_p)
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}")
    cfg = model.config
    prompts = _prompts(prompts)
    B, lens = len(prompts), [len(p) for p in prompts]
    for i, n in enumerate(lens):
        if n + max_new_tokens - 1 > cfg.block_size:
            raise ValueError(f"prompts[{i}]: {n} prompt tokens + max_new_tokens={max_new_tokens} need "
                             f"{n + max_new_tokens - 1} positions, more than the context length "
                             f"block_size={cfg.block_size}; shorten the prompt or ask for fewer tokens")
    padded = np.zeros((B, max(lens)), np.int32)
    for i, p in enumerate(prompts):
        padded[i, :len(p)] = p
    model.check_tokens(padded, "prompts")                     # ids in range, before any GPU work
    rng = np.random.default_rng(seed)
    greedy = temperature == 0
    gen = Generation([[] for _ in range(B)], lens, graph=cuda_graph and kv_cache)
    done = [False] * B

    def choose(logits, into):
        if greedy:
            return argmax(logits, into)
        into[...] = sample(logits, rng.random(B), temperature, top_k, top_p).astype(cp.int32)
        return into

    def record(host_tokens) -> bool:
        for b, t in enumerate(host_tokens):
            if done[b]:
                continue
            gen.tokens[b].append(int(t))
            if on_token is not None:
                on_token(b, int(t))
            if stop_at_eos and t == eos:
                done[b] = True
        return all(done)

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        t0 = time.perf_counter()
        if not kv_cache:
            seqs = [list(p) for p in prompts]
            tokens = cp.zeros(B, cp.int32)
            for step in range(max_new_tokens):
                cur = np.zeros((B, max(map(len, seqs))), np.int32)
                for i, s in enumerate(seqs):
                    cur[i, :len(s)] = s
                last = np.array([len(s) - 1 for s in seqs])
                host = choose(model.forward(cur, last=last), tokens).get()
                if step == 0:
                    gen.prefill_s, t0 = time.perf_counter() - t0, time.perf_counter()
                for s, t in zip(seqs, host):
                    s.append(int(t))
                if record(host) or step == max_new_tokens - 1:
                    break
                gen.steps += 1
            gen.decode_s = time.perf_counter() - t0
            return gen

        length = max(lens) + max_new_tokens - 1
        key = (B, length, greedy)
        cached = model._decode_cache if model.keep_graphs else None
        if cached is not None and cached[0] == key:
            _, s, graphs, warmed = cached
        else:
            model._decode_cache = None                # drop the old state (and its graphs) before allocating
            s, graphs, warmed = DecodeState(cfg, B, length), {}, set()
            if model.keep_graphs:
                model._decode_cache = (key, s, graphs, warmed)
        logits = model.forward(padded, cache=s.cache, last=np.array(lens) - 1)
        s.pos[...] = cp.asarray(np.array(lens, np.int32))
        s.lens[...] = s.pos + 1
        choose(logits, s.tokens)
        host = s.tokens.get()
        gen.prefill_s, t0 = time.perf_counter() - t0, time.perf_counter()
        plan = model.plan_for(B)
        gen.info.update(plan=plan, attention_versions=set())

        def capture_step(version):
            return capture(stream, lambda: model.decode_step(s, greedy=greedy, attention_version=version, plan=plan))

        def step(k):
            """Enqueue decode step k (cache rows of the longest sequence: max(lens) + 1 + k)."""
            version = model.attention_version_for(max(lens) + 1 + k)
            gen.info["attention_versions"].add(version)
            gkey = (plan, version)
            if cuda_graph and gkey not in graphs and plan in warmed:
                model.warm(s, version)            # its workspace exists before the capture
                graphs[gkey] = capture_step(version)
            if cuda_graph and gkey in graphs:
                graphs[gkey].launch(stream)
                return
            model.decode_step(s, greedy=greedy, attention_version=version, plan=plan)   # compiles, warms
            warmed.add(plan)
            if cuda_graph:                       # captured (not run) now, replayed from the next step on
                graphs[gkey] = capture_step(version)

        n_steps = max_new_tokens - 1             # the prefill made the first token
        if record(host) or n_steps == 0:
            pass
        elif greedy:
            # The tokens stay on the device (argmax feeds the next step), so the host queues step k+1
            # before it reads step k's tokens (an async copy into pinned memory): the GPU never waits
            # for the host's read + launch between two steps. On EOS at most DEPTH-1 steps are wasted.
            import cupyx
            depth, launched, pending = max(1, PIPELINE_DEPTH), 0, []
            ring = cupyx.empty_pinned((depth + 1, B), np.int32)
            while True:
                while launched < n_steps and len(pending) < depth:
                    step(launched)
                    slot = ring[launched % (depth + 1)]
                    s.tokens.get(stream=stream, out=slot, blocking=False)
                    pending.append((stream.record(), slot))
                    launched += 1
                if not pending:
                    break
                event, slot = pending.pop(0)
                event.synchronize()
                gen.steps += 1
                if record(slot.copy()):
                    break
        else:
            for k in range(n_steps):
                step(k)
                choose(s.logits, s.tokens)
                advance(s.pos, s.lens)
                host = s.tokens.get()
                gen.steps += 1
                if record(host):
                    break
        stream.synchronize()                     # nothing of this call may still run when the state is reused
        gen.decode_s = time.perf_counter() - t0
    return gen


def generate_streamed(model, prompt: str, max_new_tokens: int = 64, stream_print: bool = True, **kw) -> Generation:
    """generate() for one text prompt, printing the prompt and then the text as it is made (whole
    characters only; the end-of-text token is not printed). Returns the Generation (its timings)."""
    from step4_gpt2.tokenizer import TextStream, encode
    printer = TextStream()
    if stream_print:
        print(prompt, end="", flush=True)
    on_token = (lambda b, t: printer(t) if t != EOT else None) if stream_print else None
    gen = generate(model, [encode(prompt)], max_new_tokens, on_token=on_token, **kw)
    if stream_print:
        print()
    return gen


def generate_text(model, prompt: str, max_new_tokens: int = 64, stream_print: bool = True, **kw) -> str:
    """Generate from one text prompt, printing the text as it is made; returns prompt + continuation."""
    from step4_gpt2.tokenizer import decode
    gen = generate_streamed(model, prompt, max_new_tokens, stream_print, **kw)
    return prompt + decode([t for t in gen.tokens[0] if t != EOT])
