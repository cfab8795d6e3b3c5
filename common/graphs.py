"""CUDA graphs: `capture_graph(fn, stream)` records the GPU work `fn()` enqueues, to replay it with one launch.

One way to do each thing:
- `capture_graph(fn, stream, node_priority=False)` -> a graph to `launch(stream)` (`record_graph` is its
  first half, the capture before any edit);
- `stream_priorities()` -> (lowest, highest) stream priority of this GPU.

A replayed graph has no host between its kernels, but it still has gaps: each dependent node starts a
microsecond or so after the one before it ends. Two things here shorten the critical path of a captured graph,
both through the CUDA driver's graph API (libcuda through ctypes: CuPy does not wrap these calls):

- **cuBLAS's memsets moved off the path.** On Hopper, cuBLAS puts a small memset before many of its GEMM
  kernels (a counter in its workspace that the kernel's tile scheduler counts up). Captured on a stream, each
  becomes a node between the kernel before the GEMM and the GEMM: two dependent steps instead of one, about
  5 us of idle GPU each time (measured in the training step's timeline, docs/training.md). `common.cublas.gemm`
  notes which nodes each of its calls added to a capture and which workspace the call used; after the capture a
  memset that writes into that workspace is made to wait only for the previous cuBLAS call on the same workspace,
  so it runs beside the kernels in between, and the GEMM follows the kernel before it directly. Nothing but
  cuBLAS touches its workspace, so the result is the same bits.
- **node priorities** (`node_priority=True`): each kernel keeps the priority of the stream it was captured on;
  CuPy instantiates graphs without that flag, so all of a graph's kernels take its launch stream's priority.
"""
from __future__ import annotations

import contextlib
import ctypes

_libcuda = None
MEMSET_NODE = 2                              # CU_GRAPH_NODE_TYPE_MEMSET
LOSSY_QUERY = 402                            # CUDA_ERROR_LOSSY_QUERY: see _EdgeData
USE_NODE_PRIORITY = 8                        # CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY
_recording: dict[int, list] = {}             # capture id -> cuBLAS calls made in it (capture_graph's captures)


def _driver():
    """The CUDA driver library (libcuda), for the calls CuPy does not wrap. Its unsuffixed graph functions keep
    the CUDA 11/12 signatures in every later driver (cuda.h declares them so), which are the ones used here."""
    global _libcuda
    if _libcuda is None:
        import sys
        _libcuda = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    return _libcuda


class _EdgeData(RuntimeError):
    """A graph query met an edge that carries data, which the CUDA 11/12 signatures cannot return (cuBLAS's
    bf16 GEMMs on Hopper launch with programmatic dependent launch, and their edges say so). The nodes around
    such an edge are left as captured."""


def _call(name: str, *args) -> None:
    status = getattr(_driver(), name)(*args)
    if status == LOSSY_QUERY:
        raise _EdgeData(f"{name}: an edge with data (CUresult {status})")
    if status != 0:
        raise RuntimeError(f"{name} failed with CUresult {status}")


def stream_priorities() -> tuple[int, int]:
    """(lowest, highest) stream priority of this GPU, as CUDA numbers them (lower numbers run first, so
    highest <= lowest; the default stream priority is the lowest)."""
    import cupy as cp
    from common.device import require_gpu
    require_gpu()
    cp.cuda.runtime.free(0)                      # cudaFree(0): makes the device's context current, as the call needs
    least, greatest = ctypes.c_int(), ctypes.c_int()
    _call("cuCtxGetStreamPriorityRange", ctypes.byref(least), ctypes.byref(greatest))
    return least.value, greatest.value


