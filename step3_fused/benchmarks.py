"""Step 3 benchmark rows (python -m common.benchmarks --only step3_fused): fused residual + LayerNorm vs torch
and the bytes floor, LayerNorm versions, the attention sublayer fused vs unfused vs torch, the decode tail's
schedules (separate / two kernels / one kernel), conv2d + bias + ReLU and the over-fused LayerNorm + GEMM.
fp32 everywhere, TF32 off on every side (CuPy's cuBLAS is fp32 unless CUPY_TF32=1)."""
from __future__ import annotations

import math

from common import bench, capture_graph, copy_bandwidth, device_info, rand, torch_cuda
from common.benchmarks import Row

N_LN, C_LN = 8192, 768
B_SUB, T_SUB, C_SUB, H_SUB = 8, 1024, 768, 12


def unavailable(name: str, size: str, reason: str, target: bool = False) -> Row:
    """A row that could not be measured here, with the reason in its name (ms is NaN). target=True: it stands
    for a row that has a reference value, recorded as "n/a" in the JSON."""
    return Row(f"{name} [unavailable: {reason[:80]}]", size, float("nan"), target="n/a" if target else "")


def torch_residual_layernorm(torch):
    F = torch.nn.functional

    def f(x, r, w, b):
        s = x + r
        return s, F.layer_norm(s, (s.shape[-1],), w, b, 1e-5)
    return f


