"""GPT-2 weights: the config, the Hugging Face file layout, download, loading, checking, random weights.

The layout is the one of Hugging Face's `openai-community/gpt2` `model.safetensors` (names without the
`transformer.` prefix, which is stripped if present):

    wte.weight (V, C)   wpe.weight (T, C)   ln_f.weight/bias (C,)
    h.{i}.ln_1.weight/bias (C,)             h.{i}.ln_2.weight/bias (C,)
    h.{i}.attn.c_attn.weight (C, 3C) + bias  h.{i}.attn.c_proj.weight (C, C) + bias
    h.{i}.mlp.c_fc.weight (C, 4C) + bias     h.{i}.mlp.c_proj.weight (4C, C) + bias

Conv1D weights are (in, out): y = x @ W + b. `h.{i}.attn.bias` / `attn.masked_bias` (causal-mask buffers)
are ignored; `lm_head.weight` is tied to `wte.weight`. Everything here is NumPy: no GPU needed.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HF_REPO = "openai-community/gpt2"     # gpt2-medium / -large / -xl load the same way
WEIGHTS_FILE = "model.safetensors"
GIBBERISH = ("NOTICE: using RANDOM weights (no download). The model runs exactly like GPT-2 - same shapes, "
             "same FLOPs, same bytes - but the text it writes will be gibberish.")


@dataclass
class GPTConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50257
    block_size: int = 1024        # context length (n_positions)
    eps: float = 1e-5             # LayerNorm epsilon

    SIZES = {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280),
             "gpt2-xl": (48, 25, 1600)}

    @classmethod
    def from_name(cls, name: str) -> "GPTConfig":
        if name not in cls.SIZES:
            raise ValueError(f"name: expected one of {sorted(cls.SIZES)}, got {name!r}")
        n_layer, n_head, n_embd = cls.SIZES[name]
        return cls(n_layer=n_layer, n_head=n_head, n_embd=n_embd)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def n_params(self) -> int:
        """Parameters in the file (the tied LM head counted once)."""
        return sum(int(np.prod(s)) for s in expected_shapes(self).values())

    def weight_bytes_per_token(self) -> int:
        """Bytes a decode step must read: every matrix, bias and LayerNorm parameter once (fp32), plus one
        row of wpe; wte counts once (as the LM head: the embedding reads one row). 494.6 MB for gpt2."""
        return (self.n_params() - self.block_size * self.n_embd + self.n_embd) * 4

    def to_hf(self) -> dict:
        """config.json in the Hugging Face GPT2Config format."""
        eot = 50256 if self.vocab_size > 50256 else self.vocab_size - 1
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": self.n_layer,
                "n_head": self.n_head, "n_embd": self.n_embd, "vocab_size": self.vocab_size,
                "n_positions": self.block_size, "n_ctx": self.block_size, "layer_norm_epsilon": self.eps,
                "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "bos_token_id": eot, "eos_token_id": eot, "tie_word_embeddings": True}

    @classmethod
    def from_hf(cls, d: dict) -> "GPTConfig":
        return cls(n_layer=d["n_layer"], n_head=d["n_head"], n_embd=d["n_embd"], vocab_size=d["vocab_size"],
                   block_size=d.get("n_positions", d.get("n_ctx", 1024)), eps=d.get("layer_norm_epsilon", 1e-5))


class WeightFileError(ValueError):
    """A weight file that does not match the GPT-2 layout; the message names every offending tensor."""


def expected_shapes(cfg: GPTConfig) -> dict:
    C, V, T = cfg.n_embd, cfg.vocab_size, cfg.block_size
    shapes = {"wte.weight": (V, C), "wpe.weight": (T, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        shapes.update({p + "ln_1.weight": (C,), p + "ln_1.bias": (C,),
                       p + "attn.c_attn.weight": (C, 3 * C), p + "attn.c_attn.bias": (3 * C,),
                       p + "attn.c_proj.weight": (C, C), p + "attn.c_proj.bias": (C,),
                       p + "ln_2.weight": (C,), p + "ln_2.bias": (C,),
                       p + "mlp.c_fc.weight": (C, 4 * C), p + "mlp.c_fc.bias": (4 * C,),
                       p + "mlp.c_proj.weight": (4 * C, C), p + "mlp.c_proj.bias": (C,)})
    return shapes


def _is_ignored(name: str) -> bool:
    return name.endswith(("attn.bias", "attn.masked_bias")) and ".c_attn." not in name and ".c_proj." not in name


def normalize(tensors: dict) -> dict:
    """Strip `transformer.`, drop the mask buffers, drop a tied `lm_head.weight` (checked equal to wte)."""
    out = {}
    for name, t in tensors.items():
        name = name.removeprefix("transformer.")
        if _is_ignored(name):
            continue
        out[name] = t
    head = out.pop("lm_head.weight", None)
    if head is not None and "wte.weight" in out and (head.shape != out["wte.weight"].shape
                                                     or not np.array_equal(head, out["wte.weight"])):
        raise WeightFileError("lm_head.weight differs from wte.weight: GPT-2 ties the LM head to the token "
                              "embedding, an untied head is not supported")
    return out


def infer_config(tensors: dict, n_head: int | None = None, eps: float = 1e-5) -> GPTConfig:
    """Sizes from the tensor shapes; n_head cannot be seen in shapes (GPT-2 uses head_dim 64)."""
    if "wte.weight" not in tensors or "wpe.weight" not in tensors:
        missing = [n for n in ("wte.weight", "wpe.weight") if n not in tensors]
        raise WeightFileError(f"not a GPT-2 weight file: missing {', '.join(missing)}")
    V, C = tensors["wte.weight"].shape
    T = tensors["wpe.weight"].shape[0]
    layers = {int(n.split(".")[1]) for n in tensors if n.startswith("h.") and n.split(".")[1].isdigit()}
    n_layer = max(layers) + 1 if layers else 0
    return GPTConfig(n_layer=n_layer, n_head=n_head or max(1, C // 64), n_embd=C, vocab_size=V, block_size=T, eps=eps)


def validate(tensors: dict, cfg: GPTConfig) -> None:
    """Raise WeightFileError listing missing, unexpected and mis-shaped tensors (all of them, by name)."""
    want = expected_shapes(cfg)
    missing = [n for n in want if n not in tensors]
    extra = [n for n in tensors if n not in want]
    shaped = [f"{n} has shape {tuple(tensors[n].shape)}, expected {want[n]}"
              for n in want if n in tensors and tuple(tensors[n].shape) != want[n]]
    dtypes = [f"{n} has dtype {tensors[n].dtype}" for n in want if n in tensors
              and np.dtype(tensors[n].dtype).kind != "f"]
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:12])}" + (" ..." if len(missing) > 12 else ""))
    if extra:
        problems.append(f"unexpected tensors: {', '.join(extra[:12])}" + (" ..." if len(extra) > 12 else ""))
    problems += shaped + dtypes
    if problems:
        raise WeightFileError(f"weights do not match GPT-2 {cfg}:\n  " + "\n  ".join(problems))


def load_file(path, cfg: GPTConfig | None = None) -> tuple[GPTConfig, dict]:
    """Read a safetensors file (HF layout) -> (config, {name: float32 NumPy array}), checked.

    The config comes from `cfg`, else from a config.json beside the file, else from the shapes."""
    from safetensors.numpy import load_file as st_load

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: weight file {str(path)!r} does not exist")
    try:
        raw = st_load(str(path))
    except Exception as e:
        raise WeightFileError(f"path: {path} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    tensors = normalize(raw)
    if cfg is None:
        cj = path.parent / "config.json"
        cfg = GPTConfig.from_hf(json.loads(cj.read_text())) if cj.is_file() else infer_config(tensors)
    validate(tensors, cfg)
    return cfg, {n: np.ascontiguousarray(t, dtype=np.float32) for n, t in tensors.items()}


def download(repo: str = HF_REPO, filename: str = WEIGHTS_FILE) -> Path:
    """Download once (progress bar) into the Hugging Face cache and return the local path."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise ImportError("downloading GPT-2 needs huggingface_hub: pip install huggingface_hub") from None
    path = Path(hf_hub_download(repo_id=repo, filename=filename))
    try:
        hf_hub_download(repo_id=repo, filename="config.json")
    except Exception:
        pass                     # config.json only confirms n_head; the shapes give the rest
    return path


