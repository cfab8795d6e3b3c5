"""Hints in levels for every exercise, and the checks of the exercises whose answer is a number.

    from common.hints import hint
    hint("step1/scale_clamp", 1)     # hint 1: where to look, what to compute
    hint("step1/scale_clamp", 2)     # hint 2: the idea, or the shape of the code
    hint("step1/scale_clamp", 3)     # where the solution is (read it after trying)

A kernel exercise keeps its two hints in its stub's header, after what to compute and how it is launched:

    // Hint 1 (where to look): one line ...
    //   continued on lines indented by two spaces or more
    // Hint 2 (the idea): ...
    // The solution: solution("step1/scale_clamp") gives its path.

so the stub is the one place to edit them; `hint` reads them back one level at a time. The stub's first line
carries the exercise's number, "Exercise <lesson>.<n>" ("Exercise 1a.2"), the same in the notebook's heading
and in docs/exercises.md.

An exercise whose answer is a number (napkin bytes, a bandwidth bound) is a `Question` in a step's
`<step>/exercises/questions.py` (its `QUESTIONS` list): its number, its hints, the worked answer that the
third level shows, and a function computing the expected values, so the notebook's check cell holds no answer.
`answer(id, name=value, ...)` compares silently and prints PASS or FAIL per value; it never raises.
"""
from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from common.kernels import ROOT

LEVELS = 2                       # hint 1, hint 2; the level after them is the solution
QUESTION_PACKAGES = ("step1_simple", "step2_attention", "step3_fused", "step4_gpt2",
                     "step4_gpt2.train", "step4_gpt2.megakernel")
NUMBER = re.compile(r"\bExercise (\d[a-z])\.(\d+)\b")
_HINT = re.compile(r"^//\s*Hint ([1-9])\b\s*(\([^)]*\))?\s*:?\s*(.*)$")
_MORE = re.compile(r"^//\s{2,}(\S.*)$")          # a continuation line: indented by two spaces or more


@dataclass(frozen=True)
class Question:
    """An exercise answered with numbers in the notebook, checked by `answer`.

    expected() -> {name: value} (it may measure, e.g. the copy bandwidth); rtol: the relative tolerance per
    value (0 for an exact count); hints: (hint 1, hint 2); worked: the worked answer (the third level);
    wrong: {name: a sentence} said on a FAIL of that value (a nudge, never the value)."""
    id: str
    number: str
    title: str
    hints: tuple
    worked: str
    expected: Callable
    rtol: float | dict = 0.0     # one tolerance, or {name: tolerance}
    wrong: dict | None = None


_QUESTIONS: dict = {}


def questions() -> dict:
    """id -> Question for every question of the course (each package's `exercises/questions.py`)."""
    if not _QUESTIONS:
        for pkg in QUESTION_PACKAGES:
            if (ROOT / pkg.replace(".", "/") / "exercises" / "questions.py").is_file():
                for q in importlib.import_module(f"{pkg}.exercises.questions").QUESTIONS:
                    _QUESTIONS[q.id] = q
    return _QUESTIONS


@dataclass(frozen=True)
class Stub:
    """A kernel exercise's stub, found by the `check("<id>")` line every stub has (common.exercises holds the
    specs; this module reads only the files, so common.exercises can import it)."""
    id: str
    stub: str                    # path from the repository root

    @property
    def solution(self) -> str:
        p = Path(self.stub)
        return (p.parent / "solutions" / p.name).as_posix()


_STUBS: dict = {}
_CHECK = re.compile(r'check\("([^"]+)"\)')


def stubs() -> dict:
    """id -> Stub for every kernel exercise stub (`<package>/exercises/*.cu`, solutions excluded)."""
    if not _STUBS:
        for path in sorted(ROOT.glob("step*/exercises/*.cu")) + sorted(ROOT.glob("step*/*/exercises/*.cu")):
            m = _CHECK.search(path.read_text())
            if m:
                _STUBS[m.group(1)] = Stub(m.group(1), path.relative_to(ROOT).as_posix())
    return _STUBS


def all_ids() -> list:
    """Every exercise that has hints: the kernel exercises, then the questions."""
    return list(stubs()) + [q for q in questions() if q not in stubs()]


def _lookup(exercise_id: str):
    ex = stubs().get(exercise_id)
    if ex is not None:
        return ex
    q = questions().get(exercise_id)
    if q is None:
        raise ValueError(f"exercise_id: expected one of {sorted(all_ids())}, got {exercise_id!r}")
    return q


