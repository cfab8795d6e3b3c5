"""Command line: python -m step4_gpt2 "Hello, I'm a language model," --max-new-tokens 64 --temperature 0.8 --seed 0

Downloads GPT-2 (124M) from Hugging Face once; offline it runs the same model with random weights and
says so (the text is then gibberish). --weights PATH loads a local model.safetensors instead.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m step4_gpt2", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="+", help="one or more prompts (a batch)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="gpt2", help="gpt2, gpt2-medium, gpt2-large or gpt2-xl")
    p.add_argument("--weights", default=None, help="a local model.safetensors (HF layout)")
    p.add_argument("--no-graph", action="store_true", help="launch every kernel of a decode step (no CUDA graph)")
    args = p.parse_args(argv)

    from common.device import describe, require_gpu
    from step4_gpt2 import weights
    from step4_gpt2.generate import generate, generate_streamed
    from step4_gpt2.model import GPT
    from step4_gpt2.tokenizer import EOT, decode, encode

    require_gpu()
    print(describe(), file=sys.stderr)
    # random weights (offline): load() prints the gibberish notice, once, to stderr (stdout is the text)
    cfg, params, _ = weights.load(args.model, path=args.weights, notice="stderr")
    model = GPT(cfg, params)
    kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
              cuda_graph=not args.no_graph)
    if len(args.prompt) == 1:          # streamed as it is made
        gen = generate_streamed(model, args.prompt[0], args.max_new_tokens, **kw)
    else:
        gen = generate(model, [encode(t) for t in args.prompt], args.max_new_tokens, **kw)
        for text, new in zip(args.prompt, gen.tokens):
            print(f"--- {text}{decode([t for t in new if t != EOT])}")
    print(f"[{sum(map(len, gen.tokens))} tokens; prefill {gen.prefill_s * 1e3:.1f} ms; decode "
          f"{gen.tokens_per_s:,.0f} tokens/s{' with a CUDA graph' if gen.graph else ''}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
