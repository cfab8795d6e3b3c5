"""One rank's view of a group of processes that add, split and gather arrays together: the collectives that
data and tensor parallelism are made of.

    comm = Comm(rank, world, unique_id)          # one process per GPU; unique_id from launch.spawn / from_env
    comm.all_reduce(gflat, op="avg")             # every rank ends with the mean of every rank's gradients
    comm.reduce_scatter(gflat, out=shard)        # ZeRO-1: each rank ends with the sum of its 1/world slice
    comm.all_gather(shard, out=flat)             # ... and every rank gets every rank's slice back
    comm.broadcast(flat, root=0)                 # rank 0's weights everywhere
    comm.wait(stream, what="grad all-reduce")    # bounded: a dead or hung peer raises CommError, never a hang
    comm.on_abort(trainer.close)                 # what holds the communicator lets go before it ends

Three classes with the same methods:
- `Comm`: NCCL through CuPy (`cupy.cuda.nccl`). A collective is *enqueued* on a CUDA stream like a kernel and
  returns at once, so a peer that died shows up only as a stream that never finishes: `wait` polls the stream and
  NCCL's asynchronous error, and after `timeout_s` aborts the communicator (which ends NCCL's kernels) and raises.
- `LocalComm`: world = 1, the same calls as copies, so that a trainer has one code path.
- `CpuComm`: NumPy arrays over pipes between processes: a multi-GPU run's control flow (who sends what, in which
  order, what happens when a rank fails) checked on a machine without a GPU.

Reduction order, where it matters for reproducibility: CpuComm and LocalComm add the ranks' arrays in rank
order (0, 1, ...), so every rank gets the same bits; NCCL picks its own order (ring or tree, by size), the same on
every rank of one run but not necessarily the order of a single GPU's sum.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
import weakref

import numpy as np

OPS = ("sum", "avg")
EXIT_HUNG = 3            # exit status of a rank whose watchdog fired inside a call that could not be interrupted
ABORT_S = 30.0           # NCCL's abort, at most (with a short timeout_s too): it ends its kernels, frees its buffers
POLL_MAX_S = 2e-4        # the longest sleep between two polls of a stream (_poll_stream)


class CommError(RuntimeError):
    """A collective that did not complete: a peer died, hung, or failed. Says which rank saw it, which collective
    and after how many seconds; the communicator is aborted (unusable) by then."""

    def __init__(self, rank: int, what: str, seconds: float, reason: str):
        self.rank, self.what, self.seconds = rank, what, seconds
        super().__init__(f"rank {rank}: {what} did not complete after {seconds:.1f} s: {reason}")


def _check_rank(rank, world):
    for name, v in (("rank", rank), ("world", world)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name}: expected an integer, got {v!r}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"world: expected at least 1 rank, got {world}" if world < 1 else
                         f"rank: expected 0 <= rank < world={world}, got {rank}")


def _check_timeout(timeout_s):
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s: expected a number of seconds > 0, got {timeout_s!r}")
    return float(timeout_s)


class _Collectives:
    """The argument checks every backend shares: contiguous arrays, sizes that fit the collective, op names."""
    rank: int
    world: int

    def _array(self, x, name: str):
        if not hasattr(x, "dtype") or not hasattr(x, "flags"):
            raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
        if not x.flags.c_contiguous:
            raise ValueError(f"{name}: expected a C-contiguous array (a collective reads raw memory)")
        return x

    def _op(self, op: str, x) -> str:
        if op not in OPS:
            raise ValueError(f"op: expected one of {OPS}, got {op!r}")
        if op == "avg" and x.dtype.kind != "f":
            raise ValueError(f"op: 'avg' needs a floating-point array, got {x.dtype}")
        return op

    def _pair(self, x, out):
        x, out = self._array(x, "x"), (x if out is None else self._array(out, "out"))
        if out.dtype != x.dtype:
            raise ValueError(f"out: expected dtype {x.dtype} like x, got {out.dtype}")
        return x, out

    def _check_all_reduce(self, x, out, op):
        x, out = self._pair(x, out)
        if out.size != x.size:
            raise ValueError(f"out: expected {x.size} elements like x, got {out.size}")
        return x, out, self._op(op, x)

    def _check_reduce_scatter(self, x, out, op):
        x, out = self._pair(x, out)
        if x.size != self.world * out.size:
            raise ValueError(f"x: expected world * out.size = {self.world} * {out.size} elements, got {x.size}")
        return x, out, self._op(op, x)

    def _check_all_gather(self, x, out):
        x, out = self._pair(x, out)
        if out.size != self.world * x.size:
            raise ValueError(f"out: expected world * x.size = {self.world} * {x.size} elements, got {out.size}")
        return x, out

    def _check_root(self, root):
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < self.world:
            raise ValueError(f"root: expected a rank in [0, {self.world}), got {root!r}")
        return int(root)

    def on_abort(self, release):
        """Call release() once, first thing when this communicator ends (abort or close). NCCL (2.26 and later)
        ends a communicator only once every CUDA graph that recorded its collectives is destroyed: a trainer that
        records its step registers the graph's release here. A bound method is held weakly (its object may go)."""
        if not callable(release):
            raise TypeError(f"release: expected a callable, got {type(release).__name__}")
        ref = weakref.WeakMethod(release) if hasattr(release, "__func__") else (lambda: release)
        self.__dict__.setdefault("_releases", []).append(ref)

    def _release_users(self):
        """The on_abort functions, latest first. One that raises is reported, not raised: the end must go on."""
        for ref in reversed(self.__dict__.pop("_releases", [])):
            try:
                if (release := ref()) is not None:
                    release()
            except Exception as e:
                print(f"rank {self.rank}: releasing a user of the communicator raised {e!r}", file=sys.stderr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):         # an exception inside: abort (peers may wait on this rank), else close
        self.abort() if exc[0] is not None else self.close()


