"""Embedding lookups whose gradients are per example: ``padding_idx`` and
``scale_grad_by_freq``.

Eagerly, an embedding's weight gets no gradient at ``padding_idx``, and with
``scale_grad_by_freq`` each row's gradient is divided by how often the example's own
indices hold it. Batched, both went wrong silently:

* ``nn.Embedding(scale_grad_by_freq=True)`` stacked the examples' indices into one
  call, which counted each row over the whole batch (``EmbeddingFreqKey``);
* ``F.embedding(ids, weight, padding_idx=p)`` with the weight a per-example input ran
  through vmap, whose rule flattens the examples' weights into one table and pads
  only the first example's row ``p``: the others' padding positions trained it
  (``PaddedEmbeddingKey``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from batchgraph.keys import StackKey, VmapKey
from batchgraph.specs import CallSignature, InputSlot

__all__ = ["EmbeddingFreqKey", "PaddedEmbeddingKey", "per_example_counts"]


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose gradient is multiplied by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad * scale, None


def per_example_counts(indices: torch.Tensor) -> torch.Tensor:
    """For each index of a ``(B, ...)`` batch, how often its example holds it.

    Example:
        >>> per_example_counts(torch.tensor([[1, 1, 2], [1, 3, 3]]))
        tensor([[2, 2, 1],
                [1, 2, 2]])
    """
    flat = indices.reshape(indices.shape[0], -1).long()
    if not flat.numel():
        return torch.ones_like(indices, dtype=torch.long)
    span = int(flat.max()) + 1
    offset = flat + torch.arange(flat.shape[0], device=flat.device)[:, None] * span
    counts = torch.bincount(offset.reshape(-1), minlength=flat.shape[0] * span)
    return counts[offset].reshape(indices.shape)


class EmbeddingFreqKey(StackKey):
    """``nn.Embedding(scale_grad_by_freq=True)``: the examples' indices in one lookup,
    each position's gradient divided by its count in its own example (stacked, the
    lookup counted it over the batch)."""

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        assert isinstance(fn, nn.Embedding)  # chosen for these only (batchgraph.rules)
        indices = inputs[0]
        out = F.embedding(indices, fn.weight, fn.padding_idx, fn.max_norm, fn.norm_type,
                          False, fn.sparse)
        # Read now, as the module's forward reads it: the key is kept per signature.
        if not (out.requires_grad and fn.scale_grad_by_freq):
            return out
        scale = per_example_counts(indices).to(out.dtype).reciprocal().unsqueeze(-1)
        scaled: torch.Tensor = _ScaleGrad.apply(out, scale)  # type: ignore[no-untyped-call]
        return scaled


class PaddedEmbeddingKey(VmapKey):
    """``F.embedding`` with a ``padding_idx``: run through vmap without it, then the
    padding positions' values kept out of autograd (as eagerly, the weight's padding
    row gets no gradient; its values are looked up as any row's)."""

    def __init__(self, fn: Callable[..., Any], call: CallSignature, *, deterministic: bool = True):
        super().__init__(fn, call.with_arg(2, "padding_idx", None), deterministic=deterministic)
        self.call = call  # the identity, and what errors show, are the call's own
        indices, weight = call.static_arg(0, "input", None), call.static_arg(1, "weight", None)
        padding = call.static_arg(2, "padding_idx", None)
        spec = call.input_specs[weight.slot] if type(weight) is InputSlot else None
        rows = spec.shape[0] if spec is not None else 0
        self._slot = indices.slot if type(indices) is InputSlot else None
        self._padding = padding + rows if isinstance(padding, int) and padding < 0 else padding

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        out = super().run(fn, inputs, size)
        if self._slot is None or not isinstance(out, torch.Tensor) or not out.requires_grad:
            return out
        padded = (inputs[self._slot] == self._padding).unsqueeze(-1)
        return torch.where(padded, out.detach(), out)
