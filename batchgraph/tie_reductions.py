"""Whole-tensor ``max``, ``min``, ``median`` and ``nanmedian`` (no ``dim``), batched with
eager's gradient.

Eagerly the backward of ``x.max()`` (and of ``min``, ``median``, ``nanmedian`` without a
dim) spreads the gradient evenly over every element equal to the result (torch's
``evenly_distribute_backward``; over the NaNs where the result is NaN), where the dim
forms, and ``vmap`` of the whole-tensor form, give it all to one element. Through
``vmap`` the per-example ``h.max()`` of a value with ties got another gradient than
eagerly, silently: ``[[1, 2, 2], [2, 0, 2]]`` gave ``[0, 1, 0, ...]`` where eager code
gives ``0.25`` to each 2. ``EvenReductionKey`` reduces each example's flattened row with
the dim form (same values) and spreads its gradient as eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from batchgraph.keys import BatchKey

__all__ = ["EVEN_REDUCTIONS", "EvenReductionKey"]

# Called with the tensor alone, these reduce it whole and spread their gradient evenly.
EVEN_REDUCTIONS: frozenset[Any] = frozenset(
    {
        torch.max, torch.min, torch.median, torch.nanmedian, torch.Tensor.max,
        torch.Tensor.min, torch.Tensor.median, torch.Tensor.nanmedian,
    }
)


class _EvenlySpread(torch.autograd.Function):
    """``values`` (one per row of ``flat``), whose gradient goes in equal parts to the
    elements of the row equal to its value (to its NaNs where the value is NaN)."""

    @staticmethod
    def forward(flat: torch.Tensor, values: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return values.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        flat, values = inputs
        column = values.unsqueeze(1)
        ctx.mask = torch.where(column.isnan(), flat.isnan(), flat == column)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        mask = ctx.mask
        # grad / count, as eagerly; where, not a product: an infinite grad leaves the
        # other elements at 0 (masked_fill eagerly).
        share = grad.unsqueeze(1) / mask.sum(1, keepdim=True)
        return torch.where(mask, share, torch.zeros((), dtype=share.dtype)), None


class EvenReductionKey(BatchKey):
    """A whole-tensor ``max``/``min``/``median``/``nanmedian`` (``h.max()``): each
    example's row, flattened, reduced by the dim form, with eager's gradient.

    Example:
        >>> import batchgraph as bg, torch
        >>> x = torch.tensor([[1.0, 2.0, 2.0], [2.0, 0.0, 2.0]], requires_grad=True)
        >>> with bg.BatchingPolicy():
        ...     hs = [bg.batched_value(x).max(), bg.batched_value(x * 2).max()]
        >>> bg.compute(hs)[0].backward()
        >>> x.grad                        # as x.max().backward() gives it
        tensor([[0.0000, 0.2500, 0.2500],
                [0.2500, 0.0000, 0.2500]])
    """

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        flat = inputs[0].reshape(size, -1)
        values = fn(flat, dim=1).values
        if not values.requires_grad:
            return values
        spread: torch.Tensor = _EvenlySpread.apply(flat, values.detach())  # type: ignore[no-untyped-call]
        return spread