def _poll_stream(stream, deadline: float, check=None) -> bool:
    """Poll a CUDA stream until its work is done (True) or the deadline passes (False), calling check() between
    polls (NCCL's asynchronous error). Sleeps grow from 50 us to POLL_MAX_S: a training step ends with this wait
    and the GPU idles until the poll that sees its work done, so every step pays up to one pause."""
    pause = 5e-5
    while not stream.done:
        if check is not None:
            check()
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_S)
    return True


# ============================================================================ NCCL
_DTYPES = {"float32": "NCCL_FLOAT32", "float16": "NCCL_FLOAT16", "float64": "NCCL_FLOAT64",
           "int32": "NCCL_INT32", "int64": "NCCL_INT64", "uint8": "NCCL_UINT8"}


def nccl_module():
    """cupy.cuda.nccl, or a RuntimeError that names the wheel to install (CuPy loads libnccl from it)."""
    from cupy.cuda import nccl
    if not nccl.available:
        raise RuntimeError("NCCL could not be loaded: install the wheel CuPy loads it from, "
                           "`pip install nvidia-nccl-cu12` (requirements.txt names it)")
    return nccl


def nccl_unique_id() -> bytes:
    """A fresh NCCL unique id (bytes), made by one process for every rank of the group: needs NCCL, not a GPU."""
    return nccl_module().get_unique_id()


class _Watchdog:
    """Bounds the calls that block inside NCCL and cannot be polled: creating the communicator (it waits for every
    rank to join), enqueuing a collective (NCCL connects to peers lazily, inside the call), ending it. A thread
    checks a deadline; if a call is still inside when it passes, it says what hung on stderr and ends the process
    (exit status EXIT_HUNG; the driver frees the GPU, the peers' own bounded waits end them). If the blocked call
    holds Python's lock that thread cannot run: faulthandler's watchdog, which needs no lock, then ends the process
    a few seconds later and prints every thread's stack."""

    GRACE_S = 5.0

    def __init__(self, rank: int, timeout_s: float):
        self.rank, self.timeout_s = rank, timeout_s
        self._deadline, self._what, self._error, self._seconds = None, "", None, timeout_s
        self._stop = threading.Event()
        threading.Thread(target=self._run, name=f"comm-watchdog-{rank}", daemon=True).start()

    def _run(self):
        while not self._stop.wait(0.25):
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                head = f"{self._error}\n" if self._error else ""      # the error that led here, named first
                print(f"{head}rank {self.rank}: {self._what} did not return after {self._seconds:.1f} s (a peer "
                      f"died or hangs); ending this rank", file=sys.stderr, flush=True)
                os._exit(EXIT_HUNG)

    @contextlib.contextmanager
    def guard(self, what: str, backstop: bool = False, error=None, seconds: float | None = None):
        """with watchdog.guard(what): the call inside has `seconds` (timeout_s; faulthandler's too, with backstop);
        error: printed first if the call hangs (the CommError that made this rank abort)."""
        self._what, self._error, self._seconds = what, error, seconds or self.timeout_s
        if backstop:
            faulthandler.dump_traceback_later(self._seconds + self.GRACE_S, exit=True)
        self._deadline = time.monotonic() + self._seconds
        try:
            yield
        finally:
            self._deadline = self._error = None
            if backstop:
                faulthandler.cancel_dump_traceback_later()

    def stop(self):
        self._stop.set()


