"""The find-the-bug exercises (docs/exercises.md, "Find the bug"): the shipped file is a complete kernel with
one bug, not a TODO stub. tests/test_exercises.py already compiles them, requires FAIL for the shipped file,
PASS for the solution and FAIL for each planted bug (tests/exercise_bugs/find_bug.py). This file adds what a
find-the-bug exercise promises on top of that:

- the shipped file is the solution with exactly its one bug (the "as_shipped" edit), comments aside;
- its header says what the kernel should do, the symptom, and two levels of hints; the solution names the bug;
- docs/exercises.md lists every one;
- on a GPU, the shipped file fails exactly the cases its header says, the same way on every run (the race of
  find_bug_sync: its large case on every run), and racecheck finds find_bug_sync's race and none in the fix.
"""
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from common import exercises as E
from common.kernels import ROOT
from tests.exercise_bugs import BUGS

FIND_BUG = [i for i in E.registry() if i.split("/")[1].startswith("find_bug_")]
gpu = pytest.mark.gpu

# What the shipped file does under check(): the cases that FAIL (every other case PASSes) and a piece of the
# first failing case's detail. A race makes find_bug_sync's middle cases vary from run to run: RACY lists the
# cases that may go either way.
ALL = None          # every case fails
SHIPPED_FAILS = {
    "step1/find_bug_tail": ({"n=1", "n=1,027 (256 groups of 4 + 3)", "n=4,194,307 (large)"}, "got nan"),
    "step1/find_bug_warp_sum": ("all but n=1", "got"),
    "step1/find_bug_last_block": (ALL, "got nan"),
    "step2/find_bug_softmax_overflow": ({"64 x 1000, values up to +-100", "64 x 1000, values up to +-500"}, "y:"),
    "step2/find_bug_matmul_tile": ("all but M=1, N=1, K=1", "c:"),
    "step3/find_bug_sync": ({"37 x 1000", "2048 x 1024 (2048 blocks)"}, "y:"),
    "step3/find_bug_inplace_loss": (ALL, "loss:"),
    "step4/find_bug_gemv_batch": ({"B=2, N=37, K=100", "B=3, N=768, K=768, no bias",
                                   "B=11 (two launches), N=5003, K=768", "in the model"}, "first mismatch at (1, 0)"),
}
RACY = {"step3/find_bug_sync": {"7 x 33", "37 x 1000"}}


def _expected_fails(ex_id: str) -> set:
    names = [n for n, _ in E.exercise(ex_id).cases] + (["in the model"] if E.exercise(ex_id).model else [])
    want = SHIPPED_FAILS[ex_id][0]
    if want is ALL:
        return set(names)
    if isinstance(want, str):                          # "all but <case>"
        return set(names) - {want.removeprefix("all but ")}
    return set(want)


