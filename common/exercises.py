"""Exercises: write a kernel yourself, check it against the float64 reference, time it next to the course's.

    from common.exercises import start, check, reset
    start("step1/scale_clamp")    # copies the stub to my_exercises/step1/scale_clamp.cu and prints the path
    check("step1/scale_clamp")    # compiles YOUR copy, runs awkward cases, prints PASS/FAIL, then the speed
    reset("step1/scale_clamp")    # a fresh copy of the stub (your previous file is kept as .cu.bak)

Every exercise is a `.cu` stub next to its notebook (`<step>/exercises/<name>.cu`, never edited: `start`
copies it), a solution (`<step>/exercises/solutions/<name>.cu`) and a spec in `<step>/exercises/__init__.py`:
how to make inputs, how to launch the kernel, the float64 reference, the cases, and the course's kernel to
compare with. `check` never raises on a wrong answer or a compile error: it prints what went wrong and
returns a `CheckResult` (`.passed`), so a notebook with the stubs untouched still runs to the end.

How a check is honest: every array the kernel sees sits inside a larger buffer filled with NaN (outputs are
NaN too before each run), so an element the kernel forgot stays NaN and a write past the end shows in the
guard; the cases include sizes that are not a multiple of the block or tile, 1, large ones, misaligned
starts where alignment is the point and large magnitudes where stability is.
Hangs: the check waits for each case at most `timeout_s` seconds. A kernel that loops forever cannot be
stopped from Python, though: the check reports it, and the Python kernel must then be restarted.
Without a GPU the check compiles your file with NVRTC for every architecture the course targets, prints
registers and spills, and says that running it needs a GPU.

The working copies live in `<repository>/my_exercises/` (a `.gitignore` inside it keeps git out of it);
the environment variable COURSE_EXERCISES_DIR moves it elsewhere.

Swaps: an exercise whose kernel does the job of one of GPT-2's ops declares a `Swap` (the op it replaces
and how to call the learner's kernel with that op's arguments), in a `SWAPS` list next to its specs (or in
step4_gpt2/capstone.py for the exercises that came before it); `swaps()` collects them and the capstone
(`python -m step4_gpt2 --mine`) runs GPT-2 on every one the learner's file passes.
"""
from __future__ import annotations

import importlib
import os
import shutil
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from common.check import is_poisoned, poison
from common.kernels import ROOT

STEP_PACKAGES = ("step1_simple", "step2_attention", "step3_fused", "step4_gpt2")
# step 4's lessons 4b and 4c: their `<package>/exercises/` is read where it exists
LESSON_PACKAGES = ("step4_gpt2.train", "step4_gpt2.megakernel")
# modules with a SWAPS list besides the exercise packages: swaps of exercises written before the capstone
SWAP_MODULES = ("step4_gpt2.capstone",)
SWAP_USES = ("prefill", "decode", "train")    # where GPT-2 runs an op
GUARD = 1024            # NaN elements before and after every array a kernel gets
TIMEOUT_S = 30.0        # per case


# ----------------------------------------------------------------------------------------- the specs
class Out:
    """An output the kernel must write: allocated NaN-poisoned, inside a NaN guard."""

    def __init__(self, shape, dtype=np.float32):
        self.shape, self.dtype = tuple(int(s) for s in np.atleast_1d(shape)), np.dtype(dtype)


@dataclass
class Speed:
    """How to time an exercise: a large case, the bytes or FLOPs it must move or do (functions of the GPU
    arrays), and the course's own kernel for it: (label, factory(arrays) -> a callable that runs it)."""
    params: dict
    bytes: Callable | None = None
    flops: Callable | None = None
    course: tuple | None = None


