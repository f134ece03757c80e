"""Weightless stand-ins for a model's tensors, as a DataLoader worker's model holds them.

``structure.load_structure`` gives every parameter and buffer a placeholder of the
right shape and dtype that costs 8 bytes (see ``structure._placeholder``); the binder
in the main process reads the live tensors in their place. Placeholders are marked
with an attribute so that the recording (``graph.constant_signature``: never merged by
value) and the exporter (``portable``: a view of one is refused) can tell them apart,
and this module has no imports of the package so that both can.
"""

from __future__ import annotations

import torch

__all__ = ["PLACEHOLDER_ATTR", "is_placeholder"]

# Set on every placeholder.
PLACEHOLDER_ATTR = "_batchgraph_placeholder"


def is_placeholder(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``load_structure`` placeholder, or a view of one.

    Example:
        >>> from batchgraph.structure import load_structure, model_structure
        >>> lin = load_structure(model_structure(torch.nn.Linear(2, 3)))
        >>> is_placeholder(lin.weight), is_placeholder(lin.weight[0]), is_placeholder(torch.ones(2))
        (True, True, False)
    """
    if getattr(tensor, PLACEHOLDER_ATTR, False):
        return True
    base = tensor._base
    return base is not None and getattr(base, PLACEHOLDER_ATTR, False)
