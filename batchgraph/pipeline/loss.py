"""The loss seen by the pipeline: per-microbatch loss and its gradient, scaled to the batch.

A pipeline never sees the whole batch at once; it sees microbatches of sizes
``n_0 + n_1 + ... = N`` (the last may be smaller). For the summed microbatch gradients
to equal the full-batch gradient, each microbatch's loss is weighted:

* ``reduction="mean"`` (the loss averages over its samples): weight ``n_i / N``, because
  ``mean over N = sum_i (n_i / N) * mean over microbatch i``;
* ``reduction="batchmean"`` (``KLDivLoss``: the sum divided by the number of samples):
  weight ``n_i / N`` too, as ``sum / N = sum_i (n_i / N) * (sum over microbatch i / n_i)``;
* ``reduction="sum"``: weight 1.

The reduction is read from the loss function's ``reduction`` attribute when it has one
(every ``torch.nn`` loss does) and otherwise must be declared; a plain function is taken
as ``"mean"`` (what ``torch.nn.functional`` losses do by default) unless told otherwise.
A "mean" that is not a plain average over samples (``CrossEntropyLoss`` with class
``weight`` or ``ignore_index`` hits divides by a data-dependent count) cannot be split
exactly: use ``reduction="sum"`` and divide by your own count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor

from batchgraph.pipeline import _autograd
from batchgraph.pipeline.errors import PipelineConfigError

__all__ = ["Loss", "Reduction"]

Reduction = Literal["mean", "batchmean", "sum"]
Output = Tensor | tuple[Tensor, ...]
# Each reduction a microbatch's loss can be weighted for exactly (see the module docstring).
_REDUCTIONS: dict[str, Reduction] = {"mean": "mean", "batchmean": "batchmean", "sum": "sum"}


class Loss:
    """Wraps ``loss_fn(output, target) -> scalar`` for microbatched training.

    Args:
        fn: the loss function; it must return a scalar tensor.
        reduction: ``"mean"``, ``"batchmean"``, ``"sum"``, or ``"auto"`` (read
            ``fn.reduction``; ``"mean"`` for a function without that attribute).

    Raises:
        PipelineConfigError: if the reduction is not one of those (``"none"`` gives no
            scalar to differentiate).

    Example:
        >>> import torch
        >>> loss = Loss(torch.nn.MSELoss())
        >>> loss.reduction, loss.weight(2, 8)
        ('mean', 0.25)
        >>> out = torch.zeros(2, 1, requires_grad=True)
        >>> value = loss.compute_loss(out, torch.ones(2, 1))
        >>> loss.compute_gradient(value, out, weight=0.25)
        (tensor([[-0.2500],
                [-0.2500]]),)
    """

    def __init__(self, fn: Callable[[Output, Output], Tensor], reduction: str = "auto") -> None:
        self.fn = fn
        if reduction == "auto":
            reduction = str(getattr(fn, "reduction", "mean"))
        if reduction not in _REDUCTIONS:
            raise PipelineConfigError(
                f"Loss reduction {reduction!r} is not supported: use 'mean', 'batchmean' or "
                "'sum' (a pipeline needs a scalar loss per microbatch; for reduction='none', "
                "reduce it yourself inside the loss function)"
            )
        self.reduction: Reduction = _REDUCTIONS[reduction]

    def weight(self, microbatch_size: int, batch_size: int) -> float:
        """The factor that turns a microbatch's loss into its share of the batch loss.

        Args:
            microbatch_size: samples in this microbatch.
            batch_size: samples in the whole batch.

        Returns:
            ``microbatch_size / batch_size`` for ``"mean"`` and ``"batchmean"``, ``1.0``
            for ``"sum"``.
        """
        if self.reduction != "sum":
            return microbatch_size / batch_size
        return 1.0

    def compute_loss(self, output: Output, target: Output) -> Tensor:
        """The loss of one microbatch, as ``fn`` reduces it (unweighted).

        Raises:
            ValueError: if ``fn`` does not return a one-element tensor.
        """
        value = self.fn(output, target)
        if not isinstance(value, Tensor) or value.numel() != 1:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"loss_fn must return a scalar tensor per microbatch, got {shape}; "
                "reduce it (mean or sum) inside the loss function"
            )
        # A 0-dim loss (every torch.nn loss) as it is: a reshape is one more graph node.
        return value if value.dim() == 0 else value.reshape(())

    def compute_gradient(
        self, loss: Tensor, output: Output, *, weight: float = 1.0
    ) -> tuple[Tensor | None, ...]:
        """dL_batch/d(output) for one microbatch: the gradient of ``weight * loss``.

        Args:
            loss: what :meth:`compute_loss` returned for ``output``.
            output: the microbatch's output (tensors that require grad, as leaves).
            weight: the microbatch's share, see :meth:`weight`.

        Returns:
            One gradient per output tensor (``None`` where the loss does not use it).
        """
        outputs: Sequence[Tensor] = output if isinstance(output, tuple) else (output,)
        targets = [o for o in outputs if o.requires_grad]
        if not targets:
            grads: tuple[Tensor | None, ...] = ()
        elif loss.numel() == 1:
            # ``weight`` seeds the backward: the same numbers as differentiating
            # ``weight * loss``, one graph node fewer.
            grads = _autograd.grad([loss], [torch.full_like(loss, weight)], targets)
        else:  # not a scalar: let autograd say so
            grads = torch.autograd.grad(loss * weight, targets, allow_unused=True)
        by_id = {id(o): g for o, g in zip(targets, grads)}
        return tuple(by_id.get(id(o)) for o in outputs)
