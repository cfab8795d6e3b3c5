"""Lab: weight gradients split over the rows by hand ("split-K"), against cuBLAS's single GEMM.

dW = x^T dy reduces over all N = B*T rows into a small output (C x 4C at most): few output tiles for the
GPU's SMs. Splitting the rows into S chunks makes S partial products in one strided-batched GEMM and adds them
in a fixed order (deterministic). The mainline (ops.weight_grad) keeps cuBLAS's own kernel choice for the
single GEMM: train_breakdown_rows in step4_gpt2.train.benchmarks measures both, and the single GEMM is faster.
"""
from __future__ import annotations

import numpy as np

from common import expect_array, out_array


def weight_splits(N: int, n_in: int, n_out: int) -> int:
    """A split count: enough 128 x 128 output tiles for two per SM, each chunk at least 256 rows, N divisible
    by the count (a fixed function of the shape: deterministic)."""
    from common import device_info
    tiles, target, S = -(-n_in // 128) * -(-n_out // 128), 2 * device_info()["multiprocessors"], 1
    while tiles * S < target and N % (2 * S) == 0 and N // (2 * S) >= 256:
        S *= 2
    return S


def weight_grad_split(x, dy, out=None, splits: int | None = None):
    """dW = x^T dy (x (N, n_in), dy (N, n_out) -> (n_in, n_out)) as `splits` partial products over row chunks
    and a sum in a fixed order (None: weight_splits' choice; 1: the mainline's ops.weight_grad)."""
    import cupy as cp
    from step4_gpt2.train import ops
    x = expect_array(x, "x", dtype=np.float32, ndim=2)
    N, n_in = x.shape
    dy = expect_array(dy, "dy", dtype=np.float32, shape=(N, None))
    n_out = dy.shape[1]
    S = weight_splits(N, n_in, n_out) if splits is None else splits
    if isinstance(S, bool) or not isinstance(S, (int, np.integer)) or S < 1 or N % S:
        raise ValueError(f"splits: expected a positive divisor of N={N} (or None), got {splits!r}")
    if S == 1:
        return ops.weight_grad(x, dy, out=out)
    out = out_array(out, (n_in, n_out))
    n = N // S
    part = cp.matmul(x.reshape(S, n, n_in).transpose(0, 2, 1), dy.reshape(S, n, n_out))
    return cp.sum(part, axis=0, out=out)
