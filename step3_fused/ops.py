"""Python side of step 3: LayerNorm (four versions), the fused residual + bias + LayerNorm, the GPT-2
attention sublayer as an unfused and a fused pipeline, the decode-step sublayer tail (separate kernels,
two kernels, one kernel), and the "when fusion hurts" experiments. Every wrapper checks its arguments
and returns CuPy arrays; with `out=` buffers given, layernorm / residual_layernorm / decode_sublayer
allocate nothing and never synchronise with the host, so they can be captured in a CUDA graph."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common import (expect_array, expect_choice, float4_rows, launch_grid, get_kernel, allow_dynamic_smem, out_array,
                    require_gpu)

HERE = Path(__file__).resolve().parent
LAYERNORM, RESIDUAL_LN = HERE / "layernorm.cu", HERE / "residual_layernorm.cu"
GLUE, DECODE, HURTS = HERE / "sublayer_glue.cu", HERE / "sublayer_decode.cu", HERE / "when_fusion_hurts.cu"
LAYERNORM_VERSIONS = (1, 2, 3, 4)
# Compile-time constants of the .cu files, defined here only and passed as -D defines (the .cu files have no
# defaults), so a launch configuration and its kernel cannot disagree.
LN_BLOCK = 256                # LayerNorm v2..v4 and residual_layernorm: one warp per row, LN_BLOCK // 32 rows a block
GLUE_BLOCK = 256              # the grid-stride glue and convolution kernels
DECODE_BLOCK = 256            # sublayer_decode.cu: threads per (head, sequence) block
OVERFUSE_THREADS = 128        # ln_linear_overfused
KSIZE = 3                     # conv2d_bias_relu's square filter
LN_DEFINES = {"BLOCK": LN_BLOCK}
GLUE_DEFINES = {"BLOCK": GLUE_BLOCK}
HURTS_DEFINES = {"KSIZE": KSIZE, "OVERFUSE_THREADS": OVERFUSE_THREADS, "OVERFUSE_ROWS": 8, "OVERFUSE_COLS": 4}
# Every .cu file of this module with the defines it is compiled with (HEAD_DIM and the over-fused tile vary
# per call; these are the defaults). tests/test_step3_fused.py compiles each one offline with them.
CU_DEFINES = {LAYERNORM: LN_DEFINES, RESIDUAL_LN: LN_DEFINES, GLUE: GLUE_DEFINES,
              DECODE: {"HEAD_DIM": 64, "BLOCK": DECODE_BLOCK}, HURTS: HURTS_DEFINES}


def _rows(x, name="x"):
    x = expect_array(x, name, dtype=np.float32, ndim=2)
    if x.shape[1] == 0:
        raise ValueError(f"{name}: expected at least one column, got shape {x.shape}")
    return x


# ------------------------------------------------------------------------------------ LayerNorm
def layernorm(x, weight, bias, eps: float = 1e-5, version: int = 4, out=None):
    """LayerNorm over the rows of x (N, C) float32 with layernorm_v<version> of layernorm.cu."""
    x = _rows(x)
    N, C = x.shape
    weight = expect_array(weight, "weight", dtype=np.float32, shape=(C,))
    bias = expect_array(bias, "bias", dtype=np.float32, shape=(C,))
    expect_choice(version, "version", LAYERNORM_VERSIONS)
    y = out_array(out, x.shape)
    if N == 0:
        return y
    args = (x, weight, bias, y, np.int32(N), np.int32(C), np.float32(eps))
    if version == 1:
        get_kernel(LAYERNORM, "layernorm_v1", LN_DEFINES)(launch_grid(N, 128), (128,), args)
        return y
    name = {2: "layernorm_v2", 3: "layernorm_v3", 4: "layernorm_v4"}[version]
    if version == 4 and not float4_rows(C, x, weight, bias, y):
        name = "layernorm_v4_scalar"     # C % 4 != 0 or an unaligned view: float loads, same algorithm
    get_kernel(LAYERNORM, name, LN_DEFINES)(launch_grid(N, LN_BLOCK // 32), (LN_BLOCK,), args)
    return y


def residual_layernorm(x, proj, proj_bias, weight, bias, eps: float = 1e-5, out_residual=None, out_ln=None):
    """r = x + proj + proj_bias (proj_bias may be None), y = LayerNorm(r); one kernel. Returns (r, y).
    x, proj (N, C) float32; out_residual may be x itself (the residual stream updated in place)."""
    x = _rows(x)
    N, C = x.shape
    proj = expect_array(proj, "proj", dtype=np.float32, shape=(N, C))
    if proj_bias is not None:
        proj_bias = expect_array(proj_bias, "proj_bias", dtype=np.float32, shape=(C,))
    weight = expect_array(weight, "weight", dtype=np.float32, shape=(C,))
    bias = expect_array(bias, "bias", dtype=np.float32, shape=(C,))
    r = out_array(out_residual, (N, C), name="out_residual")
    y = out_array(out_ln, (N, C), name="out_ln")
    if y.data.ptr in (x.data.ptr, proj.data.ptr, r.data.ptr):
        raise ValueError("out_ln: must not share memory with x, proj or out_residual")
    if N == 0:
        return r, y
    vec = float4_rows(C, x, proj, proj_bias, weight, bias, r, y)
    pb = proj_bias if proj_bias is not None else weight        # any valid pointer; has_bias = 0 ignores it
    get_kernel(RESIDUAL_LN, "residual_layernorm" if vec else "residual_layernorm_scalar", LN_DEFINES)(
        launch_grid(N, LN_BLOCK // 32), (LN_BLOCK,),
        (x, proj, pb, np.int32(proj_bias is not None), weight, bias, r, y, np.int32(N), np.int32(C),
         np.float32(eps)))
    return r, y


# ------------------------------------------------------------------------------------ glue (unfused)
def bias_add_rows(x, bias, out=None):
    """y[n, c] = x[n, c] + bias[c] for x (..., C). out may be x itself (in place)."""
    x = expect_array(x, "x", dtype=np.float32)
    bias = expect_array(bias, "bias", dtype=np.float32, shape=(x.shape[-1],))
    y = out_array(out, x.shape)
    if x.size:
        get_kernel(GLUE, "bias_add_rows", GLUE_DEFINES)(
            launch_grid(x.size, GLUE_BLOCK, per_sm=16), (GLUE_BLOCK,),
            (x, bias, y, np.int64(x.size), np.int32(x.shape[-1])))
    return y


def add(a, b, out=None):
    """y = a + b elementwise; out may be a or b (in place)."""
    a = expect_array(a, "a", dtype=np.float32)
    b = expect_array(b, "b", dtype=np.float32, shape=a.shape)
    y = out_array(out, a.shape)
    if a.size:
        get_kernel(GLUE, "add", GLUE_DEFINES)(launch_grid(a.size, GLUE_BLOCK, per_sm=16), (GLUE_BLOCK,),
                                              (a, b, y, np.int64(a.size)))
    return y


def split_heads(qkv, n_head: int, out=None):
    """(B, T, 3C) -> (q, k, v) each (B, H, T, D). out: optional tuple of three buffers."""
    qkv = expect_array(qkv, "qkv", dtype=np.float32, ndim=3)
    B, T, C3 = qkv.shape
    n_head = _positive_int(n_head, "n_head")
    if C3 % (3 * n_head):
        raise ValueError(f"qkv: last dimension {C3} is not 3 * n_head * head_dim with n_head={n_head}")
    D = C3 // 3 // n_head
    shape = (B, n_head, T, D)
    q, k, v = (out_array(o, shape, name=f"out[{i}]") for i, o in enumerate(out or (None, None, None)))
    if qkv.size:
        get_kernel(GLUE, "split_heads", GLUE_DEFINES)(
            launch_grid(qkv.size // 3, GLUE_BLOCK, per_sm=16), (GLUE_BLOCK,),
            (qkv, q, k, v, np.int32(B), np.int32(T), np.int32(n_head), np.int32(D)))
    return q, k, v


def merge_heads(o, out=None):
    """(B, H, T, D) -> (B, T, H*D)."""
    o = expect_array(o, "o", dtype=np.float32, ndim=4)
    B, H, T, D = o.shape
    y = out_array(out, (B, T, H * D))
    if o.size:
        get_kernel(GLUE, "merge_heads", GLUE_DEFINES)(
            launch_grid(o.size, GLUE_BLOCK, per_sm=16), (GLUE_BLOCK,),
            (o, y, np.int32(B), np.int32(T), np.int32(H), np.int32(D)))
    return y


# ------------------------------------------------------------------------------------ attention sublayer
PARAM_SHAPES = {"ln1_w": ("C",), "ln1_b": ("C",), "w_qkv": ("C", "3C"), "b_qkv": ("3C",),
                "w_proj": ("C", "C"), "b_proj": ("C",), "ln2_w": ("C",), "ln2_b": ("C",)}


def sublayer_params(C: int, seed: int = 0) -> dict:
    """Random GPT-2-shaped attention-sublayer weights (float32 CuPy arrays), never zeros or ones."""
    require_gpu()
    import cupy as cp
    from common import rand
    dims = {"C": C, "3C": 3 * C}
    p = {}
    for i, (name, shape) in enumerate(PARAM_SHAPES.items()):
        shp = tuple(dims[s] for s in shape)
        if name.startswith("ln") and name.endswith("_w"):
            p[name] = cp.asarray(rand(*shp, seed=seed + i, low=0.5, high=1.5))
        elif name.startswith("w_"):
            bound = 1.0 / math.sqrt(C)              # keeps activations O(1), like a trained model
            p[name] = cp.asarray(rand(*shp, seed=seed + i, low=-bound, high=bound))
        else:
            p[name] = cp.asarray(rand(*shp, seed=seed + i, low=-0.1, high=0.1))
    return p


def _check_params(p: dict, C: int) -> dict:
    dims = {"C": C, "3C": 3 * C}
    missing = set(PARAM_SHAPES) - set(p)
    if missing:
        raise KeyError(f"params: missing {sorted(missing)} (expected keys {list(PARAM_SHAPES)})")
    return {k: expect_array(p[k], f"params[{k!r}]", dtype=np.float32, shape=tuple(dims[s] for s in shp))
            for k, shp in PARAM_SHAPES.items()}


@dataclass
class Stage:
    name: str
    fn: object            # callable with no arguments, working on the pipeline's buffers
    bytes: float          # napkin-math DRAM bytes (each tensor read/written once per kernel)
    launches: int         # kernels launched (cuBLAS counted as 1)


class AttentionSublayer:
    """The attention sublayer of a GPT-2 block on preallocated buffers, as a list of stages.

        sub = AttentionSublayer(x, params, n_head, fused=True)
        r, ln2 = sub()                    # run every stage; r, ln2 are sub.r, sub.y, which the next call rewrites
        for s in sub.stages: bench(s.fn)  # or time them one by one

    unfused: ln_1, QKV GEMM, bias add, split heads, naive attention (3 kernels, step 2), merge heads,
             projection GEMM, bias add, residual add, ln_2.
    fused:   ln_1, QKV GEMM, flash attention reading the QKV buffer (bias folded in, heads merged on the
             store; step 2), projection GEMM, residual_layernorm (bias + residual + ln_2).
    """

    def __init__(self, x, params: dict, n_head: int, fused: bool, eps: float = 1e-5,
                 out_residual=None, out_ln=None):
        require_gpu()
        import cupy as cp
        x = expect_array(x, "x", dtype=np.float32, ndim=3)
        B, T, C = x.shape
        if n_head <= 0 or C % n_head:
            raise ValueError(f"n_head: expected a positive divisor of C={C}, got {n_head}")
        p = _check_params(params, C)
        N, D = B * T, C // n_head
        self.x, self.p, self.n_head, self.fused, self.eps = x, p, n_head, fused, eps
        self.r = out_array(out_residual, (B, T, C), name="out_residual")
        self.y = out_array(out_ln, (B, T, C), name="out_ln")
        e = cp.empty
        self.h = e((N, C), cp.float32)
        self.qkv = e((N, 3 * C), cp.float32)
        self.attn = e((B, T, C), cp.float32)
        self.proj = e((N, C), cp.float32)
        f = 4.0
        NC, C2 = N * C, C * C
        xf = x.reshape(N, C)
        st = [Stage("ln_1", lambda: layernorm(xf, p["ln1_w"], p["ln1_b"], eps, out=self.h), f * 2 * NC, 1),
              Stage("QKV GEMM", lambda: cp.matmul(self.h, p["w_qkv"], out=self.qkv), f * (NC + 3 * C2 + 3 * NC), 1)]
        if fused:
            from step2_attention.flash import flash_attention_qkv
            qkv3 = self.qkv.reshape(B, T, 3 * C)
            st += [Stage("flash attention (QKV, bias)",
                         lambda: flash_attention_qkv(qkv3, n_head, causal=True, bias=p["b_qkv"], out=self.attn),
                         f * (3 * NC + NC), 1)]
        else:
            from step2_attention.ops import attention_naive
            self.qkv_b = e((N, 3 * C), cp.float32)
            self.q, self.k, self.v = (e((B, n_head, T, D), cp.float32) for _ in range(3))
            self.o = e((B, n_head, T, D), cp.float32)
            self.proj_b = e((N, C), cp.float32)
            qkv3 = self.qkv_b.reshape(B, T, 3 * C)
            S = B * n_head * T * T          # the score matrix the naive kernels write and read
            st += [Stage("QKV bias add", lambda: bias_add_rows(self.qkv, p["b_qkv"], out=self.qkv_b), f * 6 * NC, 1),
                   Stage("split heads", lambda: split_heads(qkv3, n_head, out=(self.q, self.k, self.v)), f * 6 * NC, 1),
                   Stage("naive attention (3 kernels)",
                         lambda: attention_naive(self.q, self.k, self.v, causal=True, out=self.o),
                         f * ((2 * NC + S) + 2 * S + (S + 2 * NC)), 3),
                   Stage("merge heads", lambda: merge_heads(self.o, out=self.attn), f * 2 * NC, 1)]
        attn2 = self.attn.reshape(N, C)
        st += [Stage("proj GEMM", lambda: cp.matmul(attn2, p["w_proj"], out=self.proj), f * (2 * NC + C2), 1)]
        r2, y2 = self.r.reshape(N, C), self.y.reshape(N, C)
        if fused:
            st += [Stage("bias + residual + ln_2",
                         lambda: residual_layernorm(xf, self.proj, p["b_proj"], p["ln2_w"], p["ln2_b"], eps,
                                                    out_residual=r2, out_ln=y2), f * 4 * NC, 1)]
        else:
            st += [Stage("proj bias add", lambda: bias_add_rows(self.proj, p["b_proj"], out=self.proj_b), f * 2 * NC, 1),
                   Stage("residual add", lambda: add(xf, self.proj_b, out=r2), f * 3 * NC, 1),
                   Stage("ln_2", lambda: layernorm(r2, p["ln2_w"], p["ln2_b"], eps, out=y2), f * 2 * NC, 1)]
        self.stages = st

    def __call__(self):
        for s in self.stages:
            s.fn()
        return self.r, self.y

    @property
    def launches(self) -> int:
        return sum(s.launches for s in self.stages)

    @property
    def bytes(self) -> float:
        return sum(s.bytes for s in self.stages)

    def stage_times(self, **bench_kw) -> list:
        """[(stage name, common.Timing)], each stage timed alone (inputs already computed by a full run)."""
        from common import bench
        self()
        return [(s.name, bench(s.fn, name=s.name, bytes=s.bytes, **bench_kw)) for s in self.stages]


def attention_sublayer_unfused(x, params: dict, n_head: int, eps: float = 1e-5, out_residual=None, out_ln=None):
    """x (B, T, C) -> (x + attn(ln_1(x)) @ W_proj + b_proj, ln_2 of that), with 12 kernel launches."""
    return AttentionSublayer(x, params, n_head, fused=False, eps=eps, out_residual=out_residual, out_ln=out_ln)()


def attention_sublayer_fused(x, params: dict, n_head: int, eps: float = 1e-5, out_residual=None, out_ln=None):
    """Same result as attention_sublayer_unfused with 5 launches: flash attention reads the QKV GEMM's
    output directly (bias folded in) and the projection's bias, the residual and ln_2 are one kernel."""
    return AttentionSublayer(x, params, n_head, fused=True, eps=eps, out_residual=out_residual, out_ln=out_ln)()