def torch_sublayer(torch, p: dict, n_head: int):
    """GPT-2's attention sublayer + ln_2 in torch eager (LayerNorm, Linear, SDPA, Linear, add, LayerNorm)."""
    F = torch.nn.functional
    t = {k: torch.from_dlpack(v) for k, v in p.items()}
    w_qkv, w_proj = t["w_qkv"].t().contiguous(), t["w_proj"].t().contiguous()     # nn.Linear layout

    def f(x):
        B, T, C = x.shape
        h = F.layer_norm(x, (C,), t["ln1_w"], t["ln1_b"], 1e-5)
        q, k, v = F.linear(h, w_qkv, t["b_qkv"]).split(C, dim=2)
        q, k, v = (z.view(B, T, n_head, C // n_head).transpose(1, 2) for z in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        r = x + F.linear(o, w_proj, t["b_proj"])
        return r, F.layer_norm(r, (C,), t["ln2_w"], t["ln2_b"], 1e-5)
    return f


def sublayer_flops(B, T, C, H) -> float:
    N = B * T
    return 2.0 * N * C * 3 * C + 2.0 * N * C * C + 4.0 * B * H * T * T * (C // H) / 2


def residual_rows() -> list[Row]:
    import cupy as cp
    from step3_fused import ops
    N, C = N_LN, C_LN
    size = f"{N}x{C}"
    x, p = cp.asarray(rand(N, C, seed=1)), cp.asarray(rand(N, C, seed=2))
    w, b = cp.asarray(rand(C, seed=3, low=0.5, high=1.5)), cp.asarray(rand(C, seed=4))
    r, y = cp.empty_like(x), cp.empty_like(x)
    nbytes = 4.0 * 4 * N * C              # read x, proj; write r, y: the floor
    t = bench(lambda: ops.residual_layernorm(x, p, None, w, b, out_residual=r, out_ln=y),
              name="fused residual+LayerNorm", bytes=nbytes)
    rows = [Row.of(t, size, ceiling=("copy bw", copy_bandwidth()), target=("fraction", 0.87))]
    t_un = bench(lambda: (ops.add(x, p, out=r), ops.layernorm(r, w, b, out=y)),
                 name="residual add + LayerNorm (2 kernels)", bytes=4.0 * 5 * N * C)
    rows.append(Row.of(t_un, size, ceiling=("copy bw", copy_bandwidth())))
    rows.append(Row.of(t, size, anchor=("add + LayerNorm kernels", t_un)))
    torch = torch_cuda()
    if torch is None:
        rows.append(unavailable("fused residual+LN vs torch", size, "torch with CUDA not installed", target=True))
        return rows
    xt, pt, wt, bt = (torch.from_dlpack(a) for a in (x, p, w, b))
    f = torch_residual_layernorm(torch)
    t_eager = bench(lambda: f(xt, pt, wt, bt), name="torch eager x + r, F.layer_norm", bytes=4.0 * 5 * N * C)
    rows.append(Row.of(t_eager, size, ceiling=("copy bw", copy_bandwidth())))
    row = Row.of(t, size, anchor=("torch eager", t_eager), target=("ratio", 1.6))
    row.name = "fused residual+LN vs torch eager"
    rows.append(row)
    try:
        fc = torch.compile(f)
        fc(xt, pt, wt, bt)
        torch.cuda.synchronize()
        t_comp = bench(lambda: fc(xt, pt, wt, bt), name="torch.compile x + r, F.layer_norm", bytes=nbytes)
        rows.append(Row.of(t_comp, size, ceiling=("copy bw", copy_bandwidth())))
        row = Row.of(t, size, anchor=("torch.compile", t_comp), target=("ratio", 1.0))
        row.name = "fused residual+LN vs torch.compile"
        rows.append(row)
    except Exception as e:   # inductor needs triton and a C compiler; report instead of failing the table
        rows.append(unavailable("fused residual+LN vs torch.compile", size, f"{type(e).__name__}: {e}", target=True))
    return rows


def layernorm_rows() -> list[Row]:
    import cupy as cp
    from step3_fused import ops
    N, C = N_LN, C_LN
    x = cp.asarray(rand(N, C, seed=1))
    w, b = cp.asarray(rand(C, seed=3, low=0.5, high=1.5)), cp.asarray(rand(C, seed=4))
    y = cp.empty_like(x)
    rows, ts = [], {}
    for v in ops.LAYERNORM_VERSIONS:
        ts[v] = bench(lambda: ops.layernorm(x, w, b, version=v, out=y), name=f"layernorm v{v}", bytes=8.0 * N * C)
    torch = torch_cuda()
    anchor = None
    if torch is not None:
        xt, wt, bt = (torch.from_dlpack(a) for a in (x, w, b))
        anchor = ("torch F.layer_norm", bench(lambda: torch.nn.functional.layer_norm(xt, (C,), wt, bt, 1e-5),
                                              name="torch F.layer_norm", bytes=8.0 * N * C))
    for v, t in ts.items():
        rows.append(Row.of(t, f"{N}x{C}", ceiling=("copy bw", copy_bandwidth()), anchor=anchor))
    return rows


def sublayer_rows() -> list[Row]:
    import cupy as cp
    from step3_fused import ops
    B, T, C, H = B_SUB, T_SUB, C_SUB, H_SUB
    size = f"B{B} T{T} C{C} H{H}"
    flops = sublayer_flops(B, T, C, H)
    x = cp.asarray(rand(B, T, C, seed=1, low=-2, high=2))
    p = ops.sublayer_params(C, seed=2)
    rows, t = [], {}
    for fused in (False, True):
        label = "fused" if fused else "unfused"
        try:
            sub = ops.AttentionSublayer(x, p, H, fused=fused)
        except ImportError as e:
            rows.append(unavailable(f"attention sublayer {label}", size, f"step 2 missing: {e}"))
            continue
        t[label] = bench(sub, name=f"attention sublayer {label} ({sub.launches} launches)", flops=flops)
        rows.append(Row.of(t[label], size))
        for name, ts in sub.stage_times(target_ms=100):      # napkin bytes -> GB/s per stage
            ts.name = f"  {label}: {name}"
            rows.append(Row.of(ts, size, ceiling=("copy bw", copy_bandwidth())))
    if "fused" in t and "unfused" in t:
        row = Row.of(t["fused"], size, anchor=("unfused pipeline", t["unfused"]), target=("ratio", 1.25))
        row.name = "fused sublayer vs unfused"
        rows.append(row)
    torch = torch_cuda()
    if torch is None:
        rows.append(unavailable("fused sublayer vs torch eager", size, "torch with CUDA not installed", target=True))
    elif "fused" in t:
        f = torch_sublayer(torch, p, H)
        xt = torch.from_dlpack(x)
        t_t = bench(lambda: f(xt), name="torch eager sublayer (SDPA)", flops=flops)
        rows.append(Row.of(t_t, size))
        row = Row.of(t["fused"], size, anchor=("torch eager", t_t), target=("ratio", 1.1))
        row.name = "fused sublayer vs torch eager"
        rows.append(row)
    return rows


def decode_case(B: int, L: int, H: int = 12, D: int = 64, seed: int = 0):
    """Inputs of the decode tail at batch B with L cached tokens per sequence (GPT-2 small's head shape)."""
    import cupy as cp
    C = H * D
    bound = 1 / math.sqrt(C)
    return dict(q=cp.asarray(rand(B, H, D, seed=seed)), k_cache=cp.asarray(rand(B, H, L, D, seed=seed + 1)),
                v_cache=cp.asarray(rand(B, H, L, D, seed=seed + 2)), lengths=cp.full(B, L, dtype=cp.int32),
                x=cp.asarray(rand(B, C, seed=seed + 3)),
                w_proj=cp.asarray(rand(C, C, seed=seed + 4, low=-bound, high=bound)),
                b_proj=cp.asarray(rand(C, seed=seed + 5)), ln_w=cp.asarray(rand(C, seed=seed + 6)),
                ln_b=cp.asarray(rand(C, seed=seed + 7)))


def decode_bytes(B: int, L: int, H: int = 12, D: int = 64) -> float:
    """The floor: the cache, W_proj and the small vectors once."""
    C = H * D
    return 4.0 * (2 * B * H * L * D + C * C + B * C * 4)


def decode_call(schedule: str, case: dict, graph: bool = False):
    """A call of ops.decode_sublayer(schedule) on preallocated buffers, to time with common.bench (its bytes:
    decode_bytes). graph=True: the call captured once as a CUDA graph and replayed on the current stream (one
    launch, no Python between kernels); capturing raises for the separate schedules, since CuPy refuses cuBLAS
    calls in a capture. The returned function's `outputs` are the (r, y) buffers every call rewrites. bench's
    `median_ms` is the GPU's time (it queues the call behind GPU work that outlasts the host's time to issue it,
    so the host's work is hidden); `host_median_ms` is that host work per call; `wall_median_ms` is the host clock
    around one call + synchronize from an idle GPU, the host's work and the GPU's idle time included."""
    import cupy as cp
    from step3_fused import ops
    B, C = case["x"].shape
    r, y = cp.empty_like(case["x"]), cp.empty_like(case["x"])
    attn, proj = cp.empty((B, C), cp.float32), cp.empty((B, C), cp.float32)
    ws = (cp.zeros((B, C), cp.float32), cp.zeros(B, cp.int32))

    def call():
        ops.decode_sublayer(**case, schedule=schedule, out_residual=r, out_ln=y, workspace=ws, attn_out=attn,
                            proj_out=proj)
    call()                                  # compiles the kernels: nothing may compile during a capture
    if not graph:
        call.outputs = (r, y)
        return call
    stream = cp.cuda.Stream(non_blocking=True)
    g = capture_graph(call, stream)
    stream.synchronize()

    def replay():
        g.launch()
    replay.outputs = (r, y)                 # what each call writes (tests read it)
    return replay


def decode_rows() -> list[Row]:
    from step3_fused import ops
    rows = []
    for B in (1, 8, 64):
        L = 1024
        case = decode_case(B, L)
        size = f"B{B} L{L} C768"
        for graph in (False, True):
            ts = {}
            for v in ops.DECODE_SCHEDULES:
                try:
                    ts[v] = bench(decode_call(v, case, graph), name=f"decode {v}" + (" (graph)" if graph else ""),
                                  bytes=decode_bytes(B, L))
                except Exception as e:     # CuPy refuses cuBLAS calls during stream capture
                    rows.append(unavailable(f"decode {v}" + (" (graph)" if graph else ""), size,
                                            f"{type(e).__name__}: {e}"))
                    continue
                anchor = ("separate", ts["separate"]) if v != "separate" and "separate" in ts else None
                rows.append(Row.of(ts[v], size, ceiling=("copy bw", copy_bandwidth()), anchor=anchor))
            if not graph:       # what a Python loop waiting on each call sees: launches + host work included
                for v, t in ts.items():
                    row = Row(f"decode {v} host wall (idle GPU)", size, t.wall_median_ms)
                    if v != "separate" and "separate" in ts:
                        row.anchor, row.ratio = "separate host wall", ts["separate"].wall_median_ms / t.wall_median_ms
                    rows.append(row)
    return rows


def conv_rows() -> list[Row]:
    import cupy as cp
    from step3_fused import ops
    N, Cin, H, W, Cout = 8, 64, 56, 56, 64
    size = f"{N}x{Cin}x{H}x{W}->{Cout}"
    x, w = cp.asarray(rand(N, Cin, H, W, seed=1)), cp.asarray(rand(Cout, Cin, 3, 3, seed=2, low=-0.1, high=0.1))
    b = cp.asarray(rand(Cout, seed=3))
    y = cp.empty((N, Cout, H, W), cp.float32)
    flops = 2.0 * N * Cout * H * W * Cin * 9
    t_un = bench(lambda: ops.conv2d_bias_relu(x, w, b, fused=False, out=y), name="conv2d, bias, relu (3 kernels)", flops=flops)
    t_f = bench(lambda: ops.conv2d_bias_relu(x, w, b, fused=True, out=y), name="conv2d+bias+relu fused", flops=flops)
    rows = [Row.of(t_un, size), Row.of(t_f, size, anchor=("3 kernels", t_un))]
    torch = torch_cuda()
    if torch is not None:
        xt, wt, bt = (torch.from_dlpack(a) for a in (x, w, b))
        t_t = bench(lambda: torch.relu(torch.nn.functional.conv2d(xt, wt, bt, padding=1)),
                    name="torch cuDNN conv2d + relu", flops=flops)
        rows.append(Row.of(t_t, size))
        row = Row.of(t_f, size, anchor=("torch cuDNN", t_t))
        row.name = "conv2d+bias+relu fused vs cuDNN"
        rows.append(row)
    return rows


OVERFUSE_TILES = ((4, 1), (8, 4), (16, 8), (32, 8))


def overfuse_tiles(C: int) -> tuple[list, list]:
    """(tiles this GPU can launch at row length C, tiles whose shared memory exceeds its opt-in limit)."""
    from step3_fused import ops
    limit = device_info()["shared_per_block_optin"]
    ok = [t for t in OVERFUSE_TILES if ops.overfused_smem(t[0], C) <= limit]
    return ok, [t for t in OVERFUSE_TILES if t not in ok]


def overfuse_rows() -> list[Row]:
    import cupy as cp
    from step3_fused import ops
    N, C, M = 8192, 768, 3072
    size = f"{N}x{C} @ {C}x{M}"
    x = cp.asarray(rand(N, C, seed=1))
    lw, lb = cp.asarray(rand(C, seed=2, low=0.5, high=1.5)), cp.asarray(rand(C, seed=3))
    w, b = cp.asarray(rand(C, M, seed=4, low=-0.05, high=0.05)), cp.asarray(rand(M, seed=5))
    h, y = cp.empty_like(x), cp.empty((N, M), cp.float32)
    flops = 2.0 * N * C * M

    def separate():
        ops.layernorm(x, lw, lb, out=h)
        cp.matmul(h, w, out=y)
        ops.bias_add_rows(y, b, out=y)
    t_sep = bench(separate, name="LayerNorm + cuBLAS GEMM + bias (3 kernels)", flops=flops)
    rows = [Row.of(t_sep, size)]
    tiles, skipped = overfuse_tiles(C)
    for rr, cc in skipped:
        rows.append(unavailable(f"over-fused LN+GEMM {rr}x{cc}", size,
                                f"needs {ops.overfused_smem(rr, C)} B shared memory, this GPU allows "
                                f"{device_info()['shared_per_block_optin']}"))
    for rr, cc in tiles:
        k = ops.overfused_kernel(rr, cc)
        t = bench(lambda: ops.ln_linear_overfused(x, lw, lb, w, b, rows=rr, cols=cc, out=y), repeat=10,
                  name=f"over-fused LN+GEMM {rr}x{cc} ({k.num_regs} regs, {k.local_size_bytes} B local)", flops=flops)
        rows.append(Row.of(t, size, anchor=("LN + cuBLAS", t_sep)))
    return rows


def run() -> list[Row]:
    return [*residual_rows(), *layernorm_rows(), *sublayer_rows(), *decode_rows(), *conv_rows(), *overfuse_rows()]
