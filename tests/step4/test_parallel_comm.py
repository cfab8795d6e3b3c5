"""step4_gpt2.parallel's communicators, launcher and command line (comm.py, launch.py, __main__.py).

On the CPU: CpuComm's collectives between real processes (spawn, backend="cpu") against NumPy, bit-equal on every
rank; a peer that hangs, exits or calls another collective gives a CommError within timeout_s; a child that raises,
dies or hangs makes spawn() stop every rank and raise LaunchError within its timeout; a communicator's users
released (on_abort) before it ends, and an abort that never returns ending its rank with the error named;
from_env's rendezvous between two processes; the argument errors of every entry point and of the command line. On
GPUs: the same collectives through NCCL on 2 and 4 GPUs, and a stalled peer ending in a CommError, not a hang."""
import os
import socket
import time

import numpy as np
import pytest

from step4_gpt2.parallel import __main__ as cli
from step4_gpt2.parallel import comm as C
from step4_gpt2.parallel.comm import Comm, CommError, CpuComm, CpuGroup, LocalComm
from step4_gpt2.parallel.launch import LaunchError, from_env, spawn


def _inputs(rank: int, n: int, xp=np):
    """Rank-dependent float32 values whose sums are not exact in float32 (the reduction order shows)."""
    rng = np.random.default_rng(100 + rank)
    return xp.asarray(rng.standard_normal(n).astype(np.float32) * (1 + rank))


def _reference(world: int, n: int) -> dict:
    """What every collective of _collectives must give, summed in rank order in float32 (CpuComm's order)."""
    parts = [_inputs(r, n) for r in range(world)]
    total = parts[0].copy()
    for p in parts[1:]:
        total += p
    return {"sum": total, "avg": total / np.float32(world), "gathered": np.concatenate(parts), "root": parts[1 % world]}


