"""The whole GPT-2 decode step in one persistent kernel (megakernel.cu), as a decoder for generate().

    dec = MegakernelDecoder(model, batch=1, length=300)          # version=2: counters + prefetch
    first = dec.prefill(ids, lens)                                # the prompt, on the model's prefill path
    for tokens in dec.decode(200):                                # np.int32 (B,) per step
        ...
    generate(model, prompts, 200, mode="megakernel")             # the same through generate()

MegakernelDecoder is a generate.Decoder (its interface, prefill, argument checks and token choice, its decode
state and stream) whose steps are launches of this kernel; `MegakernelDecoder.preferred(model, batch, length,
greedy)` answers mode="auto". Options:
  version          1: a grid-wide barrier before every stage; 2: counters + weight prefetch (default)
  steps_per_launch greedy steps one launch runs (the kernel feeds its own argmax to the next step); 1 =
                   one launch per token, the host queues them ahead (pipeline_depth)
  blocks_per_sm    resident blocks per SM (capped by the occupancy API); threads: per block; unroll: float4
                   columns per lane per weight row in flight
  timeout_s        the longest any block may wait for another inside the kernel before it reports an error
  timeline         compile in %globaltimer stamps (start, inputs ready, end) per stage and block
  max_blocks       cap the grid (the compute-sanitizer tests run a handful of blocks)
  keep_layers_in_l2  a measurement (sm_80+): ask L2 to keep the layers' weights (evict-last prefetches, loads
                   without the streaming hint), so it keeps what fits of them (benchmarks_megakernel.floor_rows,
                   on a model whose every layer is layer 0); release_l2() after
Sampling (choose given) works one launch per token: the kernel's argmax is replaced by the sampled token.

Nothing hangs: the grid is sized so every block is resident at once (the driver's occupancy calculator);
when it cannot be, the constructor raises MegakernelUnavailable (mode="auto" then uses the graph decoder),
and every wait inside the kernel is bounded: a timeout raises MegakernelTimeout naming the block, stage,
layer and step that waited, and the decoder's counters are reset so it can run again.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from common import allow_dynamic_smem, device_info, expect_choice, get_kernel, occupancy, require_gpu
from step4_gpt2.generate import PIPELINE_DEPTH, Decoder
from step4_gpt2.weights import GPTConfig

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "megakernel.cu"
KERNEL = "megakernel_decode"
MAX_BATCH = 8            # the kernel keeps a (rows x batch) accumulator per lane in registers
THREADS = 384            # 12 warps per block (155-168 registers per thread by batch and version at sm_90; 512: 128, slower)
ROWS = 2                 # output rows per warp item (rows(): ROWS_B1 where that fits)
ROWS_B1 = 4              # batch 1, sm_80+, n_embd <= 768, default threads and unroll: one wave of 4-row items
                         # covers a block's QKV and c_fc rows (124M on 132 SMs), one round trip fewer per stage;
                         # elsewhere (other knobs included) they would spill or are untested
UNROLL = 3               # float4 columns per lane per row in one item: 96 float4 = 384 floats per segment
PF_WAVES = 2             # v2: waves of weight rows asked from L2 ahead of use
ATT_MAXCL = 256          # most cache positions one attention unit (one warp) handles
MERGE_MAX = 4            # batch x chunks up to which the attention projection merges the chunks itself
HCAP = 48                # most h rows a block keeps in shared memory at once (the MLP stage; more: in turns)
SYNC_FIXED = 8           # fixed counters before the per-head ones (megakernel.cu: S_HEAD0)
LW_COUNT = 14            # pointers per layer in the table (megakernel.cu: LW_COUNT)
STAGES = ("QKV", "attention", "attn proj", "mlp", "LM head")
PER_LAYER = len(STAGES) - 1          # stages per layer; the LM head ends a step
TIMEOUT_S = 2.0
AUTO_MAX_BATCH = 8       # mode="auto" picks the megakernel for greedy decoding up to this batch, where it fits
                         # (benchmarks_megakernel: v2 beat the graph decode at batch 1 and 8, caches 32 and 991)


class MegakernelUnavailable(RuntimeError):
    """The megakernel cannot run this model/batch on this GPU (its blocks would not all be resident)."""


class MegakernelTimeout(RuntimeError):
    """A block waited longer than timeout_s for another block inside the kernel (reported, not hung)."""


def unsupported_reason(config, batch: int) -> str | None:
    """Why the kernel cannot take this config and batch (None when it can)."""
    if not isinstance(batch, (int, np.integer)) or not 1 <= batch <= MAX_BATCH:
        return f"batch: the megakernel decodes 1 to {MAX_BATCH} sequences, got {batch!r}"
    if config.n_embd % config.n_head or config.head_dim not in (32, 64):
        return f"config: head_dim must be 32 or 64, got n_embd={config.n_embd}, n_head={config.n_head}"
    if config.n_embd % 4:
        return f"config: n_embd must be a multiple of 4 (float4 loads), got {config.n_embd}"
    return None


def rows(config, batch: int, sm: int | None = None, threads: int = THREADS, unroll: int = UNROLL) -> int:
    """Output rows per warp item for a config, batch and knobs on a GPU of compute capability `sm` (None: any)."""
    fits = batch == 1 and sm is not None and sm >= 80 and config.n_embd <= 768 and threads == THREADS \
        and unroll == UNROLL
    return ROWS_B1 if fits else ROWS


def defines(config, batch: int, version: int = 2, timeline: bool = False, threads: int = THREADS,
            unroll: int = UNROLL, sm: int | None = None, keep_layers_in_l2: bool = False) -> dict:
    """The compile-time constants of megakernel.cu for a model config and batch, on a GPU of compute
    capability `sm` (None: the portable choices)."""
    return {"NB": int(batch), "C": config.n_embd, "NH": config.n_head, "NL": config.n_layer,
            "VOCAB": config.vocab_size, "MK_THREADS": threads, "MK_ROWS": rows(config, batch, sm, threads, unroll),
            "MK_UNROLL": unroll,
            "MK_VERSION": version, "MK_PF_WAVES": PF_WAVES, "ATT_MAXCL": ATT_MAXCL, "MK_MERGE_MAX": MERGE_MAX,
            "MK_HCAP": HCAP,
            "MK_EPS": f"{float(config.eps)!r}f", "MK_TIMELINE": int(bool(timeline)),
            "MK_KEEP_WEIGHTS": int(bool(keep_layers_in_l2)),
            "MK_LW_COUNT": LW_COUNT, "MK_SYNC_FIXED": SYNC_FIXED}     # checked against the .cu's own (static_assert)


# For tests/test_compile.py: GPT-2 124M at batch 1 (the .cu's own defaults), and LW_COUNT / SYNC_FIXED checked.
CU_DEFINES = {SOURCE: defines(GPTConfig(), 1)}


def stages_per_step(n_layer: int) -> int:
    """Stages of one decode step (megakernel.cu: STAGES_PER_STEP): PER_LAYER per layer, then the LM head."""
    return PER_LAYER * n_layer + 1


def _mlp_groups(config, threads: int) -> int:
    """Groups of threads that split the rows of the MLP's down projection (megakernel.cu: MLP_KG)."""
    c4 = config.n_embd // 4
    return 1 if c4 > threads else threads // c4


