"""Two plots the whole course uses: throughput vs size with a ceiling, and grouped bars."""
from __future__ import annotations


def throughput(sizes, series: dict, ceiling: float | None = None, ceiling_label: str = "copy bandwidth",
               xlabel: str = "elements", ylabel: str = "GB/s", title: str = "", ax=None):
    """One line per entry of `series` (label -> values over `sizes`), log-x, with a dashed ceiling."""
    import matplotlib.pyplot as plt
    ax = ax or plt.subplots(figsize=(7, 4))[1]
    for label, ys in series.items():
        ax.plot(sizes, ys, marker="o", ms=3, label=label)
    if ceiling:
        ax.axhline(ceiling, ls="--", color="gray", label=f"{ceiling_label} ({ceiling:,.0f})")
    ax.set_xscale("log", base=2)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def bars(groups: dict, ylabel: str = "time (ms)", title: str = "", stacked: bool = False, ax=None):
    """groups: category -> {series label -> value}. Grouped (or stacked) bars with the values printed."""
    import matplotlib.pyplot as plt
    import numpy as np
    ax = ax or plt.subplots(figsize=(7, 4))[1]
    cats = list(groups)
    labels = list(dict.fromkeys(k for g in groups.values() for k in g))
    x = np.arange(len(cats))
    width = 0.8 if stacked else 0.8 / max(len(labels), 1)
    bottom = np.zeros(len(cats))
    for i, lab in enumerate(labels):
        vals = np.array([groups[c].get(lab, 0.0) for c in cats], dtype=float)
        pos = x if stacked else x - 0.4 + width * (i + 0.5)
        b = ax.bar(pos, vals, width, bottom=bottom if stacked else None, label=lab)
        if not stacked:
            ax.bar_label(b, fmt="%.3g", fontsize=7)
        if stacked:
            bottom += vals
    ax.set_xticks(x, cats, rotation=20 if len(cats) > 4 else 0)
    ax.set(ylabel=ylabel, title=title)
    ax.grid(axis="y", alpha=0.3)
    if len(labels) > 1:
        ax.legend(fontsize=8)
    return ax
