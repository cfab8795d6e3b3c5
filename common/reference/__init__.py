"""float64 NumPy references for every op the course builds. Kernels are checked against these.

Inputs may be float32/16 NumPy or CuPy arrays; everything is computed in float64 and returned as float64.
Each later step adds its module here and re-exports it below.
"""
from common.reference.ops import *  # noqa: F401,F403
from common.reference.ops import __all__ as _ops_all

__all__ = list(_ops_all)
