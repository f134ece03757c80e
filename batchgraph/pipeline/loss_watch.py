"""Class-index means inside a loss function the pipeline cannot see into, found as it runs.

A pipeline weights each microbatch's loss by its share of the samples (``n_i / N`` for
a mean). ``F.cross_entropy``/``F.nll_loss`` with ``reduction="mean"`` on class indices
divide by the count of targets that are not ``ignore_index`` (each counted as its class
weight), which differs from microbatch to microbatch: given as the loss itself
(``nn.CrossEntropyLoss(...)``, ``F.cross_entropy``, a ``functools.partial`` of it) the
pipeline counts the batch's targets and splits it exactly (see
:mod:`batchgraph.pipeline.loss`). Called from inside a function of the user's (nanoGPT's
``lambda logits, y: F.cross_entropy(logits.view(-1, V), y.view(-1), ignore_index=-1)``),
it was weighted as a plain mean, and the step's loss and gradients were not one device's
wherever targets were ignored or classes weighted, without a word.

:class:`CountedMeanWatch` is entered around such a function's call on a microbatch: it
sees each ``F.cross_entropy``/``F.nll_loss`` call (a torch function mode; an
``nn.CrossEntropyLoss`` called inside calls it too) and refuses the ones whose mean a
microbatch's share cannot give: class weights, or a target equal to ``ignore_index``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import Tensor
from torch.nn import _reduction
from torch.overrides import TorchFunctionMode

from batchgraph.pipeline.errors import PipelineConfigError

__all__ = ["CountedMeanWatch"]

_WATCHED: dict[Callable[..., Any], inspect.Signature] = {
    F.cross_entropy: inspect.signature(F.cross_entropy),
    F.nll_loss: inspect.signature(F.nll_loss),
}


def _inexact(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Why a microbatch's share of this call's mean is not its part of the batch's, or ''."""
    bound = _WATCHED[func].bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    reduction = a["reduction"]
    if a["size_average"] is not None or a["reduce"] is not None:
        reduction = _reduction.legacy_get_string(a["size_average"], a["reduce"])
    target = a["target"]
    if reduction != "mean" or not isinstance(target, Tensor) or target.is_floating_point():
        return ""  # a sum, or class probabilities (a mean over samples): exact
    if a["weight"] is not None:
        return "with class weights (weight=)"
    if bool((target == a["ignore_index"]).any()):
        return f"with targets equal to ignore_index={a['ignore_index']}"
    return ""


class CountedMeanWatch(TorchFunctionMode):
    """Refuses ``F.cross_entropy``/``F.nll_loss`` means that a microbatch cannot share.

    Example:
        >>> import torch
        >>> logits, y = torch.randn(4, 3), torch.tensor([0, 2, -1, 1])
        >>> with CountedMeanWatch():
        ...     F.cross_entropy(logits, y, ignore_index=-1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        batchgraph.pipeline.errors.PipelineConfigError: loss_fn calls F.cross_entropy with reduction='mean' on class indices with targets equal to ignore_index=-1: ...
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _WATCHED:
            why = _inexact(func, args, kwargs)
            if why:
                name = func.__name__
                raise PipelineConfigError(
                    f"loss_fn calls F.{name} with reduction='mean' on class indices {why}: "
                    "that mean divides by the count of targets not ignored (each weighted by "
                    "its class), which differs from microbatch to microbatch, so no weight "
                    "per microbatch gives one device's loss and gradients. Give the loss "
                    f"itself as loss_fn (nn.CrossEntropyLoss(...), F.{name}, or "
                    f"functools.partial(F.{name}, ignore_index=...)), which the pipeline "
                    "splits exactly; or have loss_fn sum (reduction='sum') and divide by the "
                    "batch's count, and pass reduction='sum' to the pipeline"
                )
        return func(*args, **kwargs)
