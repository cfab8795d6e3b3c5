"""The whole GPT-2 decode step in one persistent kernel (megakernel_v1.cu, megakernel_v2.cu), as a decoder.

    dec = MegakernelDecoder(model, batch=1, length=300)          # version=2: counters + prefetch
    first = dec.prefill(ids, lens)                                # the prompt, on the model's prefill path
    for tokens in dec.decode(200):                                # np.int32 (B,) per step
        ...
    generate(model, prompts, 200, decoder=MegakernelDecoder)     # the same through lesson 4a's generate()

MegakernelDecoder is a generate.Decoder (its interface, prefill, argument checks and token choice, its decode
state and stream) whose steps are launches of this kernel. Options:
  version          1: a grid-wide barrier before every stage (megakernel_v1.cu); 2: counters + weight
                   prefetch (megakernel_v2.cu, the default)
  steps_per_launch greedy steps one launch runs (the kernel feeds its own argmax to the next step); 1 =
                   one launch per token, the host queues them ahead (generate.PIPELINE_DEPTH)
  timeout_s        the longest any block may wait for another inside the kernel before it reports an error
Sampling (choose given) works one launch per token: the kernel's argmax is replaced by the sampled token.
`supports(model, batch, greedy)` says whether the megakernel is the decoder to pick for a call.

Weights in fewer bytes: version 2 reads a bf16 or int8 model (lesson 4f's GPT(precision=...), its LM head in
its own precision) as it is stored, widening each weight in registers; the build is picked from the model's
weights (defines(..., precision=, lm_head=): megakernel.cuh's MK_WT, MK_WT_HEAD). Version 1 reads fp32 only.
supports() picks the megakernel automatically for the precisions in AUTO_PRECISIONS; the others decode with it
when it is asked for by name (decoder=MegakernelDecoder).

Nothing hangs: the grid is sized so every block is resident at once (the driver's occupancy calculator);
when it cannot be, the constructor raises MegakernelUnavailable (supports() then says False), and every wait
inside the kernel is bounded: a timeout raises MegakernelTimeout naming the block, stage, layer and step that
waited, and the decoder's counters are reset so it can run again.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from common import allow_dynamic_smem, device_info, expect_choice, get_kernel, null_or, occupancy, require_gpu
from step4_gpt2.generate import Decoder
from step4_gpt2.model import Block
from step4_gpt2.quantize import KIND_OF_DTYPE, PRECISIONS
from step4_gpt2.weights import GPTConfig

HERE = Path(__file__).resolve().parent
SOURCES = {1: HERE / "megakernel_v1.cu", 2: HERE / "megakernel_v2.cu"}     # by version
KERNEL = "megakernel_decode"
MAX_BATCH = 8            # the kernel keeps a (rows x batch) accumulator per lane in registers
THREADS = 384            # 12 warps per block (155-168 registers per thread by batch and version at sm_90; 512: 128, slower)
ROWS = 2                 # output rows per warp item (rows(): ROWS_B1 where that fits)
ROWS_B1 = 4              # batch 1, sm_80+, n_embd <= 768, default threads and unroll: one wave of 4-row items
                         # covers a block's QKV and c_fc rows (124M on 132 SMs), one round trip fewer per stage;
                         # elsewhere (other threads or unroll included) they would spill or are untested; bf16
                         # and int8 weights (the registers that widen them): sm_90+ only
UNROLL = 3               # float4 columns per lane per row in one item: 96 float4 = 384 floats per segment
PF_WAVES = 2             # v2: waves of weight rows asked from L2 ahead of use
ATT_MAXCL = 256          # most cache positions one attention unit (one warp) handles
MERGE_MAX = 4            # batch x chunks up to which the attention projection merges the chunks itself
HCAP = 48                # most h rows a block keeps in shared memory at once (the MLP stage; more: in turns)
SYNC_FIXED = 8           # fixed counters before the per-head ones (megakernel.cuh: S_HEAD0)
LW_COUNT = 18            # pointers per layer in the table (megakernel.cuh: LW_COUNT)
WEIGHT_FORMATS = {"fp32": 0, "bf16": 1, "int8": 2}     # megakernel.cuh's W_F32, W_BF16, W_I8 (MK_WT, MK_WT_HEAD)
MATRICES = Block.MATRICES     # a block's matrices (their int8 scales: <name>_s)
STAGES = ("QKV", "attention", "attn proj", "mlp", "LM head")
PER_LAYER = len(STAGES) - 1          # stages per layer; the LM head ends a step
TIMEOUT_S = 2.0
AUTO_MAX_BATCH = 8       # supports(): the megakernel for greedy decoding up to this batch, where it fits
                         # (its benchmark: v2 beat the graph decode at batch 1 and 8, caches 32 and 991)
AUTO_PRECISIONS = ("fp32",)   # supports(): the weight formats it picks the megakernel for; bf16 and int8 are
                              # measured (benchmarks.py's precision rows) but not picked automatically yet


class MegakernelUnavailable(RuntimeError):
    """The megakernel cannot run this model/batch on this GPU (its blocks would not all be resident)."""


class MegakernelTimeout(RuntimeError):
    """A block waited longer than timeout_s for another block inside the kernel (reported, not hung)."""


def unsupported_reason(config, batch: int) -> str | None:
    """Why the kernel cannot take this config and batch (None when it can). With head_dim 32 or 64, n_embd is a
    multiple of 32, so every weight row starts 16-byte aligned in every format (4, 8 or 16 weights per load)."""
    if not isinstance(batch, (int, np.integer)) or not 1 <= batch <= MAX_BATCH:
        return f"batch: the megakernel decodes 1 to {MAX_BATCH} sequences, got {batch!r}"
    if config.n_embd % config.n_head or config.head_dim not in (32, 64):
        return f"config: head_dim must be 32 or 64, got n_embd={config.n_embd}, n_head={config.n_head}"
    if config.n_embd % 4:
        return f"config: n_embd must be a multiple of 4 (float4 loads), got {config.n_embd}"
    return None


def model_precisions(model) -> tuple[str, str]:
    """(the block matrices' precision, the LM head's) of a model: lesson 4f's GPT(precision=, lm_head=); models
    without them (before lesson 4f) are fp32."""
    precision = getattr(model, "precision", "fp32")
    return precision, getattr(model, "lm_head_precision", precision)


def precision_reason(model, version: int = 2) -> str | None:
    """Why this version of the kernel cannot take this model's weights (None when it can): v2 reads fp32, bf16
    and int8 (lesson 4f's GPT(precision=...)), v1 fp32 only."""
    precision, head = model_precisions(model)
    for name, p in (("precision", precision), ("lm_head_precision", head)):
        if p not in PRECISIONS:
            return f"model: {name} must be one of {PRECISIONS}, got {p!r}"
    if (precision, head) != ("fp32", "fp32") and version == 1:
        return (f"version: megakernel v1 reads fp32 weights, and this model stores them as {precision} "
                f"(LM head: {head}); decode it with version=2")
    if precision == "fp32" and head != "fp32":
        return f"model: an fp32 model's LM head is fp32 (tied to wte), got lm_head_precision={head!r}"
    return None


def rows(config, batch: int, sm: int | None = None, threads: int = THREADS, unroll: int = UNROLL,
         precision: str = "fp32") -> int:
    """Output rows per warp item for a config and batch on a GPU of compute capability `sm` (None: any);
    threads and unroll: the build's (the defaults but in the lab's variant builds); precision: its weights'."""
    fits = batch == 1 and sm is not None and sm >= (80 if precision == "fp32" else 90) and config.n_embd <= 768 \
        and threads == THREADS and unroll == UNROLL
    return ROWS_B1 if fits else ROWS


def defines(config, batch: int, sm: int | None = None, threads: int = THREADS, unroll: int = UNROLL,
            precision: str = "fp32", lm_head: str | None = None) -> dict:
    """The compile-time constants of megakernel_v1.cu / megakernel_v2.cu (each sets its own MK_VERSION) for a
    model config and batch, on a GPU of compute capability `sm` (None: the portable choices), with the block
    matrices stored in `precision` and the LM head in `lm_head` (None: the same)."""
    expect_choice(precision, "precision", PRECISIONS)
    lm_head = expect_choice(lm_head or precision, "lm_head", PRECISIONS)
    return {"NB": int(batch), "C": config.n_embd, "NH": config.n_head, "NL": config.n_layer,
            "VOCAB": config.vocab_size, "MK_THREADS": threads,
            "MK_ROWS": rows(config, batch, sm, threads, unroll, precision),
            "MK_UNROLL": unroll, "MK_PF_WAVES": PF_WAVES, "ATT_MAXCL": ATT_MAXCL, "MK_MERGE_MAX": MERGE_MAX,
            "MK_HCAP": HCAP, "MK_EPS": f"{float(config.eps)!r}f",
            "MK_WT": WEIGHT_FORMATS[precision], "MK_WT_HEAD": WEIGHT_FORMATS[lm_head],
            "MK_LW_COUNT": LW_COUNT, "MK_SYNC_FIXED": SYNC_FIXED}     # checked against the .cu's own (static_assert)


# For tests/test_compile.py: GPT-2 124M at batch 1 (the .cu's own defaults), and LW_COUNT / SYNC_FIXED checked.
CU_DEFINES = {SOURCES[1]: defines(GPTConfig(), 1), SOURCES[2]: defines(GPTConfig(), 1)}


def stages_per_step(n_layer: int) -> int:
    """Stages of one decode step (megakernel.cuh: STAGES_PER_STEP): PER_LAYER per layer, then the LM head."""
    return PER_LAYER * n_layer + 1


def _mlp_groups(config, threads: int) -> int:
    """Groups of threads that split the rows of the MLP's down projection (megakernel_stages.cuh: MLP_KG)."""
    c4 = config.n_embd // 4
    return 1 if c4 > threads else threads // c4


def smem_bytes(config, batch: int, sm: int | None = None, threads: int = THREADS, unroll: int = UNROLL,
               precision: str = "fp32") -> int:
    """Dynamic shared memory per block: the stage input (batch x C), the MLP's cross-group sums and its h
    rows, the cross-warp partial sums, and each warp's q row and attention probabilities (all fp32, whatever
    the weights' precision)."""
    warps, C, r = threads // 32, config.n_embd, rows(config, batch, sm, threads, unroll, precision)
    return 4 * (batch * C * (1 + _mlp_groups(config, threads)) + batch * HCAP + 2 * warps * r * batch
                + warps * config.head_dim + warps * ATT_MAXCL)


def compile_kernel(version: int, constants: dict):
    """The kernel of megakernel_v1.cu or megakernel_v2.cu (version 1 or 2), compiled with these constants."""
    return get_kernel(SOURCES[expect_choice(version, "version", (1, 2))], "megakernel_decode", constants)


def fit(fn, config, batch: int, threads: int = THREADS, unroll: int = UNROLL,
        precision: str = "fp32") -> tuple[int, int]:
    """(dynamic shared memory per block, resident blocks per SM >= 1) of the compiled kernel fn for this config
    and batch on this GPU; MegakernelUnavailable where its shared memory is past the GPU's opt-in limit or not
    one block fits on an SM (every block must be resident at once)."""
    smem = smem_bytes(config, batch, device_info()["sm"], threads, unroll, precision)
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
    return smem, per_sm


def supports(model, batch: int, greedy: bool) -> bool:
    """Whether to decode this call with the megakernel: greedy decoding of 1..AUTO_MAX_BATCH sequences of a
    model the kernel takes, where every block of it fits on this GPU at once."""
    precision, head = model_precisions(model)
    if not greedy or unsupported_reason(model.config, batch) or batch > AUTO_MAX_BATCH or precision_reason(model) \
            or precision not in AUTO_PRECISIONS:
        return False
    require_gpu()
    try:
        fit(compile_kernel(2, defines(model.config, batch, device_info()["sm"], precision=precision, lm_head=head)),
            model.config, batch, precision=precision)
    except MegakernelUnavailable:
        return False
    return True


class MegakernelDecoder(Decoder):
    """Decodes one batch with the megakernel: one launch runs every layer of a step (or several steps).
    Decoder's prefill and checks; its own launches, pipelining and sampling loop (the kernel advances the
    positions itself and reports a timeout in an error flag). Memory beyond the graph decoder's: a transposed
    copy of every layer's mlp c_proj (4 C^2 weights per layer in the model's precision: 113 MB for the 124M
    model in fp32)."""

    mode = "megakernel"
    threads, unroll = THREADS, UNROLL       # the build (the lab's variant builds change them)

    def __init__(self, model, batch: int, length: int, greedy: bool = True, version: int = 2,
                 steps_per_launch: int = 1, timeout_s: float = TIMEOUT_S):
        expect_choice(version, "version", (1, 2))
        reason = precision_reason(model, version)          # an argument error, before the no-GPU message
        if reason:
            raise ValueError(reason)
        require_gpu()
        import cupy as cp
        cfg = model.config
        self.precision, self.head_precision = model_precisions(model)
        reason = unsupported_reason(cfg, batch)
        if reason:
            raise MegakernelUnavailable(reason)
        if not isinstance(steps_per_launch, (int, np.integer)) or steps_per_launch < 1:
            raise ValueError(f"steps_per_launch: expected an integer >= 1, got {steps_per_launch!r}")
        if not (timeout_s > 0 and np.isfinite(timeout_s)):
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
        if not isinstance(length, (int, np.integer)) or not 1 <= length <= cfg.block_size:
            raise ValueError(f"length: the KV cache holds 1 .. block_size={cfg.block_size} positions, got {length!r}")
        if not greedy and steps_per_launch != 1:
            raise ValueError("steps_per_launch: sampling (greedy=False) chooses each token on the host, "
                             "so it needs steps_per_launch=1")
        self.version, self.steps_per_launch = version, int(steps_per_launch)
        self.timeout_ns = int(timeout_s * 1e9)

        self.fn = self._compile(defines(cfg, batch, device_info()["sm"], self.threads, self.unroll,
                                        self.precision, self.head_precision))
        self.smem, per_sm = fit(self.fn, cfg, batch, self.threads, self.unroll, self.precision)
        self.grid = self._grid(per_sm)
        self.resident_per_sm = per_sm

        self._allocate(model, batch, length, greedy)
        B, C, H, D, L = self.batch, cfg.n_embd, cfg.n_head, cfg.head_dim, self.length
        warps = self.grid * (self.threads // 32)
        self.nch = max(-(-L // ATT_MAXCL), min(-(-L // 32), max(1, warps // (B * H))))
        self.work = cp.zeros(B * C * 4 + B * H * self.nch * (D + 2), cp.float32)     # x, q, att, acc, partials
        self.sync = cp.zeros(SYNC_FIXED + H + B * H, cp.uint32)
        self.amax = cp.zeros(B, cp.uint64)
        self.err = cp.zeros(8, cp.int32)
        ptrs, mproj_t = [], {}
        for i, blk in enumerate(model.h):
            # the MLP's down projection is split over its inputs: each block reads whole rows of c_proj^T
            # (4C x C, as the checkpoint stores it), so the decoder keeps that copy (4C x C weights per layer;
            # one per matrix: layers that share their weights share it too). Its int8 scales stay as they are:
            # one per output, which is a column of the copy.
            key = (blk.mlp_proj.data.ptr, blk.mlp_proj.shape, blk.mlp_proj.strides)
            if key not in mproj_t:
                mproj_t[key] = cp.ascontiguousarray(blk.mlp_proj.T)
            mats = [_checked(blk.c_attn, f"h[{i}].c_attn", self.precision), _checked(blk.c_proj, f"h[{i}].c_proj",
                    self.precision), _checked(blk.c_fc, f"h[{i}].c_fc", self.precision),
                    _checked(mproj_t[key], f"h[{i}].mlp_proj", self.precision)]
            scales = [_scale_of(blk, m, f"h[{i}].{m}", self.precision) for m in MATRICES]
            fp32 = [blk.ln_1[0], blk.ln_1[1], blk.c_attn_b, blk.c_proj_b, blk.ln_2[0], blk.ln_2[1], blk.c_fc_b,
                    blk.mlp_proj_b, self.state.cache.k[i], self.state.cache.v[i]]
            if any(a.dtype != cp.float32 for a in fp32):      # the kernel reads raw addresses as floats
                raise ValueError(f"model: h[{i}]'s biases, LayerNorms and caches must be float32, got "
                                 f"{sorted({str(a.dtype) for a in fp32} - {'float32'})}")
            ptrs += [blk.ln_1[0], blk.ln_1[1], mats[0], blk.c_attn_b, mats[1], blk.c_proj_b, blk.ln_2[0],
                     blk.ln_2[1], mats[2], blk.c_fc_b, mats[3], blk.mlp_proj_b, self.state.cache.k[i],
                     self.state.cache.v[i], *scales]
        if len(ptrs) != cfg.n_layer * LW_COUNT:
            raise RuntimeError("megakernel: the layer pointer table does not match megakernel.cuh's LW_COUNT")
        self.ptrs = cp.asarray(np.array([0 if a is None else a.data.ptr for a in ptrs], np.uint64))
        # the LM head: wte itself for an fp32 model (tied), else the model's converted copy (and its int8 scales)
        self.head = _checked(getattr(model, "lm_head", model.wte), "lm_head", self.head_precision)
        self.head_s = _scale_of(model, "lm_head", "lm_head", self.head_precision)
        self._keep = [a for a in ptrs if a is not None]      # the table holds raw addresses: keep them alive
        self.epoch = 0                          # steps run on these counters (v2 targets)
        self.barriers = 0                       # v1: barrier arrivals so far (the counter's value)
        cp.cuda.runtime.deviceSynchronize()     # its zeroed buffers and table exist before a launch on self.stream

    def _compile(self, constants: dict):
        """The kernel this decoder launches (the lab's builds compile their own .cu)."""
        return compile_kernel(self.version, constants)

    def _grid(self, per_sm: int) -> int:
        """One block per SM: each keeps its share of every stage's weights streaming."""
        return device_info()["multiprocessors"]

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
    def launch(self, nsteps: int = 1, out_tokens=None) -> None:
        """Enqueue one launch of nsteps greedy steps on self.stream (no host sync). out_tokens: an int32
        (nsteps, B) device array for every step's tokens, or None."""
        if not isinstance(nsteps, (int, np.integer)) or nsteps < 1:
            raise ValueError(f"nsteps: expected an integer >= 1, got {nsteps!r}")
        self._check_room(nsteps, "nsteps", "launch")
        self._rows += int(nsteps)
        w, s = self.model, self.state
        args = (self.ptrs, w.wte, w.wpe, w.ln_f[0], w.ln_f[1], self.head, null_or(self.head_s), s.tokens, s.pos, s.lens,
                self.work, self.sync, self.amax, s.logits, null_or(out_tokens),
                np.int32(self.length), np.int32(self.nch), np.int32(nsteps), np.uint32(self.epoch % 2**32),
                np.uint32(self.barriers % 2**32), np.int64(self.timeout_ns), self.err)
        with self.stream:
            self.fn((self.grid,), (self.threads,), args, shared_mem=self.smem)
        self.epoch += nsteps
        self.barriers += self.grid * (nsteps * stages_per_step(self.model.config.n_layer) - 1)   # v1: not the first

    def check(self) -> None:
        """Raise MegakernelTimeout if a launch reported a timeout (and reset the counters for the next run)."""
        e = [int(v) for v in self.err.get()]    # Python ints: the counters are printed as unsigned below
        if e[0] == 0:
            return
        self.reset()
        if e[0] == 2:
            raise RuntimeError(f"megakernel: launched with {e[5]:,} B of dynamic shared memory, its layout needs "
                               f"{e[6]:,} B (smem_bytes and megakernel_v{self.version}.cu disagree)")
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


def _checked(a, name: str, precision: str):
    """a, a C-contiguous matrix stored as `precision` (float32, uint16 bf16 bits or int8), else an error naming it:
    the kernel reads its raw address in that format."""
    if KIND_OF_DTYPE.get(a.dtype) != precision or not a.flags.c_contiguous or a.ndim != 2:
        raise ValueError(f"model: {name} must be a C-contiguous 2-D {precision} matrix (the megakernel's build "
                         f"for this model), got {a.dtype} {tuple(a.shape)}")
    return a


def _scale_of(obj, matrix: str, name: str, precision: str):
    """The int8 row scales of obj.<matrix> (obj.<matrix>_s: float32, one per output row), or None for fp32/bf16."""
    if precision != "int8":
        return None
    s = getattr(obj, matrix + "_s", None)
    rows = getattr(obj, matrix).shape[0]
    if s is None or s.dtype != np.float32 or s.shape != (rows,) or not s.flags.c_contiguous:
        got = None if s is None else f"{s.dtype} {tuple(s.shape)}"
        raise ValueError(f"model: {name}_s must be the int8 matrix's float32 row scales, shape ({rows},), got {got}")
    return s


__all__ = ["MegakernelDecoder", "MegakernelUnavailable", "MegakernelTimeout", "supports", "unsupported_reason",
           "precision_reason", "model_precisions", "defines", "smem_bytes", "rows", "stages_per_step", "STAGES",
           "AUTO_MAX_BATCH", "AUTO_PRECISIONS"]
