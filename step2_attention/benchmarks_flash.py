"""Steps 2b and 2c benchmark rows: attention at B=8, H=12, D=64, causal, T = 128 .. 2048 (fused fp32, tensor
cores fp16/bf16, torch SDPA when installed), tile-size sweeps at T=1024, and decode attention vs the
bytes floor. The naive and cuBLAS-based lines of the same sweep are benchmarks.py's (measured once, there);
the fused kernel's "vs naive" target uses one naive measurement at T=1024 here. FLOPs: 4*B*H*T*T*D / 2 for
causal attention (only the visible half counts, the FlashAttention convention), the same count for every row."""
from __future__ import annotations

from common import bench, copy_bandwidth, rand, torch_cuda
from common.benchmarks import Row

B, H, D = 8, 12, 64
TS = (128, 256, 512, 1024, 2048)
TARGET_T = 1024


SDPA_BACKENDS = {"fp32": "EFFICIENT_ATTENTION", "fp16": "FLASH_ATTENTION", "bf16": "FLASH_ATTENTION"}


def have_sdpa() -> bool:
    """torch with CUDA and torch.nn.attention's backend selection (torch >= 2.3)."""
    if torch_cuda() is None:
        return False
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
    except ImportError:
        return False
    return True


def torch_sdpa(q, k, v, dtype: str = "fp32", causal: bool = True, pinned: bool = True):
    """A zero-argument callable that runs torch's scaled_dot_product_attention on copies of the float32
    CuPy arrays q, k, v (B, H, T, D) converted to dtype ("fp32", "fp16" or "bf16"), pinned to one backend:
    memory-efficient for fp32, flash for fp16/bf16 (TF32 off); pinned=False leaves the choice to torch
    (its default: cuDNN's attention on Hopper with recent torch). Check have_sdpa() first."""
    torch = torch_cuda()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    backend = getattr(SDPBackend, SDPA_BACKENDS[dtype])
    tq, tk, tv = (torch.as_tensor(x, device="cuda").to(tdt) for x in (q, k, v))
    f = torch.nn.functional.scaled_dot_product_attention

    def run():
        if not pinned:
            return f(tq, tk, tv, is_causal=causal)
        with sdpa_kernel(backend):
            return f(tq, tk, tv, is_causal=causal)
    return run


