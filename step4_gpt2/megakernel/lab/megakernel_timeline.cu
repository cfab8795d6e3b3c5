// megakernel_timeline.cu - the lab's timeline build of the decode megakernel (v1 or v2, by MK_VERSION): thread 0
// of each block stamps %globaltimer when a stage starts, when its inputs are ready (after the barrier or the
// counter wait) and when its tile is done, into timeline[(block, stage, 3)] (the kernel's last argument).
// The stamps are the only change: the kernel is the mainline's, included below with MK_STAMP defined.
#ifndef MK_VERSION
#define MK_VERSION 2
#endif
struct Ctl;
__device__ __forceinline__ void timeline_stamp(const Ctl& ctl, int idx, int which);
#define MK_STAMP(ctl, idx, which) timeline_stamp(ctl, idx, which)
#if MK_VERSION == 1
#include "../megakernel_v1.cu"
#else
#include "../megakernel_v2.cu"
#endif

__device__ __forceinline__ void timeline_stamp(const Ctl& ctl, int idx, int which) {
    if (threadIdx.x == 0) ctl.timeline[((long long)blockIdx.x * ctl.stamps_per_block + idx) * 3 + which] = globaltimer();
}