def _collectives(comm, n: int, xp=np) -> dict:
    """Every collective once, out of place and in place, on this rank's inputs; what each gave (NumPy)."""
    host = (lambda a: a.get()) if xp is not np else (lambda a: a.copy())
    x, w, out = _inputs(comm.rank, n, xp), comm.world, {}
    out["sum"] = host(comm.all_reduce(x, out=xp.empty_like(x)))
    y = x.copy()
    comm.all_reduce(y, op="avg")                           # in place
    out["avg"] = host(y)
    shard = xp.empty(n // w, xp.float32)
    out["rs_sum"] = host(comm.reduce_scatter(x, out=shard))
    z = x.copy()                                           # in place: out is this rank's slice of x (ZeRO-1's)
    comm.reduce_scatter(z, out=z[comm.rank * (n // w):(comm.rank + 1) * (n // w)], op="avg")
    out["rs_avg"] = host(z[comm.rank * (n // w):(comm.rank + 1) * (n // w)])
    out["gathered"] = host(comm.all_gather(x, out=xp.empty(w * n, xp.float32)))
    g = xp.empty(w * n, xp.float32)                        # in place: x is this rank's slice of out
    g[comm.rank * n:(comm.rank + 1) * n] = x
    out["gathered_in_place"] = host(comm.all_gather(g[comm.rank * n:(comm.rank + 1) * n], out=g))
    b = x.copy()
    out["root"] = host(comm.broadcast(b, root=1 % w))
    comm.wait(what="the last collective")
    return out


def _check(results: list, world: int, n: int, exact: bool):
    ref, k = _reference(world, n), n // world
    close = (lambda a, b: np.array_equal(a, b)) if exact else (lambda a, b: np.allclose(a, b, rtol=1e-5, atol=1e-5))
    for r, got in enumerate(results):
        assert close(got["sum"], ref["sum"]) and close(got["avg"], ref["avg"]), r
        assert close(got["rs_sum"], ref["sum"][r * k:(r + 1) * k]), r
        assert close(got["rs_avg"], ref["avg"][r * k:(r + 1) * k]), r
        assert np.array_equal(got["gathered"], ref["gathered"]) and np.array_equal(got["gathered_in_place"],
                                                                                   ref["gathered"]), r
        assert np.array_equal(got["root"], ref["root"]), r
        for key in got:                                    # every rank the same bits
            assert np.array_equal(got[key], results[0][key]) or key.startswith("rs_"), (r, key)


# ============================================================================ CPU: collectives between processes
def cpu_collectives_rank(rank, world, endpoint, n):
    with CpuComm(rank, world, endpoint, timeout_s=30) as comm:
        return _collectives(comm, n)


@pytest.mark.parametrize("world,n", [(2, 1000), (3, 3 * 7)])
def test_cpu_comm_collectives_in_separate_processes(world, n):
    _check(spawn(cpu_collectives_rank, world, n, backend="cpu", timeout_s=120), world, n, exact=True)


def test_local_comm_is_one_rank():
    comm = LocalComm()
    x = _inputs(0, 12)
    assert np.array_equal(comm.all_reduce(x, out=np.empty_like(x), op="avg"), x)
    assert np.array_equal(comm.reduce_scatter(x, out=np.empty(12, np.float32)), x)
    assert np.array_equal(comm.all_gather(x, out=np.empty(12, np.float32)), x)
    assert comm.broadcast(x) is x
    comm.wait()                                          # nothing in flight on the CPU


def test_collective_arguments_are_named():
    comm = LocalComm()
    x = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="op"):
        comm.all_reduce(x, op="max")
    with pytest.raises(ValueError, match="op: 'avg' needs a floating-point"):
        comm.all_reduce(np.zeros(4, np.int32), op="avg")
    with pytest.raises(ValueError, match="out: expected 8 elements"):
        comm.all_reduce(x, out=np.zeros(7, np.float32))
    with pytest.raises(ValueError, match="out: expected dtype float32"):
        comm.all_reduce(x, out=np.zeros(8, np.float64))
    with pytest.raises(ValueError, match="x: expected world"):
        comm.reduce_scatter(x, out=np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        comm.all_reduce(np.zeros((4, 4), np.float32)[:, 0])
    with pytest.raises(ValueError, match="root"):
        comm.broadcast(x, root=1)
    with pytest.raises(TypeError, match="x: expected an array"):
        comm.all_reduce([1.0, 2.0])
    with pytest.raises(ValueError, match="timeout_s"):
        LocalComm(timeout_s=0)
    group = CpuGroup(2)
    try:
        with pytest.raises(ValueError, match="rank: expected 0 <= rank < world=2"):
            CpuComm(2, 2, group.endpoint(0))
        with pytest.raises(ValueError, match="unique_id: the endpoint of rank 0"):
            CpuComm(1, 2, group.endpoint(0))
        with pytest.raises(TypeError, match="unique_id"):
            CpuComm(0, 2, b"an NCCL id")
    finally:
        group.close()
    # Comm checks its arguments before it looks for a GPU or NCCL
    with pytest.raises(TypeError, match="unique_id: expected the bytes"):
        Comm(0, 2, "not an id")
    with pytest.raises(ValueError, match="world"):
        Comm(0, 0, b"")


# ============================================================================ CPU: faults
class _FakeNcclComm:
    """What Comm.wait asks of CuPy's NcclCommunicator, with a peer's error to report or none."""

    class NcclError(Exception):
        pass

    def __init__(self, error: str | None, log=None, abort_s: float = 0.0):
        self.error, self.aborted, self.log, self.abort_s = error, False, log if log is not None else [], abort_s

    def check_async_error(self):
        if self.error:
            raise self.NcclError(self.error)

    def abort(self):
        time.sleep(self.abort_s)               # an abort that waits (for a graph nobody released, say)
        self.aborted = True
        self.log.append("abort")

    def destroy(self):
        self.log.append("destroy")


class _FakeStream:
    def __init__(self, done_after_s: float):
        self.end = time.monotonic() + done_after_s

    @property
    def done(self):
        return time.monotonic() > self.end


def _comm_without_gpu(error=None, timeout_s=0.5, log=None, abort_s=0.0):
    """A Comm whose NCCL communicator is a fake: wait()'s polling, time-out and abort, run on a CPU."""
    comm = Comm.__new__(Comm)
    comm.rank, comm.world, comm.timeout_s, comm._aborted = 1, 2, timeout_s, False
    comm._comm = _FakeNcclComm(error, log, abort_s)
    comm.nccl = comm._comm
    comm._watchdog = C._Watchdog(comm.rank, timeout_s)
    return comm


def test_comm_wait_is_bounded_and_aborts():
    comm = _comm_without_gpu()
    comm.wait(_FakeStream(0.05), what="a quick all-reduce")             # done in time: returns
    fake = comm._comm
    t0 = time.monotonic()
    with pytest.raises(CommError, match=r"rank 1: the grads' all-reduce did not complete after 0\.5 s: timed out"):
        comm.wait(_FakeStream(60), what="the grads' all-reduce")
    assert time.monotonic() - t0 < 1.5 and fake.aborted and comm._aborted
    with pytest.raises(CommError, match="aborted or closed"):              # an aborted communicator stays so
        comm.wait(_FakeStream(0), what="the next step")
    comm._watchdog.stop()
    comm = _comm_without_gpu("remote process exited or there was a network error")
    with pytest.raises(CommError, match="NCCL reported remote process exited") as e:
        comm.wait(_FakeStream(60), what="step 3")
    assert e.value.seconds < 0.5 and comm._comm.aborted
    comm._watchdog.stop()


def test_a_wait_ends_soon_after_the_work_does(monkeypatch):
    """A step ends with comm.wait: the GPU idles from the end of the step's work until the poll that sees it, so the
    poll's sleeps stay short however long the work ran (the data-parallel step's time counts that lag)."""
    pauses = []
    monkeypatch.setattr(C.time, "sleep", pauses.append)

    class Polled:                               # done at the 40th poll: a long wait, on no clock
        polls = 0

        @property
        def done(self):
            self.polls += 1
            return self.polls > 40

    assert C._poll_stream(Polled(), time.monotonic() + 60)
    assert len(pauses) == 40 and pauses[0] == 5e-5 and max(pauses) == C.POLL_MAX_S <= 5e-4
    assert pauses == sorted(pauses)             # growing, then held at the cap


class _GraphHolder:
    """A user of a communicator, as DataParallelTrainer is: it holds a graph and lets go in close()."""

    def __init__(self, log, name):
        self.log, self.name, self.graph = log, name, "a CUDA graph"

    def close(self):
        self.graph = None
        self.log.append(f"release {self.name}")


def test_comm_releases_its_users_before_it_ends():
    """on_abort: every registered release runs once, latest first, before NCCL's abort or destroy; a bound method
    is held weakly (an object that is gone is skipped); one that raises is reported and the end goes on."""
    import gc
    log = []
    comm = _comm_without_gpu(log=log)
    a, b, gone = _GraphHolder(log, "a"), _GraphHolder(log, "b"), _GraphHolder(log, "gone")
    for user in (a, gone, b):
        comm.on_abort(user.close)
    comm.on_abort(lambda: 1 / 0)
    del gone
    gc.collect()
    with pytest.raises(CommError, match="timed out"):
        comm.wait(_FakeStream(60), what="step 3")
    assert log == ["release b", "release a", "abort"] and a.graph is None and b.graph is None
    comm.abort()                                        # once: nothing left to release, nothing to abort again
    assert log == ["release b", "release a", "abort"]
    comm._watchdog.stop()
    log.clear()
    comm = _comm_without_gpu(log=log)
    comm.on_abort(_GraphHolder(log, "c").close)         # its object is gone at once: nothing to release
    keep = _GraphHolder(log, "d")
    comm.on_abort(keep.close)
    comm.close()
    assert log == ["release d", "destroy"]
    with pytest.raises(TypeError, match="release: expected a callable"):
        comm.on_abort("not a function")
    local = LocalComm()
    local.on_abort(keep.close)
    local.abort()
    assert log[-1] == "release d"


def abort_that_never_returns_rank(rank, world, endpoint):
    """A rank whose wait times out and whose abort then never returns (as NCCL's waits for a CUDA graph that
    nobody destroyed): the watchdog must name the time-out and end the rank, exit status EXIT_HUNG."""
    C.ABORT_S = 1.0                                     # the abort's bound, short for the test
    comm = _comm_without_gpu(timeout_s=0.5, abort_s=600)
    comm.wait(_FakeStream(600), what="step 3")
    return "the abort returned"


def test_comm_abort_that_never_returns_ends_the_rank_with_the_named_error(capfd):
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=rf"rank 0 died without a result \(exit status {C.EXIT_HUNG}\)"):
        spawn(abort_that_never_returns_rank, 1, backend="cpu", timeout_s=60)
    assert time.monotonic() - t0 < 0.5 + 1.0 + 10            # + starting a Python on a busy machine
    err = capfd.readouterr().err
    assert "rank 1: step 3 did not complete after 0.5 s: timed out" in err, err
    assert "rank 1: releasing the graphs and aborting the communicator (ncclCommAbort) did not return after 1.0 s" \
        in err, err


def stalled_peer_rank(rank, world, endpoint, mode):
    """Rank 0 all-reduces; rank 1 stalls (sleeps), leaves (closes its pipes) or calls another collective."""
    comm = CpuComm(rank, world, endpoint, timeout_s=2)
    x = np.ones(4, np.float32)
    if rank == 1:
        if mode == "stall":           # long enough for rank 0's 2 s even if it starts seconds later (a busy CPU)
            time.sleep(10)
            return "slept"
        if mode == "leave":
            comm.close()
            return "left"
    t0 = time.monotonic()
    try:
        if rank == 1:                              # mode "mismatch"
            comm.all_gather(x, out=np.empty(8, np.float32))
        else:
            comm.all_reduce(x)
    except CommError as e:
        return (str(e), time.monotonic() - t0)
    return ("no error", time.monotonic() - t0)


def test_cpu_comm_peer_that_stalls_is_a_comm_error_within_timeout():
    (message, seconds), slept = spawn(stalled_peer_rank, 2, "stall", backend="cpu", timeout_s=60)
    assert slept == "slept"
    assert message.startswith("rank 0: all_reduce did not complete after 2.") and "waiting for rank 1" in message
    assert 2 <= seconds < 5


def test_cpu_comm_peer_that_leaves_is_a_comm_error_at_once():
    (message, seconds), left = spawn(stalled_peer_rank, 2, "leave", backend="cpu", timeout_s=60)
    assert "rank 1 closed its pipe" in message and seconds < 2, message


def test_cpu_comm_mismatched_collectives_are_named():
    (m0, _), (m1, _) = spawn(stalled_peer_rank, 2, "mismatch", backend="cpu", timeout_s=60)
    assert "rank 1 called all_gather (collective #1) where this rank called all_reduce" in m0, m0
    assert m1.startswith("rank 1: all_gather") and ("called all_reduce" in m1 or "aborted" in m1), m1


def failing_rank(rank, world, endpoint, how):
    if rank == 1:
        if how == "raise":
            raise ValueError("a planted failure")
        if how == "die":
            os._exit(7)
        if how == "hang":
            time.sleep(600)
    return rank


@pytest.mark.parametrize("how,message", [
    ("raise", r"rank 1 raised ValueError: a planted failure"),
    ("die", r"rank 1 died without a result \(exit status 7\)"),
    ("hang", r"rank 1 did not finish within timeout_s=4 s"),
])
def test_spawn_stops_every_rank_when_one_fails_or_hangs(how, message):
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=message) as e:
        spawn(failing_rank, 2, how, backend="cpu", timeout_s=4)
    assert time.monotonic() - t0 < 4 + 3.5, "spawn overran its timeout (+ the grace to stop the children)"
    assert "every rank was stopped" in str(e.value)


def blocked_rank(rank, world, endpoint, holds_the_gil):
    """A call that never returns inside Comm's watchdog guard, as a blocked NCCL call would be."""
    import re
    from step4_gpt2.parallel.comm import _Watchdog
    with _Watchdog(rank, 1.0).guard("a call that never returns", backstop=True):
        if holds_the_gil:                                  # a regular expression's backtracking keeps Python's lock
            re.match(r"(a+)+$", "a" * 60 + "b")
        time.sleep(600)


@pytest.mark.parametrize("holds_the_gil,message,limit", [
    (False, r"rank 0 died without a result \(exit status 3\)", 4),       # the watchdog thread
    (True, r"rank 0 died without a result \(exit status 1\)", 1 + 5 + 3),  # faulthandler's, GRACE_S later
])
def test_comm_watchdog_ends_a_rank_blocked_in_a_call(holds_the_gil, message, limit):
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=message):
        spawn(blocked_rank, 1, holds_the_gil, backend="cpu", timeout_s=60)
    assert time.monotonic() - t0 < limit + 5                # + starting a Python on a busy machine


def test_spawn_returns_every_rank_value_and_checks_its_arguments():
    assert spawn(failing_rank, 3, "none", backend="cpu", timeout_s=60) == [0, 1, 2]
    with pytest.raises(ValueError, match="nprocs"):
        spawn(failing_rank, 0, backend="cpu")
    with pytest.raises(ValueError, match="fn: .* cannot be sent"):
        spawn(lambda *a: 0, 2, backend="cpu")
    with pytest.raises(ValueError, match="backend"):
        spawn(failing_rank, 2, backend="gloo")
    with pytest.raises(ValueError, match="timeout_s"):
        spawn(failing_rank, 2, backend="cpu", timeout_s=-1)


# ============================================================================ CPU: a launcher's environment
def fake_id() -> bytes:
    return os.urandom(128)             # each call another: only the shared one can be equal on both ranks


def env_rank(rank, world, endpoint, port):
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port - 1)}
    got = from_env(timeout_s=30, env=env, make_id=fake_id)
    return got.rank, got.world, got.local_rank, got.unique_id


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_from_env_shares_rank_zeros_id():
    results = spawn(env_rank, 3, _free_port(), backend="cpu", timeout_s=90)
    assert [r[:3] for r in results] == [(r, 3, r) for r in range(3)]
    assert len({r[3] for r in results}) == 1 and len(results[0][3]) == 128


def test_from_env_names_what_is_missing_and_is_bounded():
    with pytest.raises(LaunchError, match="RANK is not set"):
        from_env(env={}, make_id=fake_id)
    with pytest.raises(LaunchError, match="WORLD_SIZE='two'"):
        from_env(env={"RANK": "0", "WORLD_SIZE": "two", "LOCAL_RANK": "0"}, make_id=fake_id)
    with pytest.raises(LaunchError, match="RANK=2, WORLD_SIZE=2"):
        from_env(env={"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, make_id=fake_id)
    assert from_env(env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, make_id=lambda: b"id").unique_id == b"id"
    base = {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port() - 1)}
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="no NCCL id from rank 0"):       # rank 0 never comes
        from_env(timeout_s=1.5, env={**base, "RANK": "1"}, make_id=fake_id)
    with pytest.raises(LaunchError, match="rank 0: 0 of 1 ranks fetched"):  # rank 1 never comes
        from_env(timeout_s=1.5, env={**base, "RANK": "0"}, make_id=fake_id)
    assert time.monotonic() - t0 < 10


def test_from_env_another_key_is_refused_by_name():
    import threading
    base = {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port() - 1)}
    server = {**base, "RANK": "0", "PARALLEL_AUTHKEY": "one key"}
    t = threading.Thread(target=lambda: pytest.raises(LaunchError, from_env, timeout_s=3, env=server,
                                                      make_id=fake_id), daemon=True)
    t.start()
    with pytest.raises(LaunchError, match="refused this rank's key: set the same \\$PARALLEL_AUTHKEY"):
        from_env(timeout_s=2, env={**base, "RANK": "1", "PARALLEL_AUTHKEY": "another key"}, make_id=fake_id)
    t.join(5)


# ============================================================================ CPU: the command line
@pytest.mark.parametrize("argv,message", [
    (["--gpus", "0"], "--gpus: expected an integer >= 1, got 0"),
    (["--gpus", "3", "--batch", "64"], "--batch 64: not divisible by 3 GPUs"),
    (["--gpus", "2", "--batch", "8", "--accumulate", "3"], "--batch 8: not divisible by 2 GPUs x --accumulate 3"),
    (["--tp", "--zero1"], "--tp: tensor parallelism"),
    (["--tp", "--gpus", "4"], "--tp on 4 GPUs: shakespeare_char's 6 heads"),
    (["--bucket-mb", "0"], "--bucket-mb"),
    (["--model", "gpt3"], "--model: invalid choice"),
])
def test_cli_argument_errors_name_the_argument(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_checks_that_need_the_machine():
    args = cli.parser().parse_args(["--gpus", "4"])
    with pytest.raises(ValueError, match="--gpus 4: this machine has 2 GPUs"):
        cli.check_args(args, gpus_here=2)
    args = cli.parser().parse_args([])
    assert cli.check_args(args, gpus_here=4) == 4 and args.batch == 4 * cli.PER_GPU_BATCH["shakespeare_char"]
    args = cli.parser().parse_args(["--gpus", "2"])
    with pytest.raises(ValueError, match="--gpus: under a launcher"):
        cli.check_args(args, world=8)
    args = cli.parser().parse_args(["--model", "gpt2", "--tp", "--batch", "3"])
    assert cli.check_args(args, world=4) == 4 and args.batch == 3        # the model splits, not the batch
    assert cli.under_launcher({"RANK": "0", "WORLD_SIZE": "2"}) and not cli.under_launcher({})
    with pytest.raises(ValueError, match="WORLD_SIZE='x'"):
        cli.launcher_world({"RANK": "0", "WORLD_SIZE": "x"})


def test_cli_under_a_launcher_refuses_gpus(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        cli.main(["--gpus", "2"])
    assert "--gpus: under a launcher" in capsys.readouterr().err


# ============================================================================ the NCCL wheel
def test_requirements_name_the_nccl_wheel_cupy_loads():
    """CuPy's CUDA 12 build loads libnccl from the nvidia-nccl-cu12 wheel (its install hint names it); once that
    wheel is installed, CuPy finds it on any machine, a GPU or none."""
    import importlib.metadata
    from tests.test_install import _requirements
    assert "nvidia-nccl-cu12" in _requirements("requirements.txt")
    try:
        importlib.metadata.version("nvidia-nccl-cu12")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("nvidia-nccl-cu12 is not installed in this environment (pip install -r requirements.txt)")
    import cupy.cuda.nccl as nccl
    assert nccl.available and nccl.get_version() >= 21800


def test_spawn_with_nccl_on_a_machine_without_a_gpu_says_so():
    """The NCCL path as far as a CPU takes it: the parent makes the unique id (no GPU needed), each child's Comm
    refuses with the course's one-line reason, and spawn reports the rank."""
    import importlib.util
    from common.device import skip_reason
    if skip_reason() is None or importlib.util.find_spec("nvidia.nccl") is None:
        pytest.skip("needs a machine without a GPU, with the NCCL wheel installed")
    with pytest.raises(LaunchError, match=r"rank \d raised RuntimeError: This needs an NVIDIA GPU"):
        spawn(nccl_collectives_rank, 2, 8, timeout_s=60)


# ============================================================================ GPUs
def _gpus() -> int:
    from common.device import skip_reason
    if skip_reason() is not None:
        return 0
    import cupy as cp
    return cp.cuda.runtime.getDeviceCount()


def needs_gpus(n: int):
    return pytest.mark.skipif(_gpus() < n, reason=f"needs {n} GPUs of one machine, this one has {_gpus()}")


def nccl_collectives_rank(rank, world, unique_id, n):
    import cupy as cp
    with Comm(rank, world, unique_id, timeout_s=60) as comm:
        out = _collectives(comm, n, cp)
        out["stream"] = _on_a_side_stream(comm, n)
        return out


def _on_a_side_stream(comm, n):
    """An all-reduce enqueued on a stream of its own (as the data-parallel trainer's buckets are), waited for."""
    import cupy as cp
    side = cp.cuda.Stream(non_blocking=True)
    x = _inputs(comm.rank, n, cp)
    side.wait_event(cp.cuda.get_current_stream().record())
    comm.all_reduce(x, stream=side)
    comm.wait(side, what="the side stream's all-reduce")
    return x.get()


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_nccl_collectives_on_gpus(world):
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs of one machine, this one has {_gpus()}")
    n = world * 250_007                                   # odd per-rank size: no tidy multiple of anything
    results = spawn(nccl_collectives_rank, world, n, timeout_s=300)
    _check(results, world, n, exact=False)
    ref = _reference(world, n)["sum"]
    assert all(np.allclose(r["stream"], ref, rtol=1e-5, atol=1e-5) for r in results)


def nccl_stalled_rank(rank, world, unique_id):
    """Both ranks all-reduce once (NCCL connects); then rank 1 stalls and rank 0's next all-reduce never ends:
    its bounded wait must raise CommError and abort the communicator."""
    import cupy as cp
    comm = Comm(rank, world, unique_id, timeout_s=5)
    x = cp.ones(1 << 20, cp.float32)
    comm.all_reduce(x)
    comm.wait(what="the first all-reduce")
    if rank == 1:
        time.sleep(15)
        comm.abort()
        return "stalled"
    comm.all_reduce(x)
    t0 = time.monotonic()
    try:
        comm.wait(what="the second all-reduce")
    except CommError as e:
        return (str(e), time.monotonic() - t0)
    return ("no error", time.monotonic() - t0)


@pytest.mark.gpu
@needs_gpus(2)
def test_nccl_stalled_peer_is_a_comm_error_not_a_hang():
    (message, seconds), stalled = spawn(nccl_stalled_rank, 2, timeout_s=120)
    assert message.startswith("rank 0: the second all-reduce did not complete after 5."), message
    assert 5 <= seconds < 30 and stalled == "stalled"           # the abort itself may take a few seconds


def nccl_failing_rank(rank, world, unique_id):
    import cupy as cp
    comm = Comm(rank, world, unique_id, timeout_s=20)
    if rank == 1:
        raise RuntimeError("a planted failure after the communicator was made")
    x = cp.ones(1024, cp.float32)
    comm.all_reduce(x)
    comm.wait(what="an all-reduce rank 1 never joins")
    return "no error"


@pytest.mark.gpu
@needs_gpus(2)
def test_nccl_rank_that_raises_ends_the_run():
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="rank 1 raised RuntimeError: a planted failure"):
        spawn(nccl_failing_rank, 2, timeout_s=60)
    assert time.monotonic() - t0 < 60


@pytest.mark.gpu
@pytest.mark.parametrize("args,gpus", [(["--gpus", "1"], 1), (["--gpus", "2"], 2), (["--gpus", "2", "--zero1"], 2),
                                       (["--gpus", "2", "--tp"], 2), (["--gpus", "4", "--zero1"], 4)])
def test_cli_trains_on_gpus(args, gpus):
    import subprocess
    import sys
    from common.kernels import ROOT
    if _gpus() < gpus:
        pytest.skip(f"needs {gpus} GPUs of one machine, this one has {_gpus()}")
    r = subprocess.run([sys.executable, "-m", "step4_gpt2.parallel", *args, "--steps", "3", "--timeout-s", "300"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    if "--tp" in args:
        assert "tensor parallel on 2 GPUs" in r.stdout and "all-reduces" in r.stdout, r.stdout
    else:
        assert r.stdout.count("loss ") == 3 and "tokens/s" in r.stdout, r.stdout


@pytest.mark.gpu
def test_cli_more_gpus_than_the_machine_is_a_named_error():
    import subprocess
    import sys
    from common.kernels import ROOT
    r = subprocess.run([sys.executable, "-m", "step4_gpt2.parallel", "--gpus", "99"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and f"--gpus 99: this machine has {_gpus()} GPU" in r.stderr, r.stderr