# ------------------------------------------------------------------------------------ decode sublayer tail
# Not numbered versions of one kernel but four schedules of the same work: how many kernels it is split into.
DECODE_SCHEDULES = ("separate", "separate-splitk", "two", "fused")
_decode_workspaces: dict = {}


def _decode_defines(D: int) -> dict:
    if D % 32 or not 32 <= D <= 256:
        raise ValueError(f"q: head dimension must be a multiple of 32 between 32 and 256, got {D}")
    return {"HEAD_DIM": D, "BLOCK": DECODE_BLOCK}


def decode_workspace(B: int, C: int):
    """The zeroed (accum (B, C) float32, counter (B,) int32) pair the one- and two-kernel schedules use.
    The kernels leave it zeroed, so one per shape is reused (not safe for concurrent calls on two streams)."""
    require_gpu()
    import cupy as cp
    key = (cp.cuda.Device().id, B, C)
    if key not in _decode_workspaces:
        _decode_workspaces[key] = (cp.zeros((B, C), cp.float32), cp.zeros(B, cp.int32))
    return _decode_workspaces[key]


def _check_decode(q, k_cache, v_cache, lengths):
    q = expect_array(q, "q", dtype=np.float32, ndim=3)
    B, H, D = q.shape
    k_cache = expect_array(k_cache, "k_cache", dtype=np.float32, ndim=4)
    if k_cache.shape[:2] != (B, H) or k_cache.shape[3] != D:
        raise ValueError(f"k_cache: expected shape ({B}, {H}, *, {D}), got {k_cache.shape}")
    v_cache = expect_array(v_cache, "v_cache", dtype=np.float32, shape=k_cache.shape)
    lengths = expect_array(lengths, "lengths", dtype=np.int32, shape=(B,))
    return q, k_cache, v_cache, lengths