def smem_bytes(config, batch: int, threads: int = THREADS, sm: int | None = None, unroll: int = UNROLL) -> int:
    """Dynamic shared memory per block: the stage input (batch x C), the MLP's cross-group sums and its h
    rows, the cross-warp partial sums, and each warp's q row and attention probabilities."""
    warps, C, r = threads // 32, config.n_embd, rows(config, batch, sm, threads, unroll)
    return 4 * (batch * C * (1 + _mlp_groups(config, threads)) + batch * HCAP + 2 * warps * r * batch
                + warps * config.head_dim + warps * ATT_MAXCL)


def _fit(config, batch: int, version: int = 2, timeline: bool = False, threads: int = THREADS,
         unroll: int = UNROLL, keep_layers_in_l2: bool = False) -> tuple:
    """(kernel, dynamic shared memory per block, resident blocks per SM >= 1) of the megakernel for this config
    and batch on this GPU; MegakernelUnavailable where its shared memory is past the GPU's opt-in limit or not
    one block fits on an SM (every block must be resident at once). The constructor and mode="auto" ask this."""
    sm = device_info()["sm"]
    fn = get_kernel(SOURCE, KERNEL, defines(config, batch, version, timeline, threads, unroll, sm, keep_layers_in_l2))
    smem = smem_bytes(config, batch, threads, sm, unroll)
    try:
        allow_dynamic_smem(fn, smem, f"batch={batch}: the megakernel's stage inputs")
    except ValueError as e:
        raise MegakernelUnavailable(str(e)) from None
    per_sm = int(occupancy(fn, threads, smem)["blocks_per_sm"])
    if per_sm < 1:
        raise MegakernelUnavailable(
            f"not one block of the megakernel ({threads} threads, {fn.num_regs} registers each, {smem:,} B of "
            f"shared memory) fits on an SM of this GPU ({device_info()['name']}); every block must be resident "
            f"at once, so it cannot run here")
    return fn, smem, per_sm


