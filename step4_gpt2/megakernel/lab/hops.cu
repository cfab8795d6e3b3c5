// hops.cu - what one hop between blocks costs: the unit of the decode megakernel's critical path.
//
// The megakernel (../megakernel_v2.cu) runs a layer as four stages on every SM; between two stages the data goes
// from the blocks that made it to the blocks that read it through L2, announced by a counter. However the
// weights are streamed, a layer cannot be shorter than its chain of such hops and of the dependent loads
// inside each stage. Three measurements (not versions: each times a different thing), each a loop of
// `rounds` repetitions timed with %globaltimer inside one launch (no launch cost in them):
//
//   (a) hop_pingpong  two blocks on different SMs hand a counter back and forth (red.release, then the other
//                     polls with ld.acquire): the latency of one hop from one block to one other, the
//                     attention's wait for its head's q/k/v rows.
//   (b) hop_all       every block adds one to a counter and waits until all have (a grid-wide barrier): one
//                     hop from every block to every block, the megakernel v1's barrier and v2's waits for the
//                     attention projection and the MLP (whose consumers need every block's rows).
//   (c) l2_chase      one thread follows a chain of dependent loads through a table that stays in L2
//                     (__ldcg): one L2 round trip, the step every hop and every dependent load is made of.
//
// Nothing hangs: every poll is bounded by timeout_ns of %globaltimer; a block that times out writes 1 and
// where it was to err[] and leaves (the host raises). Every block must be resident: the host launches one
// small block per SM. The ping-pong runs on block 0 and the last block (the others leave at once), and
// reports both blocks' SMs so the host can check that the hop crossed between two.
#include "course.cuh"

// Poll until *ctr >= target; false (and err[] set) after timeout_ns or once another block reported.
__device__ bool spin_until(const unsigned* ctr, unsigned target, long long timeout_ns, int* err, int round) {
    const unsigned long long t0 = globaltimer();
    for (unsigned it = 0;; ++it) {
        if ((int)(ld_acquire(ctr) - target) >= 0) return true;
        if ((it & 15) == 15) {
            if (*(volatile int*)err) return false;
            if ((long long)(globaltimer() - t0) > timeout_ns) {
                if (atomicCAS(err, 0, 1) == 0) { err[1] = blockIdx.x; err[2] = round; }
                return false;
            }
        }
    }
}

__device__ __forceinline__ unsigned smid() {
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}

// (a): block 0 and the last block take turns. Round 0 is a handshake (the other block may start later); then
// out[0] = ns for the next `rounds` round trips (2 hops each), out[1], out[2] = the two blocks' SMs.
extern "C" __global__ void hop_pingpong(unsigned* ctr, int rounds, long long timeout_ns, int* err,
                                        unsigned long long* out) {
    const bool ping = blockIdx.x == 0, pong = blockIdx.x == gridDim.x - 1;
    if (threadIdx.x != 0 || !(ping || pong) || gridDim.x < 2) return;
    unsigned* to_pong = ctr;
    unsigned* to_ping = ctr + 32;                  // another 128-byte line: the two sides do not share one
    out[ping ? 1 : 2] = smid();
    unsigned long long t0 = 0;
    for (int i = 0; i <= rounds; ++i) {
        if (ping) {
            if (i == 1) t0 = globaltimer();
            red_release(to_pong, 1u);
            if (!spin_until(to_ping, i + 1, timeout_ns, err, i)) return;
        } else {
            if (!spin_until(to_pong, i + 1, timeout_ns, err, i)) return;
            red_release(to_ping, 1u);
        }
    }
    if (ping) out[0] = globaltimer() - t0;
}

// (b): `rounds` grid-wide barriers, each a block barrier, one release add per block and a poll for all of them;
// out[block] = ns for all the rounds, as this block saw them.
extern "C" __global__ void hop_all(unsigned* ctr, int rounds, long long timeout_ns, int* err,
                                   unsigned long long* out) {
    __shared__ int ok;
    const unsigned long long t0 = globaltimer();
    for (int i = 0; i < rounds; ++i) {
        __syncthreads();
        if (threadIdx.x == 0) {
            red_release(ctr, 1u);
            ok = spin_until(ctr, gridDim.x * (unsigned)(i + 1), timeout_ns, err, i);
        }
        __syncthreads();
        if (!ok) return;
    }
    if (threadIdx.x == 0) out[blockIdx.x] = globaltimer() - t0;
}

// (c): j = next[j], `rounds` times; out[0] = ns, out[1] = the last j (so the chain is not optimised away).
extern "C" __global__ void l2_chase(const unsigned* next, int rounds, unsigned long long* out) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    unsigned j = 0;
    const unsigned long long t0 = globaltimer();
    for (int i = 0; i < rounds; ++i) j = __ldcg(next + j);
    out[0] = globaltimer() - t0;
    out[1] = j;
}
