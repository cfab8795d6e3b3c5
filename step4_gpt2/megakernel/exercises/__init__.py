"""Lesson 4c's exercises (the megakernel): what common.exercises.check runs for each stub in this folder (see
step1's for the shape).

Exercise 4c.1, `step4/handoff`: one block hands a payload to another inside one launch, release on the
producer's side, a bounded acquire spin on the consumer's, and an error flag the host reads: the hop the
megakernel makes between its stages, alone. The check runs it many times with many pairs of blocks at once
(every payload must arrive whole and fresh, no consumer may give up) and once with no producer at all (every
consumer must give up and say so, within its bounded number of tries: nothing hangs)."""
from __future__ import annotations

import numpy as np

from common.exercises import Exercise, Out

HERE = "step4_gpt2/megakernel/exercises"
PAYLOAD = 1024        # ints per handoff (4 KB), as in lesson 1d
BLOCK = 256           # threads per block, producers and consumers alike
MAX_TRIES = 1 << 18   # reads of the flag before a consumer gives up (a fraction of a second on any GPU)
SEQ_STRIDE = 1000003  # payload_value in handoff.cu: seq * SEQ_STRIDE + p * PAYLOAD + k


def _pairs(p) -> int:
    """The case's pairs; "per_sm": one pair per SM, i.e. two blocks on each SM, all resident at once."""
    if p["pairs"] == "per_sm":
        from common.device import device_info
        return device_info()["multiprocessors"]
    return p["pairs"]


def _handoff_make(p, rng):
    pairs, trials = _pairs(p), p["trials"]
    return {"received": Out((trials, pairs, PAYLOAD), np.int32), "status": Out((trials, pairs), np.int32),
            "pairs": pairs, "trials": trials, "producers": int(p.get("producers", True))}


def _handoff_ref(h):
    pairs, trials = h["pairs"], h["trials"]
    if not h["producers"]:      # nothing arrives: every consumer gives up (1) and copies nothing (-1 stays)
        return {"received": np.full((trials, pairs, PAYLOAD), -1.0), "status": np.ones((trials, pairs))}
    seq = np.arange(1, trials + 1, dtype=np.float64)[:, None, None]
    p = np.arange(pairs, dtype=np.float64)[None, :, None]
    k = np.arange(PAYLOAD, dtype=np.float64)[None, None, :]
    return {"received": seq * SEQ_STRIDE + p * PAYLOAD + k, "status": np.zeros((trials, pairs))}


def _resident(kernel) -> int:
    from common.device import device_info
    from common.kernels import occupancy
    return occupancy(kernel, BLOCK)["blocks_per_sm"] * device_info()["multiprocessors"]


def _handoff_launch(kern, a):
    """`trials` launches, seq = 1, 2, ...: launch t writes received[t - 1] and status[t - 1]. The flags start at
    0 once and count up; the payload buffer is shared by the launches (a stale read finds the launch before's
    numbers). Without producers the grid is the consumers alone."""
    import cupy as cp
    pairs, trials = a["pairs"], a["trials"]
    k = kern("handoff")
    blocks = 2 * pairs if a["producers"] else pairs
    if blocks > _resident(k):
        print(f"step4/handoff: {blocks} blocks must run at once, and this GPU holds {_resident(k)} of your kernel's "
              f"blocks: not launched (use fewer registers?)")
        return
    flags = cp.zeros(pairs, cp.int32)
    payloads = cp.full(pairs * PAYLOAD, -7, cp.int32)     # never a payload value
    for t in range(trials):
        k((blocks,), (BLOCK,), (flags, payloads, a["received"][t], a["status"][t], np.int32(pairs), np.int32(t + 1),
                                np.int32(MAX_TRIES)))


EXERCISES = [
    Exercise(
        id="step4/handoff", title="a release/acquire handoff between two blocks, with a bounded spin and an error flag",
        teaches="release (payload, barrier, flag) and acquire (bounded spin, barrier, payload); a wait that gives up "
                "and says so",
        stub=f"{HERE}/handoff.cu", kernels=("handoff",), defines={"PAYLOAD": PAYLOAD}, make=_handoff_make,
        launch=_handoff_launch, reference=_handoff_ref, outputs=("received", "status"), rtol=0.0, atol=0.0,
        cases=(("1 pair, 4 launches", {"pairs": 1, "trials": 4}),
               ("7 pairs, 16 launches", {"pairs": 7, "trials": 16}),
               ("one pair per SM (2 blocks on each), 16 launches", {"pairs": "per_sm", "trials": 16}),
               ("3 pairs, the producers never launched: every consumer gives up", {"pairs": 3, "trials": 2,
                                                                                    "producers": False}))),
]
