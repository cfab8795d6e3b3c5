"""Text generation: prefill the prompt with flash attention, then one token at a time from the KV cache.

    gen = generate(model, [ids], max_new_tokens=64, temperature=0.8, top_k=40, seed=0, on_token=print)
    gen.tokens[0]          # the new token ids of prompt 0

generate() checks the prompts, pads them into one batch and hands the decoding to a `Decoder`:
- with a CUDA graph (the default): the first decode step runs eagerly (compiling and warming every
  kernel), then the step is captured in a CUDA graph (`common.capture_graph`) and replayed for every later
  token: all the step's launches (5 per block with the "fused" plan, 7 with "split", one more per block when
  attention v2 splits the cache; the notebook counts them) become one. One graph per attention version
  (step 2's v1 while the cache is short, v2 when long; the host knows each step's cache length and
  replays the right one). Greedy decoding keeps the choice (argmax) and the position update inside the
  graph too, so the host queues the next step before it reads the last one's tokens (PIPELINE_DEPTH).
- eager (cuda_graph=False): the same Decoder launching every kernel of every step.
- programmatic=True: the step's kernels (embedding, GEMVs, decode attention, argmax) launch with programmatic
  dependent launch on sm_90 and newer (`ops.programmatic`): each starts while the one before it drains (v5-v9's
  GEMVs with their first weight loads), in the graph as eagerly; below sm_90 the launches stay plain.
- tensor_cores=False: the bf16/int8 GEMVs stay on the CUDA cores (v6/v7, x in fp32) at every batch; by default a
  batch of 2 or more, and batch 1 for short rows, takes the tensor-core GEMVs (v8/v9, `ops.lowp_version`).
- `decoder=`: another Decoder subclass, built with the same arguments (model, batch, cache length, greedy,
  and the options given to generate); generate() drives it the same way.
The decoder (its KV cache, buffers and graphs) is kept on the model for the next call with the same class,
batch, cache length, greedy flag and options, as a server keeps its captured graphs; `release(model)` frees it.
Prompts of different lengths share one batch: they are right-padded; causal attention never lets a real
token see the padding, and each sequence's position (pos) and cache length (lens) live on the device.
Sampling (temperature > 0, top-k, top-p) draws one uniform number per sequence per step from a NumPy
Generator seeded with `seed`, so a seed gives the same text on every run.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np

from common import capture_graph, expect_choice, require_gpu
from step4_gpt2 import ops
from step4_gpt2.tokenizer import EOT

PIPELINE_DEPTH = 2       # greedy decode steps queued ahead of the host's token read
ATTN_V1_MAX_LEN = 128    # step 2's decode_attention v1 (one launch) up to this many cached rows, then v2


def attention_version_for(rows: int) -> int:
    """Step 2's decode_attention version for a step whose longest sequence has `rows` cache rows: v1 (one
    launch) while the cache is short, v2 (split-K over the cache + a combine kernel) once it is long, where
    one block per head would leave most SMs idle."""
    return 1 if rows <= ATTN_V1_MAX_LEN else 2


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
    mode: str = ""                    # the decoder's mode: "graph", "eager", or a Decoder subclass's own
    info: dict = field(default_factory=dict)

    @property
    def graph(self) -> bool:
        """Decoded by replaying CUDA graphs (mode "graph")."""
        return self.mode == "graph"

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


def pad_prompts(prompts) -> np.ndarray:
    """Token id lists of different lengths as one (B, longest) int32 batch, each right-padded with zeros:
    causal attention never lets a real token see the padding after it."""
    padded = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for i, p in enumerate(prompts):
        padded[i, :len(p)] = p
    return padded


class Decoder:
    """Decodes one batch on the course's kernels: owns the decode state (KV cache and every buffer of a
    step, allocated once), the stream, the CUDA graphs (one per attention version) and the pipelining.

    The interface generate() uses (a subclass keeps it, with its own step):
      Decoder(model, batch, length, greedy, **options)   allocate everything: `length` cache rows per sequence
      .mode, .batch, .length, .greedy                     what it is and what it was built for
      .prefill(ids, lens, choose=None) -> np.int32 (B,)   run the prompts (ids: (B, T) int32 NumPy, right-padded;
                                                          lens: each prompt's length) into the cache, return
                                                          the first new token of each sequence (on the host)
      .decode(n_steps, choose=None) -> iterator           each step's new tokens, np.int32 (B,) on the host,
                                                          one array per step, as soon as that step is read;
                                                          closing the iterator early waits for queued work
      .info                                               a dict for Generation.info (set by prefill)
    choose is None for greedy decoding (argmax on the device), else a function logits (B, V) CuPy -> (B,)
    integer CuPy token ids (generate's seeded sampler). Options here: cuda_graph (False: eager launches);
    plan ("fused" / "split", None = model.py's plan_for(batch)); programmatic (True: the step's kernels launch
    with programmatic dependent launch where the GPU has it, ops.programmatic); tensor_cores (False: bf16/int8
    GEMVs on the CUDA cores at every batch, ops.tensor_cores).
    """

    def __init__(self, model, batch: int, length: int, greedy: bool = True, cuda_graph: bool = True,
                 plan: str | None = None, programmatic: bool = False, tensor_cores: bool = True):
        require_gpu()
        from step4_gpt2.model import PLANS, plan_for
        self.mode = "graph" if cuda_graph else "eager"
        self.programmatic = bool(programmatic)
        self.tensor_cores = bool(tensor_cores)
        self.plan = expect_choice(plan or plan_for(batch), "plan", PLANS)
        self.graphs: dict = {}        # attention version -> CUDA graph of one step
        self.warmed = False           # one eager step has run (kernels compiled, workspaces allocated)
        self._allocate(model, batch, length, greedy)

    def _allocate(self, model, batch: int, length: int, greedy: bool) -> None:
        """What every decoder has, whatever runs its steps: the decode state (KV cache, tokens, positions,
        logits) and the stream its work is queued on."""
        import cupy as cp
        from step4_gpt2.model import DecodeState
        self.model, self.batch, self.length, self.greedy = model, int(batch), int(length), bool(greedy)
        self.pipeline_depth = PIPELINE_DEPTH
        self.state = DecodeState(model.config, batch, length)
        # the state is filled on the current stream; this decoder's non-blocking stream does not wait for it
        cp.cuda.get_current_stream().synchronize()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.info: dict = {}
        self._rows = None             # cache rows of the longest sequence after the last enqueued step

    def _info(self) -> dict:
        """A fresh Generation.info for the next call (its steps add the attention versions they run)."""
        return {"mode": self.mode, "plan": self.plan, "attention_versions": set()}

    def _attention_version(self, rows: int) -> int:
        return attention_version_for(rows)

    def prefill(self, ids, lens, choose=None) -> np.ndarray:
        import cupy as cp
        if len(lens) != self.batch:
            raise ValueError(f"lens: this decoder was built for batch {self.batch}, got {len(lens)} prompts")
        if max(lens) > self.length:
            raise ValueError(f"lens: prompts of up to {max(lens)} tokens need a cache of at least that many rows; "
                             f"this decoder holds {self.length}")
        s = self.state
        self.info = self._info()
        self._rows = max(lens)
        with self.stream:
            logits = self.model.forward(ids, cache=s.cache, last=np.asarray(lens) - 1)
            s.pos[...] = cp.asarray(np.asarray(lens, np.int32))
            s.lens[...] = s.pos + 1
            self._choose(logits, choose)
            return s.tokens.get()

    def decode(self, n_steps: int, choose=None):
        if (choose is None) != self.greedy:
            raise ValueError(f"choose: this decoder was built for greedy={self.greedy}; "
                             f"pass choose={'None' if self.greedy else 'a sampler'}")
        if not isinstance(n_steps, (int, np.integer)) or n_steps < 0:
            raise ValueError(f"n_steps: expected an integer >= 0, got {n_steps!r}")
        self._check_room(n_steps, "n_steps", "decode")
        try:
            yield from (self._pipelined(int(n_steps)) if self.greedy else self._sampled(int(n_steps), choose))
        finally:
            self.stream.synchronize()      # nothing may still run when the state is reused

    # ------------------------------------------------------------------ inside
    def _check_room(self, n: int, name: str, caller: str) -> None:
        """After a prefill, the cache has room for n more steps past those already queued."""
        if self._rows is None:
            raise ValueError(f"{caller}: call prefill() first (it fills the cache and sets the positions)")
        if self._rows + n > self.length:           # a step would append past the cache
            raise ValueError(f"{name}: {n} more steps after {self._rows} cached rows need {self._rows + n} "
                             f"cache rows; this decoder holds {self.length}")

    def _choose(self, logits, choose) -> None:
        import cupy as cp
        if choose is None:
            ops.argmax(logits, self.state.tokens)
        else:
            self.state.tokens[...] = cp.asarray(choose(logits)).astype(cp.int32)

    def _step(self) -> None:
        """Enqueue the next decode step on self.stream: a graph replay, or eager launches (the first step,
        which compiles and warms every kernel, then captures the graph: recorded, not run)."""
        s, m = self.state, self.model
        self._rows += 1
        version = self._attention_version(self._rows)
        self.info["attention_versions"].add(version)

        def step():
            with ops.programmatic(self.programmatic), ops.tensor_cores(self.tensor_cores):
                m.decode_step(s, greedy=self.greedy, attention_version=version, plan=self.plan)

        graph = self.mode == "graph"
        if graph and version not in self.graphs and self.warmed:
            self._warm(version)
            self.graphs[version] = capture_graph(step, self.stream)
        if graph and version in self.graphs:
            self.graphs[version].launch(self.stream)
            return
        step()
        self.warmed = True
        if graph:
            self.graphs[version] = capture_graph(step, self.stream)

    def _warm(self, version: int) -> None:
        """What a first step with this attention version sets up (decode_attention's workspace), run eagerly
        so the capture allocates nothing. Writes s.att only."""
        s, cfg = self.state, self.model.config
        B, H, D = s.batch, cfg.n_head, cfg.head_dim
        ops.decode_attention(s.q.reshape(B, H, D), s.cache.k[0], s.cache.v[0], s.lens,
                             out=s.att.reshape(B, H, D), version=version)

    def _pipelined(self, n_steps: int):
        """Greedy: the tokens stay on the device (argmax feeds the next step), so the host queues step k+1
        before it reads step k's tokens (an async copy into pinned memory): the GPU never waits for the
        host's read + launch between two steps. On EOS at most pipeline_depth - 1 steps are wasted."""
        import cupyx
        depth, launched, pending = self.pipeline_depth, 0, []
        ring = cupyx.empty_pinned((depth + 1, self.batch), np.int32)
        while True:
            while launched < n_steps and len(pending) < depth:
                with self.stream:
                    self._step()
                    slot = ring[launched % (depth + 1)]
                    self.state.tokens.get(stream=self.stream, out=slot, blocking=False)
                    pending.append((self.stream.record(), slot))
                launched += 1
            if not pending:
                return
            event, slot = pending.pop(0)
            event.synchronize()
            yield slot.copy()

    def _sampled(self, n_steps: int, choose):
        s = self.state
        for _ in range(n_steps):
            with self.stream:
                self._step()
                self._choose(s.logits, choose)
                ops.advance(s.pos, s.lens)
                host = s.tokens.get()
            yield host


def make_decoder(model, decoder: type | None, batch: int, length: int, greedy: bool, **options) -> Decoder:
    """The decoder for a call: the one kept on the model when it was built by the same class with the same
    batch, cache length, greedy flag and options, else a new one, kept for the next call. decoder: a Decoder
    subclass, or None for Decoder itself."""
    cls = Decoder if decoder is None else decoder
    if not (isinstance(cls, type) and issubclass(cls, Decoder)):
        raise TypeError(f"decoder: expected None or a subclass of step4_gpt2.generate.Decoder, got {decoder!r}")
    key = (cls, batch, length, greedy, tuple(sorted(options.items())))
    kept = getattr(model, "_kept_decoder", None)
    if kept is not None and kept[0] == key:
        return kept[1]
    release(model)                               # free the old cache and graphs before allocating
    dec = cls(model, batch, length, greedy, **options)
    model._kept_decoder = (key, dec)
    return dec


def release(model) -> None:
    """Free the decoder generate() keeps on the model (its KV cache, buffers and graphs)."""
    model._kept_decoder = None


def generate(model, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = 0, stop_at_eos: bool = True, eos: int | None = EOT,
             on_token=None, decoder: type | None = None, **decoder_options) -> Generation:
    """New tokens for a batch of prompts (lists of ids, or strings). on_token(b, id) is called as each
    token is made (streaming). temperature=0 is greedy. stop_at_eos: a sequence stops at its first `eos`
    (None: a vocabulary without an end-of-text token; nothing stops). Raises ValueError if a prompt plus the
    new tokens would not fit the context (block_size).
    decoder: None for the course's Decoder, or a Decoder subclass; decoder_options go to its constructor
    (Decoder: cuda_graph=False for eager launches, plan, programmatic, tensor_cores)."""
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
    padded = pad_prompts(prompts)
    model.check_tokens(padded, "prompts")                     # ids in range, before any GPU work
    rng = np.random.default_rng(seed)
    greedy = temperature == 0
    choose = None if greedy else (lambda logits: sample(logits, rng.random(B), temperature, top_k, top_p))
    gen = Generation([[] for _ in range(B)], lens)
    done = [False] * B
    stop_at_eos = stop_at_eos and eos is not None

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

    dec = make_decoder(model, decoder, B, max(lens) + max_new_tokens - 1, greedy, **decoder_options)
    gen.mode = dec.mode
    t0 = time.perf_counter()
    first = dec.prefill(padded, lens, choose)
    gen.prefill_s, t0 = time.perf_counter() - t0, time.perf_counter()
    if not record(first) and max_new_tokens > 1:          # the prefill made the first token
        with contextlib.closing(dec.decode(max_new_tokens - 1, choose)) as steps:
            for host in steps:
                gen.steps += 1
                if record(host):
                    break
    gen.decode_s = time.perf_counter() - t0
    gen.info.update(dec.info)
    return gen


def generate_streamed(model, prompt: str, max_new_tokens: int = 64, tokenizer=None, **kw) -> Generation:
    """generate() for one text prompt, printing the prompt and then the text as it is made (whole
    characters only; the end-of-text token is not printed). tokenizer: GPT-2's BPE by default, or the one
    of a checkpoint (tokenizer.for_checkpoint). Returns the Generation (its tokens and timings)."""
    from step4_gpt2.tokenizer import BPETokenizer, TextStream
    tok = tokenizer or BPETokenizer()
    printer = TextStream(tokenizer=tok)
    print(prompt, end="", flush=True)
    kw.setdefault("eos", tok.eot)               # None (a character vocabulary): nothing stops the text
    gen = generate(model, [tok.encode(prompt)], max_new_tokens,
                   on_token=lambda b, t: printer(t) if t != tok.eot else None, **kw)
    print()
    return gen
