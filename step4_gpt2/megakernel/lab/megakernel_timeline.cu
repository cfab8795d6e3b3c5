// megakernel_timeline.cu - the lab's timeline build of the decode megakernel (v1 or v2, by MK_VERSION): thread 0
// of each block stamps %globaltimer when a stage starts, when its inputs are ready (after the barrier or the
// counter wait) and when its tile is done, into mk_timeline.stamps[(block, stage, 3)].
// The stamps are the only change: the kernel is the mainline's, included below with MK_STAMP defined.
#ifndef MK_VERSION
#define MK_VERSION 2
#endif
#include "course.cuh"                   // globaltimer()

// Where the stamps go: (grid, stamps_per_block = nsteps * STAGES_PER_STEP, 3). The host writes it into this
// module's symbol on the launch's stream before each launch (lab/decoder.py). Constant memory: a stamp reads
// it from the constant cache, as it would a kernel argument; a global would be re-read through L1, which
// every acquire of a counter wait empties, and each stamp would then cost an L2 round trip.
struct MkTimeline {
    unsigned long long* stamps;
    long long stamps_per_block;
};
__constant__ MkTimeline mk_timeline;

__device__ __forceinline__ void timeline_stamp(int idx, int which) {
    if (threadIdx.x == 0)
        mk_timeline.stamps[((long long)blockIdx.x * mk_timeline.stamps_per_block + idx) * 3 + which] = globaltimer();
}
#define MK_STAMP(idx, which) timeline_stamp(idx, which)

#if MK_VERSION == 1
#include "../megakernel_v1.cu"
#else
#include "../megakernel_v2.cu"
#endif
