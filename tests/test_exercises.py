"""The exercises are trustworthy: every stub and solution compiles for every arch; the working copies never
touch the shipped stubs; and on a GPU the checker says FAIL for the stub as shipped, PASS for the solution
and FAIL for every planted bug of tests/exercise_bugs (mistakes a careless learner would make)."""
import hashlib
import os

import numpy as np
import pytest

from common import exercises as E
from common.kernels import ARCHS, ROOT, compile_offline, supported_archs
from tests.exercise_bugs import BUGS, bugged_copy as _bugged

IDS = list(E.registry())
BUG_CASES = [(i, b[0]) for i in IDS for b in BUGS.get(i, [])]
gpu = pytest.mark.gpu


def _sha(path) -> str:
    return hashlib.sha256((ROOT / path).read_bytes()).hexdigest()


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """The learner's folder in a temporary place (never the repository's my_exercises/)."""
    monkeypatch.setenv("COURSE_EXERCISES_DIR", str(tmp_path / "mine"))
    return tmp_path / "mine"


# ------------------------------------------------------------------------------------------- registry
def test_registry_has_every_exercise():
    assert len(IDS) >= 16, IDS
    for step, n in (("step1", 4), ("step2", 5), ("step3", 5), ("step4", 2)):
        assert len(E.exercises(step)) >= n, (step, E.exercises(step))
    for ex in E.registry().values():
        assert (ROOT / ex.stub).is_file() and (ROOT / ex.solution).is_file(), ex.id
        assert ex.cases and ex.outputs and ex.kernels, ex.id
        assert "TODO" in (ROOT / ex.stub).read_text(), f"{ex.id}: the stub should say what is left to do"
        assert f'check("{ex.id}")' in (ROOT / ex.stub).read_text(), f"{ex.id}: the stub should say how to check it"
        assert BUGS.get(ex.id), f"{ex.id}: needs at least one planted bug in tests/exercise_bugs"


def test_unknown_exercise_is_a_clear_error():
    with pytest.raises(ValueError, match="exercise_id: expected one of"):
        E.check("step1/no_such_exercise")


# ---------------------------------------------------------------------------------------- compiling
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("which", ["stub", "solution"])
@pytest.mark.parametrize("ex_id", IDS)
def test_compiles(ex_id, which, arch):
    if arch not in supported_archs():
        if os.environ.get("CI"):
            pytest.fail(f"CI must check sm_{arch}, but this NVRTC supports only {supported_archs()}")
        pytest.skip(f"the installed NVRTC cannot target sm_{arch} (CUDA 13 dropped it); CI checks it with NVRTC 12.9")
    ex = E.exercise(ex_id)
    report = compile_offline(getattr(ex, which), arch, ex.defines)
    assert not report.warnings, "\n".join(report.warnings)
    assert set(ex.kernels) <= set(report.kernels), report.log
    spills = {k.name: k.spill_stores for k in report.kernels.values() if k.spill_stores or k.spill_loads}
    assert not spills, report.table()


@pytest.mark.parametrize("ex_id,bug", BUG_CASES)
def test_planted_bugs_apply_and_compile(tmp_path, ex_id, bug):
    path = _bugged(tmp_path, ex_id, bug)
    assert compile_offline(path, 80, E.exercise(ex_id).defines).kernels


# -------------------------------------------------------------------------------------- working copies
def test_start_copies_the_stub_and_never_overwrites(workdir, capsys):
    ex_id = "step1/scale_clamp"
    stub = E.exercise(ex_id).stub
    before = _sha(stub)
    path = E.start(ex_id)
    assert path == workdir / "step1" / "scale_clamp.cu"
    assert path.read_bytes() == (ROOT / stub).read_bytes()
    assert str(path) in capsys.readouterr().out
    assert (workdir / ".gitignore").read_text().strip().endswith("*"), "git must ignore the learner's folder"
    path.write_text(path.read_text() + "// my work\n")
    assert E.start(ex_id) == path and path.read_text().endswith("// my work\n"), "start must keep the learner's file"
    assert "left as it is" in capsys.readouterr().out
    assert _sha(stub) == before, "the shipped stub must never change"