def _code(text: str) -> str:
    """The C++ code of a .cu without comments or white space: what the compiler sees, give or take."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"\s+", "", text)


def _header(path) -> str:
    lines = (ROOT / path).read_text().splitlines()
    return "\n".join(line for line in lines if line.startswith("//"))


# ------------------------------------------------------------------------------------------- no GPU
def test_at_least_six_across_the_steps():
    assert len(FIND_BUG) >= 6, FIND_BUG
    assert {i.split("/")[0] for i in FIND_BUG} >= {"step1", "step2", "step3", "step4"}, FIND_BUG
    assert set(SHIPPED_FAILS) == set(FIND_BUG), "every find-the-bug exercise says here how its shipped file fails"


@pytest.mark.parametrize("ex_id", FIND_BUG)
def test_expected_failures_name_real_cases(ex_id):
    ex = E.exercise(ex_id)
    names = {n for n, _ in ex.cases} | ({"in the model"} if ex.model else set())
    want = SHIPPED_FAILS[ex_id][0]
    named = {want.removeprefix("all but ")} if isinstance(want, str) else (want or set())
    assert named | RACY.get(ex_id, set()) <= names, (ex_id, sorted(named - names))
    assert _expected_fails(ex_id) and _expected_fails(ex_id) != {"in the model"}, ex_id
    if want is not ALL:                  # a case that passes is the contrast that points at the bug
        assert names - _expected_fails(ex_id) - RACY.get(ex_id, set()), f"{ex_id}: name a case that passes"


@pytest.mark.parametrize("ex_id", FIND_BUG)
def test_shipped_file_is_the_solution_with_its_one_bug(ex_id):
    ex = E.exercise(ex_id)
    name, _, old, new = BUGS[ex_id][0]
    assert name == "as_shipped", f"{ex_id}: the first planted bug must be the shipped one"
    solution = (ROOT / ex.solution).read_text()
    shipped = (ROOT / ex.stub).read_text()
    assert solution.count(old) == 1, f"{ex_id}: the as_shipped edit must apply to the solution once"
    assert _code(solution) != _code(shipped), f"{ex_id}: the shipped file must differ from the solution"
    assert _code(solution.replace(old, new)) == _code(shipped), (
        f"{ex_id}: the shipped file must be the solution with exactly the as_shipped bug (comments aside)")


@pytest.mark.parametrize("ex_id", FIND_BUG)
def test_header_and_solution_say_what_they_must(ex_id):
    ex = E.exercise(ex_id)
    head = _header(ex.stub)
    for needed in ("TODO", "What it should do", "Symptom", "Hint 1", "Hint 2", f'check("{ex_id}")'):
        assert needed in head, f"{ex.stub}: the header must say {needed!r}"
    assert head.index("Hint 1") < head.index("Hint 2")
    assert "FIX" not in (ROOT / ex.stub).read_text(), f"{ex.stub}: the shipped file must not point at the fix"
    sol = (ROOT / ex.solution).read_text()
    assert "The bug:" in _header(ex.solution) and "Why it bit" in _header(ex.solution), ex.solution
    assert "FIX" in sol, f"{ex.solution}: mark the fixed line with a FIX comment"


def test_the_sanitizer_exercise_says_how_to_run_it():
    head = _header(E.exercise("step3/find_bug_sync").stub)
    assert "racecheck" in head and 'sanitize("step3/find_bug_sync", tool="racecheck")' in head
    assert "check('step3/find_bug_sync'" in head


def test_docs_list_every_find_bug_exercise():
    text = (ROOT / "docs" / "exercises.md").read_text()
    assert "## Find the bug" in text
    section = text[text.index("## Find the bug"):]
    section = section[:section.find("\n## ", 4)] if "\n## " in section[4:] else section
    for ex_id in FIND_BUG:
        assert f"`{ex_id}`" in section, f"docs/exercises.md, Find the bug: {ex_id} is not listed"


def test_the_sanitizer_command_of_the_header_finds_the_sanitizer_module():
    """The header's line (`from common.sanitize import sanitize`) imports from any folder."""
    r = subprocess.run([sys.executable, "-c", "from common.sanitize import sanitize; print(sanitize)"],
                       cwd=Path(tempfile.gettempdir()), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------------------------------- on the GPU
@gpu
@pytest.mark.parametrize("ex_id", FIND_BUG)
def test_shipped_file_fails_the_cases_its_header_names_on_every_run(ex_id):
    ex = E.exercise(ex_id)
    want, detail = _expected_fails(ex_id), SHIPPED_FAILS[ex_id][1]
    racy = RACY.get(ex_id, set())
    for _ in range(3):
        result = E.check(ex_id, path=ROOT / ex.stub, timing=False)
        assert result.compiled and result.ran and not result.passed, result
        failed = {c.name for c in result.cases if not c.passed}
        assert failed - racy == want - racy, (ex_id, sorted(failed), sorted(want))
        first = next(c for c in result.cases if not c.passed)
        assert detail in first.detail, (ex_id, first.detail)


def _racecheck(path) -> subprocess.CompletedProcess:
    from common.sanitize import sanitizer_command
    code = ("from common.exercises import check; "
            f"check('step3/find_bug_sync', path={str(path)!r}, timing=False)")
    cmd = sanitizer_command("racecheck", [sys.executable, "-c", code], print_limit=5)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


@gpu
def test_racecheck_finds_the_race_and_not_in_the_fix():
    try:
        from common.sanitize import find_sanitizer
        find_sanitizer()
    except SystemExit as e:
        pytest.skip(str(e))
    ex = E.exercise("step3/find_bug_sync")
    bad = _racecheck(ROOT / ex.stub)
    report = (bad.stdout + bad.stderr).lower()
    assert bad.returncode == 99 and ("hazard" in report or "race" in report), bad.stdout[-3000:] + bad.stderr[-3000:]
    good = _racecheck(ROOT / ex.solution)
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-3000:]