class Comm(_Collectives):
    """One rank of an NCCL communicator, on its own GPU (`device`, default: LOCAL_RANK from the environment, else
    rank modulo the GPUs visible). Arrays are CuPy arrays on that GPU; every collective is enqueued on `stream`
    (default: the current stream) and returns at once; `wait` is the bounded way to know it finished."""

    def __init__(self, rank: int, world: int, unique_id: bytes, timeout_s: float = 60, device: int | None = None):
        from common.device import require_gpu
        _check_rank(rank, world)
        self.timeout_s = _check_timeout(timeout_s)
        if not isinstance(unique_id, bytes):
            raise TypeError(f"unique_id: expected the bytes of nccl_unique_id(), got {type(unique_id).__name__}")
        require_gpu()
        import cupy as cp
        # NVLink SHARP (multicast objects) stays off: the course's machines lend GPUs whose multicast set-up must
        # not be touched, and the collectives here do not need it. NCCL reads this when the communicator is made.
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        self.nccl = nccl_module()
        self.rank, self.world = int(rank), int(world)
        if device is None:
            local = os.environ.get("LOCAL_RANK")
            device = int(local) if local is not None else self.rank % cp.cuda.runtime.getDeviceCount()
        self.device = cp.cuda.Device(device)
        self.device.use()
        self._comm, self._aborted = None, False
        self._watchdog = _Watchdog(self.rank, self.timeout_s)
        # ncclCommInitRank returns only once every rank has joined: a rank that never comes would hold it forever
        try:
            with self._watchdog.guard(f"NCCL communicator set-up ({self.world} ranks, device {device})",
                                      backstop=True):
                self._comm = self.nccl.NcclCommunicator(self.world, unique_id, self.rank)
        except BaseException:
            self._watchdog.stop()
            raise

    # -------------------------------------------------------------- helpers
    def _array(self, x, name: str):
        import cupy as cp
        if not isinstance(x, cp.ndarray):
            raise TypeError(f"{name}: expected a CuPy array on GPU {self.device.id}, got {type(x).__name__}")
        if x.device.id != self.device.id:
            raise ValueError(f"{name}: on GPU {x.device.id}, but this rank's communicator is on GPU {self.device.id}")
        return super()._array(x, name)

    def _stream(self, stream):
        import cupy as cp
        return cp.cuda.get_current_stream() if stream is None else stream

    def _dtype(self, x):
        name = _DTYPES.get(x.dtype.name)
        if name is None:
            raise ValueError(f"x: dtype {x.dtype} is not one NCCL carries here; expected one of {tuple(_DTYPES)}")
        return getattr(self.nccl, name)

    def _nccl_op(self, op):
        return self.nccl.NCCL_SUM if op == "sum" else self.nccl.NCCL_AVG

    def _live(self, what):
        if self._comm is None or self._aborted:
            raise CommError(self.rank, what, 0.0, "the communicator was aborted or closed")

    def _call(self, what, fn, *args):
        """Enqueue one collective. Guarded: NCCL connects to the peers lazily, inside the first call that needs a
        connection (any call may be one), and that waits for them on the host."""
        self._live(what)
        with self._watchdog.guard(what):
            fn(*args)

    # -------------------------------------------------------------- collectives
    def all_reduce(self, x, out=None, op: str = "sum", stream=None):
        """out = sum (or mean) over ranks of x; out=None reduces in place. Returns out."""
        x, out, op = self._check_all_reduce(x, out, op)
        self._call("all_reduce", self._comm.allReduce, x.data.ptr, out.data.ptr, x.size, self._dtype(x),
                   self._nccl_op(op), self._stream(stream).ptr)
        return out

    def reduce_scatter(self, x, out, op: str = "sum", stream=None):
        """out = this rank's slice [rank * n, (rank + 1) * n) of the sum (mean) over ranks of x, n = out.size."""
        x, out, op = self._check_reduce_scatter(x, out, op)
        self._call("reduce_scatter", self._comm.reduceScatter, x.data.ptr, out.data.ptr, out.size, self._dtype(x),
                   self._nccl_op(op), self._stream(stream).ptr)
        return out

    def all_gather(self, x, out, stream=None):
        """out = every rank's x, in rank order (x may be out's own slice of this rank: in place)."""
        x, out = self._check_all_gather(x, out)
        self._call("all_gather", self._comm.allGather, x.data.ptr, out.data.ptr, x.size, self._dtype(x),
                   self._stream(stream).ptr)
        return out

    def broadcast(self, x, root: int = 0, stream=None):
        """x on every rank = x on `root` (in place). Returns x."""
        x, root = self._array(x, "x"), self._check_root(root)
        self._call("broadcast", self._comm.broadcast, x.data.ptr, x.data.ptr, x.size, self._dtype(x), root,
                   self._stream(stream).ptr)
        return x

    def wait(self, stream=None, what: str = "collective"):
        """Wait until `stream`'s work (the collectives enqueued on it) is done, at most timeout_s. A peer's error
        (NCCL's asynchronous error) or the timeout aborts the communicator and raises CommError."""
        self._live(what)
        stream, start = self._stream(stream), time.monotonic()

        def check():
            try:
                self._comm.check_async_error()
            except self.nccl.NcclError as e:
                error = CommError(self.rank, what, time.monotonic() - start, f"NCCL reported {e}")
                self.abort(error)
                raise error from e

        if not _poll_stream(stream, start + self.timeout_s, check):
            error = CommError(self.rank, what, time.monotonic() - start,   # before the abort, which takes a while
                              "timed out (a peer died, hangs, or called another collective); communicator aborted")
            self.abort(error)
            raise error

    # -------------------------------------------------------------- end
    def abort(self, error: CommError | None = None):
        """End the communicator at once: NCCL's kernels still waiting for peers return. Its users let go first
        (on_abort): NCCL's abort raises the flag that ends its kernels, then waits until every graph that recorded
        them is destroyed (one destroyed mid-replay is freed once that replay ends). Bounded: if it hangs anyway,
        the watchdog prints `error` (why this rank aborts) and ends the rank (EXIT_HUNG), as a launcher needs."""
        if self._comm is not None and not self._aborted:
            self._aborted = True
            with self._watchdog.guard("releasing the graphs and aborting the communicator (ncclCommAbort)",
                                      backstop=True, error=error, seconds=max(self.timeout_s, ABORT_S)):
                self._release_users()
                self._comm.abort()

    def close(self):
        """Destroy the communicator (its work done, its users released first), or drop it if it was aborted."""
        if self._comm is not None:
            if not self._aborted:
                with self._watchdog.guard("releasing the graphs and destroying the communicator"):
                    self._release_users()
                    self._comm.destroy()
            self._comm = None
        self._watchdog.stop()


