"""One kernel under Nsight Compute, from a notebook: what the hardware counters say it did.

    from common import profile
    p = profile(code, kernel="axpb_v3")      # code: Python source, run in a child Python under `ncu`
    if p:                                    # None (after one printed line saying why) if ncu can't be used
        print(p)                             # a short table: time, DRAM bytes and GB/s, FLOPs, occupancy
        print(f"napkin {8 * n / 1e6:.0f} MB, measured {p.dram_bytes / 1e6:.0f} MB")

The child runs with the course root as its working directory and on its PYTHONPATH, with this interpreter, so
`import common` and `from step1_simple import ops` work in `code`. `kernel` is a regular expression searched in
the kernel names (templates are mangled: "layernorm" matches "layernorm<256>"); the first matching launch is
profiled, after skipping `launch_skip` matching launches (e.g. a warm-up).

How to read it: ncu flushes the caches before the kernel, so its inputs come from DRAM, as in `bench`. Bytes a
kernel writes that are still in L2 when it ends are not yet DRAM traffic, so the measured write bytes can be a
little below the napkin figure. The kernel runs at the GPU's own clocks (`--clock-control none`), so its time is
comparable with `bench`'s, but it is one run, not a median.
"""
from __future__ import annotations

import csv
import glob
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELP = "docs/debugging.md#4-slow-kernels-nsight-compute-basics"

# The counters every reading collects; each exists on sm_70 ... sm_90 (Volta to Hopper).
METRICS = (
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "smsp__sass_thread_inst_executed_op_ffma_pred_on.sum",
    "smsp__sass_thread_inst_executed_op_fadd_pred_on.sum",
    "smsp__sass_thread_inst_executed_op_fmul_pred_on.sum",
    "sm__inst_executed_pipe_tensor.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "launch__registers_per_thread",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
)

_TIME_SCALE_MS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0,
                  "s": 1e3, "second": 1e3}
_BYTE_SCALE = {"byte": 1.0, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "kibyte": 1024.0, "mibyte": 1024.0 ** 2,
               "gibyte": 1024.0 ** 3}


@dataclass
class Profile:
    """One kernel launch as Nsight Compute measured it (bytes, FLOPs and times of that one launch)."""
    kernel: str
    duration_ms: float
    dram_read_bytes: float
    dram_write_bytes: float
    fp32_flops: float                     # 2 x FFMA + FADD + FMUL, counted per thread
    tensor_inst: float                    # instructions issued to the tensor-core pipe (per warp)
    sm_pct: float                         # SM throughput, % of peak sustained
    dram_pct: float                       # DRAM throughput, % of peak sustained
    registers: int                        # registers per thread
    occupancy_pct: float                  # achieved occupancy: active warps, % of the SM's maximum
    grid: str = ""
    block: str = ""
    metrics: dict = field(default_factory=dict, repr=False)   # every metric read: name -> value (base units)

    @property
    def dram_bytes(self) -> float:
        return self.dram_read_bytes + self.dram_write_bytes

    @property
    def dram_gbps(self) -> float:
        return self.dram_bytes / (self.duration_ms * 1e-3) / 1e9 if self.duration_ms > 0 else float("nan")

    @property
    def tflops(self) -> float:
        return self.fp32_flops / (self.duration_ms * 1e-3) / 1e12 if self.duration_ms > 0 else float("nan")

    def __str__(self) -> str:
        launch = f"  grid {self.grid} block {self.block}" if self.grid else ""
        rows = [f"Nsight Compute: {self.kernel}{launch}",
                f"  duration              {self.duration_ms * 1e3:12.1f} us",
                f"  DRAM read             {self.dram_read_bytes / 1e6:12.2f} MB",
                f"  DRAM write            {self.dram_write_bytes / 1e6:12.2f} MB",
                f"  DRAM bandwidth        {self.dram_gbps:12.1f} GB/s   ({self.dram_pct:.1f}% of peak)",
                f"  FP32 FLOPs            {self.fp32_flops / 1e6:12.2f} M      ({self.tflops:.2f} TFLOP/s)",
                f"  tensor-pipe inst.     {self.tensor_inst:12,.0f}",
                f"  SM throughput         {self.sm_pct:12.1f} % of peak",
                f"  registers / thread    {self.registers:12d}",
                f"  achieved occupancy    {self.occupancy_pct:12.1f} %"]
        return "\n".join(rows)