# ------------------------------------------------------------------------------------- the capture's nodes
def _capture_state(stream_ptr: int) -> tuple[int, tuple[int, ...]] | None:
    """(capture id, the nodes the stream's next work will depend on) while the stream is being captured."""
    status, cid, graph = ctypes.c_int(), ctypes.c_ulonglong(), ctypes.c_void_p()
    deps, n = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_size_t()
    try:
        _call("cuStreamGetCaptureInfo_v2", ctypes.c_void_p(stream_ptr), ctypes.byref(status), ctypes.byref(cid),
              ctypes.byref(graph), ctypes.byref(deps), ctypes.byref(n))
    except _EdgeData:                            # the last call's edges carry data: not noted, left alone
        return None
    if status.value != 1:                        # CU_STREAM_CAPTURE_STATUS_ACTIVE
        return None
    return cid.value, tuple(deps[i] for i in range(n.value))


@contextlib.contextmanager
def cublas_call(stream_ptr: int, workspace: tuple[int, int]):
    """Around one cuBLAS call on `stream_ptr` with `workspace` (pointer, bytes): `with cublas_call(...): ...`.
    Inside a capture_graph capture it notes the nodes the call adds; elsewhere (or if the call raises) nothing."""
    before = _capture_state(stream_ptr) if _recording else None
    if before is not None and before[0] not in _recording:
        before = None                                # a capture that capture_graph did not start
    yield
    if before is not None:
        after = _capture_state(stream_ptr)
        if after is not None:                        # else the capture failed: end_capture will say so
            _recording[before[0]].append((workspace, before[1], after[1]))


def _nodes(fn: str, node) -> list[int]:
    """A node's dependencies (fn = cuGraphNodeGetDependencies) or dependents (cuGraphNodeGetDependentNodes)."""
    n = ctypes.c_size_t()
    _call(fn, ctypes.c_void_p(node), None, ctypes.byref(n))
    if not n.value:                              # a buffer with a count of 0 is refused
        return []
    arr = (ctypes.c_void_p * n.value)()
    _call(fn, ctypes.c_void_p(node), arr, ctypes.byref(n))
    return [arr[i] for i in range(n.value)]


def _edges(name: str, graph, pairs) -> None:
    """Add or remove (name) the edges `pairs` [(from, to)] of `graph`."""
    if pairs:
        src = (ctypes.c_void_p * len(pairs))(*[a for a, _ in pairs])
        dst = (ctypes.c_void_p * len(pairs))(*[b for _, b in pairs])
        _call(name, ctypes.c_void_p(graph), src, dst, ctypes.c_size_t(len(pairs)))


class _MemsetParams(ctypes.Structure):       # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", ctypes.c_ulonglong), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("elementSize", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


MAX_CALL_NODES = 32      # more nodes than one library call adds: _added_nodes gives up (the call is left alone)


def _added_nodes(before, after) -> set[int] | None:
    """The nodes between `before` and `after` (those a call added): walked back from `after`; None if the walk
    finds more than MAX_CALL_NODES."""
    stop, seen, todo = set(before), set(), [n for n in after if n not in before]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if len(seen) > MAX_CALL_NODES:
            return None
        try:
            todo.extend(d for d in _nodes("cuGraphNodeGetDependencies", node) if d not in stop)
        except _EdgeData:
            return None
    return seen


