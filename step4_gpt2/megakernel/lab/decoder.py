"""LabMegakernelDecoder: the megakernel decoder with its measurement builds and test hooks.

    dec = LabMegakernelDecoder(model, 1, 64, timeline=True)        # lab/megakernel_timeline.cu
    dec.prefill(ids, lens); dec.launch(1)
    t = dec.timeline_ms()                                           # (grid, stages, 3) ms
    breakdown(t, model.config.n_layer); plot_timeline(t, model.config.n_layer)

Options beyond MegakernelDecoder's:
  timeline           compile in %globaltimer stamps (start, inputs ready, end) per stage and block
  keep_layers_in_l2  sm_80+, v2, fp32 weights: ask L2 to keep the layers' weights (evict-last prefetches, loads without the
                     streaming hint), so it keeps what fits of them (the floor, lab/floor.py); release_l2() after
  threads, unroll    the block size (256, 384, 512) and float4 columns per lane per weight row in flight
  blocks_per_sm      resident blocks per SM (capped by the occupancy API)
  max_blocks         cap the grid (the compute-sanitizer tests use a handful of blocks)
  launch(..., stall_block=b)  block b never signals (the test of the timeout path): the launch runs the stall
                     build (lab/megakernel_stall.cu, compiled with MK_STALL_BLOCK=b) of the decoder's version
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from common import device_info, expect_choice, get_kernel, load_module
from step4_gpt2.megakernel.megakernel import (PER_LAYER, STAGES, THREADS, TIMEOUT_S, UNROLL, MegakernelDecoder,
                                              MegakernelUnavailable, defines, fit, model_precisions,
                                              stages_per_step)
from step4_gpt2.weights import GPTConfig

HERE = Path(__file__).resolve().parent
TIMELINE = HERE / "megakernel_timeline.cu"
KEEP_L2 = HERE / "megakernel_keep_l2.cu"
STALL = HERE / "megakernel_stall.cu"

# For tests/test_compile.py: GPT-2 124M at batch 1, as the mainline declares it (the timeline and stall builds:
# of v2; the stall build with block 0 stalled).
CU_DEFINES = {TIMELINE: {**defines(GPTConfig(), 1), "MK_VERSION": 2}, KEEP_L2: defines(GPTConfig(), 1),
              STALL: {**defines(GPTConfig(), 1), "MK_VERSION": 2, "MK_STALL_BLOCK": 0}}


def lab_defines(config, batch: int, version: int = 2, timeline: bool = False, threads: int = THREADS,
                unroll: int = UNROLL, sm: int | None = None) -> dict:
    """The constants of a lab build: the mainline's, and MK_VERSION for the timeline build (which includes
    megakernel_v1.cu or megakernel_v2.cu by it)."""
    d = defines(config, batch, sm, threads, unroll)
    return {**d, "MK_VERSION": version} if timeline else d


class LabMegakernelDecoder(MegakernelDecoder):
    """MegakernelDecoder with the lab's builds and hooks (the module docstring lists them)."""

    def __init__(self, model, batch: int, length: int, greedy: bool = True, version: int = 2,
                 steps_per_launch: int = 1, timeout_s: float = TIMEOUT_S, *, timeline: bool = False,
                 keep_layers_in_l2: bool = False, threads: int = THREADS, unroll: int = UNROLL,
                 blocks_per_sm: int = 1, max_blocks: int | None = None):
        self.threads = expect_choice(threads, "threads", (256, 384, 512))
        self.unroll = expect_choice(unroll, "unroll", (1, 2, 3, 4))
        if not isinstance(blocks_per_sm, (int, np.integer)) or blocks_per_sm < 1:
            raise ValueError(f"blocks_per_sm: expected an integer >= 1, got {blocks_per_sm!r}")
        if max_blocks is not None and (not isinstance(max_blocks, (int, np.integer)) or max_blocks < 1):
            raise ValueError(f"max_blocks: expected None or an integer >= 1, got {max_blocks!r}")
        if timeline and keep_layers_in_l2:
            raise ValueError("timeline, keep_layers_in_l2: two separate lab builds; ask for one of them")
        if keep_layers_in_l2 and version != 2:
            raise ValueError(f"keep_layers_in_l2: a build of v2 (megakernel_v2.cu), got version={version!r}")
        if keep_layers_in_l2 and model_precisions(model) != ("fp32", "fp32"):
            raise ValueError(f"keep_layers_in_l2: fp32 weights only (the bf16/int8 loads take no KEEP hint, while "
                             f"their lines would stay evict-last), got a {model_precisions(model)[0]} model")
        self.timeline, self.keep_layers_in_l2 = bool(timeline), bool(keep_layers_in_l2)
        self.blocks_per_sm, self.max_blocks = int(blocks_per_sm), max_blocks
        self.last_timeline = None
        self._stalled = {}                      # stall build per stalled block (stall_kernel)
        super().__init__(model, batch, length, greedy, version, steps_per_launch, timeout_s)

    def _compile(self, constants: dict):
        self._constants = constants             # the stall build's, with MK_STALL_BLOCK added
        if self.timeline:
            built = {**constants, "MK_VERSION": self.version}
            # where the stamps go: the build's __constant__ mk_timeline, a symbol of the module the kernel comes
            # from (get_kernel loads its module through load_module, cached by path and defines: the same one)
            self._timeline_symbol = load_module(TIMELINE, built).get_global("mk_timeline")
            return get_kernel(TIMELINE, "megakernel_decode", built)
        if self.keep_layers_in_l2:
            if device_info()["sm"] < 80:
                raise ValueError(f"keep_layers_in_l2: needs L2 eviction-priority hints (sm_80 or newer); this GPU "
                                 f"is sm_{device_info()['sm']}")
            return get_kernel(KEEP_L2, "megakernel_decode", constants)
        return super()._compile(constants)

    def stall_kernel(self, block: int):
        """The stall build (lab/megakernel_stall.cu) of this decoder's version in which `block` never signals,
        compiled once per block and allowed this decoder's shared memory: what launch(stall_block=block) runs."""
        if self.timeline or self.keep_layers_in_l2:
            raise ValueError("stall_block: the stall build is the mainline kernel's; not with timeline or "
                             "keep_layers_in_l2")
        if not isinstance(block, (int, np.integer)) or not 0 <= block < self.grid:
            raise ValueError(f"stall_block: a block 0..{self.grid - 1} (or -1: none), got {block!r}")
        block = int(block)
        if block not in self._stalled:
            fn = get_kernel(STALL, "megakernel_decode",
                            {**self._constants, "MK_VERSION": self.version, "MK_STALL_BLOCK": block})
            _, per_sm = fit(fn, self.model.config, self.batch, self.threads, self.unroll)
            if per_sm * device_info()["multiprocessors"] < self.grid:
                raise MegakernelUnavailable(f"stall_block: the stall build fits {per_sm} block(s) per SM, fewer "
                                            f"than this decoder's grid of {self.grid} needs")
            self._stalled[block] = fn
        return self._stalled[block]

    def _grid(self, per_sm: int) -> int:
        grid = device_info()["multiprocessors"] * min(self.blocks_per_sm, per_sm)
        return grid if self.max_blocks is None else min(grid, int(self.max_blocks))

    def _info(self) -> dict:
        return {**super()._info(), "lab": {"timeline": self.timeline, "keep_layers_in_l2": self.keep_layers_in_l2,
                                           "threads": self.threads, "unroll": self.unroll}}

    def launch(self, nsteps: int = 1, out_tokens=None, stall_block: int = -1) -> None:
        """MegakernelDecoder.launch; stall_block >= 0: that block never signals (the test of the timeout path:
        this launch runs stall_kernel(stall_block)). With timeline=True the launch's stamps go to a fresh buffer
        (timeline_ms reads it)."""
        import cupy as cp
        if not isinstance(nsteps, (int, np.integer)) or nsteps < 1:
            raise ValueError(f"nsteps: expected an integer >= 1, got {nsteps!r}")
        mainline = self.fn
        if stall_block != -1:
            self.fn = self.stall_kernel(stall_block)
        try:
            if self.timeline:
                per_step = stages_per_step(self.model.config.n_layer)
                with self.stream:               # zeroed, and its address set, on the stream the kernel runs on
                    timeline = cp.zeros((self.grid, nsteps * per_step, 3), cp.uint64)
                    where = cp.ndarray((2,), cp.uint64, self._timeline_symbol)       # mk_timeline {stamps, per block}
                    where.set(np.array([timeline.data.ptr, nsteps * per_step], np.uint64), stream=self.stream)
                self.last_timeline = timeline
            super().launch(nsteps, out_tokens)
        finally:
            self.fn = mainline

    def release_l2(self) -> None:
        """After a decoder built with keep_layers_in_l2: return the lines of the layers' weights to L2's normal
        eviction priority, so that they do not crowd out what runs next."""
        import cupy as cp
        if not self.keep_layers_in_l2:
            return
        fn = get_kernel(KEEP_L2, "l2_evict_normal", defines(self.model.config, self.batch, device_info()["sm"],
                                                             self.threads, self.unroll))
        seen = set()
        with self.stream:
            for a in self._keep:
                if a.data.ptr not in seen and a.dtype == cp.float32:
                    seen.add(a.data.ptr)
                    fn((256,), (256,), (a, np.int64(a.size)))
        self.stream.synchronize()

    # ------------------------------------------------------------------ the timeline
    def timeline_ms(self):
        """The last launch's stamps (timeline=True) as a NumPy (grid, stages, 3) array of milliseconds since
        the earliest stamp: [start, inputs ready, end] of every stage of every block; NaN where not stamped."""
        if self.last_timeline is None:
            raise ValueError("timeline: build the decoder with timeline=True and launch it first")
        t = self.last_timeline.get().astype(np.float64)
        t[t == 0] = np.nan
        return (t - np.nanmin(t)) / 1e6

    def stage_names(self, nsteps: int = 1) -> list[str]:
        """Names of the stages of nsteps steps, in timeline order ("L0 QKV", ..., "LM head")."""
        names = []
        for _ in range(nsteps):
            for layer in range(self.model.config.n_layer):
                names += [f"L{layer} {s}" for s in STAGES[:PER_LAYER]]
            names.append(STAGES[PER_LAYER])
        return names


