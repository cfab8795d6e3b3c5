"""Diagrams of the course's ideas, drawn by code so that they are exact and reproducible (no GPU needed).

Each function returns a matplotlib `Figure`; in a notebook, make it the last expression of a cell:

    from common import diagrams
    diagrams.coalescing(stride=8)

`python -m common.diagrams [folder]` saves every diagram as a PNG (default folder: `diagrams/`;
`python -m common.diagrams docs/diagrams` redraws the ones the docs show).
The figures are built with `matplotlib.figure.Figure`, not pyplot, so a notebook shows each one once.
"""
from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

BLOCK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def _show_in_notebooks() -> None:
    """A Figure made without pyplot displays as a picture only once IPython has a PNG formatter for it; pyplot's
    inline backend installs one on its first figure, which may come after the first diagram. Install it now."""
    try:
        from IPython import get_ipython
        from IPython.core.pylabtools import select_figure_formats
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None and hasattr(shell, "display_formatter"):
        select_figure_formats(shell, {"png"})


_show_in_notebooks()
LANE_COLORS = [c for cmap in ("tab20", "tab20b") for c in __import__("matplotlib").colormaps[cmap].colors][:32]


def _cell(ax, x, y, w=1.0, h=1.0, color="white", text="", fs=8, alpha=1.0, ec="black", lw=0.6, tc="black"):
    """A labelled rectangle with its lower-left corner at (x, y)."""
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor=ec, lw=lw, alpha=alpha))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fs, color=tc)


def _ink(color) -> str:
    """Black or white text, whichever reads better on `color`."""
    r, g, b = __import__("matplotlib").colors.to_rgb(color)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"


def _arrow(ax, xy0, xy1, color="black", lw=1.0, style="-|>", rad=0.0):
    ax.add_patch(FancyArrowPatch(xy0, xy1, arrowstyle=style, mutation_scale=8, color=color, lw=lw,
                                 connectionstyle=f"arc3,rad={rad}"))


def _blank(ax, xlim, ylim):
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.set_aspect("equal")
    ax.axis("off")


def thread_indexing(n: int = 21, block: int = 8) -> Figure:
    """Global index i = blockIdx.x * blockDim.x + threadIdx.x, the rounded-up grid, and the bounds check."""
    grid = math.ceil(n / block)
    fig = Figure(figsize=(max(8, 0.42 * grid * block + 1.5), 2.2))
    ax = fig.subplots()
    for i in range(grid * block):
        b, t = divmod(i, block)
        inside = i < n
        _cell(ax, i, 1, color=BLOCK_COLORS[b % 8] if inside else "#eeeeee", alpha=0.85 if inside else 1,
              text=str(t), fs=7, tc="white" if inside else "gray")
        _cell(ax, i, 0, text=str(i) if inside else "×", fs=7, tc="black" if inside else "red")
    for b in range(grid):
        ax.text(b * block + block / 2, 2.35, f"blockIdx.x = {b}", ha="center", fontsize=8, color=BLOCK_COLORS[b % 8])
    ax.text(-0.3, 1.5, "threadIdx.x", ha="right", va="center", fontsize=8)
    ax.text(-0.3, 0.5, "element i", ha="right", va="center", fontsize=8)
    ax.set_title(f"n = {n}, blockDim.x = {block}: grid = ceil(n / block) = {grid} blocks, {grid * block} threads; "
                 f"i = blockIdx.x·blockDim.x + threadIdx.x;  the {grid * block - n} threads with i ≥ n "
                 f"must skip (if (i < n))", fontsize=9)
    _blank(ax, (-4.5, grid * block + 0.5), (-0.4, 2.8))
    fig.tight_layout()
    return fig