def decode_attention_merged(q, k_cache, v_cache, lengths, out=None):
    """Decode attention with the heads merged on the store: returns (B, H*D), the projection GEMM's input.
    One query per sequence against its first lengths[b] cache rows (clamped to [0, Lmax]; 0 gives zeros).
    q (B, H, D), caches (B, H, Lmax, D), lengths int32 (B,) on the GPU. One block per (head, sequence),
    running the same attention code as the fused decode kernel, so the decode schedules differ only in
    fusion (step 2's decode_attention is the split-K one: (B, H, D) out, lengths >= 1)."""
    q, k_cache, v_cache, lengths = _check_decode(q, k_cache, v_cache, lengths)
    B, H, D = q.shape
    y = out_array(out, (B, H * D))
    if B:
        get_kernel(DECODE, "decode_attention_merged", _decode_defines(D))(
            (H, B), (DECODE_BLOCK,), (q, k_cache, v_cache, lengths, y, np.int32(H), np.int32(k_cache.shape[2]),
                             np.float32(1.0 / math.sqrt(D))))
    return y


def decode_sublayer(x, q, k_cache, v_cache, lengths, w_proj, b_proj, ln_w, ln_b, eps: float = 1e-5,
                    schedule: str = "fused", out_residual=None, out_ln=None, workspace=None, attn_out=None,
                    proj_out=None):
    """Decode-step tail: r = x + attention(q, caches) @ w_proj + b_proj, y = LayerNorm(r). Returns (r, y).

    schedule "separate": decode_attention_merged, cupy.matmul, residual_layernorm (3 launches);
             "separate-splitk": the same with step 2's split-K decode_attention (4 launches; lengths >= 1);
             "two":      decode_attention_merged, then projection + bias + residual + LN in one kernel;
             "fused":    all of it in one kernel (see sublayer_decode.cu).
    x (B, C) may be out_residual (in place). b_proj may be None. With every buffer given (out_residual, out_ln,
    workspace = decode_workspace's pair, attn_out and proj_out (B, C) for the schedules that have those
    intermediates) a call allocates nothing, so a CUDA graph can capture it (section 1 of 03c)."""
    import cupy as cp
    q, k_cache, v_cache, lengths = _check_decode(q, k_cache, v_cache, lengths)
    B, H, D = q.shape
    C = H * D
    x = expect_array(x, "x", dtype=np.float32, shape=(B, C))
    w_proj = expect_array(w_proj, "w_proj", dtype=np.float32, shape=(C, C))
    if b_proj is not None:
        b_proj = expect_array(b_proj, "b_proj", dtype=np.float32, shape=(C,))
    ln_w = expect_array(ln_w, "ln_w", dtype=np.float32, shape=(C,))
    ln_b = expect_array(ln_b, "ln_b", dtype=np.float32, shape=(C,))
    expect_choice(schedule, "schedule", DECODE_SCHEDULES)
    r = out_array(out_residual, (B, C), name="out_residual")
    y = out_array(out_ln, (B, C), name="out_ln")
    if B == 0:
        return r, y
    if schedule.startswith("separate"):
        if schedule == "separate":
            attn = decode_attention_merged(q, k_cache, v_cache, lengths, out=attn_out)
        else:       # step 2's flash-decoding: the cache split over many blocks, then a combine kernel
            from step2_attention.flash import decode_attention
            attn = out_array(attn_out, (B, C), name="attn_out")
            decode_attention(q, k_cache, v_cache, lengths, out=attn.reshape(B, H, D))
        proj = cp.matmul(attn, w_proj, out=out_array(proj_out, (B, C), name="proj_out"))
        return residual_layernorm(x, proj, b_proj, ln_w, ln_b, eps, out_residual=r, out_ln=y)
    accum, counter = workspace if workspace is not None else decode_workspace(B, C)
    expect_array(accum, "workspace[0]", dtype=np.float32, shape=(B, C))
    expect_array(counter, "workspace[1]", dtype=np.int32, shape=(B,))
    has_bias = np.int32(b_proj is not None)
    pb = b_proj if b_proj is not None else ln_b
    tail = (x, ln_w, ln_b, accum, counter, r, y)
    if schedule == "two":
        attn = decode_attention_merged(q, k_cache, v_cache, lengths, out=attn_out)
        get_kernel(DECODE, "decode_proj_ln", _decode_defines(D))(
            (H, B), (DECODE_BLOCK,), (attn, w_proj, pb, has_bias, *tail, np.int32(H), np.float32(eps)))
    else:
        get_kernel(DECODE, "decode_sublayer_fused", _decode_defines(D))(
            (H, B), (DECODE_BLOCK,), (q, k_cache, v_cache, lengths, w_proj, pb, has_bias, *tail, np.int32(H),
                             np.int32(k_cache.shape[2]), np.float32(1.0 / math.sqrt(D)), np.float32(eps)))
    return r, y