@dataclass
class Exercise:
    id: str                      # "step1/scale_clamp"
    title: str                   # one line: what the learner writes
    teaches: str                 # one line: the idea it practises
    stub: str                    # path from the repository root
    kernels: tuple               # kernel names the file must define (compiled with `defines`)
    make: Callable               # (params, rng) -> {name: NumPy array | Out | scalar}; "_name": reference only
    launch: Callable             # (kernel(name), arrays) -> None: launches the learner's kernel(s)
    reference: Callable          # (host inputs) -> {output name: float64 array}
    cases: tuple                 # ((name, params), ...)
    outputs: tuple               # names compared with the reference (Out entries or in-place arrays)
    defines: dict = field(default_factory=dict)
    rtol: float = 1e-5           # per element: |got - ref| <= rtol * |ref| + atol * max|ref|
    atol: float = 1e-5
    speed: Speed | None = None
    model: Callable | None = None   # (kernel(name)) -> [CaseResult]: the kernel swapped into a model
    min_sm: tuple | None = None     # (sm, what needs it): on an older GPU the check says so and runs nothing

    @property
    def solution(self) -> str:
        p = Path(self.stub)
        return (p.parent / "solutions" / p.name).as_posix()


@dataclass
class CaseResult:
    name: str
    passed: bool
    detail: str
    index: tuple | None = None
    got: float | None = None
    expected: float | None = None


@dataclass
class CheckResult:
    exercise: str
    path: str
    compiled: bool = False
    ran: bool = False
    cases: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    message: str = ""

    @property
    def passed(self) -> bool:
        return self.ran and bool(self.cases) and all(c.passed for c in self.cases)

    def __repr__(self) -> str:
        if not self.compiled:
            state = "did not compile"
        elif not self.ran:
            state = "compiled, not run (no GPU)" if "GPU" in self.message else "not run"
        else:
            state = f"{sum(c.passed for c in self.cases)}/{len(self.cases)} cases passed"
        return f"CheckResult({self.exercise!r}: {'PASS' if self.passed else 'FAIL'}, {state})"


@dataclass(frozen=True)
class Swap:
    """An exercise's kernel in place of one of GPT-2's ops (step4_gpt2/capstone.py).

    op: the module attribute the model calls at run time, "step4_gpt2.ops.bias_gelu" (the model calls every
    op through its module, so patching the attribute swaps the op everywhere). uses: where GPT-2 runs it, a
    subset of SWAP_USES. make(kern, original): the replacement, a function with the op's signature that
    launches the learner's kernels (kern(name) compiles one from the learner's file, as check does) and
    hands what the exercise does not cover (a fused variant, a shape the kernel was not written for) to
    `original`, the course's op."""
    exercise: str
    op: str
    uses: tuple
    make: Callable
    note: str = ""               # one line for the capstone's table: what of the op is the learner's

    @property
    def module(self) -> str:
        return self.op.rpartition(".")[0]

    @property
    def attribute(self) -> str:
        return self.op.rpartition(".")[2]


# ------------------------------------------------------------------------------------------ the registry
_REGISTRY: dict = {}
_SWAPS: dict = {}


def exercise_packages() -> tuple:
    """The packages whose `exercises` subpackage holds specs: every step's, and 4b's and 4c's where they
    exist."""
    lessons = tuple(p for p in LESSON_PACKAGES
                    if (ROOT / p.replace(".", "/") / "exercises" / "__init__.py").is_file())
    return STEP_PACKAGES + lessons


def registry() -> dict:
    """id -> Exercise for every exercise of the course (from each step's exercises package)."""
    if not _REGISTRY:
        for pkg in exercise_packages():
            for ex in importlib.import_module(f"{pkg}.exercises").EXERCISES:
                _REGISTRY[ex.id] = ex
    return _REGISTRY


def swaps() -> dict:
    """exercise id -> Swap, for every exercise whose kernel can stand in for one of GPT-2's ops: the SWAPS
    lists of the exercise packages and of SWAP_MODULES. An exercise swaps into one op."""
    if not _SWAPS:
        found = {}
        mods = [f"{p}.exercises" for p in exercise_packages()] + list(SWAP_MODULES)
        for mod in mods:
            for sw in _swap_list(mod, getattr(importlib.import_module(mod), "SWAPS", ())):
                if sw.exercise in found:
                    raise ValueError(f"{mod}: a second swap for {sw.exercise!r} (one op per exercise)")
                found[sw.exercise] = sw
        _SWAPS.update(found)
    return _SWAPS


