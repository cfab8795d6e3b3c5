"""common.sanitize, on the CPU: compute-sanitizer on one exercise's check from a notebook (docs/debugging.md,
section 2). What needs a GPU (the sanitizer really running, racecheck finding find_bug_sync's race) is in
tests/test_exercises_find_bug.py; here the sanitizer and the GPU are stood in for: the arguments, the messages
without either, the child's command line, the report reader on compute-sanitizer's printed form, and that
tests/sanitize.py (which imports find_sanitizer from here) still answers --help."""
import subprocess
import sys

import pytest

import common.sanitize  # noqa: F401  (the module; common/__init__ may export its function under this name)
from common import exercises as E
from common.kernels import ROOT

sanitize = sys.modules["common.sanitize"]
EX = "step3/find_bug_sync"
FAKE = ["/opt/fake/compute-sanitizer", "--injection-path", "/opt/fake/lib"]

# compute-sanitizer's printed form (its documentation's examples, with the lines this exercise would name)
RACECHECK_RACE = """\
========= COMPUTE-SANITIZER
step3/find_bug_sync: find the bug: LayerNorm with one block per row (compute-sanitizer's racecheck)
file: /home/me/course/my_exercises/step3/find_bug_sync.cu
========= Error: Race reported between Write access at block_total(float, float *)+0x2a0 in find_bug_sync.cu:45
=========     and Read access at block_total(float, float *)+0x2f0 in find_bug_sync.cu:47 [224 hazards]
=========
========= Warning: Race reported between Read access at layernorm_rows+0x1b0 in find_bug_sync.cu:47
=========     and Write access at layernorm_rows+0x150 in find_bug_sync.cu:41 [7 hazards]
=========
  case                       result  detail
  1 x 1                      PASS    max abs error 0.00e+00
  37 x 1000                  FAIL    y: first mismatch at (0, 32): got 0.31, expected 1.2 (36000 of 37000 wrong)
step3/find_bug_sync: FAIL (3 of 5 cases pass)
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
"""
RACECHECK_CLEAN = """\
========= COMPUTE-SANITIZER
step3/find_bug_sync: PASS - every case matches the float64 reference
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""
MEMCHECK_OOB = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ write of size 4 bytes
=========     at axpb_v1+0x90 in axpb.cu:12
=========     by thread (232,0,0) in block (3,0,0)
=========     Address 0x7f6510c00fa0 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7f6510c00000 of size 4000 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========     Host Frame: [0x2dcdbf]
=========                in /usr/lib/x86_64-linux-gnu/libcuda.so.1
=========
========= Invalid __global__ write of size 4 bytes
=========     at axpb_v1+0x90 in axpb.cu:12
=========     by thread (233,0,0) in block (3,0,0)
=========     Address 0x7f6510c00fa4 is out of bounds
=========
========= ERROR SUMMARY: 24 errors
"""
MEMCHECK_CLEAN = "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"
MEMCHECK_NO_LINEINFO = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 4 bytes
=========     at layernorm_rows+0x1c0
=========     by thread (0,0,0) in block (2,0,0)
=========
========= ERROR SUMMARY: 1 error
"""
NO_GPU = ("========= COMPUTE-SANITIZER\n========= Error: Target application terminated before first instrumented "
          "API call\n========= Error: couldn't find exit code.\n")


# ---------------------------------------------------------------------------------------- the one way
def test_tests_sanitize_uses_the_course_helper():
    sys.path.insert(0, str(ROOT / "tests"))
    import sanitize as script                                   # tests/sanitize.py, as tests/test_install does
    assert script.find_sanitizer is sanitize.find_sanitizer
    from tests.sanitize import find_sanitizer                   # the command in find_bug_sync.cu's header
    assert find_sanitizer is sanitize.find_sanitizer
    assert "def find_sanitizer" not in (ROOT / "tests" / "sanitize.py").read_text()


def test_tests_sanitize_still_answers_help(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "sanitize.py"), "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and "usage:" in r.stdout and "racecheck" in r.stdout, r.stdout + r.stderr


def test_missing_sanitizer_is_a_system_exit_with_the_install_line(monkeypatch):
    monkeypatch.setattr(sanitize.shutil, "which", lambda name: None)
    monkeypatch.setattr(sanitize.Path, "is_file", lambda self: False)
    monkeypatch.setattr(sanitize.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="nvidia-cuda-sanitizer-api-cu12"):
        sanitize.find_sanitizer()


def test_sanitizer_command_puts_the_options_before_the_program(monkeypatch):
    monkeypatch.setattr(sanitize, "find_sanitizer", lambda: list(FAKE))
    cmd = sanitize.sanitizer_command("racecheck", ["python", "x.py"], print_limit=5,
                                     extra=("--target-processes", "all"))
    assert cmd == [*FAKE, "--tool", "racecheck", "--error-exitcode", "99", "--print-limit", "5",
                   "--target-processes", "all", "python", "x.py"]


# ------------------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize("tool", ["race", "Memcheck", "", None])
def test_unknown_tool_is_a_clear_error(tool):
    with pytest.raises(ValueError, match=r"tool: expected one of memcheck, racecheck, initcheck, synccheck"):
        sanitize.sanitize(EX, tool=tool)


def test_unknown_exercise_is_a_clear_error():
    with pytest.raises(ValueError, match=r"exercise_id: expected one of .*step3/find_bug_sync"):
        sanitize.sanitize("step3/find_bug_snyc", tool="racecheck")


@pytest.mark.parametrize("kw", [{"show": -1}, {"show": 1.5}, {"timeout": 0}, {"timeout": "60"}])
def test_bad_show_or_timeout_is_a_clear_error(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        sanitize.sanitize(EX, tool="racecheck", **kw)


def test_a_path_that_is_no_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a file"):
        sanitize.sanitize(EX, tool="racecheck", path=tmp_path / "nothing.cu")


# ------------------------------------------------------------------------- without a sanitizer or GPU
def _no_sanitizer():
    raise sanitize.SanitizerMissing("compute-sanitizer not found")


def test_without_the_sanitizer_one_line_and_none(monkeypatch, capsys):
    monkeypatch.setattr(sanitize, "find_sanitizer", _no_sanitizer)
    monkeypatch.setattr(subprocess, "Popen", _refuse)
    assert sanitize.sanitize(EX, tool="racecheck", path=ROOT / E.exercise(EX).stub) is None
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sanitize: compute-sanitizer is not installed"), lines
    assert "pip install nvidia-cuda-sanitizer-api-cu12" in lines[0] and "requirements-dev.txt" in lines[0]


def test_without_a_gpu_one_line_and_none(monkeypatch, capsys):
    import common.device
    monkeypatch.setattr(sanitize, "find_sanitizer", lambda: list(FAKE))
    monkeypatch.setattr(common.device, "gpu_available", lambda: False)
    monkeypatch.setattr(subprocess, "Popen", _refuse)
    assert sanitize.sanitize(EX, tool="memcheck", path=ROOT / E.exercise(EX).stub) is None
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sanitize: running it needs an NVIDIA GPU"), lines


def _refuse(*a, **k):
    raise AssertionError("no child process may start here")


# ---------------------------------------------------------------------------------- the child's command
class _FakePopen:
    """Stands in for subprocess.Popen: records the command, answers with canned output."""
    calls: list = []
    stdout_text, returncode = "", 0

    def __init__(self, cmd, **kw):
        _FakePopen.calls.append((cmd, kw))
        self.pid, self.returncode = 4242, _FakePopen.returncode

    def communicate(self, timeout=None):
        return _FakePopen.stdout_text, ""


@pytest.fixture
def fake_run(monkeypatch, tmp_path):
    import common.device
    monkeypatch.setattr(sanitize, "find_sanitizer", lambda: list(FAKE))
    monkeypatch.setattr(common.device, "gpu_available", lambda: True)
    monkeypatch.setattr(subprocess, "Popen", _FakePopen)
    monkeypatch.setenv("COURSE_EXERCISES_DIR", str(tmp_path / "mine"))
    _FakePopen.calls = []
    return _FakePopen


def test_the_child_runs_the_learners_copy_under_the_tool(fake_run, capsys):
    E.start(EX)                                           # the learner's working copy, under tmp_path
    mine = E.working_copy(EX)
    fake_run.stdout_text, fake_run.returncode = RACECHECK_RACE, 99
    r = sanitize.sanitize(EX, tool="racecheck", timeout=120)
    (cmd, kw), = fake_run.calls
    assert cmd[:len(FAKE)] == FAKE
    opts = cmd[len(FAKE):cmd.index(sys.executable)]
    assert opts[opts.index("--tool") + 1] == "racecheck" and opts[opts.index("--error-exitcode") + 1] == "99"
    assert "--print-limit" in opts and opts[opts.index("--show-backtrace") + 1] == "device"
    py = cmd[cmd.index(sys.executable):]
    assert py[1] == "-c" and len(py) == 3
    code = py[2]
    assert f"check('{EX}', path={str(mine.resolve())!r}, timing=False, timeout_s=120.0)" in code
    assert "'--generate-line-info'" in code and "set_allocator(None)" in code
    compile(code, "<child>", "exec")
    assert kw["cwd"] == ROOT and kw.get("start_new_session") is True and str(ROOT) in kw["env"]["PYTHONPATH"]
    assert r is not None and r.errors == 1 and r.warnings == 1 and r.hazards == 2 and not r.passed
    assert r.check_passed is False and r.exit_code == 99 and r.path == str(mine.resolve())
    assert r.locations == ["find_bug_sync.cu:45", "find_bug_sync.cu:47", "find_bug_sync.cu:41"]
    out = capsys.readouterr().out
    assert "racecheck: 2 hazards reported (1 error, 1 warning); its 2 reports:" in out
    assert "find_bug_sync.cu:45" in out and "the check under racecheck: FAIL" in out
    assert len(out.splitlines()) <= 20, out


def test_a_clean_run_reports_no_hazards(fake_run, capsys):
    fake_run.stdout_text, fake_run.returncode = RACECHECK_CLEAN, 0
    path = ROOT / E.exercise(EX).solution
    r = sanitize.sanitize(EX, tool="racecheck", path=path)
    assert r.passed and r.errors == 0 and r.check_passed is True and r.reports == []
    assert "racecheck: no hazards reported" in capsys.readouterr().out
    assert f"path={str(path.resolve())!r}" in fake_run.calls[0][0][-1]


def test_no_working_copy_sanitizes_the_file_as_shipped(fake_run, capsys):
    fake_run.stdout_text = MEMCHECK_CLEAN
    r = sanitize.sanitize(EX, tool="memcheck")
    assert r.path == str((ROOT / E.exercise(EX).stub).resolve()) and r.passed
    assert "sanitizing the file as shipped" in capsys.readouterr().out


def test_a_run_without_a_summary_is_one_line_and_none(fake_run, capsys):
    fake_run.stdout_text, fake_run.returncode = NO_GPU, 255
    assert sanitize.sanitize(EX, tool="racecheck", path=ROOT / E.exercise(EX).stub) is None
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("sanitize: the sanitized run failed") and "exit 255" in last, last


def test_a_run_past_the_timeout_is_stopped_and_says_so(monkeypatch, fake_run, capsys):
    killed = []

    def hang(self, timeout=None):
        if not killed:
            raise subprocess.TimeoutExpired("compute-sanitizer", timeout)
        return "", ""

    monkeypatch.setattr(_FakePopen, "communicate", hang)
    monkeypatch.setattr(sanitize.os, "killpg", lambda pid, sig: killed.append(pid))   # common.profile's os, too
    assert sanitize.sanitize(EX, tool="racecheck", path=ROOT / E.exercise(EX).stub, timeout=5) is None
    assert killed == [4242]
    assert "did not finish within 5 s and was stopped" in capsys.readouterr().out


# ------------------------------------------------------------------------------------- the report reader
def test_parse_racecheck_race():
    rep = sanitize.parse_report(RACECHECK_RACE)
    assert (rep.errors, rep.warnings, rep.hazards) == (1, 1, 2)
    assert len(rep.reports) == 2
    assert rep.reports[0][0].startswith("Error: Race reported between Write access at block_total")
    assert rep.reports[0][1].strip().startswith("and Read access at") and "[224 hazards]" in rep.reports[0][1]
    assert rep.locations == ["find_bug_sync.cu:45", "find_bug_sync.cu:47", "find_bug_sync.cu:41"]
    assert not any("case" in line or "PASS" in line for r in rep.reports for line in r), "program output is skipped"


def test_parse_racecheck_clean():
    rep = sanitize.parse_report(RACECHECK_CLEAN)
    assert (rep.errors, rep.warnings, rep.hazards, rep.reports) == (0, 0, 0, [])


def test_parse_memcheck_errors_without_the_host_backtrace():
    rep = sanitize.parse_report(MEMCHECK_OOB)
    assert rep.errors == 24 and rep.hazards is None and len(rep.reports) == 2
    first = rep.reports[0]
    assert first[0] == "Invalid __global__ write of size 4 bytes"
    assert any("by thread (232,0,0) in block (3,0,0)" in line for line in first)
    assert not any("Host Frame" in line or "libcuda" in line or "backtrace" in line for line in first), first
    assert rep.locations == ["axpb.cu:12"]


def test_parse_memcheck_clean_and_singular():
    assert sanitize.parse_report(MEMCHECK_CLEAN).errors == 0
    rep = sanitize.parse_report(MEMCHECK_NO_LINEINFO)
    assert rep.errors == 1 and rep.locations == [] and rep.reports[0][1].strip() == "at layernorm_rows+0x1c0"


def test_parse_no_summary_is_none():
    rep = sanitize.parse_report(NO_GPU)
    assert rep.errors is None and rep.reports


def test_printed_summary_without_line_info_says_so(capsys):
    rep = sanitize.parse_report(MEMCHECK_NO_LINEINFO)
    r = sanitize.SanitizeResult(EX, "memcheck", "x.cu", rep.errors, rep.warnings, rep.hazards, rep.reports,
                                rep.locations, 99, None, MEMCHECK_NO_LINEINFO)
    sanitize._print(r, show=3)
    out = capsys.readouterr().out
    assert "memcheck: 1 error; the report:" in out and "without line information" in out
    assert "SanitizeResult('step3/find_bug_sync', memcheck: 1 error, 0 warnings; the check: no verdict)" == repr(r)


def test_warnings_alone_pass_but_are_shown(capsys):
    text = RACECHECK_RACE.replace("Error: Race", "Warning: Race").replace("(1 error, 1 warning)",
                                                                          "(0 errors, 2 warnings)")
    rep = sanitize.parse_report(text)
    r = sanitize.SanitizeResult(EX, "racecheck", "x.cu", rep.errors, rep.warnings, rep.hazards, rep.reports,
                                rep.locations, 0, False, text)
    assert r.passed
    sanitize._print(r, show=1)
    out = capsys.readouterr().out
    assert "racecheck: 2 hazards reported (0 errors, 2 warnings); the first 1 of 2 reports:" in out
    assert "Warning: Race reported between Write access" in out and "and Read access" in out


# ---------------------------------------------------------------------------------------------- on the GPU
def _line_of(path, text: str) -> str:
    lines = (ROOT / path).read_text().splitlines()
    return f"{(ROOT / path).name}:{next(i + 1 for i, line in enumerate(lines) if text in line)}"


@pytest.mark.gpu
def test_on_a_gpu_racecheck_names_the_race_lines_and_finds_none_in_the_fix():
    try:
        sanitize.find_sanitizer()
    except SystemExit as e:
        pytest.skip(str(e))
    ex = E.exercise(EX)
    bad = sanitize.sanitize(EX, tool="racecheck", path=ROOT / ex.stub)
    assert bad is not None and bad.errors >= 1 and not bad.passed and bad.check_passed is False, bad
    racing = {_line_of(ex.stub, "if (lane == 0) red[0] = v;"), _line_of(ex.stub, "return red[0];")}
    assert racing & set(bad.locations), (bad.locations, racing, bad.output[-3000:])
    good = sanitize.sanitize(EX, tool="racecheck", path=ROOT / ex.solution)
    assert good is not None and good.passed and good.check_passed is True, good.output[-3000:]
    mem = sanitize.sanitize(EX, tool="memcheck", path=ROOT / ex.solution)
    assert mem is not None and mem.passed and mem.check_passed is True, mem.output[-3000:]
