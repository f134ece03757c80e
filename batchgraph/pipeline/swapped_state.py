"""The parameters and buffers a pipeline check swaps into a stage (meta copies, or the
real ones) with ``torch.func.functional_call``.

A block reachable by two names in one stage (``nn.Sequential(block, block)``, layers
sharing one block) broke the checks: ``named_parameters()`` names its tensors once, and
``functional_call`` (``tie_weights=True``) swapped them under both names, saving the
second name's "original" after the first swap had put the meta copy there, and put
that back: the block's parameters were left on meta, and the first step failed
("Tensor on device meta is not on the expected device cpu"). :func:`swapped_state`
names each module's tensors once per module, a tensor tied between two modules under
each (one copy for both, so the tie holds), for a ``functional_call`` with
``tie_weights=False``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["swapped_state"]


def swapped_state(module: nn.Module, meta: bool = True) -> dict[str, Tensor]:
    """``module``'s parameters and buffers by name, one name per module holding them,
    as meta copies (``meta``) or as they are.

    Example:
        >>> block, head = nn.Linear(2, 2), nn.Linear(2, 2)
        >>> head.weight = block.weight  # tied
        >>> state = swapped_state(nn.Sequential(block, block, head))
        >>> sorted(state), state["0.weight"] is state["2.weight"], state["0.bias"].device
        (['0.bias', '0.weight', '2.bias', '2.weight'], True, device(type='meta'))
    """
    copies: dict[int, Tensor] = {}
    state: dict[str, Tensor] = {}
    for prefix, m in module.named_modules():  # each module once, by its first name
        for name, t in [*m._parameters.items(), *m._buffers.items()]:
            if t is None:
                continue
            if meta and id(t) not in copies:
                copies[id(t)] = torch.empty_like(t, device="meta")
            state[f"{prefix}.{name}" if prefix else name] = copies[id(t)] if meta else t
    return state
