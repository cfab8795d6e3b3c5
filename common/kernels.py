"""Load `.cu` files as CuPy modules, and compile them without a GPU (NVRTC) to check and size them.

One way to do each thing:
- `load_module(path, defines=...)` -> a compiled `cupy.RawModule`; `module.get_function(name)` gets a kernel.
- `compile_offline(path, arch)` -> a `CompileReport` with registers / shared memory / spills per kernel,
  made by NVRTC (the compiler CuPy uses, through CuPy's own binding) on any machine, driver or not. CI
  compiles every `.cu` this way.

Both prepend `#line 1 "<file>"` so compiler messages name the real file and line, and both raise
`KernelCompileError` with the offending source line quoted.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from common.device import device_info, nvrtc as _nvrtc, nvrtc_version, require_gpu

ROOT = Path(__file__).resolve().parent.parent
INCLUDE = ROOT / "common" / "include"
# sm_70 (V100) .. sm_90 (H100/H200); T4 is sm_75, A100 sm_80, RTX 30xx sm_86, L4/RTX 40xx sm_89.
ARCHS = (70, 75, 80, 86, 89, 90)
# Flags shared by the GPU path (CuPy) and the offline path (NVRTC), so both compile the same program.
BASE_OPTIONS = ("--std=c++17",)

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
_DIAG_RE = re.compile(r'^(?P<file>[^\n()]+)\((?P<line>\d+)\): (?P<kind>(?:catastrophic )?error|warning)[^:]*: '
                      r'(?P<msg>.*)$', re.M)


class KernelCompileError(RuntimeError):
    """A `.cu` file did not compile; the message names file, line, error and the source line."""


def resolve(path: str | os.PathLike) -> Path:
    """An absolute path, or one relative to the current folder (a notebook's), or to the repository."""
    p = Path(path)
    candidates = [p] if p.is_absolute() else [Path.cwd() / p, ROOT / p]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise FileNotFoundError(f"CUDA source {str(path)!r} not found; looked at: {', '.join(map(str, candidates))}")


def _display_name(path: Path) -> str:
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def _include_dirs(path: Path) -> list[Path]:
    return [path.parent, INCLUDE]


def _headers(path: Path, dirs: list[Path], seen: dict | None = None) -> dict[Path, str]:
    """Every quoted #include reachable from path, with its text (CuPy's cache key ignores them)."""
    seen = {} if seen is None else seen
    for name in _INCLUDE_RE.findall(path.read_text()):
        for d in [path.parent, *dirs]:
            h = (d / name).resolve()
            if h.is_file():
                if h not in seen:
                    seen[h] = h.read_text()
                    _headers(h, dirs, seen)
                break
    return seen


def _define_options(defines: dict | None) -> list[str]:
    return [f"-D{k}" if v is None or v is True else f"-D{k}={v}" for k, v in sorted((defines or {}).items())]


def _source(path: Path) -> str:
    """The text to compile: the file itself, so messages point at it, plus a fingerprint of its headers."""
    dirs = _include_dirs(path)
    headers = _headers(path, dirs)
    digest = hashlib.sha256("".join(f"{k}\n{v}" for k, v in sorted((str(k), v) for k, v in headers.items()))
                            .encode()).hexdigest()[:16]
    # The trailing comment changes CuPy's cache key whenever an included header changes.
    return f'#line 1 "{_display_name(path)}"\n{path.read_text()}\n// headers: {digest}\n'


def _explain(log: str, what: str) -> str:
    """Turn a compiler log into 'file:line: error: msg' + the quoted source line, errors first."""
    out = []
    for m in _DIAG_RE.finditer(log):
        if "error" not in m["kind"]:
            continue
        file, line = m["file"].strip(), int(m["line"])
        src = None
        for base in (ROOT, INCLUDE, Path.cwd()):
            f = Path(file) if Path(file).is_absolute() else base / file
            if f.is_file():
                lines = f.read_text().splitlines()
                src = lines[line - 1] if 0 < line <= len(lines) else None
                break
        out.append(f"{file}:{line}: error: {m['msg']}")
        if src is not None:
            out.append(f"    {line:5d} | {src}")
    head = "\n".join(out) if out else "(no error lines found in the log)"
    return f"{what} failed to compile:\n{head}\n--- full compiler log ---\n{log.strip()}"


_modules: dict = {}
_recent: dict = {}


def load_module(path: str | os.PathLike, defines: dict | None = None, options: tuple = (),
                name_expressions: tuple = ()):
    """Compile a `.cu` file on this machine's GPU and return the `cupy.RawModule`.

    `defines` become `-DNAME=value` (block and tile sizes are compile-time constants in the course's
    kernels). The file's folder and `common/include` are on the include path. Modules are cached per
    process (re-checked against the files' modification times, so edits take effect); CuPy also caches
    the binary on disk, keyed by the text (header fingerprint included). `name_expressions` names the
    template instantiations to compile (e.g. "layernorm<256>"), which `get_function` then accepts as names.
    """
    import cupy as cp

    require_gpu()                           # cached: a clear error without a GPU, cheap with one
    device = cp.cuda.runtime.getDevice()    # a loaded module belongs to one GPU
    name_expressions = tuple(name_expressions)
    fast_key = (str(path), Path.cwd(), tuple(sorted((defines or {}).items())), tuple(options), name_expressions,
                device)
    hit = _recent.get(fast_key)
    if hit is not None and all(os.stat(f).st_mtime_ns == m for f, m in hit[0]):
        return hit[1]       # wrappers call this on every launch: keep it to a few stat() calls

    path = resolve(path)
    code = _source(path)
    opts = (*BASE_OPTIONS, *(f"-I{d}" for d in _include_dirs(path)), *_define_options(defines), *options)
    key = (code, opts, name_expressions, device)
    if key not in _modules:
        module = cp.RawModule(code=code, options=opts, name_expressions=name_expressions or None)
        try:
            module.compile()
        except cp.cuda.compiler.CompileException as e:
            raise KernelCompileError(_explain(str(e), _display_name(path))) from None
        _modules[key] = module
    files = [path, *_headers(path, _include_dirs(path))]
    _recent[fast_key] = ([(f, os.stat(f).st_mtime_ns) for f in files], _modules[key])
    return _modules[key]


_kernels: dict = {}


def get_kernel(path: str | os.PathLike, name: str, defines: dict | None = None, options: tuple = (),
               templates: tuple = ()):
    """The one way the course gets a kernel: `name` from the `.cu` file at `path`, compiled with `defines`
    (`-DNAME=value`) and cached. Cheap enough to call on every launch (a dict access and a few stat() calls).

    `name` is either an `extern "C"` kernel or a template instantiation such as `"layernorm<256, true>"`,
    which CuPy compiles through `name_expressions`, so templated kernels need no hand-written wrappers.
    `templates` is every instantiation the course asks that `.cu` for (its `CU_TEMPLATES` entry): they are
    compiled together into one module, where each would otherwise cost a compile of the whole file of its
    own. A templated `name` must then be one of them (an `extern "C"` one comes from the same module).
    """
    templates = tuple(templates)
    templated = "<" in name
    if templates and templated and name not in templates:
        raise ValueError(f"name: {name!r} is not one of templates {templates} (the template instantiations "
                         f"compiled from {os.fspath(path)}); add it to the .cu's CU_TEMPLATES entry")
    expressions = templates or ((name,) if templated else ())
    module = load_module(path, defines, options, name_expressions=expressions)
    key = (id(module), name)
    if key not in _kernels:
        _kernels[key] = (module, module.get_function(name))   # keep module alive: id() stays unique
    return _kernels[key][1]


def occupancy(kernel, block: int, dynamic_smem: int = 0) -> dict:
    """Resident blocks and warps per SM for a compiled kernel launched with `block` threads and `dynamic_smem`
    bytes of dynamic shared memory, as the CUDA driver counts them (cuOccupancyMaxActiveBlocksPerMultiprocessor,
    which also sizes the megakernel's grid), and which resource is the limit: the smallest of the occupancy
    calculator's per-resource counts (registers are allocated per warp in units of 256, and each block
    reserves 1 KB of shared memory for the system). Above the kernel's current opt-in it first raises
    `kernel.max_dynamic_shared_size_bytes` to `dynamic_smem`, as the launch would; it never lowers it."""
    from cupy.cuda import driver
    d = device_info()
    # The driver counts no block at all for more dynamic shared memory than the kernel has opted in to. The
    # launch opts in (allow_dynamic_smem), so the question is about the kernel once it has.
    if dynamic_smem <= d["shared_per_block_optin"]:
        allow_dynamic_smem(kernel, dynamic_smem, "dynamic_smem")
    blocks = int(driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, block, dynamic_smem))
    # The driver gives the count alone; the calculator's count per resource says which one binds.
    regs = kernel.num_regs
    warps = -(-block // 32)
    regs_per_warp = -(-regs * 32 // 256) * 256
    by_regs = (d["registers_per_sm"] // regs_per_warp) // warps if regs else 10 ** 9
    # A block larger than this kernel can launch (its __launch_bounds__) fits nowhere: threads count 0 then, so
    # when not one block fits (blocks == 0) the smallest count, 0, names the resource that prevents it.
    by_threads = d["max_threads_per_sm"] // (warps * 32) if block <= kernel.max_threads_per_block else 0
    smem = kernel.shared_size_bytes + dynamic_smem
    by_smem = d["shared_per_sm"] // (smem + 1024) if smem else 10 ** 9
    limiter = min((by_regs, "registers"), (by_threads, "threads"), (by_smem, "shared memory"),
                  (d["max_blocks_per_sm"], "blocks per SM"))[1]
    return {"registers": regs, "local_bytes": kernel.local_size_bytes, "blocks_per_sm": blocks,
            "warps_per_sm": blocks * warps, "occupancy": blocks * warps * 32 / d["max_threads_per_sm"],
            "limited_by": limiter}


def allow_dynamic_smem(kernel, nbytes: int, what: str) -> None:
    """Let `kernel` launch with nbytes of dynamic shared memory: above 48 KB a kernel must opt in
    (`max_dynamic_shared_size_bytes`), and past the GPU's opt-in limit (64 KB on a T4, 99 KB on an RTX 30/40,
    227 KB on an H100) this raises a ValueError that starts with `what` (the argument or choice responsible).
    An opt-in is only ever raised, never lowered below what the kernel already has."""
    d = device_info()
    if nbytes > d["shared_per_block_optin"]:
        raise ValueError(f"{what} need {nbytes:,} B of shared memory per block; this GPU ({d['name']}) allows "
                         f"at most {d['shared_per_block_optin']:,} B")
    if nbytes > max(48 << 10, kernel.max_dynamic_shared_size_bytes):
        kernel.max_dynamic_shared_size_bytes = nbytes


@dataclass
class KernelResources:
    name: str
    registers: int = 0
    shared_bytes: int = 0
    stack_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0


@dataclass
class CompileReport:
    path: str
    arch: int
    defines: dict
    kernels: dict = field(default_factory=dict)   # name -> KernelResources
    warnings: list = field(default_factory=list)
    log: str = ""

    def table(self) -> str:
        rows = [f"{'kernel':32s} {'regs':>5s} {'smem B':>7s} {'stack':>6s} {'spill st/ld':>12s}"]
        for k in self.kernels.values():
            rows.append(f"{k.name:32s} {k.registers:5d} {k.shared_bytes:7d} {k.stack_bytes:6d} "
                        f"{k.spill_stores:5d}/{k.spill_loads:<6d}")
        return f"{self.path} for sm_{self.arch}:\n" + "\n".join(rows)


def _runtime_include() -> Path:
    """The CUDA headers shipped by the nvidia-cuda-runtime wheel (CUDA 12 and 13 wheel layouts)."""
    import importlib.util
    wheels = (("nvidia.cuda_runtime", "include"), ("nvidia.cu13", "include"))   # CUDA 12, CUDA 13 layouts
    for mod, sub in (wheels if nvrtc_version()[0] < 13 else wheels[::-1]):      # the NVRTC's own headers first
        spec = importlib.util.find_spec(mod)
        if spec and spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                if (Path(loc) / sub / "cuda_runtime.h").is_file():
                    return Path(loc) / sub
    for home in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "include" / "cuda_runtime.h").is_file():
            return Path(home) / "include"
    raise RuntimeError("CUDA headers not found: install the nvidia-cuda-runtime-cu12 wheel "
                       "(requirements.txt lists it)")


_PTXAS_FUNC = re.compile(r"Function properties for (\S+)\s*\n.*?(\d+) bytes stack frame, (\d+) bytes spill stores, "
                         r"(\d+) bytes spill loads", re.S)
_PTXAS_USED = re.compile(r"Compiling entry function '(\S+)'.*?Used (\d+) registers(?:, used \d+ barriers)?"
                         r"(?:, \d+ bytes cumulative stack size)?(?:, (\d+) bytes smem)?", re.S)


def compile_offline(path: str | os.PathLike, arch: int = 90, defines: dict | None = None,
                    options: tuple = (), name_expressions: tuple = ()) -> CompileReport:
    """Compile with NVRTC for sm_<arch> without a GPU or driver; report resources per kernel.

    `name_expressions` instantiates templated kernels (e.g. "gemv_v5<EPI_BIAS, true>"), as `get_kernel` does
    on the GPU; the report lists them under those names instead of their mangled ones.
    Raises KernelCompileError on an error. Warnings are returned in `report.warnings` (CI fails on them).
    """
    nvrtc = _nvrtc()
    version = ".".join(map(str, nvrtc_version()))
    if arch not in supported_archs():
        raise ValueError(f"arch: this NVRTC ({version}) compiles for "
                         f"sm_{', sm_'.join(map(str, supported_archs()))}, not sm_{arch}")
    path = resolve(path)
    code = _source(path)
    # NVRTC >= 12.9 caches compilations, and a cache hit skips ptxas and so prints no resource report.
    no_cache = ["--no-cache"] if nvrtc_version() >= (12, 9) else []
    opts = [f"--gpu-architecture=sm_{arch}", *BASE_OPTIONS, "--ptxas-options=-v", *no_cache,
            *(f"-I{d}" for d in _include_dirs(path)), f"-I{_runtime_include()}",
            *_define_options(defines), *options]
    prog = nvrtc.createProgram(code, _display_name(path), (), ())
    lowered = {}
    try:
        for expr in name_expressions:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, tuple(opts))
            ok = True
        except nvrtc.NVRTCError:
            ok = False
        log = nvrtc.getProgramLog(prog).rstrip("\x00 \n")
        if ok:
            lowered = {nvrtc.getLoweredName(prog, expr): expr for expr in name_expressions}
    finally:
        nvrtc.destroyProgram(prog)
    if not ok:
        raise KernelCompileError(_explain(log, f"{_display_name(path)} (sm_{arch})"))
    report = CompileReport(_display_name(path), arch, dict(defines or {}), log=log)
    # NVRTC warns that archs before sm_75 are deprecated; that is a fact of the arch list, not of the code.
    report.warnings = [ln for ln in log.splitlines()
                       if "warning" in ln and "deprecated" not in ln and not ln.startswith("ptxas info")]
    for m in _PTXAS_USED.finditer(log):
        name = lowered.get(m[1], m[1])
        report.kernels[name] = KernelResources(name, registers=int(m[2]), shared_bytes=int(m[3] or 0))
    for m in _PTXAS_FUNC.finditer(log):
        name = lowered.get(m[1], m[1])
        k = report.kernels.setdefault(name, KernelResources(name))
        k.stack_bytes, k.spill_stores, k.spill_loads = int(m[2]), int(m[3]), int(m[4])
    missing = [e for e in name_expressions if e not in report.kernels]
    if missing:
        raise KernelCompileError(f"{_display_name(path)} (sm_{arch}): no kernel was compiled for {missing}; "
                                 f"is each a __global__ template instantiation of this file?")
    if "__global__" in code and not report.kernels:
        raise RuntimeError(f"NVRTC {version} compiled {_display_name(path)} "
                           f"for sm_{arch} but gave no ptxas resource report; its log was: {log!r}")
    return report


def supported_archs() -> tuple:
    """The sm_XX numbers the loaded NVRTC can target (CUDA 12's has sm_70 .. sm_90; CUDA 13 dropped sm_70)."""
    return tuple(int(a) for a in _nvrtc().getSupportedArchs())


def kernel_source(path: str | os.PathLike, name: str) -> str:
    """The text of one kernel or device function (with its `template <...>` line and the comment block above
    it) from a `.cu` file, for notebooks to show."""
    lines = resolve(path).read_text().splitlines()
    qualifier = re.compile(r"__global__|__device__")
    start = next((i for i, ln in enumerate(lines) if re.search(rf"\b{re.escape(name)}\s*\(", ln)
                  and not ln.rstrip().endswith(";")            # a declaration or a call, not the definition
                  and qualifier.search(" ".join(lines[max(0, i - 1):i + 1]))), None)
    if start is None:
        raise KeyError(f"kernel or device function {name!r} not found in {path}")
    if not qualifier.search(lines[start]):
        start -= 1
    first = start
    if first > 0 and lines[first - 1].lstrip().startswith("template"):
        first -= 1
    while first > 0 and lines[first - 1].lstrip().startswith("//"):
        first -= 1
    depth, end, opened = 0, start, False
    for end in range(start, len(lines)):
        depth += lines[end].count("{") - lines[end].count("}")
        opened = opened or "{" in lines[end]
        if opened and depth == 0:
            break
    return "\n".join(lines[first:end + 1])


MAX_SHOWN_LINES = 80     # a printed block a learner can read on one screen


def _print_block(text: str, what: str) -> None:
    n = text.count("\n") + 1
    if n > MAX_SHOWN_LINES:
        raise ValueError(f"{what} is {n} lines; a notebook shows at most {MAX_SHOWN_LINES}: show fewer kernels, "
                         "a diff (show_diff) or an excerpt (show_excerpt)")
    print(text)


def show_source(path: str | os.PathLike, *names: str, header: bool = True) -> None:
    """Print a `.cu` file's header comment (what it teaches, its numbered versions), then the named kernels or
    device functions (`kernel_source`): what a notebook shows instead of a whole file. At most 80 lines."""
    lines = resolve(path).read_text().splitlines()
    head = []
    for ln in lines if header else ():
        if not ln.startswith("//"):
            break
        head.append(ln)
    parts = (["\n".join(head)] if head else []) + [kernel_source(path, name) for name in names]
    _print_block("\n\n".join(parts), f"{_display_name(resolve(path))}: {', '.join(names) or 'header'}")


def show_diff(path: str | os.PathLike, old: str, new: str, context: int = 2) -> None:
    """Print what kernel `new` adds to kernel `old` of the same `.cu` file, as a unified diff (`-` lines leave,
    `+` lines arrive): one idea more per version, without printing the whole kernel again."""
    import difflib
    a, b = kernel_source(path, old).splitlines(), kernel_source(path, new).splitlines()
    diff = difflib.unified_diff(a, b, fromfile=old, tofile=new, n=context, lineterm="")
    _print_block("\n".join(diff), f"diff {old} -> {new}")


def show_excerpt(path: str | os.PathLike, start: str, end: str | None = None, max_lines: int = MAX_SHOWN_LINES) -> None:
    """Print the lines of a source file from the first line containing `start` through the next line containing
    `end` (or `max_lines` lines), numbered as in the file: a part of a kernel too large to show whole."""
    p = resolve(path)
    lines = p.read_text().splitlines()
    first = next((i for i, ln in enumerate(lines) if start in ln), None)
    if first is None:
        raise KeyError(f"no line containing {start!r} in {_display_name(p)}")
    last = first + max_lines - 1
    if end is not None:
        last = next((i for i in range(first + 1, len(lines)) if end in lines[i]), None)
        if last is None:
            raise KeyError(f"no line containing {end!r} after {start!r} in {_display_name(p)}")
    body = "\n".join(f"{i + 1:4d}  {lines[i]}" for i in range(first, min(last + 1, len(lines))))
    _print_block(f"// {_display_name(p)}, lines {first + 1}-{min(last + 1, len(lines))}\n" + body,
                 f"excerpt of {_display_name(p)}")