def attention_rows(ts=TS) -> list[Row]:
    import cupy as cp
    from step2_attention import flash, ops
    rows = []
    sdpa = have_sdpa()
    for T in ts:
        q, k, v = (cp.asarray(rand(B, H, T, D, seed=i)) for i in range(3))
        flops = ops.attention_flops(B, H, T, D, causal=True)
        size = f"B{B} H{H} T{T} D{D}"
        tgt = T == TARGET_T
        out = cp.empty_like(q)
        t_fused = bench(lambda: flash.flash_attention(q, k, v, out=out), name="flash fp32 v3", flops=flops)
        if tgt:   # the naive sweep itself is benchmarks.py's; one measurement here for the target's ratio
            t_naive = bench(lambda: ops.attention_naive(q, k, v, out=out), name="attention naive (3 kernels)",
                            flops=flops)
            rows.append(Row.of(t_fused, size, anchor=("naive", t_naive), target=("ratio", 3.0)))
        else:
            rows.append(Row.of(t_fused, size))
        if sdpa:
            t_torch32 = bench(torch_sdpa(q, k, v, "fp32"), name="torch SDPA fp32 (mem-efficient)", flops=flops)
            rows.append(Row.of(t_torch32, size))
            rows.append(Row.of(t_fused, size, anchor=("torch fp32", t_torch32),
                               target=("ratio", 1.0) if tgt else None))
        for dtype in ("fp16", "bf16"):
            try:
                if dtype == "fp16":
                    flash.require_arch(75, "fp16 tensor-core attention")
                    qh, kh, vh = (x.astype(cp.float16) for x in (q, k, v))
                else:
                    flash.require_arch(80, "bf16 tensor cores")
                    qh, kh, vh = (flash.to_bf16(x) for x in (q, k, v))
            except RuntimeError as e:
                print(f"skipping {dtype} tensor cores: {e}")
                continue
            oh = cp.empty_like(qh)
            t_tc = bench(lambda: flash.flash_attention_tc(qh, kh, vh, out=oh), name=f"flash tensor cores {dtype}",
                         flops=flops)
            if sdpa:
                t_t = bench(torch_sdpa(q, k, v, dtype), name=f"torch SDPA {dtype} (flash)", flops=flops)
                rows.append(Row.of(t_t, size))
                rows.append(Row.of(t_tc, size, anchor=(f"torch {dtype}", t_t),
                                   target=("ratio", 0.5) if tgt and dtype == "bf16" else None))
            else:
                rows.append(Row.of(t_tc, size, anchor=("fp32 flash", t_fused)))
        del q, k, v, out
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def tile_rows(T=TARGET_T) -> list[Row]:
    """The compile-time tile sizes, measured: what flash.TILES / flash.TC_TILES defaults were chosen from."""
    import cupy as cp
    from step2_attention import flash, ops
    from step2_attention.lab import tiles as lab_tiles
    q, k, v = (cp.asarray(rand(B, H, T, D, seed=i)) for i in range(3))
    flops = ops.attention_flops(B, H, T, D, causal=True)
    out = cp.empty_like(q)
    rows = []
    for t in ({"BR": 64, "BC": 64, "TM": 4}, {"BR": 64, "BC": 32, "TM": 4}, {"BR": 128, "BC": 64, "TM": 4},
              {"BR": 128, "BC": 32, "TM": 8}, {"BR": 32, "BC": 64, "TM": 2}):
        name = f"flash fp32 v3 BR{t['BR']} BC{t['BC']} TM{t['TM']}"
        if not flash.smem_fits(flash.fp32_smem_bytes(D, t)):
            print(f"skipping {name}: needs {flash.fp32_smem_bytes(D, t):,} B of shared memory per block, "
                  f"more than this GPU allows")
            continue
        rows.append(Row.of(bench(lambda: flash.flash_attention(q, k, v, out=out, tiles=t), name=name, flops=flops),
                           f"T{T}"))
    for v_ in (1, 2):
        rows.append(Row.of(bench(lambda: flash.flash_attention(q, k, v, out=out, version=v_),
                                 name=f"flash fp32 v{v_}", flops=flops), f"T{T}"))
    try:
        flash.require_arch(80, "bf16 tensor cores")
        qb, kb, vb = (flash.to_bf16(x) for x in (q, k, v))
        ob = cp.empty_like(qb)
        for t in ({"WARPS": 4, "BC": 64}, {"WARPS": 8, "BC": 64}, {"WARPS": 4, "BC": 32}, {"WARPS": 8, "BC": 32}):
            name = f"flash tc bf16 WARPS{t['WARPS']} BC{t['BC']}"
            if not flash.smem_fits(flash.tc_smem_bytes(D, t)):
                print(f"skipping {name}: needs {flash.tc_smem_bytes(D, t):,} B of shared memory per block, "
                      f"more than this GPU allows")
                continue
            rows.append(Row.of(bench(lambda: lab_tiles.flash_attention_tc(qb, kb, vb, out=ob, tiles=t), name=name,
                                     flops=flops), f"T{T}"))
    except RuntimeError as e:
        print(f"skipping bf16 tile sweep: {e}")
    return rows


def decode_rows() -> list[Row]:
    import cupy as cp
    from step2_attention import flash
    rows, bw = [], copy_bandwidth()
    for b in (1, 8):
        for L in (256, 1024):
            q = cp.asarray(rand(b, H, D, seed=1))
            kc, vc = (cp.asarray(rand(b, H, L, D, seed=s)) for s in (2, 3))
            lens = cp.full((b,), L, dtype=cp.int32)
            out = cp.empty_like(q)
            nbytes = 2 * b * H * L * D * 4 + 2 * q.nbytes
            t1 = bench(lambda: flash.decode_attention(q, kc, vc, lens, out=out, version=1),
                       name="decode attention v1 (block per head)", bytes=nbytes)
            t2 = bench(lambda: flash.decode_attention(q, kc, vc, lens, out=out, version=2),
                       name=f"decode attention v2 (split-K x{flash.decode_split_count(b, H, L)[0]})", bytes=nbytes)
            size = f"B{b} H{H} L{L} D{D}"
            rows += [Row.of(t1, size, ceiling=("copy bw", bw)),
                     Row.of(t2, size, ceiling=("copy bw", bw), anchor=("v1", t1))]
    return rows


def run() -> list[Row]:
    return attention_rows() + tile_rows() + decode_rows()


def main(argv=None) -> int:
    from common.benchmarks import module_main
    return module_main("step2_attention.benchmarks_flash", __doc__, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
