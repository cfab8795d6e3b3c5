"""compute-sanitizer on one exercise's check, from a notebook: what memcheck or racecheck says about your kernel.

    from common.sanitize import sanitize
    r = sanitize("step3/find_bug_sync", tool="racecheck")   # your working copy (path= for another file)
    if r:                          # None, after one printed line, without the sanitizer or a GPU
        print(r.errors, r.passed)  # errors the sanitizer counted; passed: it found none

It runs `check(<id>, path=<your file>, timing=False)` in a child Python under compute-sanitizer, with a time
limit, and prints a short summary: how many errors (racecheck: hazards), the first reports with the file and
line of each access (the child compiles your kernel with NVRTC's `--generate-line-info` for this run only), and
what the check itself said. `print(r.output)` shows everything the sanitizer printed.

The tools: `memcheck` (out-of-bounds and misaligned accesses; the child turns CuPy's memory pool off, so each
array is an allocation of its own and memcheck sees where it ends), `racecheck` (shared-memory hazards between
threads of a block: a missing `__syncthreads()`), `initcheck` and `synccheck`. The sanitizer needs no CUDA
toolkit: the `nvidia-cuda-sanitizer-api-cu12` wheel (requirements-dev.txt) carries it; a toolkit's copy on
PATH is used first. tests/sanitize.py runs the course's own tests under it with the same `find_sanitizer`.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.kernels import ROOT

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
ERROR_EXITCODE = 99      # the sanitizer's exit status when it reported an error
TIMEOUT_S = 300.0        # the whole sanitized check: compiles and every case, 10-100x slower than without
HELP = "docs/debugging.md#2-crashes-cuda_launch_blocking-and-compute-sanitizer"
INSTALL = ("pip install nvidia-cuda-sanitizer-api-cu12 (requirements-dev.txt lists it), or put a CUDA toolkit's "
           "bin/ on PATH")


class SanitizerMissing(SystemExit):
    """compute-sanitizer is not installed (a SystemExit, so a script that cannot go on without it ends with the
    install line and no traceback)."""


def find_sanitizer() -> list[str]:
    """The compute-sanitizer command: from PATH or a CUDA toolkit, else from the PyPI wheel (whose binary
    needs the wheel's lib/ folder named as its injection path, and may be unpacked without its exec bit).
    Raises SanitizerMissing (a SystemExit) with the install line when there is none."""
    for c in (shutil.which("compute-sanitizer"), "/usr/local/cuda/bin/compute-sanitizer",
              "/opt/nvidia/compute-sanitizer/compute-sanitizer"):
        if c and Path(c).is_file():
            return [c]
    spec = importlib.util.find_spec("nvidia.cuda_sanitizer_api")
    for loc in (spec.submodule_search_locations if spec and spec.submodule_search_locations else []):
        exe = Path(loc) / "bin" / "compute-sanitizer"
        if exe.is_file():
            if not os.access(exe, os.X_OK):
                exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            return [str(exe), "--injection-path", str(Path(loc) / "lib")]
    raise SanitizerMissing(f"compute-sanitizer not found: {INSTALL}")


def sanitizer_command(tool: str, program: list[str], print_limit: int = 20, extra: tuple = ()) -> list[str]:
    """The command line that runs `program` (an argv list) under compute-sanitizer's `tool`: exit status
    ERROR_EXITCODE when it reports an error, at most `print_limit` reports printed."""
    _expect_tool(tool)
    return [*find_sanitizer(), "--tool", tool, "--error-exitcode", str(ERROR_EXITCODE),
            "--print-limit", str(int(print_limit)), *extra, *program]


def _expect_tool(tool) -> None:
    if tool not in TOOLS:
        raise ValueError(f"tool: expected one of {', '.join(TOOLS)}, got {tool!r}")


# ------------------------------------------------------------------------------------- reading the report
_PREFIX = re.compile(r"^=+ ?")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
_LOCATION = re.compile(r"([\w./+-]+\.(?:cu|cuh|h|hpp|cpp|c)):(\d+)")
_BACKTRACE = ("Saved host backtrace", "Host Frame", "Device Frame", "in /")   # a frame's library: "in /usr/lib/..."


@dataclass
class Report:
    """compute-sanitizer's text, read: the counts of its summary line(s) and its reports (each a list of lines,
    host backtraces left out), in the order printed."""
    errors: int | None = None          # None: no summary line (the sanitizer or the program failed)
    warnings: int = 0
    hazards: int | None = None         # racecheck: hazards displayed
    reports: list = field(default_factory=list)

    @property
    def locations(self) -> list[str]:
        """Every distinct file:line the reports name, in order (line info from the kernel's compile)."""
        out = []
        for rep in self.reports:
            for line in rep:
                for f, n in _LOCATION.findall(line):
                    loc = f"{Path(f).name}:{n}"
                    if loc not in out:
                        out.append(loc)
        return out


def parse_report(text: str) -> Report:
    """Read compute-sanitizer's output (lines starting with '========='; the program's own lines are skipped):
    a report is a block of such lines between empty ones; the summary is 'ERROR SUMMARY: N errors' (memcheck,
    initcheck, synccheck) or 'RACECHECK SUMMARY: H hazards displayed (E errors, W warnings)' (racecheck)."""
    rep = Report()
    block: list[str] = []

    def close():
        if block:
            rep.reports.append(list(block))
            block.clear()

    for raw in text.splitlines():
        if not raw.startswith("========="):
            continue
        line = _PREFIX.sub("", raw).rstrip()
        m_race, m_err = _RACE_SUMMARY.search(line), _ERROR_SUMMARY.search(line)
        if m_race:
            close()
            rep.hazards, rep.errors, rep.warnings = int(m_race[1]), int(m_race[2]), int(m_race[3])
        elif m_err:
            close()
            if rep.hazards is None:          # racecheck's own summary has the hazards' severities
                rep.errors = int(m_err[1])
        elif not line.strip() or line.strip() == "COMPUTE-SANITIZER":
            close()
        elif not line.strip().startswith(_BACKTRACE):
            block.append(line)
    close()
    return rep


@dataclass
class SanitizeResult:
    """What compute-sanitizer said about one exercise's check. `passed`: it reported no error (the check's own
    PASS/FAIL is `check_passed`, None when its verdict line was not found)."""
    exercise: str
    tool: str
    path: str
    errors: int
    warnings: int = 0
    hazards: int | None = None
    reports: list = field(default_factory=list)
    locations: list = field(default_factory=list)
    exit_code: int = 0
    check_passed: bool | None = None
    output: str = field(default="", repr=False)

    @property
    def passed(self) -> bool:
        return self.errors == 0 and self.exit_code != ERROR_EXITCODE

    def __repr__(self) -> str:
        check = {True: "PASS", False: "FAIL", None: "no verdict"}[self.check_passed]
        return (f"SanitizeResult({self.exercise!r}, {self.tool}: {_plural(self.errors, 'error')}, "
                f"{_plural(self.warnings, 'warning')}; the check: {check})")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


# ------------------------------------------------------------------------------------------- the run
def child_code(exercise_id: str, path: Path, timeout: float) -> str:
    """The Python the sanitizer runs: the check of `path`, its kernels compiled with line info, no memory pool."""
    return "\n".join([
        "import common.kernels as K",
        "K.BASE_OPTIONS = (*K.BASE_OPTIONS, '--generate-line-info')   # file:line in the reports, this run only",
        "import cupy",
        "cupy.cuda.set_allocator(None)          # each array its own allocation: memcheck sees where it ends",
        "from common.exercises import check",
        f"check({exercise_id!r}, path={str(path)!r}, timing=False, timeout_s={float(timeout)!r})",
    ])


def _say(msg: str) -> None:
    print(f"sanitize: {msg}")


def _file(exercise_id: str, path) -> Path:
    """The file to sanitize: `path`, else the learner's working copy, else the exercise's file as shipped."""
    from common import exercises as E
    ex = E.exercise(exercise_id)                 # an unknown id: ValueError listing the ids
    if path is None:
        path = E.working_copy(exercise_id)
        if not path.exists():
            print(f"{ex.id}: no working copy yet (start({ex.id!r}) makes one): sanitizing the file as shipped")
            path = ROOT / ex.stub
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"path: {path} is not a file")
    return path