def _swap_list(mod: str, table) -> list:
    """A module's SWAPS as Swap objects. A lesson package (4b) may still give them as a dict
    {exercise id: (attribute of the lesson's ops module, factory(kern) -> replacement)}: read as Swaps of
    that lesson's ops, used in its training step."""
    if not isinstance(table, dict):
        out = list(table)
        bad = [sw for sw in out if not isinstance(sw, Swap)]
        if bad:
            raise TypeError(f"{mod}.SWAPS: expected common.exercises.Swap entries, got {bad[0]!r}")
        return out
    lesson = mod.rpartition(".")[0]                          # "step4_gpt2.train.exercises" -> "step4_gpt2.train"
    uses = ("train",) if lesson.endswith(".train") else ("decode",)
    return [Swap(ex_id, f"{lesson}.ops.{attr}", uses, lambda kern, original, f=factory: f(kern))
            for ex_id, (attr, factory) in table.items()]


def exercise(exercise_id: str) -> Exercise:
    reg = registry()
    if exercise_id not in reg:
        raise ValueError(f"exercise_id: expected one of {sorted(reg)}, got {exercise_id!r}")
    return reg[exercise_id]


def exercises(step: str | None = None) -> list:
    """The exercise ids, all or those of one step ("step2")."""
    return [i for i in registry() if step is None or i.split("/")[0] == step]


# -------------------------------------------------------------------------------------- working copies
def work_dir() -> Path:
    """Where the learner's copies live: $COURSE_EXERCISES_DIR, or <repository>/my_exercises."""
    env = os.environ.get("COURSE_EXERCISES_DIR")
    return Path(env).expanduser().resolve() if env else ROOT / "my_exercises"


def working_copy(exercise_id: str) -> Path:
    """The path of the learner's file for an exercise (it may not exist yet: see start)."""
    ex = exercise(exercise_id)
    return work_dir() / ex.id.split("/")[0] / Path(ex.stub).name


def _ignore_folder(folder: Path) -> None:
    """A .gitignore with '*' inside the working folder: git never sees the learner's files, whatever
    the repository's own .gitignore says."""
    folder.mkdir(parents=True, exist_ok=True)
    gi = folder / ".gitignore"
    if not gi.exists():
        gi.write_text("# your exercise files: kept out of git, so pulling course updates never clashes with them\n*\n")


def _copy_stub(ex: Exercise, dest: Path) -> None:
    _ignore_folder(work_dir())
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ROOT / ex.stub, dest)        # content only: the copy is the learner's, writable


def start(exercise_id: str) -> Path:
    """Copy the exercise's stub to your working folder (unless you already have a copy there, which is
    never overwritten) and print its path. Returns the path."""
    ex = exercise(exercise_id)
    dest = working_copy(exercise_id)
    if dest.exists():
        print(f"{ex.id}: your file is {dest} (already there, left as it is; reset({ex.id!r}) starts over)")
    else:
        _copy_stub(ex, dest)
        print(f"{ex.id}: {ex.title}\nyour file: {dest}\nedit it, then run check({ex.id!r})")
    return dest


def reset(exercise_id: str) -> Path:
    """Put a fresh copy of the stub in your working folder; your previous file is kept as <name>.cu.bak."""
    ex = exercise(exercise_id)
    dest = working_copy(exercise_id)
    if dest.exists():
        backup = dest.with_name(dest.name + ".bak")
        shutil.copyfile(dest, backup)
        print(f"{ex.id}: your previous file is saved as {backup}")
    _copy_stub(ex, dest)
    print(f"{ex.id}: fresh copy of the stub at {dest}")
    return dest


def solution(exercise_id: str) -> Path:
    """The path of the exercise's solution (read it after trying!)."""
    return ROOT / exercise(exercise_id).solution


# --------------------------------------------------------------------------------------------- checking
def _guarded(value, offset: int):
    """(view the kernel gets, guarded buffer, slice of the view in it): the buffer is poisoned (common.poison:
    NaN for floats, -1 for signed and all ones for unsigned integers) and the view starts `offset` elements
    past a 256-byte boundary."""
    import cupy as cp
    shape, dtype = value.shape, np.dtype(value.dtype)
    size = int(np.prod(shape))
    start = GUARD + offset
    buf = poison(cp.empty(start + size + GUARD, dtype=dtype))
    view = buf[start:start + size].reshape(shape)
    if not isinstance(value, Out):
        view[...] = cp.asarray(value)
    return view, buf, (start, start + size)


