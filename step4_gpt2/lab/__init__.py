"""Lesson 4a's experiments: what the benchmarks switch on and off around the reading path.

- `decoders.TunedDecoder`: generate.Decoder with the switches the A/B rows flip (the cache length where
  decode attention moves from v1 to v2, the attention version past it, how many greedy steps the host
  queues ahead);
- `decoders.NoCacheDecoder`: every token from a full forward pass, the baseline a KV cache beats;
- `timeline.marked`: a hook after every op of a decode step (through step4_gpt2.ops), for the per-op
  breakdown and the launch count.
Each is passed to generate() (`decoder=TunedDecoder, pipeline_depth=1`) or wraps the model; nothing in the
reading path imports this package.
"""