def parse_hints(text: str) -> dict:
    """{level: text} from a stub's comment lines: "// Hint <k> (...): ..." and its indented continuation."""
    found, level = {}, None
    for line in text.splitlines():
        line = line.rstrip()
        m = _HINT.match(line)
        if m:
            level = int(m.group(1))
            found[level] = m.group(3).strip()
        elif level is not None and _MORE.match(line):
            found[level] += " " + _MORE.match(line).group(1).strip()
        else:
            level = None
    return found


def parse_number(text: str) -> str | None:
    """"1a.2" from the first line of a stub ("// name.cu - Exercise 1a.2: ..."), or None."""
    first = text.splitlines()[0] if text else ""
    m = NUMBER.search(first)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def hints(exercise_id: str) -> dict:
    """{1: hint 1, 2: hint 2} of an exercise (a level the stub lacks is missing from the dict)."""
    ex = _lookup(exercise_id)
    if isinstance(ex, Question):
        return {i + 1: h for i, h in enumerate(ex.hints)}
    return parse_hints((ROOT / ex.stub).read_text())


def number(exercise_id: str) -> str | None:
    """The exercise's number, "<lesson>.<n>" ("1a.2"): from the stub's first line, or the question's."""
    ex = _lookup(exercise_id)
    return ex.number if isinstance(ex, Question) else parse_number((ROOT / ex.stub).read_text())


def lesson(exercise_id: str) -> str | None:
    """The lesson an exercise goes with ("1a"), from its number."""
    n = number(exercise_id)
    return n.split(".")[0] if n else None


def hint(exercise_id: str, level: int = 1) -> None:
    """Print one level of help: 1, where to look; 2, the idea; 3, where the solution is (or the worked
    answer of a question). Try the check between two levels."""
    ex = _lookup(exercise_id)
    if not isinstance(level, int) or level < 1:
        raise ValueError(f"level: expected 1, 2 or 3, got {level!r}")
    num = number(exercise_id)
    name = f"Exercise {num} ({exercise_id})" if num else exercise_id
    if level <= LEVELS:
        text = hints(exercise_id).get(level)
        if text is None:
            print(f"{name}: no hint {level} was written for this exercise")
            return
        print(f"{name}, hint {level} of {LEVELS}:\n{_wrap(text)}")
        if level < LEVELS:
            print(f"(still stuck after trying it? hint({exercise_id!r}, {level + 1}))")
        else:
            print(f"(the last level: hint({exercise_id!r}, {LEVELS + 1}) shows where the solution is)")
        return
    if isinstance(ex, Question):
        print(f"{name}, the worked answer:\n{_wrap(ex.worked)}")
        return
    print(f"{name}: the solution is {ROOT / ex.solution}\n"
          f"(read it after trying; solution({exercise_id!r}) returns that path)")


def _wrap(text: str, width: int = 100) -> str:
    import textwrap
    return "\n".join(textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="  "))


def answer(exercise_id: str, **values) -> bool:
    """Check a question's answers: each named value against the expected one (exact for counts, within the
    question's rtol otherwise). Prints PASS or FAIL per value, never the expected value, and never raises
    on a wrong or missing answer. Returns True when every value passes."""
    q = questions().get(exercise_id)
    if q is None:
        raise ValueError(f"exercise_id: expected one of {sorted(questions())}, got {exercise_id!r}")
    want = q.expected()
    unknown = sorted(set(values) - set(want))
    if unknown:
        print(f"Exercise {q.number}: no answer named {', '.join(unknown)} (expected {', '.join(want)})")
    ok_all = not unknown
    for key, exp in want.items():
        got = values.get(key)
        ok, why = _compare(got, exp, q.rtol.get(key, 0.0) if isinstance(q.rtol, dict) else q.rtol)
        ok_all &= ok
        nudge = "" if ok or got is None else f"; {(q.wrong or {}).get(key, 'count again')}"
        print(f"  {key:24s} {'PASS' if ok else 'FAIL'}{': ' + why if why else ''}{nudge}")
    print(f"Exercise {q.number}: " + ("PASS" if ok_all else f"FAIL (hint({exercise_id!r}, 1) if you are stuck)"))
    return ok_all


def _compare(got, exp, rtol: float) -> tuple:
    if got is None:
        return False, "not done yet (replace None with your number)"
    try:
        g = float(got)
    except (TypeError, ValueError):
        return False, f"expected a number, got {type(got).__name__}"
    if not math.isfinite(g):
        return False, f"got {g}"
    if rtol == 0:
        return (g == exp), ("" if g == exp else "not the count")
    ok = abs(g - exp) <= rtol * abs(exp)
    return ok, "" if ok else f"not within {rtol:.0%}"


__all__ = ["hint", "hints", "number", "lesson", "answer", "questions", "Question", "parse_hints", "parse_number",
           "all_ids", "stubs", "Stub", "LEVELS"]