def _shown(path: Path) -> str:
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def sanitize(exercise_id: str, tool: str = "memcheck", path=None, *, show: int = 3,
             timeout: float = TIMEOUT_S) -> SanitizeResult | None:
    """Run one exercise's check (your working copy, or the file at `path`) under compute-sanitizer's `tool`
    ("memcheck", "racecheck", "initcheck" or "synccheck") and print a short summary: the number of errors, the
    first `show` reports with file:line, and the check's own verdict. Never hangs: after `timeout` seconds the
    run is stopped. Returns a SanitizeResult, or None after one printed line saying why (no sanitizer, no GPU,
    the run stopped or failed before the sanitizer's summary)."""
    from common.device import gpu_available, skip_reason
    from common.profile import last_line, run_bounded
    _expect_tool(tool)
    if isinstance(show, bool) or not isinstance(show, int) or show < 0:
        raise ValueError(f"show: expected an int >= 0 (reports to print), got {show!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout: expected seconds > 0, got {timeout!r}")
    file = _file(exercise_id, path)
    try:
        find_sanitizer()
    except SanitizerMissing:
        _say(f"compute-sanitizer is not installed, so nothing was checked: {INSTALL} (see {HELP})")
        return None
    if not gpu_available():
        _say(f"running it needs an NVIDIA GPU: {skip_reason()}")
        return None
    cmd = sanitizer_command(tool, [sys.executable, "-c", child_code(exercise_id, file, timeout)],
                            extra=("--show-backtrace", "device"))
    print(f"{tool} on {exercise_id} ({_shown(file)}): running the check under compute-sanitizer ...", flush=True)
    rc, out, err = run_bounded(cmd, timeout)
    if rc is None:
        _say(f"{tool} did not finish within {timeout:.0f} s and was stopped (an endless loop? check() without "
             f"the sanitizer says which case; pass timeout= for longer)")
        return None
    rep = parse_report(out + "\n" + err)
    if rep.errors is None:
        _say(f"the sanitized run failed before the sanitizer's summary (exit {rc}): {last_line(err + chr(10) + out)}")
        return None
    verdict = re.findall(rf"^{re.escape(exercise_id)}: (PASS|FAIL)", out, re.M)
    result = SanitizeResult(exercise_id, tool, str(file), rep.errors, rep.warnings, rep.hazards, rep.reports,
                            rep.locations, rc, (verdict[-1] == "PASS") if verdict else None, out + err)
    _print(result, show)
    return result


def _print(r: SanitizeResult, show: int) -> None:
    if r.errors == 0 and not r.reports:
        print(f"{r.tool}: no {'hazards' if r.tool == 'racecheck' else 'errors'} reported")
    else:
        counts = _plural(r.errors, "error") + (f", {_plural(r.warnings, 'warning')}" if r.warnings else "")
        if r.hazards is not None:
            counts = f"{_plural(r.hazards, 'hazard')} reported ({counts})"
        n, total = min(show, len(r.reports)), len(r.reports)
        which = "" if not n else "; the report:" if total == 1 else (
            f"; its {total} reports:" if n == total else f"; the first {n} of {total} reports:")
        print(f"{r.tool}: {counts}{which}")
        for rep in r.reports[:show]:
            for i, line in enumerate(rep[:8]):
                print(("  " if i == 0 else "      ") + line.strip())
        if r.locations:
            print("lines named: " + ", ".join(r.locations[:8]))
        elif r.reports:
            print("(no file:line in the reports: the kernel was compiled without line information)")
    check = {True: "PASS", False: "FAIL", None: "no PASS/FAIL line (print(result.output) shows the run)"}
    print(f"the check under {r.tool}: {check[r.check_passed]}")
