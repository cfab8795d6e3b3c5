"""The floor of the megakernel: a model whose every layer is layer 0 (tied_layers), whose one layer's weights
fit in L2, decoded with the layers' weights kept there (LabMegakernelDecoder(keep_layers_in_l2=True)): what is
left of a step when the layer weights cost no DRAM traffic (benchmarks.floor_rows measures it)."""
from __future__ import annotations


def tied_layers(model):
    """A shallow copy of `model` whose every layer is layer 0 (the same arrays; each layer keeps its own KV
    cache). Not GPT-2 any more, but the same shapes and the same kernels, with one layer's weights (28 MB for
    the 124M shape) read twelve times per step. L2 keeps only part of them between layers while the weights
    stream evict-first; a megakernel built with keep_layers_in_l2 loads them evict-last, so L2 keeps them all
    where they fit (tied_fits_l2) and only the LM head streams from DRAM."""
    import copy
    tied = copy.copy(model)
    tied.__dict__.pop("_kept_decoder", None)
    tied.h = [model.h[0]] * model.config.n_layer
    return tied


def tied_fits_l2(model) -> bool:
    """Whether one layer's weights fit in this GPU's L2 with room to spare (1.5x), as the floor assumes."""
    from common import device_info
    C = model.config.n_embd
    return 1.5 * 4 * 12 * C * C <= device_info()["l2_bytes"]
