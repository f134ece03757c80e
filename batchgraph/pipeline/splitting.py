"""How ``Pipeline`` turns the model it is given into one module per schedule stage.

A list is taken as one module per stage (or split like an ``nn.Sequential``); an
``nn.Sequential`` is cut between its layers (:func:`partition_sequential`); any other
module is split by tracing it with ``torch.fx`` (:func:`partition_graph`, through
:func:`~batchgraph.pipeline.traced_modes.partition_graph_by_mode`). Refusals are worded
in the ``Pipeline``'s terms (stages, chunks, the schedule).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from batchgraph.pipeline.errors import PipelineConfigError
from batchgraph.pipeline.microbatch import Batch
from batchgraph.pipeline.partition import (
    TooFewLayersError,
    partition_graph,
    partition_sequential,
)
from batchgraph.pipeline.stage import Stage
from batchgraph.pipeline.traced_modes import partition_graph_by_mode

if TYPE_CHECKING:
    from batchgraph.pipeline.actions import PipelineSchedule

__all__ = ["devices_of_stages", "stage_modules", "warn_whole_model_hooks"]


def _too_few_layers(
    exc: TooFewLayersError, stages: int, chunks: int, schedule: str, what: str
) -> PipelineConfigError:
    """The partitioner's refusal in the Pipeline's terms: stages x chunks, what to change."""
    n = exc.layers
    cut = (
        "an nn.Sequential or a list is cut only between its items"
        if what == "layers"
        else "a traced graph is cut only between its operations"
    )
    if chunks == 1:
        return PipelineConfigError(
            f"cannot split {n} {what} into {stages} stages (stages={stages}): each stage "
            f"needs at least one; use stages <= {n}, or a model with more {what} ({cut})"
        )
    fixes = [
        f"{name} <= {most} with {other}"
        for name, most, other in (
            ("chunks", n // stages, f"stages={stages}"),
            ("stages", n // chunks, f"chunks={chunks}"),
        )
        if most >= 2
    ]
    fixes.append(f"chunks=1 with stages <= {n} (schedule '1f1b' instead of {schedule!r})")
    return PipelineConfigError(
        f"cannot split {n} {what} into {stages} stages x {chunks} chunks per stage = "
        f"{stages * chunks} virtual stages: each needs at least one of the {what}. Use "
        f"{', or '.join(fixes)}, or a model with at least {stages * chunks} {what} ({cut})"
    )


def stage_modules(
    module: nn.Module | Sequence[nn.Module] | Sequence[Stage],
    stages: int | None,
    chunks: int,
    cost: str,
    sample: Batch | None,
    schedule: str = "interleaved-1f1b",
) -> list[nn.Module]:
    """One module per schedule stage (``stages * chunks`` of them), from what was given
    to ``Pipeline``: a list is used as it is (one module per stage) or split like an
    ``nn.Sequential``; any other module is split by tracing it (see
    :mod:`batchgraph.pipeline.traced_modes`).

    Raises:
        PipelineConfigError: for what cannot be split (the message says what to change).
    """
    try:
        return _split_modules(module, stages, chunks, cost, sample)
    except TooFewLayersError as exc:
        if stages is None:
            raise
        what = "layers" if isinstance(module, (list, tuple, nn.Sequential)) else "operations"
        raise _too_few_layers(exc, stages, chunks, schedule, what) from None


def _check_stage_objects(module: Sequence[object], stages: int | None, chunks: int) -> None:
    """Refuse ``Stage`` objects whose own ``index`` and ``num_stages`` say otherwise
    than the list: the list runs in its order, one stage per item, and the runtime
    builds its stages from their modules, so a differing index or count would be
    silently ignored (and a ``stages=`` that differs merged several of them into one)."""
    count = len(module)
    for position, stage in enumerate(module):
        if isinstance(stage, Stage) and (stage.index, stage.num_stages) != (position, count):
            raise PipelineConfigError(
                f"module[{position}] is {stage!r}, but a list runs in its order, one stage "
                f"per item: give Stage(..., index={position}, num_stages={count}) there, "
                "or put the Stages in index order"
            )
    if stages is not None and stages * chunks != count and any(
        isinstance(stage, Stage) for stage in module
    ):
        raise PipelineConfigError(
            f"module is a list of {count} Stages, one per stage, but stages={stages} x "
            f"chunks={chunks} asks for {stages * chunks}; leave stages= out (it is "
            f"inferred from the list) or give {stages * chunks} Stages"
        )


def _split_modules(
    module: nn.Module | Sequence[nn.Module] | Sequence[Stage],
    stages: int | None,
    chunks: int,
    cost: str,
    sample: Batch | None,
) -> list[nn.Module]:
    if isinstance(module, (list, tuple)):
        _check_stage_objects(module, stages, chunks)
        items = [s.module if isinstance(s, Stage) else s for s in module]
        for i, item in enumerate(items):
            if not isinstance(item, nn.Module):
                raise PipelineConfigError(
                    f"module[{i}] is a {type(item).__name__}; give nn.Modules or Stages"
                )
        if stages is None or len(items) == stages * chunks:
            return items
        return list(partition_sequential(items, stages * chunks, cost=cost, sample=sample))
    if not isinstance(module, nn.Module):
        raise PipelineConfigError(
            f"module must be an nn.Module or a list of modules, got {type(module).__name__}"
        )
    if stages is None:
        raise PipelineConfigError(
            f"pass stages= to split a {type(module).__name__} (or pass a list with one "
            "module per stage)"
        )
    original = getattr(module, "_orig_mod", None)
    if isinstance(original, nn.Module):  # torch.compile(model): an OptimizedModule
        raise PipelineConfigError(
            f"the model is torch.compile'd ({type(module).__name__} of "
            f"{type(original).__name__}): the pipeline splits a model into stages, which a "
            "compiled whole cannot be; pass the model itself (model._orig_mod) and compile "
            "its layers (a list of torch.compile(layer), or nn.Sequential of them) or the "
            "stage modules"
        )
    warn_whole_model_hooks(module, stacklevel=4)  # the caller of Pipeline(...)
    if isinstance(module, nn.Sequential):
        return list(partition_sequential(module, stages * chunks, cost=cost, sample=sample))
    if cost == "profile":
        raise PipelineConfigError(
            "cost='profile' needs an nn.Sequential or a list of layers; a traced graph "
            "is split with cost 'uniform' or 'params'"
        )
    # Stages that follow model.train()/eval() where the model's Python reads the mode.
    return partition_graph_by_mode(
        module, stages * chunks, lambda m, n, trace: partition_graph(m, n, cost=cost, tracer=trace)
    )


_HOOKS = (
    ("_forward_pre_hooks", "forward pre-hook"),
    ("_forward_hooks", "forward hook"),
    ("_backward_pre_hooks", "backward pre-hook"),
    ("_backward_hooks", "backward hook"),
)


def warn_whole_model_hooks(module: nn.Module, stacklevel: int = 1) -> None:
    """Warn that hooks on the model being split never run: the stages call its parts.

    Args:
        module: the whole model.
        stacklevel: as ``warnings.warn``'s, counted from the caller of this function.

    Example:
        >>> import warnings
        >>> net = nn.Sequential(nn.Linear(2, 2))
        >>> _ = net.register_forward_hook(lambda m, args, out: None)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_whole_model_hooks(net)
        >>> "forward hooks registered on it, which will not run" in str(caught[0].message)
        True
    """
    kinds = [f"{word}s" for attr, word in _HOOKS if getattr(module, attr, None)]
    if kinds:
        listed = kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} and {kinds[-1]}"
        warnings.warn(
            f"the {type(module).__name__} being split has {listed} "
            "registered on it, which will not run: the pipeline calls its stages "
            "(pipe.stage_modules), never the whole model. Register them on its layers, "
            "or on the first or last stage module (they see one microbatch per call)",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )


def devices_of_stages(
    module: object, plan: PipelineSchedule, devices: Sequence[torch.device | str] | None,
) -> Sequence[torch.device | str] | None:
    """The pipeline's ``devices``, given by the ``Stage(..., device=)`` objects of a list
    where ``devices=`` is not: the stages run where their Stage says, or the pipeline
    refuses. They were moved nowhere, silently.

    Raises:
        PipelineConfigError: where Stages on one pipeline device name different
            devices, some pipeline devices have no Stage naming one, or ``devices=``
            says otherwise.

    Example:
        >>> from torch import nn
        >>> from batchgraph.pipeline import make_schedule
        >>> plan = make_schedule("gpipe", stages=2, microbatches=2)
        >>> given = [Stage(nn.Linear(2, 2), i, 2, device="cpu") for i in range(2)]
        >>> devices_of_stages(given, plan, None)
        [device(type='cpu'), device(type='cpu')]
    """
    if not isinstance(module, Sequence):
        return devices
    named: dict[int, torch.device] = {}
    for index, stage in enumerate(module):
        if not (isinstance(stage, Stage) and stage.device_given):
            continue
        where = plan.device_of(index)
        if not _same_device(named.setdefault(where, stage.device), stage.device):
            raise PipelineConfigError(
                f"Stage {index} asks for {stage.device}, but another stage of pipeline "
                f"device {where} asks for {named[where]}: a device's stages run together"
            )
    if not named:
        return devices
    if devices is not None:
        if len(devices) != plan.devices:
            return devices  # the pipeline refuses the count, naming it
        for where, device in named.items():
            if not _same_device(torch.device(devices[where]), device):
                raise PipelineConfigError(
                    f"devices[{where}] is {devices[where]}, but its Stages ask for {device}; "
                    "give one or the other"
                )
        return devices
    if len(named) != plan.devices:
        missing = sorted(set(range(plan.devices)) - set(named))
        raise PipelineConfigError(
            f"some Stages name a device and the stages of pipeline devices {missing} "
            "do not: name one on every Stage, or give devices=[...] to the Pipeline"
        )
    return [named[where] for where in range(plan.devices)]


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` can name one device: ``"cuda"`` (the current one) and
    ``"cuda:0"`` may, so they are not told apart here."""
    return a.type == b.type and (a.index == b.index or a.index is None or b.index is None)
