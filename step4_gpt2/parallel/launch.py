"""Starting the ranks: one process per GPU, and the NCCL unique id that lets them find each other.

    results = spawn(train_rank, 2, cfg, timeout_s=600)      # on one machine: python -m step4_gpt2.parallel
    # each child runs train_rank(rank, world, unique_id, cfg); results[r] is what rank r returned

    env = from_env()                                        # under torchrun (or any launcher setting RANK, ...)
    comm = Comm(env.rank, env.world, env.unique_id)

Processes, not threads: each rank owns a GPU, a CUDA context and its own Python (CPython runs one thread of
Python at a time). They are started with multiprocessing's "spawn" (a fresh interpreter), never "fork": a forked
child would inherit the parent's CUDA state, which CUDA does not support.

Faults: spawn's parent is the watchdog. It waits on every child's result pipe and process at once; the first child
that raises, dies (a signal, os._exit) or is still running at `timeout_s` makes it end every other child
(SIGTERM, then SIGKILL) and raise LaunchError naming the rank and what happened. NCCL itself would wait forever
for a peer that is gone: in the children, Comm bounds each wait (comm.py), and this bounds the whole run.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass

from common import expect_int
from step4_gpt2.parallel.comm import CpuGroup, _check_timeout, nccl_unique_id

BACKENDS = ("nccl", "cpu")
ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# rank 0 listens one port above MASTER_PORT: torchrun's own store (its rendezvous) holds MASTER_PORT itself
PORT_OFFSET = 1
AUTHKEY_ENV = "PARALLEL_AUTHKEY"


class LaunchError(RuntimeError):
    """A run that did not complete on every rank: which rank failed and how (its error, exit status or time-out),
    or an environment a launcher left incomplete."""


# ============================================================================ one machine
def _child(fn, rank, world, unique_id, args, conn):
    """A child's whole life: its rank in the environment (as a launcher would set it), fn, and one message back."""
    import faulthandler
    faulthandler.enable()                      # a crash in native code prints every thread's stack
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        value = fn(rank, world, unique_id, *args)
        message = ("ok", value)
    except BaseException as e:                 # KeyboardInterrupt and SystemExit are failures of this rank too
        message = ("error", f"{type(e).__name__}: {e}", traceback.format_exc())
    try:
        conn.send(message)
    except Exception as e:                     # a return value that does not pickle
        conn.send(("error", f"its return value could not be sent back ({type(e).__name__}: {e})", ""))
    conn.close()


