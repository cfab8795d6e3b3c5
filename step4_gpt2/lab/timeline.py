"""A mark after every op of a decode step, without touching the model: within `marked(model, mark)`, each
op model.py calls through step4_gpt2.ops is wrapped so that mark(name) is called right after the op is
enqueued. The names say which op of the block it is, in the words of model.py's two plans:

    "fused": embedding, ln_1 + qkv GEMV + KV append, decode attention, attn proj GEMV + residual,
             ln_2 + fc GEMV + GELU, mlp proj GEMV + residual, ..., ln_f + LM head GEMV, argmax
    "split": embedding, ln_1 (step 3), qkv GEMV + KV append, decode attention, attn proj GEMV,
             bias + residual + ln_2 (step 3), fc GEMV + GELU, mlp proj GEMV,
             bias + residual + next LayerNorm (step 3), ..., LM head GEMV, argmax

A mark that records a CUDA event gives the time between ops (kernel + launch gap); a mark that appends the
name counts the ops. Only while the block runs: a CUDA graph captured inside it would replay no marks.
"""
from __future__ import annotations

import contextlib
from unittest import mock


@contextlib.contextmanager
def marked(model, mark):
    """Call mark(name) after each op model.decode_step runs through step4_gpt2.ops, inside the block."""
    gemv_names = {id(model.wte): ("ln_f + ", "LM head GEMV")}
    for blk in model.h:
        gemv_names[id(blk.c_proj)] = ("", "attn proj GEMV")
        gemv_names[id(blk.c_fc)] = ("ln_2 + ", "fc GEMV + GELU")
        gemv_names[id(blk.mlp_proj)] = ("", "mlp proj GEMV")
    ln_2 = {id(blk.ln_2[0]) for blk in model.h}

    def gemv_name(x, W, *a, ln=None, residual=False, **k):
        pre, name = gemv_names.get(id(W), ("", "GEMV"))
        return (pre if ln is not None else "") + name + (" + residual" if residual else "")

    names = {
        "embedding": lambda *a, **k: "embedding",
        "layernorm": lambda *a, **k: "ln_1 (step 3)",
        "gemv_qkv": lambda *a, ln=None, **k: ("ln_1 + " if ln is not None else "") + "qkv GEMV + KV append",
        "decode_attention": lambda *a, **k: "decode attention",
        "gemv": gemv_name,
        "residual_layernorm": lambda x, y, b, w, *a, **k: ("bias + residual + ln_2 (step 3)" if id(w) in ln_2
                                                           else "bias + residual + next LayerNorm (step 3)"),
        "argmax": lambda *a, **k: "argmax",
    }
    from step4_gpt2 import ops

    def wrapped(real, name_of):
        def op(*a, **k):
            out = real(*a, **k)
            mark(name_of(*a, **k))
            return out
        return op

    with contextlib.ExitStack() as stack:
        for op, name_of in names.items():
            stack.enter_context(mock.patch.object(ops, op, wrapped(getattr(ops, op), name_of)))
        yield