# ============================================================================ one rank
class LocalComm(_Collectives):
    """world = 1: every collective is a copy (sum or mean over one rank), enqueued on `stream` for CuPy arrays,
    so a trainer written for N ranks runs unchanged on one GPU (or on NumPy arrays)."""

    def __init__(self, timeout_s: float = 60, gpu: bool = False):
        """gpu: wait() polls the current CUDA stream even before a collective has seen a CuPy array (a rank
        that times its steps with CUDA events and makes no collective at world = 1)."""
        self.rank, self.world, self.timeout_s = 0, 1, _check_timeout(timeout_s)
        self._gpu = gpu                  # a CuPy array seen (or gpu=True): wait() then has a stream to poll

    def _copy(self, dst, src, stream):
        if isinstance(dst, np.ndarray):
            if dst is not src:
                dst.reshape(-1)[...] = src.reshape(-1)
            return dst
        self._gpu = True
        if dst is not src:
            import cupy as cp
            with (cp.cuda.get_current_stream() if stream is None else stream):
                dst.reshape(-1)[...] = src.reshape(-1)
        return dst

    def all_reduce(self, x, out=None, op="sum", stream=None):
        x, out, _ = self._check_all_reduce(x, out, op)
        return self._copy(out, x, stream)

    def reduce_scatter(self, x, out, op="sum", stream=None):
        x, out, _ = self._check_reduce_scatter(x, out, op)
        return self._copy(out, x, stream)

    def all_gather(self, x, out, stream=None):
        x, out = self._check_all_gather(x, out)
        return self._copy(out, x, stream)

    def broadcast(self, x, root=0, stream=None):
        x, _ = self._array(x, "x"), self._check_root(root)
        self._gpu = self._gpu or not isinstance(x, np.ndarray)
        return x

    def wait(self, stream=None, what: str = "collective"):
        """Bounded like Comm.wait: a kernel on the stream that never ends raises CommError after timeout_s."""
        if stream is None:
            if not self._gpu:
                return                   # NumPy arrays only: every call completed when it returned
            import cupy as cp
            stream = cp.cuda.get_current_stream()
        start = time.monotonic()
        if not _poll_stream(stream, start + self.timeout_s):
            raise CommError(0, what, time.monotonic() - start, "the stream's work did not finish")

    def abort(self, error=None):     # no peer to end: only the users to release
        self._release_users()

    close = abort