def _stop(procs, grace_s: float = 3.0):
    """End every child still running: SIGTERM, then SIGKILL after grace_s (a rank stuck in a CUDA call may ignore
    the first)."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(grace_s)


def spawn(fn, nprocs: int, *args, timeout_s: float = 600, backend: str = "nccl") -> list:
    """Run fn(rank, world, unique_id, *args) in `nprocs` new processes (ranks 0 .. nprocs-1) and return their return
    values in rank order. fn must be importable by name (a module-level function), as must args and the values it
    returns (they are pickled). backend "nccl": unique_id is an NCCL unique id (bytes) for Comm; "cpu": each rank's
    CpuEndpoint for CpuComm. Raises LaunchError, with every child ended, within timeout_s of the start when one
    raises, dies or is still running."""
    import multiprocessing as mp
    from multiprocessing.connection import wait

    expect_int(nprocs, "nprocs", expected="a number of processes >= 1")
    timeout_s = _check_timeout(timeout_s)
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    main = sys.modules.get("__main__")
    if "<" in getattr(fn, "__qualname__", "<") or (getattr(fn, "__module__", None) == "__main__"
                                                  and not getattr(main, "__file__", None)):
        raise ValueError(f"fn: {fn!r} cannot be sent to a spawned process, which imports it by name: pass a "
                         f"module-level function of a .py file (not a lambda, a nested or a notebook's function)")
    ctx = mp.get_context("spawn")
    group = CpuGroup(nprocs) if backend == "cpu" else None
    uid = None if group else nccl_unique_id()       # one id, made here, handed to every rank
    procs, pipes = [], {}
    start = time.monotonic()
    try:
        for r in range(nprocs):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, name=f"rank{r}", daemon=False,
                            args=(fn, r, nprocs, group.endpoint(r) if group else uid, args, send))
            p.start()
            send.close()                   # the child's end: once the child exits, recv sees the end of file
            procs.append(p)
            pipes[recv] = r
    except BaseException:
        _stop(procs)
        raise
    finally:
        if group is not None:
            group.close()                  # the parent's copies: a child that dies closes the pipes to its peers
    results, failure = {}, None
    sentinels = {p.sentinel: r for r, p in enumerate(procs)}
    try:
        while len(results) < nprocs and failure is None:
            left = start + timeout_s - time.monotonic()
            ready = wait([*pipes, *sentinels], timeout=max(0.0, left))
            if not ready:
                hung = [r for r in range(nprocs) if r not in results]
                failure = (f"rank{'s' if len(hung) > 1 else ''} {', '.join(map(str, hung))} did not finish within "
                           f"timeout_s={timeout_s:g} s (a hang, or a peer that waits for one)")
                break
            for obj in ready:
                if obj in pipes:
                    r = pipes.pop(obj)
                    try:
                        msg = obj.recv()
                    except (EOFError, OSError):    # its end closed without a message: it died
                        procs[r].join(1.0)
                        failure = f"rank {r} died without a result (exit status {procs[r].exitcode})"
                        break
                    if msg[0] == "ok":
                        results[r] = msg[1]
                    else:
                        failure = f"rank {r} raised {msg[1]}" + (f"\n--- rank {r}'s traceback:\n{msg[2]}"
                                                                    if msg[2] else "")
                        break
                elif obj in sentinels:
                    r = sentinels.pop(obj)
                    p = procs[r]
                    p.join(0.5)
                    # its result may still be in the pipe (read on the next pass); a closed pipe is read there too
                    if r not in results and not any(pipes.get(c) == r and c.poll() for c in list(pipes)):
                        failure = f"rank {r} died without a result (exit status {p.exitcode})"
                        break
    finally:
        if failure is None:                # every rank answered: let each exit on its own (its clean-up), briefly
            for p in procs:
                p.join(max(0.0, min(10.0, start + timeout_s - time.monotonic())))
        _stop(procs)
        for c in pipes:
            c.close()
    if failure:
        raise LaunchError(f"{failure}; every rank was stopped ({time.monotonic() - start:.1f} s after the start)")
    return [results[r] for r in range(nprocs)]


# ============================================================================ a launcher's environment
@dataclass(frozen=True)
class RankEnv:
    """This process's place in a run a launcher started: global rank, number of ranks, rank on this machine
    (its GPU), and the NCCL unique id every rank shares."""
    rank: int
    world: int
    local_rank: int
    unique_id: bytes


def _env_int(name: str, env) -> int:
    if name not in env:
        raise LaunchError(f"{name} is not set: a launcher such as torchrun sets {', '.join(ENV)} for each process")
    try:
        return int(env[name])
    except ValueError:
        raise LaunchError(f"{name}={env[name]!r}: expected an integer") from None


def from_env(timeout_s: float = 120, env=None, make_id=nccl_unique_id) -> RankEnv:
    """Read RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (torchrun's variables) and share one NCCL
    unique id: rank 0 makes it and serves it on MASTER_ADDR:MASTER_PORT+1 through multiprocessing.connection (a
    Listener, authenticated with $PARALLEL_AUTHKEY, default the course's name), every other rank fetches it; no
    torch.distributed. NCCL then finds the peers on its own transports (NVLink, PCIe, the network). Bounded: a
    rank that does not show up within timeout_s is a LaunchError naming how many did."""
    env = os.environ if env is None else env
    timeout_s = _check_timeout(timeout_s)
    rank, world, local = (_env_int(k, env) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if world < 1 or not 0 <= rank < world:
        raise LaunchError(f"RANK={rank}, WORLD_SIZE={world}: expected 0 <= RANK < WORLD_SIZE")
    if local < 0:
        raise LaunchError(f"LOCAL_RANK={local}: expected >= 0")
    if world == 1:
        return RankEnv(rank, world, local, make_id())
    if "MASTER_ADDR" not in env:
        raise LaunchError(f"MASTER_ADDR is not set: a launcher such as torchrun sets {', '.join(ENV)}")
    address = (env["MASTER_ADDR"], _env_int("MASTER_PORT", env) + PORT_OFFSET)
    authkey = env.get(AUTHKEY_ENV, "step4_gpt2.parallel").encode()
    uid = _serve_id(address, world, authkey, timeout_s, make_id) if rank == 0 else \
        _fetch_id(address, rank, authkey, timeout_s)
    return RankEnv(rank, world, local, uid)


def _serve_id(address, world: int, authkey: bytes, timeout_s: float, make_id) -> bytes:
    """Rank 0: make the id and hand it to world - 1 clients; bytes only (nothing unpickled from the network)."""
    from multiprocessing.connection import Listener
    uid = make_id()
    served, errors = [], []
    listener = Listener(("0.0.0.0", address[1]), authkey=authkey)

    def serve():
        while len(served) < world - 1:
            try:
                conn = listener.accept()       # checks the client's authkey
            except OSError:                    # the listener was closed: time is up
                return
            except Exception as e:             # a client with another authkey: said below, go on listening
                errors.append(f"{type(e).__name__}: {e}")
                continue
            with conn:
                conn.send_bytes(uid)
            served.append(1)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    t.join(timeout_s)
    listener.close()
    if len(served) < world - 1:
        raise LaunchError(f"rank 0: {len(served)} of {world - 1} ranks fetched the NCCL id from port {address[1]} "
                          f"within {timeout_s:g} s" + (f" ({errors[-1]})" if errors else ""))
    return uid


def _fetch_id(address, rank: int, authkey: bytes, timeout_s: float) -> bytes:
    """Any other rank: connect to rank 0 (retrying while it is not listening yet) and read the id. Each try runs
    in a thread of its own, joined with the time left: Client's connect has no time-out of its own, and a connect
    to an address that does not answer takes minutes."""
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client
    deadline, last, got = time.monotonic() + timeout_s, None, []

    def attempt():
        nonlocal last
        try:
            with Client(address, authkey=authkey) as conn:
                if conn.poll(max(0.0, deadline - time.monotonic())):
                    got.append(conn.recv_bytes(256))
                else:
                    last = "connected, but rank 0 sent nothing"
        except AuthenticationError:
            last = f"rank 0 refused this rank's key: set the same ${AUTHKEY_ENV} on every machine"
        except (OSError, EOFError) as e:
            last = f"{type(e).__name__}: {e}"

    while time.monotonic() < deadline:
        t = threading.Thread(target=attempt, daemon=True)
        t.start()
        t.join(max(0.0, deadline - time.monotonic()))
        if got:
            return got[0]
        if t.is_alive():
            last = last or "the connection did not complete"
            break
        time.sleep(0.2)
    raise LaunchError(f"rank {rank}: no NCCL id from rank 0 at {address[0]}:{address[1]} within {timeout_s:g} s "
                      f"({last}); is MASTER_ADDR rank 0's address, and its port {address[1]} open?")

