"""Python side of lesson 01d, the memory model: launch memory_model.cu's handoff versions and its last-block sum.

    counts = handoff(version=3)        # {"handoffs": ..., "correct": ..., "stale": ..., "gave_up": ...}
    total = sum_last_block(x)          # sum of a float32 vector in one launch (0-d float32 CuPy array)
    print(ptx_of("wait_plain"))        # the compiled code of one wait (no GPU needed)

Every spin in memory_model.cu gives up after a number of tries, so no version hangs; the wrapper launches no
more blocks than the GPU holds at once, so every waiting block's partner is running."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from common import expect_array, expect_choice, get_kernel, occupancy, out_array, require_gpu

HERE = Path(__file__).resolve().parent
CU = HERE / "memory_model.cu"
HANDOFF_VERSIONS = (1, 2, 3, 4)
PAYLOAD = 1024          # ints handed over per round (4 KB)
BLOCK = 256             # threads per block, of the handoffs and of the last-block sum
TRIES = 1 << 20         # a spin gives up after this many reads of the flag
CU_DEFINES = {CU: {"PAYLOAD": PAYLOAD, "BLOCK": BLOCK}}
COUNTERS = ("gave_up", "stale", "correct")    # the order of memory_model.cu's GAVE_UP, STALE, CORRECT


def resident_blocks(kernel) -> int:
    """How many blocks of `kernel` (BLOCK threads) the whole GPU holds at once: the most a launch may have when
    its blocks wait for each other."""
    from common import device_info
    return occupancy(kernel, BLOCK)["blocks_per_sm"] * device_info()["multiprocessors"]


def handoff(version: int, pairs: int = 64, rounds: int = 200) -> dict:
    """Run handoff_v<version> with `pairs` producer/consumer pairs of blocks, each handing over `rounds`
    payloads. Returns the counts: handoffs the consumer checked (`correct` + `stale`, where `stale` means at
    least one element of the payload was another round's) and blocks that gave up waiting (`gave_up`)."""
    import cupy as cp
    require_gpu()
    expect_choice(version, "version", HANDOFF_VERSIONS)
    if not (pairs >= 1 and rounds >= 1):
        raise ValueError(f"pairs and rounds: expected at least 1, got pairs={pairs}, rounds={rounds}")
    kernel = get_kernel(CU, f"handoff_v{version}", CU_DEFINES[CU])
    if 2 * pairs > resident_blocks(kernel):
        raise ValueError(f"pairs: {pairs} pairs need {2 * pairs} blocks at once; this GPU holds "
                         f"{resident_blocks(kernel)} of them, and a block whose partner never starts waits in vain")
    flags, acks = cp.zeros(pairs, cp.int32), cp.zeros(pairs, cp.int32)
    payloads = cp.full(pairs * PAYLOAD, -1, cp.int32)
    counts = cp.zeros(len(COUNTERS), cp.int32)
    kernel((2 * pairs,), (BLOCK,), (flags, acks, payloads, counts, np.int32(rounds), np.int32(TRIES)))
    found = dict(zip(COUNTERS, (int(c) for c in counts.get())))
    return {"handoffs": pairs * rounds, **found}


def sum_last_block(x, out=None, grid: int | None = None):
    """Sum of a float32 GPU vector in one launch of sum_last_block: `grid` blocks (by default enough to fill
    the GPU) each write a partial sum, and the last block to finish adds them. Returns a 0-d float32 array."""
    import cupy as cp
    from common import launch_grid
    x = expect_array(x, "x", dtype=np.float32, ndim=1)
    y = out_array(out, ())
    blocks = grid or launch_grid(max(x.size, 1), BLOCK, per_sm=4)[0]
    if blocks < 1:
        raise ValueError(f"grid: expected at least 1 block, got {grid}")
    partials = cp.empty(blocks, cp.float32)
    tickets = cp.zeros(1, cp.uint32)
    kernel = get_kernel(CU, "sum_last_block", CU_DEFINES[CU])
    kernel((blocks,), (BLOCK,), (x, partials, tickets, y, np.int64(x.size)))
    return y


def ptx_of(function: str, arch: int = 70) -> str:
    """The PTX (the GPU's portable assembly, before the final compile to machine code) that NVRTC makes of one
    `__noinline__` device function of memory_model.cu, for virtual architecture compute_<arch>. No GPU needed:
    this is what the compiler did to the source, on any machine."""
    from common.device import nvrtc
    from common.kernels import BASE_OPTIONS, _define_options, supported_archs
    older = [a for a in supported_archs() if a <= arch]
    arch = max(older) if older else min(supported_archs())     # a GPU newer than this NVRTC: its newest arch
    nv = nvrtc()
    prog = nv.createProgram(CU.read_text(), CU.name, (), ())
    try:
        nv.compileProgram(prog, (f"--gpu-architecture=compute_{arch}", *BASE_OPTIONS,
                                 *_define_options(CU_DEFINES[CU])))
        ptx = nv.getPTX(prog)
    finally:
        nv.destroyProgram(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    ptx = ptx.rstrip("\x00")
    for block in re.findall(r"^\.func .*?^}", ptx, re.S | re.M):
        if re.search(rf"\b_Z\d+{re.escape(function)}\w*\(", block.splitlines()[0]):
            return block
    raise KeyError(f"no __noinline__ device function {function!r} in the PTX of {CU.name}")
