"""Lesson 4e: past one GPU - 4b's GPT trained on several GPUs through NCCL (04e_multi_gpu.ipynb).

comm.py: one rank's collectives (NCCL through CuPy; one-rank and CPU stand-ins); launch.py: one process per GPU
(spawn) or per launcher slot (from_env); data_parallel.py: data parallelism and ZeRO-1; tensor_parallel.py:
Megatron-style tensor parallelism and its napkin math. `python -m step4_gpt2.parallel --help` trains from the
command line."""
from step4_gpt2.parallel.comm import Comm, CommError, CpuComm, CpuGroup, LocalComm  # noqa: F401
from step4_gpt2.parallel.launch import LaunchError, from_env, spawn  # noqa: F401
