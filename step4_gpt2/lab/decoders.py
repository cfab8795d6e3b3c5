"""Decoders for experiments: the reading path's Decoder with its fixed choices made switchable, and a
decoder without a KV cache. Both plug into generate() through `decoder=`."""
from __future__ import annotations

import numpy as np

from common import expect_choice, require_gpu
from step4_gpt2 import ops
from step4_gpt2.generate import ATTN_V1_MAX_LEN, PIPELINE_DEPTH, Decoder, pad_prompts


class TunedDecoder(Decoder):
    """Decoder with its choices as options, to measure what each is worth:
      attention_v1_max_len: decode attention v1 (one launch) up to this many cached rows (None: never);
      attention_version: the version used past it (1 or 2);
      pipeline_depth: greedy steps the host queues before it reads a step's tokens (1: none ahead).
    The defaults are Decoder's own choices."""

    def __init__(self, model, batch: int, length: int, greedy: bool = True, cuda_graph: bool = True,
                 plan: str | None = None, attention_version: int = 2,
                 attention_v1_max_len: int | None = ATTN_V1_MAX_LEN, pipeline_depth: int = PIPELINE_DEPTH):
        if not isinstance(pipeline_depth, (int, np.integer)) or pipeline_depth < 1:
            raise ValueError(f"pipeline_depth: expected an integer >= 1, got {pipeline_depth!r}")
        if attention_v1_max_len is not None and (not isinstance(attention_v1_max_len, (int, np.integer))
                                                 or attention_v1_max_len < 0):
            raise ValueError(f"attention_v1_max_len: expected None or an integer >= 0, got {attention_v1_max_len!r}")
        self.attention_version = expect_choice(attention_version, "attention_version", (1, 2))
        self.attention_v1_max_len = attention_v1_max_len
        super().__init__(model, batch, length, greedy, cuda_graph, plan)
        self.pipeline_depth = int(pipeline_depth)

    def _attention_version(self, rows: int) -> int:
        v1 = self.attention_v1_max_len is not None and rows <= self.attention_v1_max_len
        return 1 if v1 else self.attention_version


class NoCacheDecoder(Decoder):
    """Every token from a full forward pass over the whole sequence so far (no KV cache): the baseline a
    KV cache beats. Same interface as Decoder; mode "no cache"."""

    mode = "no cache"

    def __init__(self, model, batch: int, length: int, greedy: bool = True):
        require_gpu()
        import cupy as cp
        self.model, self.batch, self.length, self.greedy = model, int(batch), int(length), bool(greedy)
        self.tokens = cp.zeros(self.batch, cp.int32)
        self.info: dict = {}
        self.seqs = None

    def prefill(self, ids, lens, choose=None) -> np.ndarray:
        if len(lens) != self.batch:
            raise ValueError(f"lens: this decoder was built for batch {self.batch}, got {len(lens)} prompts")
        self.info = {"mode": self.mode}
        self.seqs = [[int(t) for t in ids[b, :n]] for b, n in enumerate(lens)]
        return self._next(choose)

    def decode(self, n_steps: int, choose=None):
        if (choose is None) != self.greedy:
            raise ValueError(f"choose: this decoder was built for greedy={self.greedy}; "
                             f"pass choose={'None' if self.greedy else 'a sampler'}")
        if self.seqs is None:
            raise ValueError("decode: call prefill() first")
        longest = max(map(len, self.seqs))
        if longest + n_steps - 1 > self.length:
            raise ValueError(f"n_steps: {n_steps} more steps after sequences of {longest} tokens need "
                             f"{longest + n_steps - 1} positions; this decoder was built for {self.length}")
        for _ in range(n_steps):
            yield self._next(choose)

    def _next(self, choose) -> np.ndarray:
        logits = self.model.forward(pad_prompts(self.seqs), last=np.array([len(s) - 1 for s in self.seqs]))
        host = (ops.argmax(logits, self.tokens) if choose is None else choose(logits)).get()
        for s, t in zip(self.seqs, host):
            s.append(int(t))
        return host