# ------------------------------------------------------------------------------------ when fusion hurts
def conv2d_bias_relu(x, w, bias, fused: bool = True, out=None):
    """relu(conv2d(x, w) + bias): NCHW, stride 1, "same" zero padding, w (Cout, Cin, KSIZE, KSIZE).
    fused=False runs conv2d, bias_add_nchw and relu_inplace (3 launches) instead of one kernel."""
    x = expect_array(x, "x", dtype=np.float32, ndim=4)
    N, Cin, H, W = x.shape
    w = expect_array(w, "w", dtype=np.float32, ndim=4)
    if w.shape[1:] != (Cin, KSIZE, KSIZE):
        raise ValueError(f"w: expected shape (Cout, {Cin}, {KSIZE}, {KSIZE}), got {w.shape}")
    Cout = w.shape[0]
    bias = expect_array(bias, "bias", dtype=np.float32, shape=(Cout,))
    y = out_array(out, (N, Cout, H, W))
    n = y.size
    if n == 0:
        return y
    grid = launch_grid(n, GLUE_BLOCK, per_sm=16)
    dims = (np.int32(N), np.int32(Cin), np.int32(H), np.int32(W), np.int32(Cout))
    if fused:
        get_kernel(HURTS, "conv2d_bias_relu", HURTS_DEFINES)(grid, (GLUE_BLOCK,), (x, w, bias, y, *dims))
    else:
        get_kernel(HURTS, "conv2d", HURTS_DEFINES)(grid, (GLUE_BLOCK,), (x, w, y, *dims))
        get_kernel(HURTS, "bias_add_nchw", HURTS_DEFINES)(
            grid, (GLUE_BLOCK,), (y, bias, np.int64(n), np.int32(Cout), np.int32(H * W)))
        get_kernel(HURTS, "relu_inplace", HURTS_DEFINES)(grid, (GLUE_BLOCK,), (y, np.int64(n)))
    return y


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return int(value)


