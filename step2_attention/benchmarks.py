"""Step 2a benchmark rows: softmax (98304 x 1024 fp32), matmul (4096^3 fp32) and the naive / cuBLAS-based
attention sweep (B=8, H=12, D=64, causal, T = 128 .. 2048). Anchors are measured in the same run.

Conventions: softmax GB/s count one read + one write of the matrix (the floor), whatever a version really
moves; its ceiling is the measured device-to-device copy bandwidth. Matmul TFLOP/s = 2*M*N*K / time.
Attention TFLOP/s = ops.attention_flops(B, H, T, D, causal=True) / time = 2*B*H*T*T*D (the two matmuls'
4*B*H*T*T*D halved for the causal mask, the FlashAttention convention). cuBLAS runs through cupy.matmul in
FP32 (CuPy uses TF32 only when CUPY_TF32=1 is set; this module refuses to run with it set).
"""
from __future__ import annotations

import os

from common import bench, copy_bandwidth, rand, torch_cuda
from common.benchmarks import Row

SOFTMAX_SHAPE = (98304, 1024)
MATMUL_N = 4096
ATTN = dict(B=8, H=12, D=64)
ATTN_T = (128, 256, 512, 1024, 2048)
MATMUL_V3_ALTERNATIVES = ({"BK": 16, "MIN_BLOCKS": 1},)   # BK=16 needs > 128 registers


def softmax_rows() -> list[Row]:
    import cupy as cp
    from step2_attention import ops
    rows_, cols = SOFTMAX_SHAPE
    x = cp.asarray(rand(rows_, cols, seed=0, low=-4, high=4))
    y = cp.empty_like(x)
    nbytes = 8 * x.size
    size = f"{rows_}x{cols}"
    ceiling = ("copy bw", copy_bandwidth())
    torch = torch_cuda()
    t_torch = None
    if torch is not None:
        xt = torch.from_dlpack(x)
        torch.cuda.synchronize()
        t_torch = bench(lambda: torch.softmax(xt, -1), name="torch.softmax", bytes=nbytes)
    out = []
    for v in ops.SOFTMAX_VERSIONS:
        t = bench(lambda v=v: ops.softmax(x, version=v, out=y), name=f"softmax_v{v}", bytes=nbytes)
        anchor = ("torch.softmax", t_torch) if t_torch else None
        if v == 4:
            out.append(Row.of(t, size, ceiling=ceiling, anchor=anchor, target=("fraction", 0.9)))
            if t_torch:
                r = Row.of(t, size, ceiling=ceiling, anchor=anchor, target=("ratio", 1.0))
                r.name = "softmax_v4 (vs torch)"
                out.append(r)
        else:
            out.append(Row.of(t, size, ceiling=ceiling, anchor=anchor))
    if t_torch:
        out.append(Row.of(t_torch, size, ceiling=ceiling))
    return out


def matmul_rows() -> list[Row]:
    import cupy as cp
    from step2_attention import ops
    from step2_attention.lab import tiles as lab_tiles
    n = MATMUL_N
    a, b = cp.asarray(rand(n, n, seed=1)), cp.asarray(rand(n, n, seed=2))
    c = cp.empty((n, n), cp.float32)
    flops = 2.0 * n ** 3
    size = f"{n}^3 fp32"
    t_cublas = bench(lambda: cp.matmul(a, b, out=c), name="cuBLAS (cupy.matmul, FP32)", flops=flops)
    out = []
    for v in ops.MATMUL_VERSIONS:
        t = bench(lambda v=v: ops.matmul(a, b, version=v, out=c), name=f"matmul_v{v}", flops=flops)
        out.append(Row.of(t, size, anchor=("cuBLAS", t_cublas), target=("ratio", 0.6) if v == 3 else None))
    for alt in MATMUL_V3_ALTERNATIVES:
        cfg = {**ops.MATMUL_V3, **alt}
        label = " ".join(f"{k}={cfg[k]}" for k in ("BM", "BN", "BK", "TM", "TN"))
        t = bench(lambda cfg=cfg: lab_tiles.matmul(a, b, version=3, out=c, config=cfg), name=f"matmul_v3 {label}",
                  flops=flops)
        out.append(Row.of(t, size, anchor=("cuBLAS", t_cublas)))
    out.append(Row.of(t_cublas, size))
    return out


def attention_rows() -> list[Row]:
    import cupy as cp
    from step2_attention import ops
    B, H, D = ATTN["B"], ATTN["H"], ATTN["D"]
    out = []
    for T in ATTN_T:
        q, k, v = (cp.asarray(rand(B, H, T, D, seed=s)) for s in (3, 4, 5))
        o = cp.empty_like(q)
        flops = ops.attention_flops(B, H, T, D, causal=True)
        size = f"B{B} H{H} T{T} D{D}"
        t_cub = bench(lambda: ops.attention_cublas(q, k, v, causal=True), name="attention_cublas fp32", flops=flops)
        t_naive = bench(lambda: ops.attention_naive(q, k, v, causal=True, out=o), name="attention_naive fp32",
                        flops=flops)
        out.append(Row.of(t_naive, size, anchor=("attention_cublas", t_cub)))
        out.append(Row.of(t_cub, size))
        del q, k, v, o
        cp.get_default_memory_pool().free_all_blocks()
    return out


def run() -> list[Row]:
    if os.environ.get("CUPY_TF32", "0") not in ("", "0"):
        raise RuntimeError("CUPY_TF32 is set: cuBLAS would use TF32 and the fp32 anchors would be wrong; unset it")
    return softmax_rows() + matmul_rows() + attention_rows()
