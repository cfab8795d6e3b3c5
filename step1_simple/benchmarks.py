"""Step 1 rows of the benchmark table: elementwise versions, the first fusion, reductions, GPU vs CPU."""
from __future__ import annotations

import numpy as np

from common import bench, copy_bandwidth, device_info
from common.benchmarks import Row
from step1_simple import ops
from step1_simple.lab import tuning

N = 256 * 2 ** 20          # 256M fp32 = 1 GiB per array: far larger than any L2


def _cupy_axpb():
    import cupy as cp
    return cp.ElementwiseKernel("float32 x, float32 a, float32 b", "float32 y", "y = a * x + b", "course_axpb")


def _data():
    """One 256M random input (1 GiB: far larger than any L2) and an output, shared by the families."""
    import cupy as cp
    rng = cp.random.default_rng(0)
    x = rng.uniform(-1, 1, N, dtype=cp.float32)
    return rng, x, cp.empty_like(x), ("copy", copy_bandwidth()), device_info()["multiprocessors"]


def axpb_rows(data=None) -> list[Row]:
    """axpb v1..v4 (and v4 tuned) against CuPy's ElementwiseKernel; GPU vs one NumPy thread."""
    _, x, y, ceiling, sms = data or _data()
    rows = []
    kern = _cupy_axpb()
    t_cupy = bench(lambda: kern(x, np.float32(2), np.float32(1), y), name="CuPy ElementwiseKernel a*x+b", bytes=8 * N)
    axpb = {v: bench(lambda v=v: ops.axpb(x, 2.0, 1.0, out=y, version=v), name=f"axpb v{v}", bytes=8 * N)
            for v in ops.AXPB_VERSIONS}
    tuned = [bench(lambda u=u, g=g: tuning.axpb(x, 2.0, 1.0, out=y, version=4, unroll=u, grid=g * sms), bytes=8 * N,
                   name=f"axpb v4 tuned (UNROLL={u}, {g} blocks/SM)") for u in (2, 4, 8) for g in (4, 8, 16)]
    axpb["v4 tuned"] = min(tuned, key=lambda t: t.median_ms)
    best = max(axpb, key=lambda v: axpb[v].gbps)
    for v, t in axpb.items():
        rows.append(Row.of(t, "256M fp32", ceiling, ("CuPy", t_cupy),
                           target=("fraction", 0.92) if v == best else None))
    rows.append(Row.of(t_cupy, "256M fp32", ceiling))

    xh = x[: 2 ** 26].get(); yh = np.empty_like(xh)
    t_np = bench(lambda: (np.multiply(xh, np.float32(2), out=yh), np.add(yh, np.float32(1), out=yh)),
                 name="NumPy a*x+b (CPU, 64M)", bytes=8 * xh.size, cpu=True, repeat=5)
    xs = x[: 2 ** 26]; ys = y[: 2 ** 26]
    t_gpu64 = bench(lambda: ops.axpb(xs, 2.0, 1.0, out=ys, version=4), name="axpb v4 (64M)", bytes=8 * xs.size)
    rows.append(Row.of(t_np, "64M fp32", ceiling))
    rows.append(Row.of(t_gpu64, "64M fp32", ceiling, ("NumPy CPU", t_np)))
    return rows


def fusion_rows(data=None) -> list[Row]:
    """gelu(x*w + b): three zoo kernels against one fused kernel."""
    import cupy as cp
    rng, x, _, ceiling, _ = data or _data()
    n_f = 64 * 2 ** 20
    xf, w, b = x[:n_f], rng.uniform(-1, 1, n_f, dtype=cp.float32), rng.uniform(-1, 1, n_f, dtype=cp.float32)
    t1, t2, yf = cp.empty_like(xf), cp.empty_like(xf), cp.empty_like(xf)
    t_unf = bench(lambda: (ops.zoo("mul", xf, w, out=t1), ops.zoo("add", t1, b, out=t2), ops.zoo("gelu", t2, out=yf)),
                  name="gelu(x*w+b) unfused, 3 kernels", bytes=32 * n_f)
    t_fus = bench(lambda: ops.mul_add_gelu(xf, w, b, out=yf), name="gelu(x*w+b) fused, 1 kernel", bytes=16 * n_f)
    return [Row.of(t_unf, "64M fp32", ceiling), Row.of(t_fus, "64M fp32", ceiling, ("unfused", t_unf))]


def reduce_rows(data=None) -> list[Row]:
    """sum v1..v3 (and v3 tuned) against cupy.sum."""
    import cupy as cp
    rng, _, _, ceiling, sms = data or _data()
    rows = []
    xs = rng.uniform(0.5, 1.5, N, dtype=cp.float32)
    t_cs = bench(lambda: cp.sum(xs), name="cupy.sum", bytes=4 * N)
    sums = {v: bench(lambda v=v: ops.total(xs, version=v), name=f"sum v{v}", bytes=4 * N) for v in ops.SUM_VERSIONS}
    tuned = [bench(lambda u=u, g=g: tuning.total(xs, version=3, unroll=u, grid=g * sms), bytes=4 * N,
                   name=f"sum v3 tuned (UNROLL={u}, {g} blocks/SM)") for u in (2, 4, 8) for g in (4, 8, 16)]
    sums["v3 tuned"] = min(tuned, key=lambda t: t.median_ms)
    best = max(sums, key=lambda v: sums[v].gbps)
    for v, t in sums.items():
        rows.append(Row.of(t, "256M fp32", ceiling, ("cupy.sum", t_cs), target=("fraction", 0.85) if v == best else None))
    rows.append(Row.of(t_cs, "256M fp32", ceiling))
    return rows


def run() -> list[Row]:
    data = _data()
    return axpb_rows(data) + fusion_rows(data) + reduce_rows(data)
