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
(every ``torch.nn`` loss does; read again at each step, so a changed attribute counts) or
a ``functools.partial``'s ``reduction=`` keyword, and otherwise must be declared; a plain
function is taken as ``"mean"`` (what ``torch.nn.functional`` losses do by default) unless told otherwise.
``CrossEntropyLoss`` and ``NLLLoss`` with ``reduction="mean"`` and class-index targets
(and ``F.cross_entropy``, ``F.nll_loss``, or a ``functools.partial`` of them with keyword
arguments only: the same losses) divide by a count that depends on the data: the targets not equal to ``ignore_index``,
each counted as its class ``weight``. Weighted by ``n_i / N``, microbatches with more
ignored (padding) or lighter targets would count too much, and one with every target
ignored gives NaN. For them, each step first counts the whole batch's targets
(:meth:`Loss.begin_step`); each microbatch's loss is then its sum (``reduction="sum"``,
the same weight, ignore_index and label smoothing), weighted ``1 / count``: exactly the
batch's mean. Another "mean" that is not a plain average over samples cannot be split
exactly: use ``reduction="sum"`` and divide by your own count.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchgraph.pipeline import _autograd
from batchgraph.pipeline.errors import PipelineConfigError
from batchgraph.pipeline.loss_watch import CountedMeanWatch

__all__ = ["Loss", "Reduction", "output_leaves"]

Reduction = Literal["mean", "batchmean", "sum"]
Output = Tensor | tuple[Tensor, ...]
# Each reduction a microbatch's loss can be weighted for exactly (see the module docstring).
_REDUCTIONS: dict[str, Reduction] = {"mean": "mean", "batchmean": "batchmean", "sum": "sum"}


def _own(fn: Callable[..., object]) -> str | None:
    """The reduction ``fn`` says it makes: its ``reduction`` attribute (``torch.nn`` losses)
    or a ``functools.partial``'s ``reduction=`` keyword; ``None`` when it says none."""
    if isinstance(fn, functools.partial) and "reduction" in fn.keywords:
        return str(fn.keywords["reduction"])
    value = getattr(fn, "reduction", None)
    return value if isinstance(value, str) else None


def _declared(fn: Callable[..., object]) -> str:
    """The reduction ``fn`` declares (see :func:`_own`), else ``"mean"``
    (``torch.nn.functional``'s default)."""
    return _own(fn) or "mean"


def _check_agrees(fn: Callable[..., object], reduction: str) -> None:
    """Refuse a ``reduction=`` passed for a loss that says it makes another: the weights
    would be another reduction's (``MSELoss(reduction="sum")`` weighted as a mean gave
    ``sum_i (n_i / N) * sum_i``, neither the batch's sum nor its mean)."""
    own = _own(fn)
    if own is not None and own != reduction:
        raise PipelineConfigError(
            f"reduction={reduction!r} was passed, but the loss function reduces with "
            f"{own!r} (its reduction attribute, or its functools.partial's keyword): the "
            "microbatch losses would be weighted for the wrong reduction and the step's loss "
            "and gradients would not be one device's; leave reduction='auto' (the default) "
            "to read it, or give the loss function the reduction you mean"
        )


