"""Lesson 4c (04c_megakernel.ipynb): the whole GPT-2 decode step in one persistent kernel, v1 with a grid-wide
barrier before every stage, v2 with counters and the next weights streaming while blocks wait.

    from step4_gpt2.generate import generate
    from step4_gpt2.megakernel import MegakernelDecoder, supports
    generate(model, prompts, 200, decoder=MegakernelDecoder)      # lesson 4a's generate(), this lesson's decoder
"""
from step4_gpt2.megakernel.megakernel import (AUTO_MAX_BATCH, MegakernelDecoder, MegakernelTimeout,
                                              MegakernelUnavailable, supports)

__all__ = ["MegakernelDecoder", "MegakernelUnavailable", "MegakernelTimeout", "supports", "AUTO_MAX_BATCH"]
