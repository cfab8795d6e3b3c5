"""pytest set-up for the whole course: GPU tests and notebooks skip with a visible reason without a GPU."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
# The notebooks' kernels (nbval) are new processes: they find the course through `pip install -e .`, or, in a
# checkout that was not installed, through this.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

from common.device import describe, skip_reason  # noqa: E402


def pytest_report_header(config):
    return f"course GPU: {describe()}"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped with the reason when there is none)")
    config.addinivalue_line("markers", "sanitize: small GPU cases that tests/sanitize.py runs under compute-sanitizer")
    config.addinivalue_line("markers", "slow: large sizes; still part of the default GPU run")


def pytest_collection_modifyitems(config, items):
    reason = skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"no GPU: {reason}")
    for item in items:
        if "gpu" in item.keywords or item.nodeid.split("::")[0].endswith(".ipynb"):
            item.add_marker(skip)