def online(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    """Quick check before a download: HF_HUB_OFFLINE set, or no route to the host within `timeout` s."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    import socket
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def random_weights(cfg: GPTConfig, seed: int = 0, notice: bool | str = True) -> dict:
    """Weights in exactly the HF layout, made offline: N(0, 0.02) like GPT-2's init (residual projections
    scaled by 1/sqrt(2 n_layer)). Biases and LayerNorm parameters are random too, so a kernel that forgets
    one of them is caught."""
    if notice:
        print(GIBBERISH, file=sys.stderr if notice == "stderr" else sys.stdout)
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
            t = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        elif name.endswith("c_proj.weight"):
            t = (0.02 / np.sqrt(2 * cfg.n_layer)) * rng.standard_normal(shape, dtype=np.float32)
        else:
            t = 0.02 * rng.standard_normal(shape, dtype=np.float32)
        out[name] = t.astype(np.float32)
    return out


def save(params: dict, cfg: GPTConfig, directory) -> Path:
    """Write model.safetensors + config.json (HF layout, loadable by transformers' from_pretrained)."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    validate(params, cfg)
    path = directory / WEIGHTS_FILE
    save_file({n: np.ascontiguousarray(t) for n, t in params.items()}, str(path), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(cfg.to_hf(), indent=1))
    return path


def load(name: str = "gpt2", path=None, allow_random: bool = True, seed: int = 0,
         notice: bool | str = True) -> tuple[GPTConfig, dict, bool]:
    """(config, params, is_random): a local file if given, else the HF download, else (offline) random
    weights with the gibberish notice, printed once, here (to stdout, or stderr with notice="stderr", as the
    messages about the failed download; notice=False prints nothing). `name` picks the GPT-2 size."""
    out = sys.stderr if notice == "stderr" else sys.stdout
    if path is not None:
        cfg, params = load_file(path)
        return cfg, params, False
    repo = HF_REPO if name == "gpt2" else f"openai-community/{name}"
    if online():
        try:
            cfg, params = load_file(download(repo), GPTConfig.from_name(name))
            return cfg, params, False
        except (OSError, ImportError, WeightFileError) as e:
            if not allow_random:
                raise
            if notice:
                print(f"download of {repo} failed ({type(e).__name__}: {e})", file=out)
    elif not allow_random:
        raise RuntimeError(f"no network (or HF_HUB_OFFLINE is set): cannot download {repo}; pass path= to a "
                           f"local {WEIGHTS_FILE}")
    elif notice:
        print(f"offline (no route to huggingface.co or HF_HUB_OFFLINE set): not downloading {repo}", file=out)
    cfg = GPTConfig.from_name(name)
    return cfg, random_weights(cfg, seed, notice=notice), True


def summary(cfg: GPTConfig) -> str:
    return (f"GPT-2 {cfg.n_layer} layers, {cfg.n_head} heads, C={cfg.n_embd}, vocab {cfg.vocab_size}, "
            f"context {cfg.block_size}: {cfg.n_params() / 1e6:.1f}M parameters, "
            f"{cfg.n_params() * 4 / 1e6:.0f} MB in fp32")


__all__ = ["GPTConfig", "WeightFileError", "expected_shapes", "normalize", "infer_config", "validate",
           "load_file", "download", "online", "random_weights", "save", "load", "summary"]
