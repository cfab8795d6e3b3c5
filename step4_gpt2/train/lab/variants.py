"""Lab: the training step with one of its choices undone, to measure what the choice is worth.

    OneStreamGPT            the weight gradients on the pass's own stream (the mainline runs them on a second
                            stream, beside the rest of the backward pass)
    MemsetsInPlaceTrainer   the step's CUDA graph with cuBLAS's memsets where the capture put them (the mainline
                            makes each wait only for the previous cuBLAS call: common.graphs)
    capture_graph_memsets_in_place(fn, stream)   common.capture_graph without that edit

Both give the mainline's bits (tests/step4/test_step4_train_lab.py checks it); step4_gpt2.train.benchmarks times them.
"""
from __future__ import annotations

from step4_gpt2.train.model import TrainGPT
from step4_gpt2.train.train import Trainer


class OneStreamGPT(TrainGPT):
    """TrainGPT whose backward pass runs the weight gradients on the current stream, after each dx."""

    def _weight_grad_stream(self):
        return None


def capture_graph_memsets_in_place(fn, stream=None, node_priority: bool = False):
    """common.capture_graph(fn, stream, node_priority) with cuBLAS's memsets left where the capture put them:
    a CapturedGraph (hoisted = 0) with node_priority, else CuPy's graph."""
    from common.graphs import CapturedGraph, record_graph
    graph, _ = record_graph(fn, stream)
    return CapturedGraph(graph, node_priority, 0) if node_priority else graph


class MemsetsInPlaceTrainer(Trainer):
    """Trainer whose step graph (graph=True) keeps cuBLAS's memsets where the capture put them."""

    def _capture(self, fn, stream):
        return capture_graph_memsets_in_place(fn, stream, node_priority=True)
