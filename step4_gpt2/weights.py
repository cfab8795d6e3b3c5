"""GPT-2 weights: the config, the Hugging Face file layout, download, loading, checking, random weights.

The layout is the one of Hugging Face's `openai-community/gpt2` `model.safetensors` (names without the
`transformer.` prefix, which is stripped if present):

    wte.weight (V, C)   wpe.weight (T, C)   ln_f.weight/bias (C,)
    h.{i}.ln_1.weight/bias (C,)             h.{i}.ln_2.weight/bias (C,)
    h.{i}.attn.c_attn.weight (C, 3C) + bias  h.{i}.attn.c_proj.weight (C, C) + bias
    h.{i}.mlp.c_fc.weight (C, 4C) + bias     h.{i}.mlp.c_proj.weight (4C, C) + bias

Conv1D weights are (in, out): y = x @ W + b. `h.{i}.attn.bias` / `attn.masked_bias` (causal-mask buffers)
are ignored; `lm_head.weight` is tied to `wte.weight`. fp16 and bf16 files are upcast to fp32 on loading,
unless dtype="bf16" asks for the weight matrices in bf16 (below). Everything here is NumPy: no GPU needed.

    cfg, params, is_random = load("gpt2")          # the Hugging Face cache first, else a download, else
                                                   # (offline, nothing cached) random weights, said so
    cfg, params, _ = load(path="my_model")         # a folder with model.safetensors (+ config.json), or
                                                   # the .safetensors file itself (a checkpoint of 04b)
    cfg, params, _ = load("gpt2", dtype="bf16")    # the weight matrices as bf16 bit patterns (uint16)

dtype="bf16": the matrices a GEMV reads (wte and every block's four Conv1D weights, `is_matrix`) come back as
uint16 arrays of bf16 bit patterns (NumPy has no bfloat16; step4_gpt2/quantize.py converts them): a bf16
file's bits are kept as they are, an fp32 or fp16 file's values are rounded to the nearest bf16 (ties to
even). Biases, LayerNorm parameters and wpe stay float32 (widened exactly from bf16): they are a small share
of a step's bytes, and the kernels add them in fp32.
Downloads go through huggingface_hub, so its settings apply: HF_HUB_OFFLINE=1 (cache only), HF_HOME /
HF_HUB_CACHE (where the cache is), HTTPS_PROXY (proxies). Before downloading, `online()` checks within 2 s
that the hub (or the proxy) answers at all, so a machine without a network falls back at once.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.check import expect_choice

HF_REPO = "openai-community/gpt2"     # gpt2-medium / -large / -xl load the same way
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
CONFIG_KEYS = ("n_layer", "n_head", "n_embd", "vocab_size")     # config.json keys GPTConfig needs
PROBE_TIMEOUT_S = 2.0            # online(): seconds to wait for a connection to the hub
DTYPES = ("fp32", "bf16")      # load(dtype=): how the weight matrices come back
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

    def __post_init__(self):
        for k in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"config: {k} must be a positive integer, got {v!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"config: n_head={self.n_head} does not divide n_embd={self.n_embd} "
                             f"(each head gets n_embd / n_head channels)")

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
    def from_hf(cls, d: dict, source: str = "config.json") -> "GPTConfig":
        """From a Hugging Face GPT2Config dict; `source` (the file it came from) is named in errors."""
        if not isinstance(d, dict):
            raise WeightFileError(f"{source}: expected a JSON object with {', '.join(CONFIG_KEYS)}, "
                                  f"got {type(d).__name__}")
        missing = [k for k in CONFIG_KEYS if k not in d]
        if missing:
            raise WeightFileError(f"{source}: missing key{'s' if len(missing) > 1 else ''} "
                                  f"{', '.join(map(repr, missing))} (a GPT-2 config.json has {', '.join(CONFIG_KEYS)})")
        try:
            return cls(n_layer=d["n_layer"], n_head=d["n_head"], n_embd=d["n_embd"], vocab_size=d["vocab_size"],
                       block_size=d.get("n_positions", d.get("n_ctx", 1024)), eps=d.get("layer_norm_epsilon", 1e-5))
        except ValueError as e:
            raise WeightFileError(f"{source}: {e}") from None

    @classmethod
    def from_file(cls, path) -> "GPTConfig":
        """Read a config.json; a malformed one is an error naming the file and the JSON problem."""
        return cls.from_hf(read_json(path), str(path))


class WeightFileError(ValueError):
    """A weight file that does not match the GPT-2 layout; the message names every offending tensor."""


def read_json(path):
    """A JSON file's content; malformed JSON is a WeightFileError naming the file, line and column."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise WeightFileError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None


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
    n_head = n_head or (C // 64 if C % 64 == 0 else 1)
    return GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=C, vocab_size=V, block_size=T, eps=eps)


