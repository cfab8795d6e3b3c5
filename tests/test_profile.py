"""common.profile: ncu's CSV parsed into a Profile; every way it can fail prints one line and returns None."""
import importlib
import textwrap

import pytest

from common import profile, Profile

mod = importlib.import_module("common.profile")      # the module (the name `common.profile` is the function)

SAMPLE = textwrap.dedent('''\
    ==PROF== Connected to process 4242 (/usr/bin/python3.12)
    some line the program printed
    ==PROF== Profiling "axpb_v3" - 0: 0%....50%....100% - 9 passes
    ==PROF== Disconnected from process 4242
    "ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
    "0","4242","python3.12","127.0.0.1","axpb_v3","1","13","(256, 1, 1)","(65536, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","268,443,392"
    "0","4242","python3.12","127.0.0.1","axpb_v3","1","13","(256, 1, 1)","(65536, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","266,338,304"
    "0","4242","python3.12","127.0.0.1","axpb_v3","1","13","(256, 1, 1)","(65536, 1, 1)","0","9.0","Command line profiler metrics","dram__throughput.avg.pct_of_peak_sustained_elapsed","%","88.12"
    "0","4242","python3.12","127.0.0.1","axpb_v3","1","13","(256, 1, 1)","(65536, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","181,344"
    "0","4242","python3.12","127.0.0.1","axpb_v3","1","13","(256, 1, 1)","(65536, 1, 1)","0","9.0","Command line profiler metrics","launch__registers_per_thread","register/thread","16"
    "0","4242","python3.12","127.0.0.1","axpb_v3","1","13","(256, 1, 1)","(65536, 1, 1)","0","9.0","Command line profiler metrics","sm__inst_executed_pipe_tensor.sum","inst","0"
    "0","4242","python3.12","127.0.0.1","axpb_v3","1","13","(256, 1, 1)","(65536, 1, 1)","0","9.0","Command line profiler metrics","sm__throughput.avg.pct_of_peak_sustained_elapsed","%","21.5"
    "0","4242","python3.12","127.0.0.1","axpb_v3","1","13","(256, 1, 1)","(65536, 1, 1)","0","9.0","Command line profiler metrics","sm__warps_active.avg.pct_of_peak_sustained_active","%","81.37"
    "0","4242","python3.12","127.0.0.1","axpb_v3","1","13","(256, 1, 1)","(65536, 1, 1)","0","9.0","Command line profiler metrics","smsp__sass_thread_inst_executed_op_fadd_pred_on.sum","inst","0"
    "0","4242","python3.12","127.0.0.1","axpb_v3","1","13","(256, 1, 1)","(65536, 1, 1)","0","9.0","Command line profiler metrics","smsp__sass_thread_inst_executed_op_ffma_pred_on.sum","inst","67,108,864"
    "0","4242","python3.12","127.0.0.1","axpb_v3","1","13","(256, 1, 1)","(65536, 1, 1)","0","9.0","Command line profiler metrics","smsp__sass_thread_inst_executed_op_fmul_pred_on.sum","inst","1,024"
    "1","4242","python3.12","127.0.0.1","void layernorm<256>(const float *, float *, int)","1","13","(256, 1, 1)","(8, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","us","2.5"
    ''')


def test_parse_csv_reads_each_launch_with_thousands_separators():
    launches = mod.parse_csv(SAMPLE)
    assert [x["kernel"] for x in launches] == ["axpb_v3", "void layernorm<256>(const float *, float *, int)"]
    first = launches[0]
    assert first["metrics"]["dram__bytes_read.sum"] == 268443392.0
    assert first["units"]["gpu__time_duration.sum"] == "ns"
    assert first["grid"] == "(65536, 1, 1)" and first["block"] == "(256, 1, 1)"
    assert mod.parse_csv("==PROF== nothing profiled\n") == []


def test_profile_fields_from_a_launch():
    p = mod.from_launch(mod.parse_csv(SAMPLE)[0])
    assert isinstance(p, Profile) and p.kernel == "axpb_v3"
    assert p.duration_ms == pytest.approx(0.181344)
    assert p.dram_bytes == pytest.approx(268443392 + 266338304)
    assert p.dram_gbps == pytest.approx((268443392 + 266338304) / 0.181344e-3 / 1e9)
    assert p.fp32_flops == 2 * 67108864 + 0 + 1024
    assert p.registers == 16 and p.occupancy_pct == pytest.approx(81.37) and p.dram_pct == pytest.approx(88.12)
    assert p.tensor_inst == 0 and p.sm_pct == pytest.approx(21.5)
    assert p.metrics["launch__registers_per_thread"] == 16.0
    text = str(p)
    assert "axpb_v3" in text and "GB/s" in text and len(text.splitlines()) <= 12
    other = mod.from_launch(mod.parse_csv(SAMPLE)[1])            # "us" is scaled; missing metrics are nan
    assert other.duration_ms == pytest.approx(0.0025) and other.dram_read_bytes != other.dram_read_bytes


def test_metric_list_is_one_constant_with_what_the_fields_need():
    for name in ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum",
                 "sm__inst_executed_pipe_tensor.sum", "launch__registers_per_thread"):
        assert name in mod.METRICS