def _to_device(host: dict, offset: int = 0):
    arrays, guards = {}, {}
    for name, value in host.items():
        if name.startswith("_"):            # data only the reference needs: stays on the host
            continue
        if isinstance(value, (Out, np.ndarray)):
            arrays[name], buf, span = _guarded(value, offset)
            guards[name] = (buf, span)
        else:
            arrays[name] = value
    return arrays, guards


def _guard_damage(buf, span) -> str | None:
    """Where a kernel wrote outside its array, if it did."""
    h = buf.get()
    before, after = ~is_poisoned(h[:span[0]]), ~is_poisoned(h[span[1]:])
    if after.any():
        k = int(np.argmax(after))
        return f"wrote past the end of the array (at index n{f' + {k}' if k else ''}, n = {span[1] - span[0]})"
    if before.any():
        return f"wrote before the start of the array (at index -{span[0] - int(np.flatnonzero(before)[-1])})"
    return None


class _Hang(Exception):
    pass


def _wait(timeout_s: float) -> None:
    """Wait for the GPU work queued so far, at most timeout_s (a bounded wait, then _Hang)."""
    import cupy as cp
    ev = cp.cuda.Event(disable_timing=True)      # a marker to wait on, not a timer (timing is common.bench)
    ev.record()
    t0 = time.monotonic()
    while not ev.done:                     # raises the kernel's CUDA error, if it had one
        if time.monotonic() - t0 > timeout_s:
            raise _Hang
        time.sleep(0.0005)


def compare(name: str, got, ref, rtol: float, atol: float) -> CaseResult:
    """PASS when every element is within rtol * |ref| + atol * max|ref| of the float64 reference and
    non-finite reference values (-inf of a mask) are matched exactly; else the first mismatch."""
    got = np.asarray(got, dtype=np.float64).reshape(np.shape(ref))
    ref = np.asarray(ref, dtype=np.float64)
    fin = np.isfinite(ref)
    scale = float(np.abs(ref[fin]).max()) if fin.any() else 1.0
    with np.errstate(invalid="ignore"):
        ok = np.where(fin, np.abs(got - ref) <= rtol * np.abs(ref) + atol * max(scale, 1e-30), got == ref)
    if ok.all():
        err = float(np.abs(got[fin] - ref[fin]).max()) if fin.any() else 0.0
        return CaseResult(name, True, f"max abs error {err:.2e}")
    idx = tuple(int(i) for i in np.argwhere(~ok)[0])
    g, e = float(got[idx]), float(ref[idx])
    where = idx[0] if len(idx) == 1 else idx
    return CaseResult(name, False, f"first mismatch at {where}: got {g:.6g}, expected {e:.6g} "
                                   f"({int((~ok).sum())} of {ok.size} wrong)", idx, g, e)


def _run_case(ex: Exercise, kern, name: str, params: dict, timeout_s: float) -> CaseResult:
    rng = np.random.default_rng(zlib.crc32(f"{ex.id}/{name}".encode()))    # the same inputs every run
    host = ex.make(params, rng)
    arrays, guards = _to_device(host, params.get("offset", 0))
    ex.launch(kern, arrays)
    _wait(timeout_s)
    ref = ex.reference({k: v for k, v in host.items() if not isinstance(v, Out)})
    rtol, atol = params.get("tol", (ex.rtol, ex.atol))
    for out in ex.outputs:
        damage = _guard_damage(*guards[out])
        if damage:
            return CaseResult(name, False, f"{out}: {damage}")
    for out in ex.outputs:
        r = compare(name, arrays[out].get(), ref[out], rtol, atol)
        if not r.passed:
            r.detail = f"{out}: {r.detail}"
            return r
    return CaseResult(name, True, r.detail if len(ex.outputs) == 1 else "all outputs match")


def _print_cases(cases: list) -> None:
    w = max([len(c.name) for c in cases] + [4])
    print(f"  {'case':{w}s}  result  detail")
    for c in cases:
        print(f"  {c.name:{w}s}  {'PASS' if c.passed else 'FAIL':6s}  {c.detail}")


