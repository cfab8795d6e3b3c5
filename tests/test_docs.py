"""The docs that teach (CPU only): no run history in learner-facing text, a README that guides, links that resolve,
and a results page generated from one benchmark run (`python -m common.benchmarks --markdown`)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common.render import course_notebooks

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = tuple(p.relative_to(ROOT).as_posix() for p in course_notebooks(ROOT))
README_WORDS = 1200
PROSE_WORDS = 250      # a notebook's markdown cell
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
RESULTS_LINES = 300

# The project's checks for run history: a commit-hash-like token (after removing URLs) and history phrases.
URL = re.compile(r"https?://\S+")
HASH = re.compile(r"(?<![#\w/.-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w])")
HISTORY = re.compile(r"\b(in a later session|this session|run [A-H]\b|since taken out|were not kept|found by "
                     r"testing|the target of|MISSED)\b", re.I)


def learner_docs() -> list[Path]:
    docs = [p for p in (ROOT / "docs").rglob("*.md") if "rendered" not in p.relative_to(ROOT / "docs").parts]
    return [ROOT / "README.md", *sorted(docs)]


def notebook_text(path: Path) -> str:
    return "\n".join("".join(c.get("source", "")) for c in json.loads(path.read_text())["cells"])


def history_in(text: str) -> list[str]:
    text = URL.sub("", text)
    return [m.group(0) for m in HASH.finditer(text)] + [m.group(0) for m in HISTORY.finditer(text)]


@pytest.mark.parametrize("path", learner_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_carry_no_run_history(path):
    found = history_in(path.read_text())
    assert not found, f"{path.relative_to(ROOT)}: commit hashes or history phrases: {found[:10]}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebooks_carry_no_run_history(name):
    path = ROOT / name
    if not path.exists():
        pytest.skip(f"{name} not here (moved?): test_readme_lists_every_notebook names it")
    found = history_in(notebook_text(path))
    assert not found, f"{name}: commit hashes or history phrases: {found[:10]}"


def test_history_patterns_catch_what_they_should():
    assert history_in("at commit 9f5d758 the step") == ["9f5d758"]
    assert history_in("in a later session we") and history_in("Run B measured") and history_in("the target of 2x")
    assert not history_in("https://github.com/karpathy/llm.c/commit/9f5d758abc and 0x7fffffff, #define, 1e-5")
    assert not history_in("a 256-thread block, 4096x4096 fp32, deadbeef")   # no digit: not a hash


def test_readme_is_a_guide_listing_every_notebook():
    text = (ROOT / "README.md").read_text()
    words = len(text.split())
    assert words <= README_WORDS, f"README.md has {words} words; at most {README_WORDS}"
    missing = [n for n in NOTEBOOKS if n not in text]
    assert not missing, f"README.md does not list: {missing}"
    where = [text.index(n) for n in NOTEBOOKS]
    assert where == sorted(where), f"README.md lists the notebooks out of course order: {NOTEBOOKS}"
    assert text.count("<!-- results -->") == 1 and text.count("<!-- /results -->") == 1


def test_notebook_names_show_the_order():
    """Inside a step, the names sort in the order the lessons are taught (01a, 01b, ...; 04a, 04b, 04c), and no
    two notebooks share a number."""
    stems = [Path(n).stem for n in NOTEBOOKS]
    numbers = [re.match(r"(\d\d)([a-z])_", s) for s in stems]
    assert all(numbers), f"every notebook is named NNx_topic: {stems}"
    keys = [m.group(1) + m.group(2) for m in numbers]
    assert len(set(keys)) == len(keys) and keys == sorted(keys), keys
    for n, m in zip(NOTEBOOKS, numbers):
        assert n.startswith(f"step{int(m.group(1))}_"), f"{n}: its number does not match its step"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_opens_with_its_title_and_keeps_prose_short(name):
    nb = json.loads((ROOT / name).read_text())
    first = nb["cells"][0]
    head = "".join(first["source"]).lstrip()
    lesson = re.match(r"(\d\d)([a-z])_", Path(name).stem)
    want = f"# Step {int(lesson.group(1))}{lesson.group(2)}"
    assert first["cell_type"] == "markdown" and head.startswith(want), \
        f"{name} opens with {head[:60]!r}; expected a title cell starting {want!r}"
    long = [(i, len("".join(c["source"]).split())) for i, c in enumerate(nb["cells"])
            if c["cell_type"] == "markdown" and len("".join(c["source"]).split()) > PROSE_WORDS]
    assert not long, f"{name}: markdown cells over {PROSE_WORDS} words (cell, words): {long}"


def anchors_of(md: Path) -> set[str]:
    """The anchors a link may name in a Markdown file: explicit `<a id=...>` and GitHub's heading slugs."""
    text = md.read_text()
    ids = set(re.findall(r'<a\s+(?:id|name)="([^"]+)"', text))
    for h in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.M):
        ids.add(re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-"))
    return ids


def broken_links(text: str, base: Path) -> list[str]:
    broken = []
    for m in LINK.finditer(text):
        link = m.group(1) or m.group(2)
        target, _, anchor = link.partition("#")
        if re.match(r"[a-z]+:", target) or (not target and not anchor):
            continue
        path = (base / target) if target else None
        if path is not None and not path.exists():
            broken.append(link)
        elif anchor and path is not None and path.suffix == ".md" and anchor not in anchors_of(path):
            broken.append(link)
    return broken


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_links_resolve(name):
    """A notebook's links to the primer, the glossary and other lessons reach a file and, into a Markdown file,
    an anchor that exists there."""
    path = ROOT / name
    text = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown")
    broken = broken_links(text, path.parent)
    assert not broken, f"{name}: broken links: {broken}"


@pytest.mark.parametrize("page", sorted((ROOT / "docs" / "rendered").glob("*/*.md")),
                         ids=lambda p: p.parent.name)
def test_rendered_pages_print_no_block_over_80_lines(page):
    """What a learner reads in a rendered run fits a screen: no printed output (or shown source) over 80 lines."""
    from common.kernels import MAX_SHOWN_LINES
    blocks = re.findall(r"^(`{3,4})[^\n]*\n(.*?)^\1\s*$", page.read_text(), re.M | re.S)
    long = [len(b.splitlines()) for _, b in blocks if len(b.splitlines()) > MAX_SHOWN_LINES]
    assert not long, f"{page.relative_to(ROOT)}: printed blocks of {long} lines; at most {MAX_SHOWN_LINES}"



@pytest.mark.parametrize("path", learner_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_that_exist(path):
    broken = broken_links(path.read_text(), path.parent)
    assert not broken, f"{path.relative_to(ROOT)}: links to missing files or anchors: {broken}"


def test_results_page_is_short():
    n = len((ROOT / "docs/results.md").read_text().splitlines())
    assert n <= RESULTS_LINES, f"docs/results.md has {n} lines; at most {RESULTS_LINES}"


# --- common.benchmarks: families in subpackages, and the page written from a run's JSON ---------------------

def _tree(tmp_path):
    (tmp_path / "step9_demo").mkdir()
    (tmp_path / "step9_demo/benchmarks.py").write_text(
        "def alpha_rows():\n    return []\n\ndef beta_rows(n):\n    return []\n\ndef run():\n    return []\n")
    (tmp_path / "step9_demo/benchmarks_flash.py").write_text("def run():\n    return []\n")
    for sub, body in (("train", "def run():\n    return []\n"), ("lab", "def other():\n    return []\n"),
                      ("_private", "def run():\n    return []\n")):
        (tmp_path / "step9_demo" / sub).mkdir()
        (tmp_path / "step9_demo" / sub / "benchmarks.py").write_text(body)
    (tmp_path / "step9_demo/train/benchmarks_bf16.py").write_text("def run():\n    return []\n")
    (tmp_path / "step9_demo/lab/benchmarks_x.py").write_text("def other():\n    return []\n")   # no run()
    (tmp_path / "step8_only_sub/mega").mkdir(parents=True)     # a step whose only benchmarks are a subpackage's
    (tmp_path / "step8_only_sub/mega/benchmarks.py").write_text("def run():\n    return []\n")
    return tmp_path


def test_benchmark_families_in_subpackages(tmp_path):
    from common.benchmarks import family_of, families, select, valid_names
    root = _tree(tmp_path)
    assert valid_names(root) == ["step8_only_sub", "step8_only_sub:mega", "step9_demo", "step9_demo:alpha",
                                 "step9_demo:flash", "step9_demo:train", "step9_demo:train_bf16"]
    assert families("step9_demo", root)["train"] == [("step9_demo.train.benchmarks", None)]
    assert select(["step9_demo:train"], root) == [("step9_demo:train", "step9_demo.train.benchmarks", None)]
    assert select(["step9_demo:train_bf16"], root) == [("step9_demo:train_bf16", "step9_demo.train.benchmarks_bf16",
                                                        None)]
    assert [j[1] for j in select(["step9_demo"], root)] == ["step9_demo.benchmarks", "step9_demo.benchmarks_flash",
                                                            "step9_demo.train.benchmarks",
                                                            "step9_demo.train.benchmarks_bf16"]
    assert [j[1] for j in select(None, root)] == ["step8_only_sub.mega.benchmarks", "step9_demo.benchmarks",
                                                  "step9_demo.benchmarks_flash", "step9_demo.train.benchmarks",
                                                  "step9_demo.train.benchmarks_bf16"]
    with pytest.raises(ValueError, match="valid names are: step8_only_sub, step8_only_sub:mega"):
        select(["step9_demo:lab"], root)
    assert family_of("step9_demo", "step9_demo.train.benchmarks", None) == "step9_demo:train"
    assert family_of("step9_demo", "step9_demo.train.benchmarks_bf16", None) == "step9_demo:train_bf16"
    assert family_of("step9_demo", "step9_demo.benchmarks_flash", None) == "step9_demo:flash"
    assert family_of("step9_demo:alpha", "step9_demo.benchmarks", "alpha_rows") == "step9_demo:alpha"
    assert family_of("step9_demo", "step9_demo.benchmarks", None) == "step9_demo"


def test_the_course_lists_step4s_subpackages():
    from common.benchmarks import select, subpackages, valid_names
    subs = subpackages(ROOT / "step4_gpt2")
    names = valid_names()
    for sub in subs:
        assert f"step4_gpt2:{sub}" in names
        assert any(m == f"step4_gpt2.{sub}.benchmarks" for _, m, _ in select(["step4_gpt2"]))
    # a subpackage's benchmarks_FAMILY.py is a family of its own, run by --only step4_gpt2 too
    assert select(["step4_gpt2:train_bf16"]) == [("step4_gpt2:train_bf16", "step4_gpt2.train.benchmarks_bf16", None)]
    assert any(m == "step4_gpt2.train.benchmarks_bf16" for _, m, _ in select(["step4_gpt2"]))


def _run_json() -> dict:
    """A run shaped like the course's: about as many rows, the same names, both sides of 1 in the ratios."""
    rows = []

    def add(section, name, size, ms=1.0, rate=None, unit="", ceiling="", fraction=None, anchor="", ratio=None,
            target=""):
        step, _, sub = section.partition(":")
        rows.append(dict(name=name, size=size, ms=ms, rate=rate, unit=unit, ceiling=ceiling, fraction=fraction,
                         anchor=anchor, ratio=ratio, target=target, step=step, family=section))
    s = "step1_simple"
    for v in ("axpb v1", "axpb v2", "axpb v3", "axpb v4", "axpb v4 tuned (UNROLL=8, 4 blocks/SM)"):
        add(s, v, "256M fp32", 0.55, 3900.0, "GB/s", "copy", 0.91, "CuPy", 2.3, "ratio >= 2")
    add(s, "CuPy ElementwiseKernel a*x+b", "256M fp32")
    add(s, "NumPy a*x+b (CPU, 64M)", "64M fp32")
    add(s, "axpb v4 (64M)", "64M fp32", anchor="NumPy CPU", ratio=347.0)
    add(s, "gelu(x*w+b) unfused, 3 kernels", "64M fp32")
    add(s, "gelu(x*w+b) fused, 1 kernel", "64M fp32", anchor="unfused", ratio=2.18)
    for v in ("sum v1", "sum v2", "sum v3", "sum v3 tuned (UNROLL=8, 4 blocks/SM)", "cupy.sum"):
        add(s, v, "256M fp32", anchor="cupy.sum", ratio=0.96)
    s = "step2_attention"
    for v in ("softmax_v1", "softmax_v2", "softmax_v3", "softmax_v4", "softmax_v4 (vs torch)", "torch.softmax"):
        add(s, v, "98304x1024", anchor="torch.softmax", ratio=0.61)
    for v in ("matmul_v1", "matmul_v2", "matmul_v3", "matmul_v3 BM=128", "cuBLAS (cupy.matmul, FP32)"):
        add(s, v, "4096^3 fp32", rate=39.0, unit="TFLOP/s", anchor="cuBLAS", ratio=0.76)
    for T in (128, 256, 512, 1024, 2048):
        size = f"B8 H12 T{T} D64"
        for v in ("attention_naive fp32", "attention_cublas fp32", "flash fp32 v3", "torch SDPA fp32 (mem-efficient)",
                  "flash fp32 v3", "torch SDPA fp16 (flash)", "flash tensor cores fp16", "torch SDPA bf16 (flash)",
                  "flash tensor cores bf16"):
            add(s, v, size, rate=100.0, unit="TFLOP/s", anchor="torch", ratio=0.95)
    for v in ("flash fp32 v3 BR64 BC64 TM4", "flash fp32 v3 BR64 BC32 TM4", "flash fp32 v1", "flash fp32 v2",
              "flash tc bf16 WARPS4 BC64", "flash tc bf16 WARPS8 BC64", "flash tc bf16 WARPS4 BC32"):
        add(s, v, "T1024")
    for size in ("B1 H12 L256 D64", "B1 H12 L1024 D64", "B8 H12 L256 D64", "B8 H12 L1024 D64"):
        add(s, "decode attention v1 (block per head)", size)
        add(s, "decode attention v2 (split-K x4)", size, anchor="v1", ratio=1.5)
    s = "step3_fused"
    for v in ("fused residual+LayerNorm", "residual add + LayerNorm (2 kernels)", "fused residual+LayerNorm",
              "torch eager x + r, F.layer_norm", "fused residual+LN vs torch eager",
              "torch.compile x + r, F.layer_norm", "fused residual+LN vs torch.compile", "layernorm v1",
              "layernorm v2", "layernorm v3", "layernorm v4"):
        add(s, v, "8192x768")
    for v in ("attention sublayer unfused (12 launches)", *(f"  unfused: part {i}" for i in range(10)),
              "attention sublayer fused (5 launches)", *(f"  fused: part {i}" for i in range(5)),
              "fused sublayer vs unfused", "torch eager sublayer (SDPA)", "fused sublayer vs torch eager"):
        add(s, v, "B8 T1024 C768 H12")
    for b in (1, 8, 64):
        for v in ("separate", "separate-splitk", "two", "fused"):
            for form in ("", " host wall (idle GPU)", " (graph)"):
                add(s, f"decode {v}{form}", f"B{b} L1024 C768", ms=float("nan") if v.startswith("separate")
                    and form == " (graph)" else 0.05)
    for v in ("conv2d, bias, relu (3 kernels)", "conv2d+bias+relu fused", "torch cuDNN conv2d + relu",
              "conv2d+bias+relu fused vs cuDNN"):
        add(s, v, "8x64x56x56->64")
    for v in ("LayerNorm + cuBLAS GEMM + bias (3 kernels)", *(f"over-fused LN+GEMM {t}" for t in "abcd")):
        add(s, v, "8192x768 @ 768x3072")
    for v in ("train step fused (adamw)", "train step unfused (adamw)", "train step fused (sgd)",
              "train step unfused (sgd)", "GEMMs only (cuBLAS, fp32)", "non-GEMM part of fused step (adamw)",
              "step ratio if non-GEMM took 0 (adamw)", "forward+backward fused", "forward+backward unfused",
              "AdamW one launch, all tensors", "AdamW one launch per tensor", "SGD one launch, all tensors",
              "SGD one launch per tensor", "per-sample step fused (sgd), B=1", "batched step fused (sgd)",
              "torch eager step (adamw)", "train step fused (adamw) vs torch"):
        add(s, v, "V8192 E256 H1024 B512")
    s = "step4_gpt2"
    for m, shape in (("c_attn", "2304x768"), ("attn c_proj", "768x768"), ("c_fc", "3072x768"),
                     ("mlp c_proj", "768x3072"), ("LM head", "50257x768")):
        for v in ("b=1 v3", "b=1 v4", "b=1 v5 ROWS=1", "b=1 v5 ROWS=2", "b=1 v5 ROWS=4", "b=1 v5 ROWS=2 UNROLL=2",
                  "b=8 v4", "b=8 v5 ROWS=1", "b=8 v5 ROWS=4"):
            add(s, f"GEMV {m} {v}", shape)
    for b in (1, 8):
        for L in (9, 128, 263):
            for v in (1, 2):
                add(s, f"decode attention v{v} b={b} L={L}", "cache 263")
    for v in ("decode b=1 (CUDA graph)", "decode b=1 (eager launches)", "decode b=1 HF generate (anchor)",
              "decode b=8 (CUDA graph)", "decode b=8 (eager launches)", "decode b=8 HF generate (anchor)"):
        add(s, v, "124M, 256 tok", rate=2161.0, unit="tok/s", ceiling="weight-bw bound", fraction=0.25,
            anchor="HF generate eager", ratio=9.5)
    for b in (1, 8):
        for ctx in (9, 128, 263):
            for v in ("fused attn v1", "fused attn v2", "split attn v1", "split attn v2"):
                add(s, f"step replay b={b} {v} ctx={ctx}", f"b={b}, {ctx} cached", anchor="best", ratio=0.85)
        for v in ("all choices on", "attention v2 only", "no host pipelining", "no graph/state reuse"):
            add(s, f"A/B generate b={b}: {v}", "124M, 256 tok")
    add(s, "prefill 8x1024 (ours)", "8x1024", anchor="HF eager", ratio=1.45)
    add(s, "HF eager prefill", "8x1024")
    for v in ("decode step, eager", "decode step, CUDA graph", "launch overhead removed by the graph"):
        add(s, v, "per step")
    for part in ("embedding", "ln_1 + qkv GEMV", "decode attention", "attn proj", "ln_2 + fc", "mlp proj", "ln_f"):
        add(s, f"  {part}: eager", "per step")
        add(s, f"  {part}: in graph", "per step")
    s = "step4_gpt2:train"
    size = "6L C384 B64 T256"
    for v in ("ours (tok/s)", "ours: host time to queue it", "ours, CUDA graph, one stream (tok/s)",
              "ours, CUDA graph, cuBLAS memsets in place (tok/s)", "ours, CUDA graph (tok/s)",
              "ours, CUDA graph: host time to queue it", "CUDA graph vs one stream",
              "CUDA graph vs cuBLAS memsets in place", "torch eager (tok/s)", "ours vs torch eager",
              "ours (graph) vs torch eager", "torch.compile (tok/s)", "ours vs torch.compile",
              "ours (graph) vs torch.compile"):
        add(s, f"train step, {v}", size, rate=1.5e6, unit="tok/s", anchor="torch eager", ratio=1.5,
            target="ratio >= 1.5")
    for v in ("whole training step (ours, one CUDA graph)", "whole step, host clock from idle", "forward GEMMs",
              "input-gradient GEMMs (dx)", "weight-gradient GEMMs (dW), one GEMM each", "all GEMMs (cuBLAS)",
              "attention forward v3 (saves lse)", "attention backward v3", "LayerNorm forward (+residual)",
              "LayerNorm backward", "bias + GELU forward and backward", "bias gradients (column sums)",
              "embeddings forward + backward", "fused classifier", "grad-norm clip + AdamW (one launch)",
              "sum of the pieces"):
        add(s, v, size, fraction=0.1, ceiling="of the step")
    for T, B in ((256, 64), (1024, 16)):
        sz = f"B{B} H6 T{T} D64"
        for v in (1, 2, 3):
            add(s, f"attention forward v{v} T={T}", sz)
            add(s, f"attention backward v{v} T={T}", sz, anchor="v1 (materialised)", ratio=2.4)
        for v in (f"torch SDPA forward T={T}", f"torch SDPA backward T={T}", f"attention forward v3 vs torch T={T}",
                  f"attention backward v3 vs torch T={T}"):
            add(s, v, sz, anchor="torch SDPA fp32", ratio=1.4)
        for split in ("2 (cvt.rna)", "1 (integer rounding)", "0 (small part truncated)"):
            for part in ("forward", "backward kernels"):
                add(s, f"attention v3 {part}, split {split} T={T}", sz)
    s = "step4_gpt2:train_bf16"             # step4_gpt2/train/benchmarks_bf16.py's names
    for label, shape, B, T in (("shakespeare_char", "6L C384 V65", 64, 256), ("GPT-2 124M", "12L C768 V50257", 16,
                                                                             1024)):
        size = f"{label}: {shape} B{B} T{T}"
        for v in ("ours fp32, CUDA graph", "ours bf16, CUDA graph", "ours bf16 + recompute, CUDA graph",
                  "torch autocast bf16 eager", "torch.compile autocast bf16"):
            add(s, f"train step, {v} (tok/s)", size, rate=1.5e6, unit="tok/s")
        for anchor, target in (("ours fp32", ""), ("torch autocast bf16 eager", "ratio >= 1.5"),
                               ("torch.compile autocast bf16", "ratio >= 1")):
            add(s, f"train step, ours bf16 vs {anchor}", size, rate=1.5e6, unit="tok/s", anchor=anchor, ratio=1.6,
                target=target)
        add(s, "train step, bf16 + recompute vs bf16 (time paid)", size, rate=1.4e6, unit="tok/s",
            anchor="ours bf16", ratio=0.93)
        for v in ("fp32", "bf16", "bf16 + recompute"):
            add(s, f"activations kept, {v} (MB)", f"{label}: B{B} T{T}", rate=900.0, unit="MB",
                anchor="bf16's bytes" if v.endswith("recompute") else "", ratio=1.4 if v.endswith("recompute")
                else None)
    s = "step4_gpt2:megakernel"
    for b in (1, 8):
        for ctx in (32, 991):
            sz = f"124M, b={b}, ctx {ctx}"
            for v in ("eager launches", "CUDA graph", "megakernel v1", "megakernel v2",
                      "megakernel v2, all steps in one launch", "transformers generate"):
                add(s, f"decode {v}", sz, rate=3000.0, unit="tok/s", ceiling="weight-bw bound", fraction=0.5,
                    anchor="CUDA graph", ratio=1.47)
            add(s, "decode best megakernel vs transformers", sz, anchor="transformers generate", ratio=40.0)
    add(s, "decode b=1 best megakernel: bandwidth", "124M, b=1, ctx 32", target="fraction >= 0.5")
    add(s, "decode b=1 best megakernel: vs graph", "124M, b=1, ctx 32", anchor="CUDA graph", ratio=1.47,
        target="ratio >= 2")
    for t in ("384 unroll=3", "512 unroll=3", "384 unroll=4"):
        add(s, f"megakernel v2 threads={t}", "124M, b=1, ctx 32")
    for v in (1, 2):
        for ctx in (32, 1000):
            add(s, f"timeline v{v}: whole step", f"b=1, ctx {ctx}")
            for stage in ("QKV", "attention", "attn proj", "mlp", "LM head"):
                add(s, f"  v{v} {stage}: waiting", f"b=1, ctx {ctx}")
                add(s, f"  v{v} {stage}: working", f"b=1, ctx {ctx}")
    for v in ("one block to another", "grid-wide barrier", "L2 round trip"):
        add(s, f"hop: {v}", "2 of the grid's blocks")
    for v in ("CUDA graph, GPT-2", "megakernel, GPT-2", "CUDA graph, every layer = layer 0",
              "megakernel, every layer = layer 0", "megakernel, every layer = layer 0, kept in L2"):
        add(s, f"floor: {v}", "124M, b=1, ctx 32", anchor="CUDA graph on GPT-2", ratio=1.7)
    s = "step4_gpt2:torch_ops"
    for m in ("torch eager", "torch.compile", "torch, CUDA graph", "course ops", "course ops, torch.compile",
              "course ops, CUDA graph"):
        add(s, f"torch GPT step, {m} (tok/s)", size, rate=6e5, unit="tok/s")
    for ours, anchor in (("course ops, CUDA graph", "torch eager"), ("course ops, CUDA graph", "torch.compile"),
                         ("course ops, CUDA graph", "torch, CUDA graph"), ("course ops", "torch eager"),
                         ("course ops, torch.compile", "torch.compile")):
        add(s, f"torch GPT step, {ours} vs {anchor}", size, rate=6e5, unit="tok/s", anchor=anchor, ratio=1.3)
    s = "step4_gpt2:parallel"
    for w in (2, 4):
        add(s, f"all-reduce {w} GPUs", "1 GiB", 6.5, 330.0, "GB/s")
        add(s, f"all-reduce {w} GPUs", "1 KiB", 0.02)
        add(s, f"all-reduce fit {w} GPUs", "1 KiB .. 1 GiB", 0.02, 330.0, "GB/s")
    for size in ("6L C384 B64/GPU T256", "12L C768 B4/GPU T1024"):
        add(s, "data parallel 1 GPU", size, 40.0, 4e5, "tok/s")
        for w in (2, 4):
            if size.startswith("6L"):                    # the bucket sweep, at the first size
                for mb in ("1 MB buckets", "4 MB buckets", "25 MB buckets", "best bucket 25 MB"):
                    add(s, f"data parallel {w} GPUs, {mb}", size, 42.0, 7.6e5, "tok/s", "of the step exposed", 0.05,
                        "1 GPU", 1.9)
            for v in ("data parallel", "ZeRO-1"):
                add(s, f"{v} {w} GPUs", size, 42.0, 7.6e5, "tok/s", "of the step exposed", 0.05, "1 GPU", 1.9,
                    "ratio >= 1.9")
            add(s, f"ZeRO-1 AdamW state per GPU, {w} GPUs", size, 42.0, 475.0, "MiB", "of one GPU's", 1 / w,
                target=f"fraction <= {1.01 / w:g}")
    for w in (2, 4):
        add(s, f"loss over 20 steps, {w} GPUs vs 1 GPU", "shakespeare_char B64 T256", 12.0, 1.2, "ppm",
            target="rate <= 10")
    for size, worlds in (("6L C384 B64 T256", (2,)), ("12L C768 B8 T1024", (2, 4))):
        add(s, "tensor parallel step 1 GPU", size, 40.0, 4e5, "tok/s")
        for w in worlds:
            add(s, f"tensor parallel all-reduces {w} GPUs, transfer", size, 3.0, anchor="napkin prediction", ratio=0.9,
                target="ratio >= 0.8 and ratio <= 1.33333")
            add(s, f"tensor parallel all-reduces {w} GPUs, waiting", size, 1.0, ceiling="of the time in all-reduces",
                fraction=0.25)
            add(s, f"tensor parallel step {w} GPUs", size, 30.0, 5e5, "tok/s", "in all-reduces", 0.1, "1 GPU", 1.3)
    s = "step4_gpt2:precision"                # step4_gpt2/precision/benchmarks.py's names
    for label in ("124M", "XL 1.5B"):
        for b in (1, 8):
            for p in ("fp32", "bf16", "int8"):
                for how in ("CUDA graph", "CUDA graph + PDL"):
                    add(s, f"decode {p} b={b} ({how})", f"{label}, 64 tok", 0.4, 2500.0, "tok/s",
                        f"{p} weight-bw bound", 0.3, "" if how == "CUDA graph" else "CUDA graph", 1.05)
                if p != "fp32":
                    add(s, f"decode {p} b={b} (CUDA graph + PDL) vs fp32", label, 0.4, 2500.0, "tok/s",
                        anchor=f"fp32 b={b} (CUDA graph + PDL)", ratio=0.9)
            add(s, f"decode HF bf16 generate (no compile) b={b}", f"{label}, 64 tok", 7.0, 140.0, "tok/s")
            add(s, f"decode bf16 b={b} vs HF bf16 (no compile)", label, 0.46, 2150.0, "tok/s",
                anchor="HF bf16 no compile", ratio=15.0)
        for p in ("bf16", "int8"):
            add(s, f"decode {p} b=1 vs fp32", label, 0.46, 2150.0, "tok/s", anchor="fp32 b=1", ratio=0.9,
                target="ratio >= 1.8")
            add(s, f"decode {p} b=1: bandwidth", label, 0.46, 2150.0, "tok/s", f"{p} weight-bw bound", 0.2,
                target="fraction >= 0.7")
    for p in ("fp32", "bf16", "int8"):
        add(s, f"perplexity {p} (4b char model)", "held-out plays", 900.0, 3.92, "ppl")
        if p != "fp32":
            add(s, f"perplexity change {p} vs fp32 (4b char model)", "held-out plays", 900.0, 0.002, "%")
            add(s, f"top-1 agreement {p} vs fp32 (4b char model)", "held-out plays", 900.0, 99.5, "%")
    s = "step4_gpt2:megakernel"
    for p in ("fp32", "bf16", "int8"):
        for v in ("CUDA graph", "megakernel v2", "megakernel v2, all steps in one launch"):
            add(s, f"decode {p} {v}", "XL 1.5B, b=1, ctx 32", 2.0, 490.0, "tok/s", f"{p} weight-bw bound", 0.36,
                "" if v == "CUDA graph" else f"{p} CUDA graph", 1.45)
        if p != "fp32":
            add(s, f"decode {p} best rung vs fp32", "XL 1.5B, b=1, ctx 32", 2.0, 490.0, "tok/s",
                anchor="fp32 CUDA graph", ratio=1.5)
            add(s, f"decode {p} best rung: bandwidth", "XL 1.5B, b=1, ctx 32", 2.0, 490.0, "tok/s",
                f"{p} weight-bw bound", 0.36)
    add(s, "L2 round trip (dependent loads)", "one load", 0.0008)
    device = {"name": "NVIDIA Test GPU 9000", "sm": 90, "multiprocessors": 132, "l2_bytes": 50 * 2 ** 20,
              "cupy_version": "14.2.0"}
    return {"device": device, "date": "2031-02-03", "copy_bandwidth_gbps": 3008.5, "rows": rows, "failed": []}


def test_results_page_from_a_runs_json(tmp_path):
    from common.benchmarks import NOTES, SECTIONS, results_page
    result = _run_json()
    assert len(result["rows"]) > 430
    page = results_page(result)
    lines = page.splitlines()
    assert len(lines) <= RESULTS_LINES, f"{len(lines)} lines for {len(result['rows'])} rows"
    assert page.count("NVIDIA Test GPU 9000") == 1 and page.count("2031-02-03") == 1 and page.count("3,008") == 1
    assert "target" not in page.lower() and ">=" not in page
    for r in result["rows"]:
        assert r["name"].strip().replace("|", "\\|").replace("<", "&lt;") in page, r["name"]
    assert "0.76× cuBLAS (slower)" in page and "2.30× CuPy" in page
    assert "1.00× cuBLAS (slower)" not in page
    assert page.count("\n## ") == len(SECTIONS)
    assert "unavailable" in page                       # a row whose time is NaN
    assert not history_in(page)
    # every row has a note, and the notes hold words, not numbers
    from common.benchmarks import note_of, section_of
    unnoted = [r["name"] for r in result["rows"] if note_of(section_of(r), r["name"])[0] < 0]
    assert not unnoted, unnoted
    quantity = re.compile(r"\d+(\.\d+)?\s*(%|×|x\b|ms|µs|us|ns|GB|MB|KB|TFLOP|tok/s)")
    for section, notes in NOTES.items():
        for _, text in notes:
            assert not quantity.search(text) and "target" not in text.lower(), (section, text)


def test_readme_block_and_the_command_without_a_gpu(tmp_path):
    from common.benchmarks import README_BEGIN, README_END
    run = tmp_path / "run.json"
    run.write_text(json.dumps(_run_json()))
    readme = tmp_path / "README.md"
    readme.write_text(f"# Course\n\nintro\n\n{README_BEGIN}\nold table\n{README_END}\n\nafter\n")
    page = tmp_path / "results.md"
    r = subprocess.run([sys.executable, "-m", "common.benchmarks", "--from-json", str(run), "--markdown", str(page),
                        "--readme", str(readme)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    text = readme.read_text()
    assert "old table" not in text and text.startswith("# Course\n\nintro") and text.endswith("after\n")
    block = text[text.index(README_BEGIN):text.index(README_END)]
    assert block.count("NVIDIA Test GPU 9000") == 1 and block.count("2031-02-03") == 1
    assert "| 4c |" in block and "| 1 |" in block and "target" not in block.lower()
    assert page.read_text().count("2031-02-03") == 1
    # bad input: a clear error naming the argument, nothing written
    r = subprocess.run([sys.executable, "-m", "common.benchmarks", "--from-json", str(tmp_path / "nope.json"),
                        "--markdown", str(tmp_path / "x.md")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--from-json" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x.md").exists()
    readme.write_text("no markers")
    r = subprocess.run([sys.executable, "-m", "common.benchmarks", "--from-json", str(run), "--readme", str(readme)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--readme" in r.stderr and readme.read_text() == "no markers"


def test_benchmarks_help_writes_nothing(tmp_path):
    r = subprocess.run([sys.executable, "-m", "common.benchmarks", "--help"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "--markdown" in r.stdout and "--from-json" in r.stdout
    assert "target" not in r.stdout.lower() and list(tmp_path.iterdir()) == []


def test_the_results_pages_are_what_the_generator_makes_of_the_committed_run():
    """docs/results.md and the README's table are generated from docs/results.json (one benchmark run on one
    device), never edited by hand: regenerate with
    `python -m common.benchmarks --from-json docs/results.json --markdown docs/results.md --readme README.md`."""
    from common.benchmarks import README_BEGIN, README_END, load_result, readme_table, results_page
    result = load_result(str(ROOT / "docs" / "results.json"))
    assert not result["failed"], f"the committed run has failed families: {result['failed']}"
    assert (ROOT / "docs" / "results.md").read_text() == results_page(result) + "\n", "docs/results.md is stale"
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index(README_BEGIN) + len(README_BEGIN):readme.index(README_END)]
    assert block.strip() == readme_table(result).strip(), "README's results table is stale"


def test_the_cpu_test_counts_are_stated_and_agree():
    """An instructor without a GPU is told what `pytest` reports there; the README and docs/environment.md say
    the same numbers."""
    counts = re.compile(r"(\d[\d,]*) passed, (\d[\d,]*) skipped")
    found = {p: counts.findall((ROOT / p).read_text()) for p in ("README.md", "docs/environment.md")}
    assert all(found.values()), f"no 'N passed, M skipped' in {[p for p, f in found.items() if not f]}"
    assert len({tuple(f) for f in found.values()}) == 1, found
    for p in found:
        assert "CPU_TEST_COUNTS" not in (ROOT / p).read_text(), f"{p}: the counts placeholder was left in"