def test_missing_ncu_prints_one_line_and_returns_none(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(mod, "NCU_FOLDERS", (str(tmp_path),))
    assert profile("print(1)", kernel="axpb_v3") is None
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1 and "ncu" in out and "not found" in out


def test_ncu_permission_error_is_explained(monkeypatch, capsys):
    monkeypatch.setattr(mod, "find_ncu", lambda: "/bin/ncu")
    monkeypatch.setattr(mod, "run_bounded", lambda cmd, timeout: (1, "==ERROR== ERR_NVGPUCTRPERM - The user does not "
                                                              "have permission to access NVIDIA GPU Performance "
                                                              "Counters", ""))
    assert profile("print(1)", kernel="k") is None
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1 and "ERR_NVGPUCTRPERM" in out and "debugging.md" in out


def test_timeout_returns_none_with_a_message(monkeypatch, capsys):
    monkeypatch.setattr(mod, "find_ncu", lambda: "/bin/ncu")
    monkeypatch.setattr(mod, "run_bounded", lambda cmd, timeout: (None, "", ""))
    assert profile("print(1)", kernel="k", timeout=3) is None
    assert "within 3 s" in capsys.readouterr().out


def test_the_command_line(monkeypatch):
    seen = {}

    def fake(cmd, timeout):
        seen["cmd"] = cmd
        return 0, SAMPLE, ""
    monkeypatch.setattr(mod, "find_ncu", lambda: "/bin/ncu")
    monkeypatch.setattr(mod, "run_bounded", fake)
    p = profile("print(1)", kernel="axpb_v[0-9]", launch_skip=2, metrics=["lts__t_bytes.sum"])
    assert p is not None and p.kernel == "axpb_v3"
    cmd = " ".join(seen["cmd"])
    assert "-k regex:axpb_v[0-9]" in cmd and "--launch-skip 2" in cmd and "--launch-count 1" in cmd
    assert "--csv" in cmd and "--print-units base" in cmd and "lts__t_bytes.sum" in cmd


@pytest.mark.parametrize("args, error", [
    (dict(code=lambda: None, kernel="k"), TypeError),
    (dict(code="x = 1", kernel=""), ValueError),
    (dict(code="x = 1", kernel="  "), ValueError),
    (dict(code="x = 1", kernel="axpb(["), ValueError),
    (dict(code="x = 1", kernel="k", launch_skip=-1), ValueError),
    (dict(code="x = 1", kernel="k", metrics=["not a metric; rm"]), ValueError),
])
def test_bad_arguments_get_clear_errors(args, error):
    with pytest.raises(error, match="profile:"):
        profile(**args)


# --- GPU: a known kernel's bytes ------------------------------------------------------------------------------

PROBE = '''
import cupy as cp
k = cp.RawKernel(r"""extern "C" __global__ void course_probe_scale(const float* x, float* y, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i];
}""", "course_probe_scale")
n = N
x = cp.ones(n, cp.float32); y = cp.empty_like(x)
for _ in range(2):
    k(((n + 255) // 256,), (256,), (x, y, cp.int64(n)))
cp.cuda.Device().synchronize()
'''


def _needs_ncu():
    if mod.find_ncu() is None:
        pytest.skip("Nsight Compute (ncu) is not installed here")


@pytest.mark.gpu
def test_profile_reads_the_bytes_of_a_known_kernel(capsys):
    _needs_ncu()
    n = 1 << 24
    p = profile(PROBE.replace("n = N", f"n = {n}"), kernel="probe_scale", launch_skip=1)
    out = capsys.readouterr().out
    if p is None and "ERR_NVGPUCTRPERM" in out:
        pytest.skip("ncu may not read this GPU's counters here")
    assert p is not None, out
    assert p.kernel.startswith("course_probe_scale")
    assert p.dram_read_bytes == pytest.approx(4 * n, rel=0.05)            # x read once, from DRAM
    # y: some may still sit in L2 at the end; the write counter also sees a few MB the kernel did not ask for
    # (7 MB here on an H200; 01b's sum, which writes one float, shows about 2 MB), so the bound is loose above
    assert 0.5 * 4 * n <= p.dram_write_bytes <= 4 * n + 16e6
    assert p.fp32_flops == pytest.approx(n, rel=0.01)                     # one FMUL per element
    assert p.duration_ms > 0 and p.dram_gbps > 0 and p.registers > 0 and p.tensor_inst == 0


@pytest.mark.gpu
def test_profile_says_when_no_kernel_matched(capsys):
    _needs_ncu()
    assert profile(PROBE.replace("n = N", "n = 1000"), kernel="no_such_kernel") is None
    out = capsys.readouterr().out
    if "ERR_NVGPUCTRPERM" in out:
        pytest.skip("ncu may not read this GPU's counters here")
    assert "no_such_kernel" in out and "course_probe_scale" in out, out


def test_a_failing_code_says_its_exception_not_no_kernel(monkeypatch, capsys):
    """The profiled code raised before its kernel: ncu disconnects normally and exits non-zero; the one line is the
    Python exception, not "no launch matched" (and the code is not run a second time to list kernels)."""
    err = ('Traceback (most recent call last):\n  File "/tmp/profiled.py", line 3, in <module>\n    x = ops.axpb(1)\n'
           'TypeError: x: expected a cupy.ndarray on the GPU, got builtins.int\n')
    log = ("==PROF== Connected to process 4242 (/usr/bin/python3)\n==PROF== Disconnected from process 4242\n"
           "==ERROR== The application returned an error code (1).\n")
    runs = []

    def fake(cmd, timeout):
        runs.append(cmd)
        log_file = cmd[cmd.index("--log-file") + 1]
        with open(log_file, "w") as f:
            f.write(log)
        return 1, "", err
    monkeypatch.setattr(mod, "find_ncu", lambda: "/bin/ncu")
    monkeypatch.setattr(mod, "run_bounded", fake)
    assert profile("from step1_simple import ops\nx = ops.axpb(1)", kernel="axpb") is None
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1 and "TypeError: x: expected a cupy.ndarray" in out, out
    assert len(runs) == 1