def _number(text: str):
    """'268,443,392' -> 268443392.0; '(256, 1, 1)' or 'n/a' stays a string."""
    t = text.strip().replace(",", "")
    try:
        return float(t)
    except ValueError:
        return text.strip()


def parse_csv(text: str) -> list[dict]:
    """ncu's `--csv` metric rows (one per kernel launch and metric) -> one dict per launch, in launch order:
    {"kernel", "id", "grid", "block", "metrics": {name: value in base units}, "units": {name: unit}}.
    Lines before the header (ncu's ==PROF== messages, the program's output) are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
    if start is None:
        return []
    launches: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if not row.get("ID") or row.get("ID") == "ID" or "Metric Name" not in row or row["Metric Name"] is None:
            continue
        launch = launches.setdefault(row["ID"], {"id": row["ID"], "kernel": row.get("Kernel Name", ""),
                                                 "grid": row.get("Grid Size", ""), "block": row.get("Block Size", ""),
                                                 "metrics": {}, "units": {}})
        launch["metrics"][row["Metric Name"]] = _number(row.get("Metric Value") or "")
        launch["units"][row["Metric Name"]] = (row.get("Metric Unit") or "").strip()
    return list(launches.values())


def _value(launch: dict, name: str, scale: dict | None = None) -> float:
    v = launch["metrics"].get(name)
    if not isinstance(v, float):
        return float("nan")
    if scale is not None:
        v *= scale.get(launch["units"].get(name, "").lower(), 1.0)
    return v


def from_launch(launch: dict) -> Profile:
    """A Profile from one parsed launch (see parse_csv)."""
    ffma, fadd, fmul = (_value(launch, f"smsp__sass_thread_inst_executed_op_{op}_pred_on.sum")
                        for op in ("ffma", "fadd", "fmul"))
    registers = _value(launch, "launch__registers_per_thread")
    return Profile(kernel=launch["kernel"],
                   duration_ms=_value(launch, "gpu__time_duration.sum", _TIME_SCALE_MS),
                   dram_read_bytes=_value(launch, "dram__bytes_read.sum", _BYTE_SCALE),
                   dram_write_bytes=_value(launch, "dram__bytes_write.sum", _BYTE_SCALE),
                   fp32_flops=2 * ffma + fadd + fmul,
                   tensor_inst=_value(launch, "sm__inst_executed_pipe_tensor.sum"),
                   sm_pct=_value(launch, "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
                   dram_pct=_value(launch, "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
                   registers=int(registers) if registers == registers else -1,
                   occupancy_pct=_value(launch, "sm__warps_active.avg.pct_of_peak_sustained_active"),
                   grid=launch.get("grid", ""), block=launch.get("block", ""),
                   metrics=dict(launch["metrics"]))


NCU_FOLDERS = ("/usr/local/cuda/bin", "/opt/nvidia/nsight-compute/*")   # where to look when ncu is not on PATH


def find_ncu() -> str | None:
    """The ncu executable: on PATH, else in the usual CUDA and Nsight Compute install folders."""
    found = shutil.which("ncu")
    if found:
        return found
    candidates = [c for folder in NCU_FOLDERS for c in sorted(glob.glob(os.path.join(folder, "ncu")), reverse=True)]
    return next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)


def _say(msg: str) -> None:
    print(f"profile: {msg}")


def run_bounded(cmd: list[str], timeout: float) -> tuple[int | None, str, str]:
    """Run ncu in its own process group; on timeout kill the group (ncu and the profiled Python)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        try:        # a process that left the group could still hold the pipes open: never wait on it forever
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        return None, "", ""


