"""The course's one shared module: kernels, timing, checks, references, plots, device info.

Everything a notebook needs is importable from here:

    from common import load_module, bench, assert_close, poison, reference
"""
from common.device import (gpu_available, device_info, require_gpu, require_arch, skip_reason, torch_cuda,
                           fp32_peak_tflops, memory_left)
from common.kernels import (load_module, get_kernel, occupancy, allow_dynamic_smem, compile_offline, kernel_source,
                            show_source, show_diff, show_excerpt, KernelCompileError, ARCHS)
from common.graphs import capture_graph, stream_priorities
from common.check import (assert_close, errors, max_rel_error, poison, rand, expect_array, expect_choice, out_array,
                          expect_int, expect_token_ids,
                          launch_grid, float4_rows, null_or)
from common.timing import bench, Timing, copy_bandwidth, faster
from common.profile import profile, Profile
from common import reference
from common.device import install_notebook_handler as _install_notebook_handler

_install_notebook_handler()    # in a notebook: no misleading CUDA error after the course's no-GPU message

__all__ = [
    "gpu_available", "device_info", "require_gpu", "require_arch", "skip_reason", "torch_cuda", "fp32_peak_tflops", "memory_left",
    "load_module", "get_kernel", "capture_graph", "stream_priorities", "occupancy", "allow_dynamic_smem",
    "compile_offline", "kernel_source", "show_source", "show_diff", "show_excerpt", "KernelCompileError", "ARCHS",
    "assert_close", "errors", "max_rel_error", "poison", "rand", "expect_array", "expect_choice", "expect_token_ids",
    "expect_int", "out_array", "launch_grid", "float4_rows", "null_or",
    "bench", "Timing", "copy_bandwidth", "faster", "profile", "Profile", "reference",
]
