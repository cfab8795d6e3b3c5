"""Lesson 4c's lab: the megakernel's measurements and experiments, apart from what the notebook reads.

- decoder.py   LabMegakernelDecoder: the mainline decoder with its measurement builds and test hooks (the
               in-kernel timeline, weights kept in L2, other block sizes and unrolls, a capped grid, a block
               that never signals); the timeline's breakdown and Gantt chart
- floor.py     a model whose every layer is layer 0: what is left of a step when the weights cost nothing
- hops.py      hops.cu: what one hop between blocks, a grid-wide barrier and an L2 round trip cost
The .cu builds (megakernel_timeline.cu, megakernel_stall.cu, megakernel_keep_l2.cu) include the mainline's
version files and define its compile-time hooks (MK_STAMP, MK_SIGNALS, MK_WEIGHT_LOADS); the mainline kernel
takes no argument for them. step4_gpt2/megakernel/benchmarks.py and tests/step4/test_step4_megakernel_lab.py
use them.
"""