def test_reset_puts_a_fresh_copy_back_and_keeps_a_backup(workdir):
    ex_id = "step2/softmax_warp"
    path = E.start(ex_id)
    path.write_text("my broken attempt\n")
    assert E.reset(ex_id) == path
    assert path.read_bytes() == (ROOT / E.exercise(ex_id).stub).read_bytes()
    assert path.with_name(path.name + ".bak").read_text() == "my broken attempt\n"
    E.reset("step3/adamw")                      # reset without a copy yet: just makes one
    assert E.working_copy("step3/adamw").is_file()


def test_working_copies_from_another_folder(workdir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = E.start("step4/gemv")
    assert path.is_absolute() and path.is_file() and path.parent == workdir / "step4"
    assert E.solution("step4/gemv") == ROOT / "step4_gpt2/exercises/solutions/gemv.cu"


def test_default_folder_is_in_the_repository(monkeypatch):
    monkeypatch.delenv("COURSE_EXERCISES_DIR", raising=False)
    assert E.work_dir() == ROOT / "my_exercises"
    assert E.working_copy("step1/block_max") == ROOT / "my_exercises" / "step1" / "block_max.cu"


# ---------------------------------------------------------------------------------------- comparing
def test_compare_reports_the_first_mismatch():
    ref = np.array([1.0, 2.0, -np.inf, 4.0])
    assert E.compare("c", np.array([1.0, 2.0, -np.inf, 4.0], np.float32), ref, 1e-6, 1e-6).passed
    r = E.compare("c", np.array([1.0, np.nan, -np.inf, 5.0], np.float32), ref, 1e-6, 1e-6)
    assert not r.passed and r.index == (1,) and np.isnan(r.got) and r.expected == 2.0 and "2 of 4 wrong" in r.detail
    assert not E.compare("c", np.array([1.0, 2.0, 0.0, 4.0]), ref, 1e-6, 1e-6).passed, "-inf must be matched"
    assert not E.compare("c", ref + 1e-3, ref, 1e-6, 1e-6).passed


# ----------------------------------------------------------------------------------- without a GPU
def test_check_without_gpu_compiles_and_says_a_gpu_is_needed(workdir, capsys):
    from common.device import gpu_available
    if gpu_available():
        pytest.skip("this machine has a GPU: the offline path is not taken")
    E.start("step1/scale_clamp")
    result = E.check("step1/scale_clamp")
    out = capsys.readouterr().out
    assert result.compiled and not result.ran and not result.passed
    assert "needs an NVIDIA GPU" in out and "registers" in out and "sm_90" in out


def test_check_reports_a_compile_error_without_raising(workdir, capsys):
    path = E.start("step1/scale_clamp")
    path.write_text(path.read_text().replace("// TODO: your code here", "    y[0] = undefined_name;"))
    result = E.check("step1/scale_clamp")
    out = capsys.readouterr().out
    assert not result.compiled and not result.passed
    assert "scale_clamp.cu:" in out and "error" in out and "y[0] = undefined_name;" in out


def test_check_reports_a_renamed_kernel_without_raising(workdir, capsys):
    path = E.start("step2/online_merge")
    path.write_text(path.read_text().replace("void merge_states(", "void merge_my_states("))
    result = E.check("step2/online_merge")
    assert not result.passed and "merge_states" in capsys.readouterr().out
    assert not result.ran             # offline: never runs; on a GPU: the kernel cannot be loaded


def test_check_of_a_missing_file_names_it(workdir):
    with pytest.raises(FileNotFoundError, match="nothing_here.cu"):
        E.check("step1/scale_clamp", path=workdir / "nothing_here.cu")


def test_check_before_start_checks_the_stub(workdir, capsys):
    result = E.check("step3/adamw")
    assert "no working copy yet" in capsys.readouterr().out and not result.passed
    assert result.path == str(ROOT / E.exercise("step3/adamw").stub)


# ---------------------------------------------------------------------------------------- on the GPU
def _skip_below_arch(ex_id):
    ex = E.exercise(ex_id)
    if ex.min_sm is not None:
        from common.device import device_info
        if device_info()["sm"] < ex.min_sm[0]:
            pytest.skip(f"{ex_id}: {ex.min_sm[1]} need sm_{ex.min_sm[0]}+ (this GPU: sm_{device_info()['sm']})")


@gpu
@pytest.mark.parametrize("ex_id", IDS)
def test_stub_as_shipped_fails(ex_id):
    _skip_below_arch(ex_id)
    result = E.check(ex_id, path=ROOT / E.exercise(ex_id).stub, timing=False)
    assert result.compiled and result.ran and not result.passed, result


@gpu
@pytest.mark.parametrize("ex_id", IDS)
def test_solution_passes_and_is_timed(ex_id):
    _skip_below_arch(ex_id)
    ex = E.exercise(ex_id)
    result = E.check(ex_id, path=ROOT / ex.solution)
    assert result.passed, [c for c in result.cases if not c.passed]
    if ex.speed is not None:
        assert result.timings["yours"].median_ms > 0
        if ex.speed.course is not None:
            assert "course" in result.timings, f"{ex_id}: the course's kernel could not be timed (see the output)"


@gpu
@pytest.mark.parametrize("ex_id,bug", BUG_CASES)
def test_planted_bug_fails(tmp_path, ex_id, bug):
    _skip_below_arch(ex_id)
    result = E.check(ex_id, path=_bugged(tmp_path, ex_id, bug), timing=False)
    assert result.compiled and result.ran and not result.passed, result


@gpu
def test_a_write_past_the_end_is_caught(tmp_path, capsys):
    result = E.check("step1/scale_clamp", path=_bugged(tmp_path, "step1/scale_clamp", "off_by_one"), timing=False)
    assert not result.passed and "past the end" in capsys.readouterr().out


@gpu
def test_a_kernel_that_does_not_finish_is_reported(tmp_path):
    import cupy as cp
    slow = tmp_path / "slow.cu"      # spins for 3 s on the GPU clock, then does the job: bounded, so it ends
    slow.write_text((ROOT / E.exercise("step1/scale_clamp").solution).read_text().replace(
        "    const long long i =",
        "    unsigned long long t0, t; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t0));\n"
        "    do { asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t)); } while (t - t0 < 3000000000ull);\n"
        "    const long long i =", 1))
    result = E.check("step1/scale_clamp", path=slow, timing=False, timeout_s=0.5)
    cp.cuda.runtime.deviceSynchronize()
    assert not result.passed and "did not finish" in result.cases[-1].detail and "restart" in result.message


@gpu
@pytest.mark.parametrize("ex_id,old,new", [
    ("step4/bias_gelu", "h[i] = gelu_tanh(h[i] + b[i % C]);", "h[i] = gelu_tanh(h[i]);"),
    ("step4/gemv", "total + (bias ? bias[n] : 0.0f)", "total"),
], ids=["bias_gelu-no_bias", "gemv-no_bias"])
def test_the_model_check_itself_catches_a_wrong_kernel(tmp_path, ex_id, old, new):
    """The swap really runs the learner's kernel in the model: a kernel that forgets the bias changes the
    logits (or tokens) enough for the model comparison alone to fail."""
    from common.kernels import get_kernel
    ex = E.exercise(ex_id)
    src = (ROOT / ex.solution).read_text()
    assert src.count(old) == 1
    path = tmp_path / "wrong.cu"
    path.write_text(src.replace(old, new))
    cases = ex.model(lambda name: get_kernel(path, name, ex.defines))
    assert cases and not all(c.passed for c in cases), cases