# ============================================================================ CPU processes (tests)
class CpuEndpoint:
    """One rank's ends of the pipes to every other rank (what CpuComm takes where Comm takes a unique id)."""

    def __init__(self, rank: int, world: int, conns: dict):
        self.rank, self.world, self.conns = rank, world, conns


class CpuGroup:
    """A pipe between every two of `world` ranks, made in the parent before the processes start; each process is
    handed its own ends only (`endpoint(rank)`), so that a rank that dies closes its pipes and its peers see it."""

    def __init__(self, world: int):
        import multiprocessing as mp
        _check_rank(0, world)
        ctx = mp.get_context("spawn")
        self.world = world
        self._ends = {r: {} for r in range(world)}
        for i in range(world):
            for j in range(i + 1, world):
                a, b = ctx.Pipe(duplex=True)
                self._ends[i][j], self._ends[j][i] = a, b

    def endpoint(self, rank: int) -> CpuEndpoint:
        _check_rank(rank, self.world)
        return CpuEndpoint(rank, self.world, self._ends[rank])

    def close(self):
        """The parent's copies: closed once the processes have theirs."""
        for c in (c for ends in self._ends.values() for c in ends.values()):
            c.close()


class CpuComm(_Collectives):
    """The collectives on NumPy arrays between processes (one CpuEndpoint each, from a CpuGroup): the same calls,
    checks and failures as Comm, so the control flow of a multi-GPU trainer runs on a CPU. Every collective is
    synchronous (done when it returns; `wait` has nothing left to wait for) and every receive is bounded by
    timeout_s. Reductions add the ranks' arrays in rank order: every rank gets the same bits. Each message carries
    the collective's name and number, so ranks that call different collectives get a CommError, not wrong sums."""

    def __init__(self, rank: int, world: int, unique_id: CpuEndpoint, timeout_s: float = 60):
        _check_rank(rank, world)
        if not isinstance(unique_id, CpuEndpoint):
            raise TypeError(f"unique_id: expected a CpuEndpoint (CpuGroup(world).endpoint(rank)), got "
                            f"{type(unique_id).__name__}")
        if (unique_id.rank, unique_id.world) != (rank, world):
            raise ValueError(f"unique_id: the endpoint of rank {unique_id.rank} of {unique_id.world}, "
                             f"not of rank {rank} of {world}")
        self.rank, self.world, self.timeout_s = int(rank), int(world), _check_timeout(timeout_s)
        self._conns, self._seq, self._aborted = unique_id.conns, 0, False
        self._peers = [r for r in range(self.world) if r != self.rank]

    def _fail(self, what, start, reason):
        self.abort(f"{what}: {reason}")
        return CommError(self.rank, what, time.monotonic() - start, reason)

    def _exchange(self, what: str, sends: dict, recv_from) -> dict:
        """Send sends[peer] to each peer (threads: a pipe holds only so much until its reader reads) and receive
        one message from each of recv_from; all bounded by timeout_s."""
        self.wait(what=what)                        # an aborted communicator raises CommError
        self._seq += 1
        tag, start = (self._seq, what), time.monotonic()
        deadline = start + self.timeout_s
        errors = []

        def send(peer, payload):
            try:
                self._conns[peer].send(("data", tag, payload))
            except (OSError, ValueError) as e:
                errors.append(f"rank {peer} closed its pipe ({type(e).__name__}: it exited or died)")

        threads = [threading.Thread(target=send, args=(p, v), daemon=True) for p, v in sends.items()]
        for t in threads:
            t.start()
        got = {}
        for peer in recv_from:
            conn = self._conns[peer]
            try:
                ready = conn.poll(max(0.0, deadline - time.monotonic()))
                msg = conn.recv() if ready else None
            except (EOFError, OSError):
                raise self._fail(what, start, f"rank {peer} closed its pipe (it exited or died)") from None
            if msg is None:
                raise self._fail(what, start, f"timed out waiting for rank {peer} (it hangs, died, or is in "
                                 f"another collective)")
            if msg[0] == "abort":
                raise self._fail(what, start, f"rank {peer} aborted: {msg[1]}")
            if msg[1] != tag:
                raise self._fail(what, start, f"rank {peer} called {msg[1][1]} (collective #{msg[1][0]}) where "
                                 f"this rank called {what} (collective #{self._seq})")
            got[peer] = msg[2]
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise self._fail(what, start, "timed out sending to a peer that does not read")
        if errors:
            raise self._fail(what, start, errors[0])
        return got

    def _parts(self, what, mine, got, size):
        """Every rank's contribution in rank order, each checked for the size this rank expects."""
        parts = []
        for r in range(self.world):
            p = mine if r == self.rank else got[r]
            if p.size != size or p.dtype != mine.dtype:
                raise self._fail(what, time.monotonic(), f"rank {r} sent {p.size} elements of {p.dtype} where "
                                 f"rank {self.rank} has {size} of {mine.dtype}")
            parts.append(p.reshape(-1))
        return parts

    @staticmethod
    def _reduce(parts, op, world):
        acc = parts[0].copy()
        for p in parts[1:]:              # rank order: the same bits on every rank
            acc += p
        if op == "avg":
            acc /= acc.dtype.type(world)
        return acc

    def all_reduce(self, x, out=None, op="sum", stream=None):
        x, out, op = self._check_all_reduce(x, out, op)
        flat = np.ascontiguousarray(x).reshape(-1)
        got = self._exchange("all_reduce", {p: flat for p in self._peers}, self._peers)
        out.reshape(-1)[...] = self._reduce(self._parts("all_reduce", flat, got, x.size), op, self.world)
        return out

    def reduce_scatter(self, x, out, op="sum", stream=None):
        x, out, op = self._check_reduce_scatter(x, out, op)
        chunks = x.reshape(self.world, -1)
        got = self._exchange("reduce_scatter", {p: chunks[p] for p in self._peers}, self._peers)
        parts = self._parts("reduce_scatter", chunks[self.rank], got, out.size)
        out.reshape(-1)[...] = self._reduce(parts, op, self.world)
        return out

    def all_gather(self, x, out, stream=None):
        x, out = self._check_all_gather(x, out)
        flat = x.reshape(-1).copy()                 # x may be a slice of out
        got = self._exchange("all_gather", {p: flat for p in self._peers}, self._peers)
        rows = out.reshape(self.world, -1)
        for r, part in enumerate(self._parts("all_gather", flat, got, x.size)):
            rows[r] = part
        return out

    def broadcast(self, x, root=0, stream=None):
        x, root = self._array(x, "x"), self._check_root(root)
        if self.rank == root:
            self._exchange("broadcast", {p: x.reshape(-1) for p in self._peers}, [])
        else:
            part = self._exchange("broadcast", {}, [root])[root]
            if part.size != x.size or part.dtype != x.dtype:
                raise self._fail("broadcast", time.monotonic(), f"rank {root} sent {part.size} elements of "
                                 f"{part.dtype} where rank {self.rank} has {x.size} of {x.dtype}")
            x.reshape(-1)[...] = part
        return x

    def wait(self, stream=None, what: str = "collective"):
        """Nothing is in flight: every CpuComm collective completed when it returned."""
        if self._aborted:
            raise CommError(self.rank, what, 0.0, "the communicator was aborted or closed")

    def abort(self, reason: str = "aborted"):
        """Release the users (on_abort), tell every peer (best effort: one that is gone is skipped), close the pipes."""
        if self._aborted:
            return
        self._aborted = True
        self._release_users()

        def tell(conn):
            try:
                conn.send(("abort", f"rank {self.rank}: {reason}"))
            except (OSError, ValueError):
                pass

        # a thread each: a peer that stopped reading must not block the abort itself
        threads = [threading.Thread(target=tell, args=(c,), daemon=True) for c in self._conns.values() if not c.closed]
        for t in threads:
            t.start()
        for t in threads:
            t.join(1.0)
        if not any(t.is_alive() for t in threads):
            self.close()

    def close(self):
        self._aborted = True             # a later call raises CommError, not an error of a closed pipe
        self._release_users()
        for conn in self._conns.values():
            conn.close()