def output_leaves(outputs: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """The last stage's outputs as detached leaves, for a loss and its gradient computed
    apart from the stage's graph; floating and complex ones require grad (a complex
    model's loss of ``|z|`` has a gradient, which the stage's backward needs).

    Example:
        >>> [t.requires_grad for t in output_leaves([torch.ones(1, dtype=torch.cfloat),
        ...                                          torch.ones(1, dtype=torch.long)])]
        [True, False]
    """
    return tuple(
        [o.detach().requires_grad_(o.is_floating_point() or o.is_complex()) for o in outputs]
    )


@dataclass(frozen=True)
class _Counted:
    """A class-index loss whose mean divides by a count of targets: its settings."""

    nll: bool  # F.nll_loss, else F.cross_entropy
    weight: Tensor | None
    ignore_index: int
    label_smoothing: float


# The keywords of F.cross_entropy / F.nll_loss a partial may fix (size_average and reduce
# are deprecated spellings of reduction: such a partial is left as a plain mean).
_COUNTED_KEYWORDS = {"weight", "ignore_index", "label_smoothing", "reduction"}


def _counted(fn: Callable[..., object]) -> _Counted | None:
    """The settings of ``fn`` when it is a cross-entropy or NLL loss (module, function, or
    a ``functools.partial`` of the function with keywords only), else ``None``."""
    # A subclass that keeps the forward (one that only sets defaults) computes the same.
    if isinstance(fn, nn.CrossEntropyLoss) and type(fn).forward is nn.CrossEntropyLoss.forward:
        return _Counted(False, fn.weight, fn.ignore_index, fn.label_smoothing)
    if isinstance(fn, nn.NLLLoss) and type(fn).forward is nn.NLLLoss.forward:
        return _Counted(True, fn.weight, fn.ignore_index, 0.0)
    keywords: dict[str, object] = {}
    if isinstance(fn, functools.partial):
        if fn.args or not set(fn.keywords) <= _COUNTED_KEYWORDS:
            return None
        keywords, fn = fn.keywords, fn.func
    if fn is not F.cross_entropy and fn is not F.nll_loss:
        return None
    nll = fn is F.nll_loss
    if nll and "label_smoothing" in keywords:
        return None  # not an argument of F.nll_loss: let the call say so
    weight = keywords.get("weight")
    return _Counted(
        nll,
        weight if isinstance(weight, Tensor) else None,
        int(cast(int, keywords.get("ignore_index", -100))),
        float(cast(float, keywords.get("label_smoothing", 0.0))),
    )


def _checked(reduction: str) -> Reduction:
    if reduction not in _REDUCTIONS:
        raise PipelineConfigError(
            f"Loss reduction {reduction!r} is not supported: use 'mean', 'batchmean' or "
            "'sum' (a pipeline needs a scalar loss per microbatch; for reduction='none', "
            "reduce it yourself inside the loss function)"
        )
    return _REDUCTIONS[reduction]


class Loss:
    """Wraps ``loss_fn(output, target) -> scalar`` for microbatched training.

    Args:
        fn: the loss function; it must return a scalar tensor.
        reduction: ``"mean"``, ``"batchmean"``, ``"sum"``, or ``"auto"`` (read
            ``fn.reduction``, or the ``reduction=`` keyword of a ``functools.partial``,
            again at each step; ``"mean"`` for a function without either).

    Raises:
        PipelineConfigError: if the reduction is not one of those (``"none"`` gives no
            scalar to differentiate), or is passed against the one ``fn`` says it makes
            (its ``reduction`` attribute or partial keyword; checked again at each step).

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
        self._auto = reduction == "auto"
        self.reduction: Reduction = _checked(_declared(fn) if self._auto else reduction)
        if not self._auto:
            _check_agrees(fn, self.reduction)
        # This step's count for a mean over counted targets (see begin_step), or None.
        self._count: float | None = None
        self._spec: _Counted | None = None  # the loss _count is for
        self._batch: int | None = None  # this step's batch size (see compute_loss)
        self._per_sample: dict[int, float] = {}  # see loss_watch.CountedMeanWatch

    def begin_step(self, targets: Tensor | Sequence[Tensor]) -> None:
        """Note, before a step's microbatches, what their weights depend on besides
        their sizes: for ``CrossEntropyLoss``/``NLLLoss`` (or ``F.cross_entropy``/
        ``F.nll_loss``) with ``reduction="mean"`` and class-index targets, the count the batch's mean divides by (see the module
        docstring). A ``Loss`` subclass that computes its own loss keeps the plain
        weights.

        Args:
            targets: the whole batch's targets.

        Example:
            >>> loss = Loss(torch.nn.CrossEntropyLoss(ignore_index=0))
            >>> loss.begin_step(torch.tensor([0, 2, 1, 0]))      # two targets count
            >>> loss.weight(2, 4)
            0.5
        """
        self._count = None
        first = targets if isinstance(targets, Tensor) else next(iter(targets), None)
        self._batch = first.shape[0] if isinstance(first, Tensor) and first.dim() else None
        self._per_sample = {}
        fn = self.fn
        if self._auto:  # e.g. loss_fn.reduction = "sum" after the pipeline was built
            self.reduction = _checked(_declared(fn))
        else:
            _check_agrees(fn, self.reduction)
        spec = _counted(fn)
        if (
            self.reduction != "mean"
            or spec is None
            or type(self).compute_loss is not Loss.compute_loss
            or type(self).weight is not Loss.weight
            or not isinstance(targets, Tensor)
            or targets.is_floating_point()  # class probabilities: a mean over samples
        ):
            return
        self._spec = spec
        counted = targets[targets != spec.ignore_index]
        weight = spec.weight
        self._count = float(
            counted.numel() if weight is None else weight[counted.to(weight.device)].sum()
        )

    def parameters(self) -> list[nn.Parameter]:
        """The loss function's own parameters (a learned weight or temperature): those of
        ``fn`` when it is an ``nn.Module``, else none.

        A step's backwards add to them as to the stages' parameters, so the pipelines
        keep them with those: a failed step leaves their ``.grad`` as before it, and
        data-parallel replicas start them equal and sum their gradients. A ``Loss``
        subclass holding parameters elsewhere overrides this.

        Example:
            >>> [p.shape for p in Loss(torch.nn.MSELoss()).parameters()]
            []
            >>> class Scaled(torch.nn.MSELoss):
            ...     def __init__(self) -> None:
            ...         super().__init__()
            ...         self.t = torch.nn.Parameter(torch.ones(()))
            >>> [p.shape for p in Loss(Scaled()).parameters()]
            [torch.Size([])]
        """
        fn = self.fn
        return list(fn.parameters()) if isinstance(fn, nn.Module) else []

    @property
    def count(self) -> float | None:
        """This step's count for a mean over counted targets (see :meth:`begin_step`), or
        ``None`` when the weights are the plain ones."""
        return self._count

    def set_count(self, count: float) -> None:
        """Divide by ``count`` instead of the count of the targets :meth:`begin_step` saw:
        data-parallel replicas each see their share of the batch, and their batch's mean
        divides by the count over all of them.

        Example:
            >>> loss = Loss(torch.nn.CrossEntropyLoss())
            >>> loss.begin_step(torch.tensor([0, 2]))   # this replica's two targets
            >>> loss.set_count(5.0)                      # of five over all replicas
            >>> loss.weight(2, 2)
            0.2
        """
        if self._count is None:
            raise RuntimeError("set_count needs a step whose loss counts its targets")
        self._count = count

    def weight(self, microbatch_size: int, batch_size: int) -> float:
        """The factor that turns a microbatch's loss into its share of the batch loss.

        Args:
            microbatch_size: samples in this microbatch.
            batch_size: samples in the whole batch.

        Returns:
            ``microbatch_size / batch_size`` for ``"mean"`` and ``"batchmean"``, ``1.0``
            for ``"sum"``; ``1 / count`` for a mean over counted targets (see
            :meth:`begin_step`), whose microbatch losses are sums.
        """
        if self._count is not None:
            return 1.0 / self._count if self._count else float("nan")  # as 0 / 0 is
        if self.reduction != "sum":
            return microbatch_size / batch_size
        return 1.0

    def compute_loss(self, output: Output, target: Output) -> Tensor:
        """The loss of one microbatch, as ``fn`` reduces it (unweighted).

        Raises:
            ValueError: if ``fn`` does not return a one-element tensor.
        """
        if self._count is not None:
            value = self._summed(output, target)
        elif (samples := self._share_of_mean(target)) is not None:
            # A class-index mean inside fn is a share only at the same count per sample
            # in every microbatch: checked as it runs (see batchgraph.pipeline.loss_watch).
            with CountedMeanWatch(samples, self._per_sample):
                value = self.fn(output, target)
        else:
            value = self.fn(output, target)
        if not isinstance(value, Tensor) or value.numel() != 1:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"loss_fn must return a scalar tensor per microbatch, got {shape}; "
                "reduce it (mean or sum) inside the loss function"
            )
        # A 0-dim loss (every torch.nn loss) as it is: a reshape is one more graph node.
        return value if value.dim() == 0 else value.reshape(())

    def _share_of_mean(self, target: Output) -> int | None:
        """The samples of ``target`` when it is a microbatch's part of a batch whose "mean"
        loss is weighted by its share of the samples (what a hidden class-index mean can
        break), else ``None``."""
        first = target if isinstance(target, Tensor) else next(iter(target), None)
        if (
            self.reduction == "mean"
            and self._batch is not None
            and isinstance(first, Tensor)
            and first.dim() > 0
            and first.shape[0] != self._batch
        ):
            return int(first.shape[0])
        return None

    def _summed(self, output: Output, target: Output) -> Tensor:
        # The microbatch's share of a mean over counted targets, before 1 / count: the
        # same loss with reduction="sum" (0, not NaN, where every target is ignored).
        spec = self._spec
        assert spec is not None and isinstance(output, Tensor) and isinstance(target, Tensor)
        if not spec.nll:
            return F.cross_entropy(
                output, target, weight=spec.weight, ignore_index=spec.ignore_index,
                reduction="sum", label_smoothing=spec.label_smoothing,
            )  # fmt: skip
        return F.nll_loss(
            output, target, weight=spec.weight, ignore_index=spec.ignore_index, reduction="sum"
        )

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