def _compile_offline_report(ex: Exercise, path: Path, result: CheckResult) -> CheckResult:
    from common.device import skip_reason
    from common.kernels import ARCHS, KernelCompileError, compile_offline, supported_archs
    archs = [a for a in ARCHS if a in supported_archs()]
    try:
        for arch in archs:
            rep = compile_offline(path, arch, ex.defines)
            missing = [k for k in ex.kernels if k not in rep.kernels]
            if missing:
                result.message = f"your file has no kernel named {', '.join(missing)} (keep the stub's names)"
                print(f"{ex.id}: {result.message}")
                return result
            print(f"  sm_{arch}: " + ", ".join(f"{k.name} {k.registers} registers, {k.spill_stores} B spilled"
                                               for k in rep.kernels.values() if k.name in ex.kernels))
    except KernelCompileError as e:
        result.message = str(e)
        print(e)
        return result
    result.compiled = True
    result.message = f"running it needs an NVIDIA GPU: {skip_reason()}"
    print(f"{ex.id}: compiles for sm_{', sm_'.join(map(str, archs))}. Checking and timing it: {result.message}")
    return result


def check(exercise_id: str, path=None, timing: bool = True, timeout_s: float = TIMEOUT_S) -> CheckResult:
    """Compile your file for an exercise (your working copy, or `path`), run it on every case against the
    float64 reference and print a table; when all pass (and timing=True), time it next to the course's
    own kernel. Never raises on a wrong kernel or a compile error: returns a CheckResult."""
    from common.device import gpu_available
    ex = exercise(exercise_id)
    if path is None:
        path = working_copy(exercise_id)
        if not path.exists():
            print(f"{ex.id}: no working copy yet (start({ex.id!r}) makes one): checking the stub as shipped")
            path = ROOT / ex.stub
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"path: {path} is not a file")
    result = CheckResult(ex.id, str(path))
    print(f"{ex.id}: {ex.title}\nfile: {path}")
    if not gpu_available():
        return _compile_offline_report(ex, path, result)
    return _check_on_gpu(ex, path, result, timing, timeout_s)


def too_old(ex: Exercise) -> str | None:
    """Why this GPU cannot run the exercise's kernel (its min_sm: e.g. tensor-core instructions), or None."""
    if ex.min_sm is None:
        return None
    from common.device import device_info
    need, what = ex.min_sm
    sm = device_info()["sm"]
    if sm >= need:
        return None
    return f"{what} need compute capability {need // 10}.{need % 10} or newer; this GPU is {sm // 10}.{sm % 10}"


def load_kernels(ex: Exercise, path) -> dict:
    """{kernel name: the compiled kernel} of the file at `path` for exercise `ex` (cached by get_kernel), e.g. a
    learner's passing file, for the capstone to swap into GPT-2."""
    from common.kernels import get_kernel
    return {k: get_kernel(path, k, ex.defines) for k in ex.kernels}


def _check_on_gpu(ex: Exercise, path: Path, result: CheckResult, timing: bool, timeout_s: float) -> CheckResult:
    from common.kernels import KernelCompileError, get_kernel
    old = too_old(ex)
    if old is not None:
        result.message = f"{old}: your file compiles, but cannot run here"
        print(f"{ex.id}: {result.message}")
        return result

    def kern(name):
        return get_kernel(path, name, ex.defines)

    try:
        fns = {k: kern(k) for k in ex.kernels}
    except KernelCompileError as e:
        result.message = str(e)
        print(e)
        return _summary(result)
    except Exception as e:        # e.g. a kernel renamed: CuPy cannot find the function
        result.message = f"could not load the kernel(s) {', '.join(ex.kernels)} from your file ({type(e).__name__}: {e})"
        print(result.message)
        return _summary(result)
    result.compiled = True
    print("compiled for this GPU: " + ", ".join(f"{k} {f.num_regs} registers, {f.local_size_bytes} B local memory"
                                                 for k, f in fns.items()))
    result.ran = True
    runs = [(name, lambda p=params, n=name: _run_case(ex, kern, n, p, timeout_s)) for name, params in ex.cases]
    if ex.model is not None:     # the kernel inside the model: only worth running once it is right alone
        runs.append(("in the model", lambda: ex.model(kern) if all(c.passed for c in result.cases) else
                     [CaseResult("in the model", False, "not run until every case above passes")]))
    for name, run in runs:
        try:
            out = run()
            result.cases += out if isinstance(out, list) else [out]
        except _Hang:
            result.cases.append(CaseResult(name, False, f"did not finish within {timeout_s:g} s (an endless loop?)"))
            result.message = ("your kernel is still running: if it loops forever, the GPU stays busy until this "
                              "Python process ends; restart the kernel (Jupyter: Kernel > Restart) before "
                              "running anything else on the GPU")
            break
        except Exception as e:
            result.cases.append(CaseResult(name, False, f"the kernel failed: {type(e).__name__}: {e}"))
            if _context_broken():
                result.message = ("the CUDA error is sticky: nothing more can run on the GPU in this process; "
                                  "restart the Python kernel, fix the file and check again")
                break
    _print_cases(result.cases)
    if result.passed and timing and ex.speed is not None:
        try:
            result.timings = _time(ex, kern)
        except Exception as e:     # e.g. your kernel fails at the timing case's size: say so, do not raise
            print(f"timing failed: {type(e).__name__}: {e}")
    return _summary(result)


