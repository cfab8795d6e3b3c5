"""Lesson 4b: train a GPT-2 on Shakespeare with the course's own kernels (04b_train_gpt.ipynb): the model and
its backward pass (model.py, ops.py, the .cu files), the trainer (train.py); lab/ holds the experiments."""