def overfused_smem(rows: int, C: int) -> int:
    """Dynamic shared memory of ln_linear_overfused: the tile's rows of normalised x, fp32."""
    return _positive_int(rows, "rows") * C * 4


def overfused_kernel(rows: int = HURTS_DEFINES["OVERFUSE_ROWS"], cols: int = HURTS_DEFINES["OVERFUSE_COLS"]):
    """The ln_linear_overfused kernel compiled for a tile of rows x cols accumulators per thread."""
    rows, cols = _positive_int(rows, "rows"), _positive_int(cols, "cols")
    return get_kernel(HURTS, "ln_linear_overfused", {**HURTS_DEFINES, "OVERFUSE_ROWS": rows, "OVERFUSE_COLS": cols})


def ln_linear_overfused(x, ln_w, ln_b, w, bias, eps: float = 1e-5, rows: int = HURTS_DEFINES["OVERFUSE_ROWS"],
                        cols: int = HURTS_DEFINES["OVERFUSE_COLS"], out=None):
    """LayerNorm(x) @ w + bias in one naive kernel (x (N, C), w (C, M)); see when_fusion_hurts.cu (b)."""
    x = _rows(x)
    N, C = x.shape
    ln_w = expect_array(ln_w, "ln_w", dtype=np.float32, shape=(C,))
    ln_b = expect_array(ln_b, "ln_b", dtype=np.float32, shape=(C,))
    w = expect_array(w, "w", dtype=np.float32, ndim=2)
    if w.shape[0] != C:
        raise ValueError(f"w: expected shape ({C}, M), got {w.shape}")
    M = w.shape[1]
    bias = expect_array(bias, "bias", dtype=np.float32, shape=(M,))
    y = out_array(out, (N, M))
    rows, cols = _positive_int(rows, "rows"), _positive_int(cols, "cols")
    smem = overfused_smem(rows, C)
    k = overfused_kernel(rows, cols)
    allow_dynamic_smem(k, smem, f"rows: {rows} rows of C={C} floats")
    if N == 0 or M == 0:
        return y
    grid = (-(-N // rows), -(-M // (OVERFUSE_THREADS * cols)))
    k(grid, (OVERFUSE_THREADS,), (x, ln_w, ln_b, w, bias, y, np.int32(N), np.int32(C), np.int32(M), np.float32(eps)),
      shared_mem=smem)
    return y
