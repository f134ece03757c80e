"""Values handed out to the caller: copies of stored values (a store is shared by
every row of a batch, and by calls still to read it), with the history the eager
value would have, whatever grad or inference mode the caller reads in."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["own_copy", "private_rows", "reading"]


def reading(column: Any) -> contextlib.AbstractContextManager[Any]:
    """Where rows of ``column``, a computed value, are taken for the caller: with grad
    on and outside inference mode when it has history, so that its rows keep it, as
    the eager value would, whatever mode the caller reads in (a view taken under
    no_grad or in inference mode has none); in the caller's mode otherwise."""
    if getattr(column, "requires_grad", False) and (
        not torch.is_grad_enabled() or torch.is_inference_mode_enabled()
    ):
        return _handing_out()
    return contextlib.nullcontext()


def _handing_out() -> contextlib.AbstractContextManager[Any]:
    if torch.is_inference_mode_enabled():
        return torch.inference_mode(False)  # which also turns grad on
    return torch.enable_grad()


def private_rows(column: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The rows of a copy of ``column``, a stored value, for handing out many at once
    (one copy for all; see ``Graph.leaf_value`` for why a copy). A row that several
    handles stand for (a merged node) is copied again for each (``own_copy``).

    Example:
        >>> stored = torch.zeros(2, 3)
        >>> rows = private_rows(stored)
        >>> rows[0].add_(1); stored.sum().item()
        tensor([1., 1., 1.])
        0.0
    """
    copy = own_copy(column)
    with reading(copy):
        if copy.requires_grad:
            # unbind's rows are outputs of one multi-view call: autograd refuses an
            # in-place change of one, and any use of the others after a change under
            # no_grad, where each eager result is a tensor of its own. Rows selected
            # one by one may change, but each select's backward makes a zero column:
            # quadratic in the rows (4096 rows of 256: 1.0-1.8 s of backward, 0.05 s here).
            # _Rows' are no views, and its backward stacks their gradients once.
            rows: tuple[torch.Tensor, ...] = _Rows.apply(copy)  # type: ignore[no-untyped-call]
            return rows
        return copy.unbind(0)


class _Rows(torch.autograd.Function):
    """A column's rows as tensors autograd takes for its own (no views: each may
    change in place), sharing the column's memory; one backward for all."""

    @staticmethod
    def forward(ctx: Any, column: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(row.detach() for row in column.unbind(0))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> torch.Tensor:
        return torch.stack(grads)


def own_copy(value: torch.Tensor) -> torch.Tensor:
    """A copy that is what ``value`` is: an inference tensor (copied in inference
    mode), or a normal tensor with ``value``'s history (copied where it is recorded),
    also when the caller reads in inference mode."""
    if value.is_inference():
        with torch.inference_mode():
            return value.clone()
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):  # which also turns grad on
            return value.clone()
    with reading(value):
        return value.clone()