def is_matrix(name: str) -> bool:
    """A weight matrix a GEMV reads (wte, the Conv1D weights), as opposed to wpe, biases and LayerNorms."""
    return name == "wte.weight" or (name.startswith("h.") and name.endswith(".weight") and ".ln_" not in name)


def validate(tensors: dict, cfg: GPTConfig, bf16: frozenset = frozenset()) -> None:
    """Raise WeightFileError listing missing, unexpected and mis-shaped tensors (all of them, by name).
    `bf16`: names whose uint16 arrays hold bf16 bit patterns (a float dtype in disguise)."""
    want = expected_shapes(cfg)
    missing = [n for n in want if n not in tensors]
    extra = [n for n in tensors if n not in want]
    shaped = [f"{n} has shape {tuple(tensors[n].shape)}, expected {want[n]}"
              for n in want if n in tensors and tuple(tensors[n].shape) != want[n]]
    dtypes = [f"{n} has dtype {tensors[n].dtype}" for n in want if n in tensors
              and np.dtype(tensors[n].dtype).kind != "f" and not (n in bf16 and tensors[n].dtype == np.uint16)]
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:12])}" + (" ..." if len(missing) > 12 else ""))
    if extra:
        problems.append(f"unexpected tensors: {', '.join(extra[:12])}" + (" ..." if len(extra) > 12 else ""))
    problems += shaped + dtypes
    if problems:
        raise WeightFileError(f"weights do not match GPT-2 {cfg}:\n  " + "\n  ".join(problems))


def weights_path(path) -> Path:
    """The model.safetensors a `path` names: the file itself, or the one inside a folder."""
    path = Path(path)
    if path.is_dir():
        f = path / WEIGHTS_FILE
        if not f.is_file():
            there = sorted(p.name for p in path.iterdir())[:10]
            raise FileNotFoundError(f"path: folder {str(path)!r} has no {WEIGHTS_FILE} (it holds: "
                                    f"{', '.join(there) or 'nothing'})")
        return f
    if not path.is_file():
        raise FileNotFoundError(f"path: weight file {str(path)!r} does not exist")
    return path


def _bf16_tensors(path: Path, names: list, keep_bits: bool = False) -> dict:
    """BF16 tensors of a safetensors file as float32 (NumPy has no bfloat16; its 16 bits are the top half
    of a float32, so shifting them left by 16 is exact), or with keep_bits as the uint16 bit patterns."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    out = {}
    for name in names:
        info = header[name]
        a, b = info["data_offsets"]
        bits = np.fromfile(path, dtype="<u2", count=(b - a) // 2, offset=8 + n + a).astype(np.uint16)
        out[name] = (bits if keep_bits else (bits.astype(np.uint32) << 16).view(np.float32)).reshape(info["shape"])
    return out


def read_tensors(path, keep_bf16: bool = False) -> dict:
    """{name: NumPy array} of a safetensors file, bf16 tensors upcast to float32 (keep_bf16: kept as uint16
    bit patterns; `bf16_names(path)` says which those are)."""
    return _read(path, keep_bf16)[0]


def bf16_names(path) -> list:
    """Names of a safetensors file's BF16 tensors (from its header, without reading the data)."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="numpy") as f:
            return [n for n in f.keys() if f.get_slice(n).get_dtype() == "BF16"]
    except Exception as e:
        raise WeightFileError(f"path: {path} is not a readable safetensors file ({type(e).__name__}: {e})") from None