def _context_broken() -> bool:
    import cupy as cp
    try:
        cp.cuda.runtime.deviceSynchronize()
        cp.zeros(1).get()
        return False
    except Exception:
        return True


def _summary(result: CheckResult) -> CheckResult:
    if result.message and result.ran:
        print(result.message)
    if result.passed:
        print(f"{result.exercise}: PASS - every case matches the float64 reference")
    else:
        n = sum(c.passed for c in result.cases)
        print(f"{result.exercise}: FAIL" + (f" ({n} of {len(result.cases)} cases pass)" if result.cases else ""))
    return result


# ---------------------------------------------------------------------------------------------- timing
def _rate(t, ceiling: float | None, unit: str) -> str:
    s = f"{t.median_ms * 1e3:.1f} us, " + (f"{t.gbps:,.0f} GB/s" if t.bytes is not None else f"{t.tflops:.2f} TFLOP/s")
    return s + (f" = {100 * t.fraction(ceiling):.0f} % of {unit}" if ceiling else "")


def _time(ex: Exercise, kern) -> dict:
    """Time the learner's kernel and the course's on the speed case; print both against the ceiling."""
    from common.device import device_info, fp32_peak_tflops
    from common.timing import bench, copy_bandwidth
    sp = ex.speed
    arrays, _ = _to_device(ex.make(sp.params, np.random.default_rng(0)))
    nbytes = sp.bytes(arrays) if sp.bytes else None
    flops = None if nbytes is not None else (sp.flops(arrays) if sp.flops else None)
    if nbytes is not None:
        ceiling, unit = copy_bandwidth(), "copy bandwidth"
    else:
        ceiling, unit = fp32_peak_tflops(), "fp32 peak"
    out = {"ceiling": ceiling, "unit": unit, "device": device_info()["name"]}
    kw = dict(bytes=nbytes, flops=flops, target_ms=60.0)
    out["yours"] = bench(lambda: ex.launch(kern, arrays), name="your kernel", **kw)
    ceil_txt = (f"{ceiling:,.0f} GB/s" if nbytes is not None else f"{ceiling:.1f} TFLOP/s") if ceiling else "unknown"
    print(f"speed on {out['device']} ({unit}: {ceil_txt}), {_size_text(sp.params)}:")
    print(f"  your kernel:          {_rate(out['yours'], ceiling, unit)}")
    if sp.course is not None:
        label, factory = sp.course
        try:
            fn = factory(arrays)
            out["course"] = bench(fn, name=label, **kw)
            print(f"  {label + ':':21s} {_rate(out['course'], ceiling, unit)}")
        except Exception as e:     # the course's wrapper changed or needs a newer GPU: say so, keep going
            print(f"  {label}: could not be timed here ({type(e).__name__}: {e})")
    return out


def _size_text(params: dict) -> str:
    return ", ".join(f"{k}={v:,}" if isinstance(v, int) else f"{k}={v}" for k, v in params.items() if k != "tol")


from common.hints import answer, hint  # noqa: E402  (the hint ladder, docs/exercises.md; hints reads no spec)

__all__ = ["start", "check", "reset", "solution", "hint", "answer", "exercises", "working_copy", "work_dir",
           "registry", "load_kernels", "too_old", "Exercise", "Speed", "Out", "CaseResult", "CheckResult", "compare", "Swap",
           "swaps", "SWAP_USES"]
