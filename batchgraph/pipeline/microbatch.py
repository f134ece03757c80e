"""Splitting a batch into microbatches and merging outputs back; probing stage shapes.

Microbatch sizes follow ``torch.tensor_split``: the first ``N % m`` microbatches get one
sample more, so sizes differ by at most one and the last may be smaller. Every tensor of
a batch (inputs may be a tuple of tensors) is split along dimension 0.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.func import functional_call

from batchgraph.pipeline.errors import PipelineConfigError, StageMismatchError
from batchgraph.pipeline.real_runs import Generators
from batchgraph.pipeline.swapped_state import swapped_state
from batchgraph.pipeline.thread_state import saved_tensors_hooks_enabled
from batchgraph.python_state import SavedAttributes

__all__ = [
    "Batch",
    "CallerGraph",
    "batch_size",
    "check_stages_fit",
    "merge_microbatches",
    "microbatch_fit_error",
    "split_microbatches",
]

Batch = Tensor | tuple[Tensor, ...] | list[Tensor]


def _as_tuple(batch: Batch) -> tuple[Tensor, ...]:
    items = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    for i, item in enumerate(items):
        if not isinstance(item, Tensor):
            raise TypeError(
                f"a batch must be a tensor or a tuple of tensors; item {i} is {type(item).__name__}"
            )
    return items


def batch_size(batch: Batch, what: str = "the batch") -> int:
    """The size of dimension 0, checked equal across the batch's tensors.

    Args:
        batch: a tensor or a tuple of tensors.
        what: how errors name it (``"inputs"``, ``"targets"``).

    Raises:
        PipelineConfigError: if the tensors disagree or a tensor has no dimension 0.

    Example:
        >>> batch_size(torch.zeros(()), "targets")
        Traceback (most recent call last):
        ...
        batchgraph.pipeline.errors.PipelineConfigError: targets: item 0 is a 0-d tensor (shape ()), which has no batch dimension to split into microbatches; give the batch in dimension 0 (one value per sample: shape (N,))
    """
    items = _as_tuple(batch)
    for i, t in enumerate(items):
        if t.dim() == 0:
            raise PipelineConfigError(
                f"{what}: item {i} is a 0-d tensor (shape ()), which has no batch dimension "
                "to split into microbatches; give the batch in dimension 0 (one value per "
                "sample: shape (N,))"
            )
    sizes = {t.shape[0] for t in items}
    if len(sizes) != 1:
        shapes = [tuple(t.shape) for t in items]
        raise PipelineConfigError(
            f"every tensor of {what} needs the same size in dimension 0 (the batch), got "
            f"shapes {shapes}"
        )
    return sizes.pop()


class CallerGraph:
    """Inputs computed by the caller's own graph (``x = embed(ids)`` before the
    pipeline), cut off it for the step and joined back once at the end.

    Every microbatch's stage-0 backward would otherwise run on into the caller's graph
    through the one node that split the batch: the first frees that graph's saved
    tensors and the second fails ("Trying to backward through the graph a second
    time"). Each such input is replaced by a leaf; after the step, one backward from the
    inputs with the leaves' gradients runs the caller's graph once, as one device's
    ``loss.backward()`` does (leaf inputs keep their own ``.grad`` and are left as they are).

    Example:
        >>> base = torch.ones(4, 2, requires_grad=True)
        >>> cut = CallerGraph(base * 3)
        >>> [mb[0].sum().backward() for mb in split_microbatches(cut.inputs, 2)]
        [None, None]
        >>> cut.join()
        >>> base.grad[0]
        tensor([3., 3.])
    """

    def __init__(self, inputs: Batch) -> None:
        items = _as_tuple(inputs)
        self._pairs: list[tuple[Tensor, Tensor]] = []
        cut: list[Tensor] = []
        for t in items:
            if t.requires_grad and t.grad_fn is not None:
                leaf = t.detach().requires_grad_(True)
                self._pairs.append((t, leaf))
                t = leaf
            cut.append(t)
        self.inputs: Batch = (
            inputs if not self._pairs else cut[0] if isinstance(inputs, Tensor) else tuple(cut)
        )

    def join(self) -> None:
        """Run the caller's graph backward from the inputs, with the step's gradients."""
        pairs = [(t, leaf.grad) for t, leaf in self._pairs if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def microbatch_fit_error(microbatches: int, n: int) -> PipelineConfigError | None:
    """The error for ``microbatches`` parts of a batch of ``n`` samples, if they do not fit.

    Example:
        >>> print(microbatch_fit_error(4, 3))
        microbatches=4 does not fit a batch of 3 samples: use 1 <= microbatches <= 3 (every microbatch needs at least one sample)
        >>> print(microbatch_fit_error(2, 0))
        the batch is empty (0 samples in dimension 0): give at least microbatches=2 samples, one per microbatch
    """
    if 1 <= microbatches <= n:
        return None
    if n == 0:
        return PipelineConfigError(
            "the batch is empty (0 samples in dimension 0): give at least "
            f"microbatches={microbatches} samples, one per microbatch"
        )
    return PipelineConfigError(
        f"microbatches={microbatches} does not fit a batch of {n} samples: use 1 <= "
        f"microbatches <= {n} (every microbatch needs at least one sample)"
    )


def split_microbatches(
    batch: Batch, microbatches: int, what: str = "the batch"
) -> list[tuple[Tensor, ...]]:
    """Split ``batch`` into ``microbatches`` parts along dimension 0.

    Args:
        batch: a tensor or a tuple of tensors with equal dimension 0.
        microbatches: how many parts, 1 <= microbatches <= batch size.
        what: how errors name the batch (``"inputs"``, ``"targets"``).

    Returns:
        One tuple of tensors (views) per microbatch.

    Raises:
        PipelineConfigError: if ``microbatches`` is not in ``1..batch size``.

    Example:
        >>> import torch
        >>> [mb[0].shape[0] for mb in split_microbatches(torch.zeros(10, 2), 4)]
        [3, 3, 2, 2]
    """
    n = batch_size(batch, what)
    error = microbatch_fit_error(microbatches, n)
    if error is not None:
        raise error
    parts = [torch.tensor_split(t, microbatches, dim=0) for t in _as_tuple(batch)]
    return [tuple(p[i] for p in parts) for i in range(microbatches)]


def merge_microbatches(
    outputs: Sequence[tuple[Tensor, ...]], source: str = "the last stage"
) -> Tensor | tuple[Tensor, ...]:
    """Concatenate per-microbatch outputs along dimension 0 (a tensor if there is one output).

    One microbatch's outputs are returned as they are (nothing to concatenate).

    Args:
        outputs: per microbatch, the outputs of the last stage.
        source: how errors name what made them (``"stage 3 (SequentialStage)"``).

    Raises:
        PipelineConfigError: if an output is 0-d (and there are several microbatches):
            it has no batch dimension to concatenate along.

    Example:
        >>> import torch
        >>> parts = split_microbatches(torch.arange(5.0), 2)
        >>> merge_microbatches(parts)
        tensor([0., 1., 2., 3., 4.])
    """
    if len(outputs) == 1:
        return outputs[0][0] if len(outputs[0]) == 1 else outputs[0]
    for mb, parts in enumerate(outputs):
        for i, t in enumerate(parts):
            if t.dim() == 0:
                raise PipelineConfigError(
                    f"{source} returned a 0-d tensor as output {i} of microbatch {mb}: it has "
                    f"no batch dimension, so the {len(outputs)} microbatches' outputs cannot "
                    "be merged along dimension 0. The model reduces over the batch (a "
                    "final .sum() or .mean()?), which a pipeline cannot split into "
                    "microbatches: return per-sample outputs (batch in dimension 0) and "
                    "move the reduction into the loss (loss_fn=, with reduction='sum' for "
                    "a sum), or use microbatches=1"
                )
    merged = tuple(torch.cat(list(parts), dim=0) for parts in zip(*outputs))
    return merged[0] if len(merged) == 1 else merged


def _describe(values: Sequence[Tensor | None]) -> str:
    return (
        "("
        + ", ".join("None" if v is None else f"{tuple(v.shape)} {v.dtype}" for v in values)
        + ")"
    )


def check_stages_fit(modules: Sequence[nn.Module], sample: Sequence[Tensor]) -> None:
    """Run the stages in sequence on the ``meta`` device to check what crosses each cut.

    Parameters and buffers are replaced by meta tensors for the call
    (``torch.func.functional_call``), so nothing is computed and no real state (e.g.
    BatchNorm's running statistics) changes. A module that cannot run on meta tensors
    (data-dependent Python control flow, ``.item()``) ends the check silently: the first
    real microbatch will report its error with the stage named.

    Args:
        modules: the stage modules, in order.
        sample: one microbatch of inputs for the first stage.

    Raises:
        StageMismatchError: naming both stages and the shapes, if a stage cannot take what
            the previous one produces (or stage 0 the inputs).

    Example:
        >>> from torch import nn
        >>> check_stages_fit([nn.Linear(4, 8), nn.Linear(3, 2)], [torch.zeros(2, 4)])
        Traceback (most recent call last):
        ...
        batchgraph.pipeline.errors.StageMismatchError: stage 0 (Linear) produces ((2, 8) torch.float32) but stage 1 (Linear) cannot take it: ...
    """
    with _python_state_kept(modules):
        _probe(modules, sample)


# Module state that functional_call swaps and restores itself.
_SWAPPED = frozenset({"_parameters", "_buffers", "_modules"})


@contextmanager
def _python_state_kept(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Undo what a probe's forwards do to the modules' Python attributes.

    A layer that caches a tensor in a plain attribute (rotary embeddings' ``cos`` per
    sequence length) kept the probe's meta tensor, and its first real forward failed
    ("Tensor on device meta is not on the expected device cpu"); one that counts its
    calls counted the probe. Attributes are put back (lists, deques, dicts and sets, nested
    ones too, keep their identity and get their old items back), added ones removed.
    A forward drawing from Python's ``random`` or NumPy's generator (a LayerDrop) drew
    on meta too, shifting the step's draws: the generators are set back as well.
    """
    saved = [SavedAttributes(m, _SWAPPED) for root in modules for m in root.modules()]
    generators = Generators((), modules)
    try:
        yield
    finally:
        generators.reset()
        for attrs in saved:
            attrs.put_back(attrs.changed(_SWAPPED))


def _probe(modules: Sequence[nn.Module], sample: Sequence[Tensor]) -> None:
    values: tuple[Tensor | None, ...] = tuple(torch.empty_like(t, device="meta") for t in sample)
    for k, module in enumerate(modules):
        state = swapped_state(module)
        try:
            # No tensor is saved here, so the caller's disable_saved_tensors_hooks is
            # lifted: a layer that enters hooks of its own is refused by the real run,
            # with the stage named, not as a shape mismatch.
            with torch.no_grad(), saved_tensors_hooks_enabled():
                result = functional_call(module, state, values, tie_weights=False)
        except StageMismatchError as exc:  # the stage's own words (a SequentialStage's)
            raise StageMismatchError(f"stage {k} ({type(module).__name__}): {exc}") from exc
        except Exception as exc:
            text = str(exc)
            if isinstance(exc, NotImplementedError) or "meta" in text.lower():
                return  # cannot tell on meta tensors; see the docstring
            name = type(module).__name__
            # What to fix: the batch, where the first stage refuses it (a split has no
            # cut before stage 0); else the cut between two stages.
            fix = "fix the split so each stage's outputs match the next stage's inputs"
            if k == 0:
                where = f"stage 0 ({name}) cannot take the microbatch inputs {_describe(values)}"
                fix = "give inputs that stage takes (check their shape and dtype) or fix it"
            else:
                prev = type(modules[k - 1]).__name__
                where = (
                    f"stage {k - 1} ({prev}) produces {_describe(values)} but stage {k} "
                    f"({name}) cannot take it"
                )
            raise StageMismatchError(
                f"{where}: {type(exc).__name__}: {text.splitlines()[0] if text else ''}; {fix}"
            ) from exc
        items = result if isinstance(result, (tuple, list)) else (result,)
        if not all(isinstance(v, Tensor) for v in items):
            return  # non-tensor outputs are reported by the stage at run time
        values = tuple(items)