def _read(path, keep_bf16: bool) -> tuple[dict, list]:
    from safetensors import safe_open
    path = Path(path)
    bf16 = bf16_names(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            out = {n: f.get_tensor(n) for n in f.keys() if n not in bf16}
        out.update(_bf16_tensors(path, bf16, keep_bits=keep_bf16))
    except Exception as e:
        raise WeightFileError(f"path: {path} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    return out, bf16


def as_dtype(params: dict, dtype: str = "fp32", bf16: frozenset = frozenset()) -> dict:
    """params with the weight matrices (is_matrix) in `dtype` and every other tensor float32. `bf16`: names of
    uint16 arrays that already hold bf16 bits (kept as they are for "bf16", widened exactly for "fp32");
    float tensors are rounded to bf16 to nearest even (step4_gpt2.quantize.to_bf16)."""
    from step4_gpt2.quantize import from_bf16, to_bf16
    expect_choice(dtype, "dtype", DTYPES)
    out = {}
    for n, t in params.items():
        bits = n in bf16 and t.dtype == np.uint16
        if dtype == "bf16" and is_matrix(n):
            out[n] = np.ascontiguousarray(t) if bits else to_bf16(np.ascontiguousarray(t, dtype=np.float32))
        else:
            out[n] = from_bf16(t) if bits else np.ascontiguousarray(t, dtype=np.float32)
    return out


def load_file(path, cfg: GPTConfig | None = None, dtype: str = "fp32") -> tuple[GPTConfig, dict]:
    """Read a safetensors file (HF layout; or a folder holding model.safetensors) -> (config, {name: float32
    NumPy array}), checked. fp16/bf16 tensors are upcast to float32; with dtype="bf16" the weight matrices
    come back as uint16 bf16 bit patterns instead (as_dtype: a bf16 file's bits kept, others rounded).

    The config comes from `cfg`, else from a config.json beside the file, else from the shapes."""
    expect_choice(dtype, "dtype", DTYPES)
    path = weights_path(path)
    raw, bf16 = _read(path, keep_bf16=dtype == "bf16")
    tensors = normalize(raw)
    bf16 = frozenset(n.removeprefix("transformer.") for n in bf16)
    if cfg is None:
        cj = path.parent / CONFIG_FILE
        cfg = GPTConfig.from_file(cj) if cj.is_file() else infer_config(tensors)
    validate(tensors, cfg, bf16)
    return cfg, as_dtype(tensors, dtype, bf16)


def repo_for(name: str) -> str:
    """The Hugging Face repository of a GPT-2 size (a ValueError naming the sizes for any other name)."""
    GPTConfig.from_name(name)
    return HF_REPO if name == "gpt2" else f"openai-community/{name}"


def cached(repo: str = HF_REPO, filename: str = WEIGHTS_FILE, cache_dir=None) -> Path | None:
    """The file from the local Hugging Face cache, or None; never touches the network."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(repo, filename, cache_dir=cache_dir)
    return Path(found) if isinstance(found, str) else None


def download(repo: str = HF_REPO, filename: str = WEIGHTS_FILE, cache_dir=None) -> Path:
    """Download once (progress bar) into the Hugging Face cache and return the local path."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise ImportError("downloading GPT-2 needs huggingface_hub: pip install huggingface_hub") from None
    path = Path(hf_hub_download(repo_id=repo, filename=filename, cache_dir=cache_dir, etag_timeout=5))
    try:
        hf_hub_download(repo_id=repo, filename=CONFIG_FILE, cache_dir=cache_dir, etag_timeout=5)
    except Exception:
        pass                     # config.json only confirms n_head; the shapes give the rest
    return path


def _offline_set() -> bool:
    """HF_HUB_OFFLINE is set (now, or when huggingface_hub was imported): the cache only, by request."""
    if os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() not in ("0", "", "false", "no", "off"):
        return True
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(constants.HF_HUB_OFFLINE)


def hub_address() -> tuple[str, int]:
    """(host, port) a download connects to first: the HTTPS proxy when one is set for the hub, else the hub
    (huggingface_hub's endpoint, HF_ENDPOINT)."""
    import urllib.parse
    import urllib.request
    try:
        from huggingface_hub import constants
        endpoint = constants.ENDPOINT
    except ImportError:
        endpoint = "https://huggingface.co"
    hub = urllib.parse.urlsplit(endpoint)
    proxy = urllib.request.getproxies().get("https")
    url = urllib.parse.urlsplit(proxy) if proxy and not urllib.request.proxy_bypass(hub.hostname) else hub
    return url.hostname, url.port or (80 if url.scheme == "http" else 443)


def online(timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a download can start: False when HF_HUB_OFFLINE is set, or when no connection to the hub (or
    its proxy) opens within `timeout` seconds. huggingface_hub itself retries an unreachable hub for about
    25 s before it gives up; this probe answers within the timeout, whatever the DNS or the network do."""
    if _offline_set():
        return False
    import socket
    import threading
    opened = []

    def probe():
        try:
            socket.create_connection(hub_address(), timeout=timeout).close()
            opened.append(True)
        except OSError:               # no DNS, no route, refused, timed out
            pass
    # a thread, because name resolution ignores the socket timeout and may hang for long on a dead network
    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout)
    return bool(opened)


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
    (directory / CONFIG_FILE).write_text(json.dumps(cfg.to_hf(), indent=1))
    return path


def load(name: str = "gpt2", path=None, allow_random: bool = True, seed: int = 0,
         notice: bool | str = True, cache_dir=None, dtype: str = "fp32") -> tuple[GPTConfig, dict, bool]:
    """(config, params, is_random): `path` (a folder with model.safetensors [+ config.json], or the file) if
    given; else GPT-2 size `name` from the Hugging Face cache, else downloaded (when online()), else
    random weights with the gibberish notice, printed once, here (to stdout, or stderr with
    notice="stderr", as the messages about the failed download; notice=False prints nothing).
    dtype="bf16": the weight matrices as bf16 bit patterns (load_file), random ones rounded to bf16."""
    out = sys.stderr if notice == "stderr" else sys.stdout
    expect_choice(dtype, "dtype", DTYPES)
    if path is not None:
        cfg, params = load_file(path, dtype=dtype)
        return cfg, params, False
    repo = repo_for(name)                  # an unknown name fails here, before any message
    cfg = GPTConfig.from_name(name)
    file = cached(repo, cache_dir=cache_dir)
    if file is not None:
        return (*load_file(file, cfg, dtype), False)
    if online():
        try:
            return (*load_file(download(repo, cache_dir=cache_dir), cfg, dtype), False)
        except Exception as e:           # proxy refused, hub error, a bad file: say which, fall back
            if not allow_random:
                raise
            if notice:
                print(f"download of {repo} failed ({type(e).__name__}: {e})", file=out)
    else:
        why = ("HF_HUB_OFFLINE is set" if _offline_set() else
               f"no connection to {':'.join(map(str, hub_address()))} within {PROBE_TIMEOUT_S:g} s")
        if not allow_random:
            raise RuntimeError(f"offline ({why}) and {repo} is not in the Hugging Face cache: cannot load it; "
                               f"pass path= to a local {WEIGHTS_FILE} (or a folder holding one)")
        if notice:
            print(f"offline ({why}) and {repo} is not in the Hugging Face cache: not downloading", file=out)
    return cfg, as_dtype(random_weights(cfg, seed, notice=notice), dtype), True


def summary(cfg: GPTConfig) -> str:
    return (f"GPT-2 {cfg.n_layer} layers, {cfg.n_head} heads, C={cfg.n_embd}, vocab {cfg.vocab_size}, "
            f"context {cfg.block_size}: {cfg.n_params() / 1e6:.1f}M parameters, "
            f"{cfg.n_params() * 4 / 1e6:.0f} MB in fp32")


__all__ = ["GPTConfig", "WeightFileError", "expected_shapes", "normalize", "infer_config", "validate",
           "weights_path", "read_tensors", "bf16_names", "is_matrix", "as_dtype", "DTYPES", "load_file",
           "repo_for", "cached", "download", "online", "hub_address",
           "random_weights",
           "save", "load", "summary"]
