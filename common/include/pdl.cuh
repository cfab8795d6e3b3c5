// pdl.cuh - programmatic dependent launch (PDL), the kernel's side: two PTX instructions of sm_90 and newer.
//
// In a stream (or a captured graph) a kernel normally starts only once the kernel before it has finished and
// its writes are visible: between the two, the GPU drains the last blocks of one and launches the first
// blocks of the next, a few microseconds in which little runs. A kernel launched with the launch attribute
// PROGRAMMATIC_STREAM_SERIALIZATION (step4_gpt2/pdl.py: launch_pdl) may start before that. Its blocks can then
// do the work that needs nothing from the kernel before it (index math, loading weights, which no kernel
// writes), and must wait before the rest:
//
//   pdl_wait()               griddepcontrol.wait (cudaGridDependencySynchronize() in CUDA C++): returns once
//                            the kernel this one depends on has completed and its writes are visible.
//   pdl_launch_dependents()  griddepcontrol.launch_dependents (cudaTriggerProgrammaticLaunchCompletion()):
//                            this block no longer holds up the start of the next kernel. The next kernel may
//                            start once every block has said so or exited; without it, once all have exited.
//
// The rules, for every thread of a kernel launched that way:
//   - call pdl_wait() before the first read of anything an earlier kernel writes, before the first write to
//     global memory (an earlier kernel may still be reading that buffer) and before returning: a kernel that
//     ends without waiting could complete before the one it depends on, and the next kernel, which waits only
//     for its own predecessor, would then run ahead of both;
//   - pdl_launch_dependents() may come anywhere: the next kernel's pdl_wait() still waits for all of this one.
// Before sm_90 both compile to nothing, and a kernel launched without the attribute returns from pdl_wait()
// at once, so a kernel written this way is correct under any launch.
#pragma once

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");      // "memory": no load may move above it
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
