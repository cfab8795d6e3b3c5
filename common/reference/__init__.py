"""float64 NumPy references for every op the course builds. Kernels are checked against these.

Inputs may be float32/16 NumPy or CuPy arrays; everything is computed in float64 and returned as float64.
The building blocks (`ops.py`) are re-exported here; whole models have their own modules, imported by name:
`from common.reference import fusion, gpt2, mlp`.
"""
from common.reference.ops import *  # noqa: F401,F403
from common.reference.ops import __all__ as _ops_all

__all__ = list(_ops_all)