def stage_kind(j: int, n_layer: int) -> int:
    """Index into STAGES of stage j of a timeline (PER_LAYER per layer, then the LM head, per step)."""
    j %= stages_per_step(n_layer)
    return PER_LAYER if j == PER_LAYER * n_layer else j % PER_LAYER


def breakdown(t_ms: np.ndarray, n_layer: int) -> dict:
    """Where a step's time goes, from a (grid, stages, 3) timeline: per kind of stage, the mean over blocks of
    time waiting for inputs (ready - start) and working (end - ready), in ms, and the step's span."""
    wait = t_ms[:, :, 1] - t_ms[:, :, 0]
    work = t_ms[:, :, 2] - t_ms[:, :, 1]
    out = {}
    kinds = [stage_kind(j, n_layer) for j in range(t_ms.shape[1])]
    for i, name in enumerate(STAGES):
        idx = [j for j, k in enumerate(kinds) if k == i]
        out[name] = {"wait_ms": float(np.nansum(np.nanmean(wait[:, idx], axis=0))),
                     "work_ms": float(np.nansum(np.nanmean(work[:, idx], axis=0)))}
    out["span_ms"] = float(np.nanmax(t_ms) - np.nanmin(t_ms))
    return out


def plot_timeline(t_ms: np.ndarray, n_layer: int, title: str = "", blocks=None, ax=None):
    """A Gantt chart of a timeline (grid, stages, 3): one row per block, a bar per stage coloured by its
    kind, hatched grey while the block waits for its inputs. Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 4))
    blocks = range(t_ms.shape[0]) if blocks is None else blocks
    colors = plt.get_cmap("tab10").colors
    for row, b in enumerate(blocks):
        for j in range(t_ms.shape[1]):
            s, r, e = t_ms[b, j]
            if np.isnan(s) or np.isnan(e):
                continue
            r = s if np.isnan(r) else r
            kind = stage_kind(j, n_layer)
            ax.barh(row, r - s, left=s, color="0.85", height=0.9)
            ax.barh(row, e - r, left=r, color=colors[kind], height=0.9)
    ax.set_xlabel("ms since the first stamp")
    ax.set_ylabel("block")
    ax.legend(handles=[Patch(color=colors[i], label=n) for i, n in enumerate(STAGES)] + [Patch(color="0.85", label="waiting")],
              ncol=7, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    if title:
        ax.set_title(title)
    return ax


def timeline(model, version: int, batch: int = 1, ctx: int = 32, steps: int = 1):
    """(timeline ms (grid, stages, 3), breakdown dict summed over the steps) of `steps` steps in one launch,
    after a warm-up launch."""
    import cupy as cp
    from step4_gpt2.benchmarks import random_ids
    dec = LabMegakernelDecoder(model, batch, ctx + 2 * steps + 2, version=version, timeline=True,
                               steps_per_launch=steps)
    ids = random_ids(model.config, batch, ctx)
    dec.prefill(ids, [ctx] * batch)
    for _ in range(2):                      # the second launch is the one kept (warm caches, compiled)
        dec.launch(steps)
        dec.stream.synchronize()
        dec.check()
    cp.cuda.runtime.deviceSynchronize()
    t = dec.timeline_ms()
    return t, breakdown(t, model.config.n_layer)
