"""Generate text with GPT-2 running on the course's own kernels.

    python -m step4_gpt2 "Hello, I'm a language model," --max-new-tokens 64 --temperature 0.8 --seed 0
    python -m step4_gpt2 --weights my_model "ROMEO:"          a folder with model.safetensors + config.json
    python -m step4_gpt2 --decode megakernel "Hello"          one persistent kernel per token (lesson 4c)
    python -m step4_gpt2 --mine "Hello"                       GPT-2 on your exercise kernels (the capstone)
    python -m step4_gpt2 --mine --solutions "Hello"           ... on the shipped solutions instead

Without --weights, GPT-2 comes from the Hugging Face cache, or is downloaded once; offline with nothing
cached it runs the same model with random weights and says so (the text is then gibberish). A folder
holding a char_vocab.json is read with that character vocabulary, any other with GPT-2's tokenizer.
With --mine, exit status 3 says that a kernel of yours never ended or hit a sticky CUDA error (the message
names it): the run stops there.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DECODE = ("auto", "graph", "eager", "megakernel")
GPU_UNUSABLE = 3         # exit status: a kernel of yours (--mine) hung or hit a sticky CUDA error


class DecoderUnavailable(RuntimeError):
    """The decoder --decode asks for cannot run here (the message says why)."""


def decoder_for(decode: str, model, batch: int, greedy: bool) -> tuple[type | None, dict]:
    """(decoder, options) for generate() from --decode: graph -> the course's Decoder replaying CUDA graphs;
    eager -> the same launching every kernel; megakernel -> lesson 4c's MegakernelDecoder; auto -> the
    megakernel where step4_gpt2.megakernel.supports(model, batch, greedy), else graph."""
    from common import expect_choice
    expect_choice(decode, "decode", DECODE)
    if decode in ("graph", "eager"):
        return None, ({} if decode == "graph" else {"cuda_graph": False})
    try:                 # lesson 4c, imported here only: the lesson's generate() knows nothing of it
        from step4_gpt2.megakernel import MegakernelDecoder, supports
    except ImportError as e:
        if decode == "megakernel":
            raise DecoderUnavailable(f"--decode megakernel needs step4_gpt2.megakernel (MegakernelDecoder, "
                                     f"supports), which is not available here ({e}); use --decode graph") from None
        return None, {}
    if decode == "megakernel" or supports(model, batch, greedy):
        return MegakernelDecoder, {}
    return None, {}


def _leave(message: str) -> None:
    """--mine: a kernel of yours left the GPU unusable (it never ends, or a sticky CUDA error): say so and end
    the process at once, without Python's clean-up, which would wait for the GPU (freeing memory synchronises
    with it) and never return."""
    print(f"\n{message}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(GPU_UNUSABLE)


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
    p.add_argument("--weights", default=None, metavar="PATH",
                   help="a folder with model.safetensors (+ config.json, + char_vocab.json), or the file itself")
    p.add_argument("--decode", default="auto", choices=DECODE,
                   help="graph: replay each decode step from a CUDA graph; eager: launch every kernel; "
                        "megakernel: one persistent kernel per step (lesson 4c); auto (default): the megakernel "
                        "where it supports this GPU, model and batch, else graph")
    p.add_argument("--mine", action="store_true",
                   help="the capstone: every exercise file of yours that passes check() replaces the course's "
                        "kernel (a table says which, and how fast); the decode step runs eagerly")
    p.add_argument("--solutions", action="store_true",
                   help="with --mine: the shipped solutions instead of your files (the same tokens as the course's)")
    p.add_argument("--train-steps", type=int, default=20, metavar="N",
                   help="with --mine, when a training-step kernel is yours: a short training run of N steps, "
                        "yours against the course's (0: none; default 20)")
    args = p.parse_args(argv)
    if args.solutions and not args.mine:
        p.error("--solutions goes with --mine (GPT-2 on the shipped solutions of the exercises)")
    if args.mine and args.decode not in ("auto", "eager"):
        p.error(f"--mine runs the decode step eagerly (your kernels, launched one by one); "
                f"--decode {args.decode} cannot be combined with it")
    if args.train_steps < 0:
        p.error(f"--train-steps: expected an integer >= 0, got {args.train_steps}")

    from common.device import describe, require_gpu
    from step4_gpt2 import tokenizer, weights
    from step4_gpt2.generate import generate, generate_streamed
    from step4_gpt2.model import GPT

    try:
        require_gpu()
    except RuntimeError as e:            # no GPU / driver: the message alone, no traceback
        print(e, file=sys.stderr)
        return 1
    print(describe(), file=sys.stderr)
    # random weights (offline): load() prints the gibberish notice, once, to stderr (stdout is the text)
    cfg, params, _ = weights.load(args.model, path=args.weights, notice="stderr")
    tok = tokenizer.for_checkpoint(args.weights) if args.weights else tokenizer.BPETokenizer()
    model = GPT(cfg, params)
    unusable_gpu = ()          # --mine: capstone.GPUUnusable (a kernel of yours hung, or a sticky CUDA error)
    if args.mine:              # the capstone: your kernels in place of the course's, a table on stderr
        from step4_gpt2.capstone import GPUUnusable, build
        unusable_gpu = GPUUnusable
        try:
            with contextlib.redirect_stdout(sys.stderr):          # stdout is the text
                capstone = build("solutions" if args.solutions else "mine", model=model)
        except GPUUnusable as e:
            print(e, file=sys.stderr)
            return GPU_UNUSABLE
        capstone.on_unusable = _leave      # a decoder's clean-up would wait for a hung kernel forever
        decoder, options = None, capstone.decoder_options() or {"cuda_graph": False}
        swapped = capstone.swapped(("prefill", "decode"))
    else:
        swapped = contextlib.nullcontext()
        try:
            decoder, options = decoder_for(args.decode, model, len(args.prompt), args.temperature == 0)
        except DecoderUnavailable as e:
            print(e, file=sys.stderr)
            return 2
    kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
              eos=tok.eot, decoder=decoder, **options)          # eot None: nothing stops
    # lesson 4c's decoder may still refuse this GPU when it is built (its constructor says why)
    unavailable = getattr(sys.modules.get("step4_gpt2.megakernel"), "MegakernelUnavailable", ())
    try:
        with swapped:
            if len(args.prompt) == 1:          # streamed as it is made
                gen = generate_streamed(model, args.prompt[0], args.max_new_tokens, tokenizer=tok, **kw)
            else:
                gen = generate(model, [tok.encode(t) for t in args.prompt], args.max_new_tokens, **kw)
                for text, new in zip(args.prompt, gen.tokens):
                    print(f"--- {text}{tok.decode([t for t in new if t != tok.eot])}")
    except unavailable as e:
        print(f"\n--decode {args.decode}: {e}; use --decode graph", file=sys.stderr)
        return 2
    except unusable_gpu as e:
        print(f"\n{e}", file=sys.stderr)
        return GPU_UNUSABLE
    print(f"[{sum(map(len, gen.tokens))} tokens; prefill {gen.prefill_s * 1e3:.1f} ms; decode "
          f"{gen.tokens_per_s:,.0f} tokens/s, decode mode {gen.mode}]", file=sys.stderr)
    if args.mine and args.train_steps and capstone.uses("train"):
        try:
            with contextlib.redirect_stdout(sys.stderr):
                capstone.train(args.train_steps)
        except unusable_gpu as e:
            print(e, file=sys.stderr)
            return GPU_UNUSABLE
    return 0


if __name__ == "__main__":
    status = main()
    if status == GPU_UNUSABLE:     # a kernel of yours may still be running: leave without Python's clean-up
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    raise SystemExit(status)
