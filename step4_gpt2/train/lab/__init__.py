"""Lesson 4b's lab: the experiments behind the training step's choices, kept apart from what the notebook
teaches. Each wraps, subclasses or recompiles the mainline (step4_gpt2.train) and changes one thing:

    variants.py    the step with the weight gradients on the pass's own stream (OneStreamGPT), and its CUDA
                   graph with cuBLAS's memsets left where the capture put them (MemsetsInPlaceTrainer)
    split_k.py     weight gradients split over the rows by hand ("split-K"), against cuBLAS's single GEMM
    tf32_split.py  attention v3 with the other ways to split an operand into TF32 parts (attention_tc.cu's
                   TF32_SPLIT), and their benchmark rows
    timeline.py    the profiler's timeline of the step's CUDA graph: idle gaps, each kernel's time

step4_gpt2.train.benchmarks measures them beside the mainline; tests/step4/test_step4_train_lab.py tests them.
"""