def last_line(text: str) -> str:
    """The line that says what went wrong: a Python traceback's exception line (not ncu's own "==ERROR== The
    application returned an error code" after it), else the last line that mentions an error, else the last."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if starts:
        exception = [line for line in lines[starts[-1] + 1:] if not line.startswith("==")]
        if exception:
            return exception[-1][:300]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["(no output)"])[-1][:300]


def profile(code: str, kernel: str, *, launch_skip: int = 0, metrics=(), timeout: float = 180.0) -> Profile | None:
    """Run `code` (Python source) under Nsight Compute and read the counters of one launch of `kernel`.

    kernel: a regular expression searched in the kernel names; the first matching launch after `launch_skip`
    matching ones is profiled. metrics: extra ncu metric names, read into `Profile.metrics`. Returns None, after
    printing one line saying why, when ncu is missing, may not read the counters, times out, matches no kernel or
    fails: a notebook goes on without the reading.
    """
    if not isinstance(code, str):
        raise TypeError(f"profile: code must be Python source as a str, got {type(code).__name__}")
    if not isinstance(kernel, str) or not kernel.strip():
        raise ValueError("profile: kernel must be a non-empty regular expression naming the kernel, e.g. 'axpb_v3'")
    try:
        re.compile(kernel)
    except re.error as e:
        raise ValueError(f"profile: kernel={kernel!r} is not a valid regular expression ({e})") from None
    if isinstance(launch_skip, bool) or not isinstance(launch_skip, int) or launch_skip < 0:
        raise ValueError(f"profile: launch_skip must be an int >= 0, got {launch_skip!r}")
    if isinstance(metrics, str):
        metrics = (metrics,)
    extra = [m for m in metrics if m not in METRICS]
    if not all(isinstance(m, str) and re.fullmatch(r"[A-Za-z0-9_.]+", m) for m in extra):
        raise ValueError(f"profile: metrics must be ncu metric names like 'lts__t_bytes.sum', got {list(metrics)!r}")

    ncu = find_ncu()
    if ncu is None:
        _say(f"Nsight Compute (ncu) was not found on PATH or in /usr/local/cuda/bin, so there is no counter reading "
             f"here (it comes with the CUDA toolkit; see {HELP}).")
        return None

    with tempfile.TemporaryDirectory(prefix="course_profile_") as tmp:
        script, log = Path(tmp) / "profiled.py", Path(tmp) / "ncu.log"
        script.write_text(code)
        cmd = [ncu, "--csv", "--print-units", "base", "--clock-control", "none", "--log-file", str(log),
               "--metrics", ",".join((*METRICS, *extra)), "-k", f"regex:{kernel}",
               "--launch-skip", str(launch_skip), "--launch-count", "1", sys.executable, str(script)]
        rc, out, err = run_bounded(cmd, timeout)
        text = log.read_text(errors="replace") if log.exists() else ""
    if rc is None:
        _say(f"ncu did not finish within {timeout:.0f} s and was stopped; no reading (pass timeout= for longer).")
        return None
    everything = "\n".join((text, out, err))
    if "ERR_NVGPUCTRPERM" in everything:
        _say("ncu may not read this GPU's performance counters (ERR_NVGPUCTRPERM): run as an administrator, or "
             f"allow counters for all users (NVreg_RestrictProfilingToAdminUsers=0); see {HELP}.")
        return None
    launches = parse_csv(text) or parse_csv(out)
    if launches:
        return from_launch(launches[0])
    # the code raised (its traceback is on stderr; ncu still disconnects normally), or ncu itself failed
    if rc != 0 and ("==PROF== Disconnected" not in everything or "Traceback (most recent call last)" in err):
        _say(f"the profiled code or ncu failed (exit {rc}): {last_line(err + chr(10) + text)}")
        return None
    seen = _kernel_names(ncu, script_code=code, timeout=timeout)
    listing = f"; kernels it saw: {', '.join(seen)}" if seen else ""
    _say(f"ncu profiled no launch of a kernel matching {kernel!r} (launch_skip={launch_skip}){listing}.")
    return None


def _kernel_names(ncu: str, script_code: str, timeout: float, count: int = 30) -> list[str]:
    """The names of the first `count` kernels `code` launches (one cheap metric each), for a helpful message."""
    with tempfile.TemporaryDirectory(prefix="course_profile_") as tmp:
        script, log = Path(tmp) / "profiled.py", Path(tmp) / "ncu.log"
        script.write_text(script_code)
        rc, out, _ = run_bounded([ncu, "--csv", "--log-file", str(log), "--metrics", "gpu__time_duration.sum",
                           "--launch-count", str(count), sys.executable, str(script)], timeout)
        text = log.read_text(errors="replace") if log.exists() else ""
    names = []
    for launch in parse_csv(text) or parse_csv(out):
        if launch["kernel"] not in names:
            names.append(launch["kernel"])
    return names
