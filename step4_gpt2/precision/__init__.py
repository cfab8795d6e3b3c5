"""Lesson 4f (04f_fewer_bytes.ipynb): fewer bytes per token. GPT-2's decode in bf16 and int8 weights, the bound
each precision sets, and what the rounding costs in perplexity.

    from step4_gpt2.model import GPT
    model = GPT(config, params, precision="int8")           # lesson 4a's model; the matrices converted at load
    generate(model, prompts, 64)                            # lesson 4a's generate(), the same CUDA graph decode
    from step4_gpt2.precision.quality import perplexity
    perplexity(model, held_out_ids, T=256)

The kernels are step4_gpt2/gemv_lowp.cu (gemv_v6: bf16, gemv_v7: int8 with one scale per output row; v8, v9:
the same on tensor cores) and the conversions step4_gpt2/quantize.py; this package measures them (quality.py,
benchmarks.py).
"""
from step4_gpt2.precision.quality import Agreement, greedy_agreement, mean_nll, perplexity, top1_agreement

__all__ = ["perplexity", "mean_nll", "greedy_agreement", "top1_agreement", "Agreement"]
