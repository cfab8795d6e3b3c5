"""pytest set-up for the whole course: GPU tests and notebooks skip with a visible reason without a GPU, and
`pytest --gpu-memory-gib 6` runs everything as if the GPU had 6 GiB (docs/environment.md, "A smaller GPU")."""
import os
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
# The notebooks' kernels (nbval) are new processes: they find the course through `pip install -e .`, or, in a
# checkout that was not installed, through this.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

from common.device import describe, skip_reason  # noqa: E402

# CuPy's own variable: every process reads it when it creates its memory pool, so the notebooks' kernels, which
# nbval starts as new processes, inherit the cap through the environment (as they inherit PYTHONPATH above).
CUPY_LIMIT = "CUPY_GPU_MEMORY_LIMIT"


def cap_bytes(value: str, total: int | None) -> int | None:
    """The cap that a CUPY_GPU_MEMORY_LIMIT value means, in bytes: "6442450944" (bytes) or "25%" (of the GPU's
    `total` bytes; None when the total is not known). None for an unset or "0" value (no cap)."""
    value = (value or "").strip()
    if value.endswith("%"):
        try:
            fraction = float(value[:-1]) / 100
        except ValueError:
            fraction = -1.0                 # "x%": said below, with the variable's name
        if not 0 <= fraction <= 1:
            raise ValueError(f"{CUPY_LIMIT}={value!r}: a percentage from 0% to 100%")
        return None if fraction == 0 or total is None else int(fraction * total)
    try:
        size = int(value) if value else 0
    except ValueError:
        size = -1
    if size < 0:
        raise ValueError(f"{CUPY_LIMIT}={value!r}: a number of bytes (6442450944) or a percentage (25%)")
    return size or None


def torch_fraction(cap: int, total: int) -> float:
    """The fraction `torch.cuda.set_per_process_memory_fraction` takes for a cap of `cap` bytes on a GPU of
    `total` bytes (torch multiplies it by the GPU's total memory); 1.0 when the cap is the whole GPU or more."""
    return min(1.0, cap / total)


def cap_environment(gib: float) -> dict[str, str]:
    """The environment that caps CuPy at `gib` GiB in this process and in every process it starts."""
    if not gib > 0:
        raise pytest.UsageError(f"--gpu-memory-gib {gib}: a size in GiB greater than 0, e.g. 6")
    return {CUPY_LIMIT: str(int(gib * 2**30))}


def _gpu_total() -> int | None:
    if skip_reason() is not None:
        return None
    from common.device import device_info
    return device_info()["memory_bytes"]


def pytest_addoption(parser):
    parser.addoption(
        "--gpu-memory-gib", type=float, default=None, metavar="GIB",
        help="act like a GPU with GIB GiB (e.g. 6): caps CuPy's memory pool through CUPY_GPU_MEMORY_LIMIT, which "
             "the notebooks' kernels inherit, and torch's allocator (docs/environment.md, 'A smaller GPU')")


def pytest_report_header(config):
    lines = [f"course GPU: {describe()}"]
    cap = getattr(config, "_course_gpu_cap", None)
    if cap is not None:
        lines.append(f"GPU memory cap: {cap / 2**30:.2f} GiB for CuPy's memory pool in every test and notebook "
                     f"({CUPY_LIMIT}={os.environ[CUPY_LIMIT]}), and for torch's allocator in the tests (fraction "
                     f"{config._course_torch_fraction:.4f} of the GPU); neither counts the CUDA context")
    elif os.environ.get(CUPY_LIMIT):
        lines.append(f"GPU memory cap: {CUPY_LIMIT}={os.environ[CUPY_LIMIT]} (no GPU here to apply it to)")
    return lines


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped with the reason when there is none)")
    config.addinivalue_line("markers", "sanitize: small GPU cases that tests/sanitize.py runs under compute-sanitizer")
    config.addinivalue_line("markers", "slow: large sizes; still part of the default GPU run")
    gib = config.getoption("--gpu-memory-gib")
    if gib is not None:
        os.environ.update(cap_environment(gib))
    total = _gpu_total()
    try:
        cap = cap_bytes(os.environ.get(CUPY_LIMIT, ""), total)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    if cap is None or total is None:
        return
    import cupy as cp
    cp.get_default_memory_pool().set_limit(size=cap)    # in case this process made its pool before the option
    config._course_gpu_cap = cap
    config._course_torch_fraction = torch_fraction(cap, total)


def pytest_runtest_setup(item):
    """torch's allocator in this process, capped alike once a test module has imported torch (before the first
    test that could use it). In a notebook's kernel, CuPy's cap comes from the environment and torch's from
    `common.torch_cuda()` (docs/environment.md says what is not capped)."""
    config = item.config
    fraction = getattr(config, "_course_torch_fraction", None)
    if fraction is None or getattr(config, "_course_torch_capped", False) or "torch" not in sys.modules:
        return
    config._course_torch_capped = True
    torch = sys.modules["torch"]
    try:
        if torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(fraction, 0)
    except Exception as e:      # a torch whose CUDA does not start here: the tests that need it say so themselves
        warnings.warn(f"--gpu-memory-gib: torch's allocator not capped ({type(e).__name__}: {e})")


def pytest_collection_modifyitems(config, items):
    reason = skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"no GPU: {reason}")
    for item in items:
        if "gpu" in item.keywords or item.nodeid.split("::")[0].endswith(".ipynb"):
            item.add_marker(skip)