def coalescing(stride: int = 8, itemsize: int = 4, lanes: int = 32, sector: int = 32) -> Figure:
    """Which 32-byte sectors a warp touches when lane k reads element k (top) or element k*stride (bottom)."""
    fig = Figure(figsize=(12, 4.0))
    axes = fig.subplots(2, 1)
    per_sector = sector // itemsize
    n_sec = math.ceil(((lanes - 1) * stride + 1) / per_sector)         # the same stretch of memory in both rows
    unit = 31.0 / n_sec                                                 # width of one sector on the page
    for ax, s in zip(axes, (1, stride)):
        addr = [k * s for k in range(lanes)]                            # element index read by lane k
        touched = {a // per_sector for a in addr}
        for j in range(n_sec):
            _cell(ax, j * unit, 0, w=unit, h=0.8, color="#C44E52" if j in touched else "#f3f3f3",
                  alpha=0.75 if j in touched else 1, lw=0.4)
        for k in range(lanes):
            _cell(ax, k * 31 / lanes, 2.2, w=31 / lanes, h=0.7, color=LANE_COLORS[k], text=str(k), fs=6, lw=0.3,
                  tc=_ink(LANE_COLORS[k]))
            x_mem = (addr[k] + 0.5) / per_sector * unit
            _arrow(ax, (k * 31 / lanes + 31 / lanes / 2, 2.2), (x_mem, 0.8), color=LANE_COLORS[k], lw=0.7)
        moved, useful = len(touched) * sector, lanes * itemsize
        ax.text(-0.5, 2.55, "lane", ha="right", va="center", fontsize=8)
        ax.text(-0.5, 0.4, f"{sector}-byte\nsectors", ha="right", va="center", fontsize=8)
        ax.set_title(f"lane k reads element k·{s}: {len(touched)} sectors touched, {moved} bytes moved for "
                     f"{useful} useful ({moved / useful:g}× the traffic)", fontsize=9,
                     color="#2a7a2a" if s == 1 else "#a02020")
        _blank(ax, (-3.5, 31.5), (-0.2, 3.1))
    fig.tight_layout()
    return fig


def tree_reduction(n: int = 16) -> Figure:
    """Tree reduction: at each step element i adds element i + offset; offsets n/2, ..., 1 (log2 n steps)."""
    steps = int(math.log2(n))
    vals = np.arange(1, n + 1, dtype=float)
    fig = Figure(figsize=(12, 1.2 + 0.65 * steps))
    ax = fig.subplots()
    y = steps * 2
    for i in range(n):
        _cell(ax, i, y, color="#dfe9f5", text=f"{vals[i]:g}", fs=7)
    offset = n // 2
    for s in range(steps):
        y_new = y - 2
        new = vals.copy()
        new[:offset] = vals[:offset] + vals[offset:2 * offset]
        for i in range(offset):
            _arrow(ax, (i + offset + 0.5, y), (i + 0.5, y_new + 1), color="#DD8452", lw=0.8)
            _arrow(ax, (i + 0.5, y), (i + 0.5, y_new + 1), color="gray", lw=0.5)
        for i in range(n):
            active = i < offset
            _cell(ax, i, y_new, color="#dfe9f5" if active else "#f7f7f7", text=f"{new[i]:g}" if active else "",
                  fs=7, ec="black" if active else "#cccccc")
        ax.text(n + 0.4, y_new + 1.3, f"offset {offset}:  shared memory: s[i] += s[i + {offset}]; __syncthreads()\n"
                f"{'':11s}in a warp: v += __shfl_xor_sync(0xffffffff, v, {offset})", fontsize=7.5, va="center",
                family="monospace")
        vals, y, offset = new, y_new, offset // 2
    ax.set_title(f"Tree reduction of {n} values in log2({n}) = {steps} steps; lane 0 ends with the sum "
                 f"({vals[0]:g}).\nWithin a warp, shuffles read the partner's register: no shared memory, "
                 f"no barrier (with xor, lane i also gets lane i ^ offset's value, so every lane ends with the sum)", fontsize=9)
    _blank(ax, (-0.5, n + 22), (-0.3, steps * 2 + 1.3))
    fig.tight_layout()
    return fig


def tiled_matmul(M: int = 8, N: int = 8, K: int = 12, tile: int = 2, ti: int = 1, tj: int = 2) -> Figure:
    """C = A·B in tiles: the block owning C tile (ti, tj) walks the K loop over A's tile row and B's tile column."""
    fig = Figure(figsize=(11, 5.2))
    ax = fig.subplots()
    nk = math.ceil(K / tile)
    cmap = __import__("matplotlib").colormaps["viridis"]
    ox_a, ox_c = 0, K + 2
    ox_b = ox_c                                        # B above C, A to the left of C: rows and columns line up
    oy_b = M + 2
    def grid(ox, oy, rows, cols, pick):
        for r in range(rows):
            for c in range(cols):
                k = pick(r, c)
                color = "white" if k is None else (cmap(0.15 + 0.7 * k / max(nk - 1, 1)) if k >= 0 else "#C44E52")
                _cell(ax, ox + c, oy + rows - 1 - r, color=color, lw=0.3, alpha=0.85)
        ax.add_patch(Rectangle((ox, oy), cols, rows, fill=False, lw=1.2))
    grid(ox_a, 0, M, K, lambda r, c: c // tile if r // tile == ti else None)
    grid(ox_b, oy_b, K, N, lambda r, c: r // tile if c // tile == tj else None)
    grid(ox_c, 0, M, N, lambda r, c: -1 if (r // tile, c // tile) == (ti, tj) else None)
    ax.text(ox_a + K / 2, -0.8, f"A  ({M}×{K})", ha="center", fontsize=10)
    ax.text(ox_b + N / 2, oy_b + K + 0.3, f"B  ({K}×{N})", ha="center", fontsize=10)
    ax.text(ox_c + N / 2, -0.8, f"C  ({M}×{N})", ha="center", fontsize=10)
    for k in range(nk):
        ax.text(ox_a + k * tile + tile / 2, M - ti * tile - tile / 2, f"k{k}", ha="center", va="center", fontsize=7,
                color="white")
        ax.text(ox_b + tj * tile + tile / 2, oy_b + K - k * tile - tile / 2, f"k{k}", ha="center", va="center",
                fontsize=7, color="white")
    ax.text(ox_c + N + 0.5, M / 2,
            f"one block owns this {tile}×{tile} tile of C.\nK loop, step k = 0 … {nk - 1}:\n"
            f"  load A tile k and B tile k\n  into shared memory; __syncthreads()\n"
            f"  C_tile += A_tile · B_tile\n  __syncthreads()\n"
            f"each loaded value is used {tile} times;\nbigger tiles: more reuse, more shared memory",
            fontsize=8, va="center", family="monospace")
    ax.set_title("Tiled matrix multiply: same colour = loaded in the same step of the K loop", fontsize=10)
    _blank(ax, (-0.5, ox_c + N + 13), (-1.5, oy_b + K + 1))
    fig.tight_layout()
    return fig


def online_softmax_merge(x=None, split: int | None = None) -> Figure:
    """Two partial softmax states (m, s) over the halves of a row, merged, and checked against the whole row."""
    x = np.array([1.0, 3.0, -0.5, 2.0, 0.5, 4.5, 1.5, -1.0]) if x is None else np.asarray(x, dtype=float)
    split = len(x) // 2 if split is None else split
    parts = [x[:split], x[split:]]
    st = [(p.max(), np.exp(p - p.max()).sum()) for p in parts]
    m = max(st[0][0], st[1][0])
    s = sum(si * np.exp(mi - m) for mi, si in st)
    fig = Figure(figsize=(11, 4))
    ax, tx = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.1, 1]})
    colors = ["#4C72B0"] * split + ["#DD8452"] * (len(x) - split)
    ax.bar(range(len(x)), x, color=colors)
    for j, (lo, hi) in enumerate(((0, split), (split, len(x)))):
        ax.hlines(st[j][0], lo - 0.4, hi - 0.6, colors="black", linestyles="--", lw=1)
        ax.text((lo + hi - 1) / 2, st[j][0] + 0.25, f"m{j + 1} = {st[j][0]:g}", ha="center", fontsize=8)
    ax.axhline(0, color="gray", lw=0.5)
    ax.set(xlabel="position in the row", ylabel="score x", title="a row split between two workers")
    ax.set_ylim(min(0, x.min()) - 0.5, x.max() + 1)
    tx.axis("off")
    lines = [f"part 1: m1 = {st[0][0]:g},  s1 = Σ exp(x − m1) = {st[0][1]:.4f}",
             f"part 2: m2 = {st[1][0]:g},  s2 = Σ exp(x − m2) = {st[1][1]:.4f}", "",
             "merge:  m = max(m1, m2)",
             "        s = s1·exp(m1 − m) + s2·exp(m2 − m)", "",
             f"        m = {m:g},  s = {st[0][1]:.4f}·exp({st[0][0] - m:g}) + {st[1][1]:.4f}·exp({st[1][0] - m:g})",
             f"          = {s:.6f}", "",
             f"whole row in one go: Σ exp(x − max x) = {np.exp(x - x.max()).sum():.6f}", "",
             "softmax(x)_i = exp(x_i − m) / s.  Exponents are ≤ 0, nothing overflows;",
             "any order, any number of parts (lanes, warps, K/V tiles)."]
    tx.text(0, 0.5, "\n".join(lines), va="center", fontsize=8.5, family="monospace", transform=tx.transAxes)
    fig.suptitle("Online softmax: merging two partial states", fontsize=10)
    fig.tight_layout()
    return fig


def flash_tiles(T: int = 16, block_q: int = 4, block_k: int = 4, causal: bool = True, q_block: int = 2) -> Figure:
    """Flash attention's tiles of the T×T score matrix: one Q block per thread block, K/V tiles streamed,
    tiles above the diagonal skipped when causal, diagonal tiles masked inside."""
    nq, nk = math.ceil(T / block_q), math.ceil(T / block_k)
    fig = Figure(figsize=(10, 6))
    ax = fig.subplots()
    counts = {"computed": 0, "masked inside": 0, "skipped": 0}
    for qi in range(nq):
        for kj in range(nk):
            q0, q1, k0, k1 = qi * block_q, min(T, (qi + 1) * block_q) - 1, kj * block_k, min(T, (kj + 1) * block_k) - 1
            kind = "computed"
            if causal and k0 > q1:
                kind = "skipped"
            elif causal and k1 > q0:
                kind = "masked inside"
            counts[kind] += 1
            color = {"computed": "#55A868", "masked inside": "#CCB974", "skipped": "#f0f0f0"}[kind]
            ec = "black" if qi == q_block and kind != "skipped" else "#999999"
            _cell(ax, k0, T - 1 - q1, w=k1 - k0 + 1, h=q1 - q0 + 1, color=color, lw=1.5 if ec == "black" else 0.6,
                  ec=ec, alpha=0.9)
            if kind == "masked inside":                       # the masked half inside a diagonal tile
                for r in range(q0, q1 + 1):
                    for c in range(max(k0, r + 1), k1 + 1):
                        _cell(ax, c, T - 1 - r, color="#f0f0f0", lw=0.2, ec="#bbbbbb")
    for kj in range(nk):
        ax.text(kj * block_k + block_k / 2, T + 0.5, f"K/V {kj}", ha="center", fontsize=8)
    for qi in range(nq):
        ax.text(-0.4, T - (qi * block_q + min(T, (qi + 1) * block_q)) / 2, f"Q block {qi}", ha="right", va="center", fontsize=8,
                weight="bold" if qi == q_block else "normal")
    q_last = min(T, (q_block + 1) * block_q) - 1
    y = T - (q_block * block_q + q_last + 1) / 2
    _arrow(ax, (0.2, y), ((q_last + 1 if causal else T) - 0.2, y), lw=1.5)
    ax.text(T + 0.7, T / 2, f"T = {T}, Q blocks of {block_q}, K/V tiles of {block_k}\n\n"
            f"one thread block per Q block: it streams\nthe K/V tiles left to right, keeping per query\n"
            f"a running max m, sum l and output O\n(online softmax); S = QKᵀ never reaches DRAM.\n\n"
            f"green: computed ({counts['computed']})\nyellow: diagonal, masked inside ({counts['masked inside']})\n"
            f"grey: skipped, above the diagonal ({counts['skipped']})", fontsize=8.5, va="center")
    ax.set_title("Flash attention: tiles of the score matrix S = QKᵀ" + (" (causal)" if causal else ""), fontsize=10)
    _blank(ax, (-3.5, T + 12), (-0.3, T + 1.2))
    fig.tight_layout()
    return fig


def mma_fragment() -> Figure:
    """Which lane of the warp holds which element of A (16×16), B (16×8) and C/D (16×8) for
    mma.sync.aligned.m16n8k16 with .f16/.bf16 inputs and .f32 accumulators (PTX ISA, "Matrix fragments for
    mma.m16n8k16"). g = lane / 4 (groupID), t = lane % 4 (threadID_in_group)."""
    def a_pos(lane, i):
        g, t = divmod(lane, 4)
        return g + 8 * ((i // 2) % 2), 2 * t + (i % 2) + 8 * (i // 4)
    def b_pos(lane, i):
        g, t = divmod(lane, 4)
        return 2 * t + (i % 2) + 8 * (i // 2), g
    def c_pos(lane, i):
        g, t = divmod(lane, 4)
        return g + 8 * (i // 2), 2 * t + (i % 2)
    fig = Figure(figsize=(16, 7.2))
    axes = fig.subplots(1, 3, gridspec_kw={"width_ratios": [16, 8, 8]})
    for ax, (name, rows, cols, nreg, pos, reg) in zip(axes, (
            ("A (16×16, row-major)", 16, 16, 8, a_pos, "a"),
            ("B (16×8, column-major)", 16, 8, 4, b_pos, "b"),
            ("C, D (16×8, fp32)", 16, 8, 4, c_pos, "c"))):
        owner = {}
        for lane in range(32):
            for i in range(nreg):
                owner[pos(lane, i)] = (lane, i)
        assert len(owner) == rows * cols, name           # every element held by exactly one (lane, register)
        for (r, c), (lane, i) in owner.items():
            _cell(ax, c, rows - 1 - r, color=LANE_COLORS[lane], text=f"T{lane}\n{reg}{i}", fs=6.5, lw=0.3,
                  tc=_ink(LANE_COLORS[lane]))
        ax.set_title(name, fontsize=10)
        for c in range(cols):
            ax.text(c + 0.5, rows + 0.3, str(c), ha="center", fontsize=6, color="gray")
        for r in range(rows):
            ax.text(-0.3, rows - 0.5 - r, str(r), ha="right", va="center", fontsize=6, color="gray")
        _blank(ax, (-1, cols + 0.2), (-0.2, rows + 1))
    fig.suptitle("mma.sync.aligned.m16n8k16 (.f16/.bf16 → .f32): Tlane = the lane holding the element, a0…a7 / "
                 "b0…b3 / c0…c3 = its place in that lane's registers (two 16-bit values per 32-bit register).\n"
                 "g = lane / 4, t = lane % 4.  A: row g (+8 for a2,a3,a6,a7), col 2t + (i & 1) (+8 for a4…a7).  "
                 "B: row 2t + (i & 1) (+8 for b2,b3), col g.  C: row g (+8 for c2,c3), col 2t + (i & 1).",
                 fontsize=9)
    fig.tight_layout()
    return fig


def fusion_dataflow(n: int = 64 * 2 ** 20, itemsize: int = 4,
                    stages=(("t1 = x * w", "w"), ("t2 = t1 + b", "b"), ("y = gelu(t2)", "")),
                    source: str = "x", outputs=None) -> Figure:
    """Unfused (one kernel per stage, intermediates round-trip through DRAM) vs fused (one kernel), with the
    bytes each arrow moves. `stages`: (operation, names of its extra input arrays of n elements, comma-separated);
    the first stage reads `source`; stage k writes t<k> (the last writes y). `outputs`: what the fused kernel must
    still write (default: y only; e.g. ("r", "y") when an intermediate is needed later)."""
    mb = n * itemsize / 1e6
    fig = Figure(figsize=(12, 3.4))
    ax = fig.subplots()
    def box(x, y, text, color, w=2.2, h=0.8):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=color, ec="black", lw=0.8))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8)
    def flow(x0, x1, y, nbytes, what):
        _arrow(ax, (x0, y), (x1, y), lw=1.2)
        ax.text((x0 + x1) / 2, y + 0.15, f"{nbytes:,.0f} MB", ha="center", fontsize=7, color="#a02020")
        ax.text((x0 + x1) / 2, y - 0.3, what, ha="center", fontsize=7, color="gray")
    extras = [[e.strip() for e in ex.split(",") if e.strip()] for _, ex in stages]
    names = [op.split("=")[0].strip() if "=" in op else f"t{k + 1}" for k, (op, _) in enumerate(stages)]
    outputs = tuple(outputs or (names[-1],))
    total_unfused, x, y_u, y_f, prev = 0.0, 0.0, 2.4, 0.3, source
    box(x, y_u, f"{source} (DRAM)", "#dfe9f5", w=1.6)
    x += 1.6
    for k, (op, _) in enumerate(stages):
        out = names[k]
        read = mb * (1 + len(extras[k]))
        flow(x, x + 1.0, y_u + 0.4, read, ", ".join([prev] + extras[k]))
        box(x + 1.0, y_u, f"kernel {k + 1}\n{op}", "#f6d7b8")
        flow(x + 3.2, x + 4.2, y_u + 0.4, mb, out)
        box(x + 4.2, y_u, f"{out} (DRAM)", "#dfe9f5", w=1.6)
        total_unfused += read + mb
        x, prev = x + 5.8, out
    inputs = [source] + [e for ex in extras for e in ex if e not in names]
    fused = mb * (len(inputs) + len(outputs))
    box(0, y_f, f"{', '.join(inputs)} (DRAM)", "#dfe9f5", w=1.6)
    flow(1.6, 4.0, y_f + 0.4, mb * len(inputs), ", ".join(inputs))
    box(4.0, y_f, "one fused kernel\n" + "; ".join(op for op, _ in stages), "#c9e6c9", w=7.5)
    flow(11.5, 13.9, y_f + 0.4, mb * len(outputs), ", ".join(outputs))
    box(13.9, y_f, f"{', '.join(outputs)} (DRAM)", "#dfe9f5", w=1.6)
    ax.text(0, y_u + 1.1, f"unfused, {len(stages)} kernels: {total_unfused:,.0f} MB "
            f"({total_unfused / mb * itemsize:g} bytes per element)", fontsize=9, weight="bold")
    ax.text(0, y_f + 1.1, f"fused, 1 kernel: {fused:,.0f} MB ({fused / mb * itemsize:g} bytes per element); "
            f"the other intermediates stay in registers", fontsize=9, weight="bold")
    ax.text(16.3, y_f + 0.4, f"memory-bound: time ≈ bytes ÷ bandwidth,\nso fused is at best "
            f"{total_unfused / fused:.3g}× faster", fontsize=9, va="center")
    ax.set_title(f"Data flow of a chain of elementwise stages, n = {n:,} elements of {itemsize} bytes", fontsize=10)
    _blank(ax, (-0.3, max(x, 22) + 0.3), (-0.2, 3.8))
    fig.tight_layout()
    return fig


def roofline(peak_tflops: float = 60.0, bandwidth_gbs: float = 4000.0, kernels=None, device: str = "example values"
             ) -> Figure:
    """Attainable FLOP/s = min(peak, bandwidth × intensity), with kernels placed at their arithmetic intensity.
    Pass this GPU's measured numbers, e.g. roofline(common.fp32_peak_tflops(), common.copy_bandwidth(), ...,
    device=common.device.describe()); `kernels`: {name: FLOPs per byte of DRAM traffic}."""
    kernels = {"y = a·x + b (2 FLOP / 8 B)": 0.25, "4096³ matmul (ideal reuse)": 2 * 4096 / 12} if kernels is None \
        else kernels
    balance = peak_tflops * 1e3 / bandwidth_gbs                       # FLOP per byte where the two roofs meet
    ai = np.logspace(-2, 4, 200)
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    ax.loglog(ai, np.minimum(peak_tflops, bandwidth_gbs * ai / 1e3), color="black", lw=1.5)
    ax.axvline(balance, ls=":", color="gray")
    ax.text(balance * 1.15, peak_tflops / 30, f"machine balance\n{balance:.1f} FLOP/B", fontsize=8, color="gray")
    for k, (name, x) in enumerate(kernels.items()):
        y = min(peak_tflops, bandwidth_gbs * x / 1e3)
        ax.plot([x], [y], "o", color=BLOCK_COLORS[k % 8])
        ax.annotate(f"{name}\n{x:.3g} FLOP/B: " + (f"memory-bound, {balance / x:.0f}× below the balance" if x < balance
                                                   else "compute-bound"),
                    (x, y), textcoords="offset points", xytext=(8, -22 if x < balance else -28), fontsize=8)
    ax.set(xlabel="arithmetic intensity (FLOPs per byte of DRAM traffic)", ylabel="attainable TFLOP/s",
           title=f"Roofline: peak {peak_tflops:.1f} TFLOP/s, bandwidth {bandwidth_gbs:,.0f} GB/s ({device})")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


def kv_cache(prompt: int = 5, new: int = 4) -> Figure:
    """Prefill computes the prompt's keys/values at once (causal T×T); each decode step appends one row to the cache
    and attends its one query to every cached row, its own included."""
    total = prompt + new
    fig = Figure(figsize=(10, 0.4 * (new + 2) + 0.9))
    ax = fig.subplots()
    rows = [("prefill", prompt)] + [(f"decode step {i + 1}", prompt + i + 1) for i in range(new)]
    for r, (label, length) in enumerate(rows):
        y = len(rows) - 1 - r
        for c in range(total):
            if r == 0:
                kind = "written" if c < prompt else "empty"
            else:
                kind = "written" if c == length - 1 else ("read" if c < length - 1 else "empty")
            color = {"written": "#DD8452", "read": "#4C72B0", "empty": "#f3f3f3"}[kind]
            _cell(ax, c, y, color=color, alpha=0.8 if kind != "empty" else 1, lw=0.4)
        what = (f"{prompt} queries × {prompt} keys (causal), fills rows 0–{prompt - 1}" if r == 0 else
                f"appends row {length - 1}, then 1 query attends over rows 0–{length - 1}")
        ax.text(-0.3, y + 0.5, label, ha="right", va="center", fontsize=8)
        ax.text(total + 0.3, y + 0.5, what, va="center", fontsize=8)
    for c in range(total):
        ax.text(c + 0.5, len(rows) + 0.2, str(c), ha="center", fontsize=7, color="gray")
    ax.set_title("KV cache of one layer, one sequence (columns = token positions): orange = keys/values written, "
                 "blue = read from the cache",
                 fontsize=9)
    _blank(ax, (-4, total + 12), (-0.2, len(rows) + 0.8))
    fig.tight_layout()
    return fig


def async_timeline(launch_ms: float = 0.02, kernel_ms: float = 1.0, queued_ms: float = 0.0) -> Figure:
    """The host's timeline against the GPU's queue for one launch: the call returns after `launch_ms`, the kernel
    runs `kernel_ms` once the work already queued (`queued_ms`) is done, and what each timer measures. Pass
    measured values to draw a run to scale (the launch is drawn at least 2% of the width, to stay visible)."""
    fig = Figure(figsize=(12, 3.6))
    ax = fig.subplots()
    total = queued_ms + kernel_ms
    launch = max(launch_ms, 0.02 * total)
    start, end = max(launch, queued_ms), max(launch, queued_ms) + kernel_ms
    def bar(x0, x1, y, text, color):
        ax.add_patch(FancyBboxPatch((x0, y), max(x1 - x0, 1e-9), 0.55, boxstyle="square,pad=0", fc=color, ec="black",
                                    lw=0.6))
        ax.text((x0 + x1) / 2, y + 0.27, text, ha="center", va="center", fontsize=8, color=_ink(color))
    bar(0, launch, 2.2, "", "#DD8452")
    ax.text(launch / 2, 2.9, f"launch call\n{launch_ms * 1e3:.0f} µs", ha="center", fontsize=8)
    bar(launch, end, 2.2, "synchronize(): the host waits", "#eeeeee")
    if queued_ms > 0:
        bar(0, queued_ms, 0.9, "work queued earlier", "#bbbbbb")
    bar(start, end, 0.9, f"the kernel: {kernel_ms:.2f} ms", "#4C72B0")
    _arrow(ax, (launch * 0.6, 2.2), (start, 1.45), color="gray", rad=0.0)
    ax.text(-0.01 * end, 2.47, "host (Python)", ha="right", va="center", fontsize=9)
    ax.text(-0.01 * end, 1.17, "GPU (one stream)", ha="right", va="center", fontsize=9)
    rows = [(0, launch, 0.45, "#C44E52", "perf_counter around the call: the launch only"),
            (0, end, 0.05, "#8172B3", "perf_counter around call + synchronize: launch + queue + kernel + wake-up"),
            (start, end, -0.35, "#55A868", "CUDA events recorded on the stream: the kernel, on the GPU's clock")]
    for x0, x1, y, color, text in rows:
        ax.plot([x0, x1], [y, y], color=color, lw=3)
        ax.text(x1 + 0.01 * end, y, text, va="center", fontsize=8, color=color)
    ax.set_title("A launch only enqueues the kernel: the call returns at once and the GPU runs it later, in the "
                 "order of its stream", fontsize=10)
    ax.set_xlim(-0.22 * end, 1.75 * end)
    ax.set_ylim(-0.7, 3.5)
    ax.axis("off")
    fig.tight_layout()
    return fig


def two_streams(a_ms: float = 1.0, b_ms: float = 1.0) -> Figure:
    """Two small kernels on one stream (one after the other) and on two streams (side by side, when the GPU
    has room for both), and an event that makes a third kernel on stream 2 wait for the first on stream 1."""
    fig = Figure(figsize=(12, 3.6))
    ax = fig.subplots()
    end = a_ms + b_ms
    def bar(x0, w, y, text, color):
        ax.add_patch(Rectangle((x0, y), w, 0.6, fc=color, ec="black", lw=0.6))
        ax.text(x0 + w / 2, y + 0.3, text, ha="center", va="center", fontsize=8, color=_ink(color))
    bar(0, a_ms, 3.2, "A", "#4C72B0"); bar(a_ms, b_ms, 3.2, "B", "#DD8452")
    ax.text(-0.02 * end, 3.5, "one stream", ha="right", va="center", fontsize=9)
    bar(0, a_ms, 1.9, "A", "#4C72B0"); bar(0, b_ms, 1.1, "B", "#DD8452")
    ax.text(-0.02 * end, 2.2, "stream 1", ha="right", va="center", fontsize=9)
    ax.text(-0.02 * end, 1.4, "stream 2", ha="right", va="center", fontsize=9)
    bar(max(a_ms, b_ms), 0.5 * b_ms, 1.1, "C", "#55A868")
    ax.plot([a_ms, a_ms], [1.9, 2.5], color="black", lw=2)
    ax.text(a_ms, 2.6, "event recorded after A", ha="center", fontsize=8)
    _arrow(ax, (a_ms, 1.9), (max(a_ms, b_ms) + 0.02, 1.7), color="#C44E52", lw=1.2)
    ax.text(max(a_ms, b_ms) + 0.55 * b_ms, 1.4, "stream 2 waits for the event (wait_event): C starts after A",
            va="center", fontsize=8, color="#C44E52")
    ax.text(end + 0.02 * end, 3.5, f"{end:g} ms: B waits for A", va="center", fontsize=8)
    ax.set_title("A stream runs its kernels in order; kernels on different streams may run at once "
                 "(if neither fills the GPU); events order work across streams", fontsize=10)
    _blank(ax, (-0.3 * end, 1.9 * end), (0.8, 4.1))
    ax.set_aspect("auto")
    fig.tight_layout()
    return fig


def message_passing() -> Figure:
    """Message passing between two blocks of one launch: the producer writes the payload, then (release) the flag;
    the consumer spins on the flag, then (acquire) reads the payload; what goes wrong without each ordering."""
    fig = Figure(figsize=(12, 4.4))
    ax = fig.subplots()
    def box(x, y, w, h, text, color, fs=8):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=color, ec="black", lw=0.8))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fs)
    box(0, 0.3, 3.4, 3.4, "", "#eef3fa")
    ax.text(1.7, 3.45, "producer block (SM 3)", ha="center", fontsize=9, weight="bold")
    steps_p = ["1  payload[k] = round·1024 + k", "2  __syncthreads()", "3  release: __threadfence()",
               "4  flag = round"]
    for i, t in enumerate(steps_p):
        ax.text(0.15, 2.9 - 0.65 * i, t, fontsize=8, family="monospace", color="#a02020" if "release" in t else "black")
    box(4.6, 2.3, 2.8, 1.2, "payload (4 KB)", "#f6d7b8")
    box(4.6, 0.6, 2.8, 1.0, "flag", "#c9e6c9")
    ax.text(6.0, 3.75, "GPU memory (L2, DRAM)", ha="center", fontsize=9, weight="bold")
    box(8.6, 0.3, 3.4, 3.4, "", "#eef3fa")
    ax.text(10.3, 3.45, "consumer block (SM 7)", ha="center", fontsize=9, weight="bold")
    steps_c = ["5  while (flag != round) {}", "6  acquire: __threadfence()", "7  __syncthreads()",
               "8  read payload[k]"]
    for i, t in enumerate(steps_c):
        ax.text(8.75, 2.9 - 0.65 * i, t, fontsize=8, family="monospace", color="#a02020" if "acquire" in t else "black")
    _arrow(ax, (3.4, 2.9), (4.6, 2.9), lw=1.2)
    _arrow(ax, (3.4, 0.95), (4.6, 1.1), lw=1.2)
    _arrow(ax, (7.4, 1.1), (8.6, 2.9), lw=1.2, color="#55A868")
    _arrow(ax, (7.4, 2.9), (8.6, 0.95), lw=1.2, color="#DD8452")
    ax.text(12.3, 3.0, "without volatile (v1): the compiler loads the flag once\nand spins on a register copy: "
            "5 never ends", fontsize=8, va="center")
    ax.text(12.3, 1.9, "without 3 (release): the flag may reach memory\nbefore the payload does",
            fontsize=8, va="center")
    ax.text(12.3, 0.8, "without 6 (acquire): 8 may read a stale copy\n(the consumer SM's L1 cache, or a load "
            "issued early)", fontsize=8, va="center")
    ax.set_title("Message passing between two blocks: the flag says the payload is ready only if its order is "
                 "kept on both sides", fontsize=10)
    _blank(ax, (-0.2, 17.5), (0.0, 4.1))
    fig.tight_layout()
    return fig


ALL = (thread_indexing, coalescing, tree_reduction, tiled_matmul, online_softmax_merge, flash_tiles, mma_fragment,
       fusion_dataflow, roofline, kv_cache, async_timeline, two_streams, message_passing)


def save_all(folder="diagrams", dpi: int = 110) -> list:
    """Save every diagram with its default arguments as `<folder>/<name>.png`; returns the paths."""
    from pathlib import Path
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for fn in ALL:
        path = out / f"{fn.__name__}.png"
        fn().savefig(path, dpi=dpi)
        paths.append(path)
    return paths


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m common.diagrams",
                                 description="Save every diagram of the course as a PNG (no GPU needed).")
    ap.add_argument("folder", nargs="?", default="diagrams",
                    help="where to write <name>.png for each diagram (created if missing; default: %(default)s)")
    ap.add_argument("--dpi", type=int, default=110, help="resolution of the PNG files (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.dpi <= 0:
        ap.error(f"--dpi: expected a positive number, got {args.dpi}")
    for p in save_all(args.folder, dpi=args.dpi):
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
