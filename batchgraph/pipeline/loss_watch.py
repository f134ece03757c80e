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
microbatch's share cannot give: where the count per sample differs between microbatches
(the same count per sample, e.g. a fixed number of masked tokens, splits exactly).
"""

from __future__ import annotations

import inspect
import math
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


def _counted(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> float | None:
    """What this call's mean divides by (its targets not ignored, each counted as its class
    weight), or ``None`` when it is no class-index mean (a sum, or class probabilities)."""
    bound = _WATCHED[func].bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    reduction = a["reduction"]
    if a["size_average"] is not None or a["reduce"] is not None:
        reduction = _reduction.legacy_get_string(a["size_average"], a["reduce"])
    target = a["target"]
    if reduction != "mean" or not isinstance(target, Tensor) or target.is_floating_point():
        return None
    kept = target[target != a["ignore_index"]]
    weight = a["weight"]
    if weight is None:
        return float(kept.numel())
    if kept.numel() and not 0 <= int(kept.min()) <= int(kept.max()) < weight.numel():
        return None  # a class out of range: the call itself says so, in torch's words
    return float(weight[kept.to(weight.device)].sum())


class CountedMeanWatch(TorchFunctionMode):
    """Refuses ``F.cross_entropy``/``F.nll_loss`` means that microbatches cannot share.

    A microbatch's mean, weighted by its share of the samples, is its part of the batch's
    mean when every microbatch's count (targets not ignored, weighted by class) is the same
    per sample. ``per_sample`` keeps, for each such call of a step (by its place in the
    loss), the count per sample the first microbatch had; a later one with another refuses.

    Args:
        samples: the samples of this microbatch.
        per_sample: the step's counts per sample so far, by call; updated.

    Example:
        >>> import torch
        >>> logits = torch.randn(2, 3)
        >>> seen: dict[int, float] = {}
        >>> with CountedMeanWatch(2, seen):       # 2 of 2 targets count
        ...     _ = F.cross_entropy(logits, torch.tensor([0, 2]), ignore_index=-1)
        >>> with CountedMeanWatch(2, seen):       # 1 of 2
        ...     F.cross_entropy(logits, torch.tensor([-1, 1]), ignore_index=-1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        batchgraph.pipeline.errors.PipelineConfigError: loss_fn calls F.cross_entropy with reduction='mean' on class indices: ...
    """

    def __init__(self, samples: int, per_sample: dict[int, float]) -> None:
        super().__init__()
        self.samples = samples
        self.per_sample = per_sample
        self.calls = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _WATCHED:
            count = _counted(func, args, kwargs)
            if count is not None:
                call, self.calls = self.calls, self.calls + 1
                ratio = count / self.samples
                first = self.per_sample.setdefault(call, ratio)
                if not math.isclose(ratio, first, rel_tol=1e-9):
                    self._refuse(func.__name__, first, ratio)
        return func(*args, **kwargs)

    def _refuse(self, name: str, first: float, ratio: float) -> None:
        raise PipelineConfigError(
            f"loss_fn calls F.{name} with reduction='mean' on class indices: that mean "
            "divides by the count of targets not equal to ignore_index (each counted as its "
            f"class weight), {first:g} per sample in the step's first microbatch but "
            f"{ratio:g} in this one, so no weight per microbatch gives one device's loss and "
            f"gradients. Give the loss itself as loss_fn (nn.CrossEntropyLoss(...), F.{name}, "
            f"or functools.partial(F.{name}, ignore_index=...)), which the pipeline splits "
            "exactly; or have loss_fn sum (reduction='sum') and divide by the batch's count, "
            "and pass reduction='sum' to the pipeline"
        )
