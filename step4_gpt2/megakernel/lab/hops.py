"""What one hop between blocks costs (hops.cu): the unit of the megakernel's critical path."""
from __future__ import annotations

from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
HOPS = HERE / "hops.cu"


def hop_costs(rounds: int = 2000, repeats: int = 5, timeout_s: float = 2.0) -> dict:
    """Nanoseconds (median of `repeats` launches, each timing `rounds` repetitions inside the kernel) of:
    "hop": one block to one other through a counter (release add, acquire poll; block 0 and the last block of
    a grid of one block per SM, on the two SMs "hop_sms"); "all": a grid-wide barrier of one block per SM (every
    block to every block); "l2": one L2 round trip (a chain of dependent loads through a 1 MB table that stays
    in L2)."""
    from common import device_info, get_kernel, require_gpu
    require_gpu()
    import cupy as cp
    sms = device_info()["multiprocessors"]
    err, out = cp.zeros(4, cp.int32), cp.zeros(max(sms, 3), cp.uint64)

    def timed(fn, name, grid, args, per):            # (median of per(out) over the repeats, the last out)
        vals = []
        for r in range(repeats + 1):                     # the first launch compiles and warms: not kept
            out.fill(0)
            cp.cuda.runtime.deviceSynchronize()          # nothing else running: every block must be resident
            fn((grid,), (128,), args())
            cp.cuda.runtime.deviceSynchronize()
            e = err.get()
            if e[0]:
                raise RuntimeError(f"hops.cu {name}: block {e[1]} waited more than {timeout_s:g} s in round {e[2]}: "
                                   f"were all {grid} blocks resident (another kernel running concurrently?)")
            o = out.get()
            if r:
                vals.append(per(o))
        return float(np.median(vals)), o

    timeout_ns = np.int64(timeout_s * 1e9)
    res = {}
    res["hop"], o = timed(get_kernel(HOPS, "hop_pingpong"), "hop_pingpong", sms,
                          lambda: (cp.zeros(64, cp.uint32), np.int32(rounds), timeout_ns, err, out),
                          lambda o: o[0] / (2 * rounds))
    res["hop_sms"] = (int(o[1]), int(o[2]))
    res["all"], _ = timed(get_kernel(HOPS, "hop_all"), "hop_all", sms,
                          lambda: (cp.zeros(1, cp.uint32), np.int32(rounds), timeout_ns, err, out),
                          lambda o: np.median(o[:sms]) / rounds)
    n = 1 << 18                                          # a random cycle through all n entries
    perm = np.random.default_rng(0).permutation(n).astype(np.uint32)
    nxt = np.empty(n, np.uint32)
    nxt[perm] = np.roll(perm, -1)
    table = cp.asarray(nxt)
    res["l2"], _ = timed(get_kernel(HOPS, "l2_chase"), "l2_chase", 1, lambda: (table, np.int32(20 * rounds), out),
                         lambda o: o[0] / (20 * rounds))
    return res