class MegakernelDecoder(Decoder):
    """Decodes one batch with megakernel.cu: one launch runs every layer of a step (or several steps).
    Decoder's prefill and checks; its own launches, pipelining and sampling loop (the kernel advances the
    positions itself and reports a timeout in an error flag). Memory beyond the graph decoder's: a transposed
    copy of every layer's mlp c_proj (4 C^2 floats per layer: 113 MB for the 124M model)."""

    mode = "megakernel"

    def __init__(self, model, batch: int, length: int, greedy: bool = True, version: int = 2,
                 steps_per_launch: int = 1, blocks_per_sm: int = 1, threads: int = THREADS, unroll: int = UNROLL,
                 timeout_s: float = TIMEOUT_S, timeline: bool = False, max_blocks: int | None = None,
                 pipeline_depth: int = PIPELINE_DEPTH, keep_layers_in_l2: bool = False):
        require_gpu()
        import cupy as cp
        cfg = model.config
        reason = unsupported_reason(cfg, batch)
        if reason:
            raise MegakernelUnavailable(reason)
        expect_choice(version, "version", (1, 2))
        expect_choice(threads, "threads", (256, 384, 512))
        expect_choice(unroll, "unroll", (1, 2, 3, 4))
        for name, v in (("steps_per_launch", steps_per_launch), ("blocks_per_sm", blocks_per_sm),
                        ("pipeline_depth", pipeline_depth)):
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {v!r}")
        if max_blocks is not None and (not isinstance(max_blocks, (int, np.integer)) or max_blocks < 1):
            raise ValueError(f"max_blocks: expected None or an integer >= 1, got {max_blocks!r}")
        if not (timeout_s > 0 and np.isfinite(timeout_s)):
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
        if not isinstance(length, (int, np.integer)) or not 1 <= length <= cfg.block_size:
            raise ValueError(f"length: the KV cache holds 1 .. block_size={cfg.block_size} positions, got {length!r}")
        if not greedy and steps_per_launch != 1:
            raise ValueError("steps_per_launch: sampling (greedy=False) chooses each token on the host, "
                             "so it needs steps_per_launch=1")
        self.version, self.steps_per_launch, self.threads, self.unroll = version, int(steps_per_launch), threads, unroll
        self.timeout_ns, self.timeline = int(timeout_s * 1e9), bool(timeline)

        if keep_layers_in_l2 and device_info()["sm"] < 80:
            raise ValueError(f"keep_layers_in_l2: needs L2 eviction-priority hints (sm_80 or newer); this GPU is "
                             f"sm_{device_info()['sm']}")
        self.keep_layers_in_l2 = bool(keep_layers_in_l2)
        self.fn, self.smem, per_sm = _fit(cfg, batch, version, timeline, threads, unroll, self.keep_layers_in_l2)
        self.grid = device_info()["multiprocessors"] * min(int(blocks_per_sm), per_sm)
        if max_blocks is not None:
            self.grid = min(self.grid, int(max_blocks))
        self.resident_per_sm = per_sm

        self._allocate(model, batch, length, greedy, pipeline_depth)
        B, C, H, D, L = self.batch, cfg.n_embd, cfg.n_head, cfg.head_dim, self.length
        warps = self.grid * (threads // 32)
        self.nch = max(-(-L // ATT_MAXCL), min(-(-L // 32), max(1, warps // (B * H))))
        self.work = cp.zeros(B * C * 4 + B * H * self.nch * (D + 2), cp.float32)     # x, q, att, acc, partials
        self.sync = cp.zeros(SYNC_FIXED + H + B * H, cp.uint32)
        self.amax = cp.zeros(B, cp.uint64)
        self.err = cp.zeros(8, cp.int32)
        ptrs, mproj_t = [], {}
        for i, blk in enumerate(model.h):
            # the MLP's down projection is split over its inputs: each block reads whole rows of c_proj^T
            # (4C x C, as the checkpoint stores it), so the decoder keeps that copy (4C x C floats per layer;
            # one per matrix: layers that share their weights share it too)
            key = (blk.mlp_proj.data.ptr, blk.mlp_proj.shape, blk.mlp_proj.strides)
            if key not in mproj_t:
                mproj_t[key] = cp.ascontiguousarray(blk.mlp_proj.T)
            ptrs += [blk.ln_1[0], blk.ln_1[1], blk.c_attn, blk.c_attn_b, blk.c_proj, blk.c_proj_b, blk.ln_2[0],
                     blk.ln_2[1], blk.c_fc, blk.c_fc_b, mproj_t[key], blk.mlp_proj_b, self.state.cache.k[i],
                     self.state.cache.v[i]]
        if len(ptrs) != cfg.n_layer * LW_COUNT:
            raise RuntimeError("megakernel: the layer pointer table does not match megakernel.cu's LW_COUNT")
        self.ptrs = cp.asarray(np.array([a.data.ptr for a in ptrs], np.uint64))
        self._keep = ptrs                       # the table holds raw addresses: keep the arrays alive
        self.epoch = 0                          # steps run on these counters (v2 targets)
        self.barriers = 0                       # v1: barrier arrivals so far (the counter's value)
        cp.cuda.runtime.deviceSynchronize()     # its zeroed buffers and table exist before a launch on self.stream
        self.last_timeline = None

    # ------------------------------------------------------------------ mode="auto"
    @staticmethod
    def preferred(model, batch: int, length: int, greedy: bool) -> bool:
        """mode="auto": greedy decoding of 1..AUTO_MAX_BATCH sequences when the kernel fits this GPU."""
        if not greedy or unsupported_reason(model.config, batch) or batch > AUTO_MAX_BATCH:
            return False
        try:
            _fit(model.config, batch)
        except MegakernelUnavailable:
            return False
        return True

    # ------------------------------------------------------------------ the Decoder interface
    def _info(self) -> dict:
        return {"mode": self.mode, "version": self.version, "grid": self.grid,
                "steps_per_launch": self.steps_per_launch}

    def decode(self, n_steps: int, choose=None):
        """Decoder.decode; a timeout inside the kernel raises MegakernelTimeout once the stream is idle."""
        try:
            yield from super().decode(n_steps, choose)
        finally:
            self.check()

    # ------------------------------------------------------------------ launching
    def launch(self, nsteps: int = 1, out_tokens=None, stall_block: int = -1) -> None:
        """Enqueue one launch of nsteps greedy steps on self.stream (no host sync). out_tokens: an int32
        (nsteps, B) device array for every step's tokens, or None. stall_block >= 0: that block never
        signals (the test of the timeout path)."""
        import cupy as cp
        if not isinstance(nsteps, (int, np.integer)) or nsteps < 1:
            raise ValueError(f"nsteps: expected an integer >= 1, got {nsteps!r}")
        self._check_room(nsteps, "nsteps", "launch")
        self._rows += int(nsteps)
        timeline = None
        if self.timeline:
            per_step = stages_per_step(self.model.config.n_layer)
            with self.stream:                   # zeroed on the stream the kernel then runs on
                timeline = cp.zeros((self.grid, nsteps * per_step, 3), cp.uint64)
            self.last_timeline = timeline
        w, s = self.model, self.state
        args = (self.ptrs, w.wte, w.wpe, w.ln_f[0], w.ln_f[1], s.tokens, s.pos, s.lens, self.work, self.sync,
                self.amax, s.logits, out_tokens if out_tokens is not None else np.uint64(0), np.int32(self.length),
                np.int32(self.nch), np.int32(nsteps), np.uint32(self.epoch % 2**32),
                np.uint32(self.barriers % 2**32), np.int64(self.timeout_ns), np.int32(stall_block), self.err,
                timeline if timeline is not None else np.uint64(0))
        with self.stream:
            self.fn((self.grid,), (self.threads,), args, shared_mem=self.smem)
        self.epoch += nsteps
        self.barriers += self.grid * (nsteps * stages_per_step(self.model.config.n_layer) - 1)   # v1: not the first

    def release_l2(self) -> None:
        """After a decoder built with keep_layers_in_l2: return the lines of the layers' weights to L2's normal
        eviction priority, so that they do not crowd out what runs next."""
        import cupy as cp
        cfg = self.model.config
        fn = get_kernel(SOURCE, "l2_evict_normal", defines(cfg, self.batch, self.version, self.timeline, self.threads,
                                                           self.unroll, device_info()["sm"], True))
        seen = set()
        with self.stream:
            for a in self._keep:
                if a.data.ptr not in seen and a.dtype == cp.float32:
                    seen.add(a.data.ptr)
                    fn((256,), (256,), (a, np.int64(a.size)))
        self.stream.synchronize()

    def check(self) -> None:
        """Raise MegakernelTimeout if a launch reported a timeout (and reset the counters for the next run)."""
        e = [int(v) for v in self.err.get()]    # Python ints: the counters are printed as unsigned below
        if e[0] == 0:
            return
        self.reset()
        if e[0] == 2:
            raise RuntimeError(f"megakernel: launched with {e[5]:,} B of dynamic shared memory, its layout needs "
                               f"{e[6]:,} B (smem_bytes and megakernel.cu disagree)")
        stage = STAGES[e[2]] if 0 <= e[2] < len(STAGES) else f"#{e[2]}"
        raise MegakernelTimeout(
            f"megakernel: block {e[1]} waited more than {self.timeout_ns / 1e9:g} s at stage {stage!r} of layer "
            f"{e[3]}, step {e[4]} of its launch (counter {e[6] & 0xffffffff} of {e[5] & 0xffffffff}): another block "
            f"never signalled. Are all {self.grid} blocks resident (another kernel running concurrently?)")

    def reset(self) -> None:
        """Zero the counters and the error flag (after an error the counters' values mean nothing)."""
        self.stream.synchronize()
        self.sync.fill(0)
        self.amax.fill(0)
        self.err.fill(0)
        self.epoch = self.barriers = 0
        import cupy as cp
        cp.cuda.runtime.deviceSynchronize()

    def _pipelined(self, n_steps: int):
        import cupy as cp
        import cupyx
        k, depth = self.steps_per_launch, self.pipeline_depth
        ring = cupyx.empty_pinned((depth + 1, k, self.batch), np.int32)
        errs = cupyx.empty_pinned((depth + 1, 8), np.int32)
        dev = cp.empty((depth + 1, k, self.batch), cp.int32)
        launched, pending, slot = 0, [], 0
        while True:
            while launched < n_steps and len(pending) < depth:
                n = min(k, n_steps - launched)
                with self.stream:
                    self.launch(n, dev[slot])
                    dev[slot, :n].get(stream=self.stream, out=ring[slot, :n], blocking=False)
                    self.err.get(stream=self.stream, out=errs[slot], blocking=False)
                    pending.append((self.stream.record(), slot, n))
                slot = (slot + 1) % (depth + 1)
                launched += n
            if not pending:
                return
            event, s, n = pending.pop(0)
            event.synchronize()
            if errs[s, 0]:
                self.stream.synchronize()
                self.check()
            for j in range(n):
                yield ring[s, j].copy()

    def _sampled(self, n_steps: int, choose):
        s = self.state
        for _ in range(n_steps):
            with self.stream:
                self.launch(1)                       # the kernel advances pos/lens; its argmax is replaced
                self._choose(s.logits, choose)
                host = s.tokens.get()
            self.check()
            yield host

    # ------------------------------------------------------------------ measurement
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


__all__ = ["MegakernelDecoder", "MegakernelUnavailable", "MegakernelTimeout", "unsupported_reason", "defines",
           "smem_bytes", "rows", "stages_per_step", "breakdown", "plot_timeline", "STAGES"]
