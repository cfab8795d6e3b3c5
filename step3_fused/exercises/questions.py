"""Step 3's exercises answered with numbers (common.hints.Question): the expected values live here, so the
notebook's check cell holds no answer; `common.hints.answer(id, ...)` compares them."""
from __future__ import annotations

from common.hints import Question

XL_TOKENS, XL_C = 4096, 1600       # GPT-2 XL: C = 1600, a batch of 4096 tokens


def _tail_bytes() -> dict:
    row = 4 * XL_TOKENS * XL_C                 # one (N, C) float32 array
    return {"unfused_tail_bytes": 7 * row, "fused_tail_bytes": 4 * row}


QUESTIONS = [
    Question(
        id="step3/tail_bytes", number="3a.1", title="the DRAM bytes of a sublayer's tail for GPT-2 XL",
        hints=("Count whole (N, C) float32 arrays, each 4 * N * C bytes, that every kernel reads from or writes to "
               "DRAM; bias, w and b (C floats) are too small to count. Section 2 of this lesson lists the three "
               "unfused kernels: bias add, residual add, LayerNorm.",
               "Unfused: the bias add reads proj and writes it back (2 arrays), the residual add reads x and proj "
               "and writes r (3), LayerNorm reads r and writes y (2). Fused: one kernel reads x and proj and "
               "writes r and y. Multiply the count of arrays by 4 * 4096 * 1600."),
        worked="unfused: (2 + 3 + 2) = 7 arrays x 4 B x 4096 x 1600 = 183,500,800 B; fused: 4 arrays = 104,857,600 "
               "B. The fused tail moves 4/7 of the bytes, so at the copy bandwidth it takes about 57 % of the time.",
        expected=_tail_bytes, rtol=0.0,
        wrong={"unfused_tail_bytes": "count the row-sized arrays each of the three kernels reads and writes",
               "fused_tail_bytes": "which arrays must the one fused kernel read, and which must it write?"}),
]
