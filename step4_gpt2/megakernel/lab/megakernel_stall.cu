// megakernel_stall.cu - the lab's stall build of the decode megakernel (v1 or v2, by MK_VERSION): block
// MK_STALL_BLOCK never signals (no counter it should add to moves), so every other block's wait for it times
// out. The test of the timeout path: the kernel reports (err[]) and ends instead of hanging, and the decoder
// raises MegakernelTimeout and recovers. The kernel is otherwise the mainline's, included below.
#ifndef MK_VERSION
#define MK_VERSION 2
#endif
#ifndef MK_STALL_BLOCK
#error "MK_STALL_BLOCK: the block that never signals (lab/decoder.py passes it)"
#endif
#define MK_SIGNALS() ((int)blockIdx.x != MK_STALL_BLOCK)

#if MK_VERSION == 1
#include "../megakernel_v1.cu"
#else
#include "../megakernel_v2.cu"
#endif