def hoist_cublas_memsets(graph, calls) -> int:
    """In the captured `graph` (a CUgraph), make each memset that a cuBLAS call put into its own workspace wait
    only for the previous cuBLAS call on that workspace (or nothing, for the first), instead of for the node
    before the call; the call's next node waits for that node instead. `calls`: (workspace (ptr, bytes), nodes
    before the call, nodes after it) in capture order, as cublas_call notes them. Returns how many moved."""
    last: dict[tuple[int, int], tuple[int, ...]] = {}
    moved = 0
    for ws, before, after in calls:
        added = _added_nodes(before, after)
        for node in added or ():
            kind = ctypes.c_int()
            _call("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(kind))
            if kind.value != MEMSET_NODE:
                continue
            p = _MemsetParams()
            _call("cuGraphMemsetNodeGetParams", ctypes.c_void_p(node), ctypes.byref(p))
            size = p.width * p.elementSize + (p.pitch * (p.height - 1) if p.height > 1 else 0)
            try:
                preds = _nodes("cuGraphNodeGetDependencies", node)
                succs = _nodes("cuGraphNodeGetDependentNodes", node)
                succ_deps = {s: set(_nodes("cuGraphNodeGetDependencies", s)) for s in succs}
            except _EdgeData:
                continue
            if not (ws[0] <= p.dst and p.dst + size <= ws[0] + ws[1]) or not set(preds) <= set(before) \
                    or not succs or not set(succs) <= added:
                continue                     # only a call's first node, writing only into its workspace
            _edges("cuGraphRemoveDependencies", graph, [(a, node) for a in preds])
            _edges("cuGraphAddDependencies", graph, [(a, s) for s in succs for a in preds if a not in succ_deps[s]])
            _edges("cuGraphAddDependencies", graph, [(a, node) for a in last.get(ws, ())])
            moved += 1
        last[ws] = after
    return moved


# ---------------------------------------------------------------------------------------------- graphs
class CapturedGraph:
    """A captured graph, edited (hoist_cublas_memsets) and instantiated by the course through the driver, with
    node priorities if asked. Same API as CuPy's Graph: launch(stream=None)."""

    def __init__(self, graph, node_priority: bool, hoisted: int = 0):
        self._graph = graph                       # CuPy's Graph owns the cudaGraph_t: keep it alive
        self.hoisted = hoisted                    # how many memsets hoist_cublas_memsets moved
        exec_ = ctypes.c_void_p()
        _call("cuGraphInstantiateWithFlags", ctypes.byref(exec_), ctypes.c_void_p(graph.graph),
              ctypes.c_ulonglong(USE_NODE_PRIORITY if node_priority else 0))
        self._exec = exec_.value

    def launch(self, stream=None):
        import cupy as cp
        from cupy_backends.cuda.api import runtime
        runtime.graphLaunch(self._exec, (stream or cp.cuda.get_current_stream()).ptr)

    def __del__(self):
        if getattr(self, "_exec", None):
            try:
                from cupy_backends.cuda.api import runtime
                runtime.graphExecDestroy(self._exec)
            except Exception:                     # at interpreter exit the context may be gone already
                pass


def record_graph(fn, stream=None):
    """(CuPy Graph, cuBLAS calls): the GPU work `fn()` enqueues on `stream`, recorded as CUDA captures it, before
    capture_graph edits it. The calls are what cublas_call noted, for hoist_cublas_memsets. Use capture_graph;
    this is its first half (a lab that measures the unedited graph calls it alone)."""
    import cupy as cp
    from common.device import require_gpu
    require_gpu()
    stream = cp.cuda.Stream(non_blocking=True) if stream is None else stream
    stream.begin_capture()
    cid = None
    try:
        cid = _capture_state(stream.ptr)[0]
        _recording[cid] = []
        with stream:
            fn()
    except BaseException:
        try:
            stream.end_capture()
        except Exception:
            pass
        raise
    finally:
        calls = _recording.pop(cid, [])
    return stream.end_capture(), calls


def capture_graph(fn, stream=None, node_priority: bool = False):
    """A CUDA graph of the GPU work that `fn()` enqueues on `stream` (a non-blocking stream made here when
    None): recorded, not run; replay it with `graph.launch(stream)`. Run `fn` once before capturing so
    kernels are compiled and buffers allocated: neither may happen during a capture. The capture is closed
    even when `fn` raises (CuPy refuses cuBLAS calls inside one), so the stream stays usable, and the
    original error is the one reported.

    cuBLAS's memsets into its workspace are made to wait only for its previous call (the module's docstring
    says why). node_priority: kernels keep the priorities of the streams they were captured on (work that `fn`
    puts on a stream of another priority). A CapturedGraph where either applies, else CuPy's graph."""
    graph, calls = record_graph(fn, stream)
    moved = hoist_cublas_memsets(graph.graph, calls)
    return CapturedGraph(graph, node_priority, moved) if node_priority or moved else graph
