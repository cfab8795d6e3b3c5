"""The course's fused kernels inside PyTorch: ops.py makes lesson 4b's kernels torch custom operators (autograd,
torch.compile and CUDA graphs see them as ops of their own), model.py builds nanoGPT's model on them, train.py
trains it on Shakespeare. Named torch_ops, not torch, so that `import torch` still finds PyTorch. Needs PyTorch
with CUDA to run, and only PyTorch to import (the shapes and checks work on the CPU)."""
