"""Building only this rank's stages: the others are never materialised here; and making
the data-parallel replicas of a stage start equal."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from batchgraph.pipeline.actions import PipelineSchedule
from batchgraph.pipeline.errors import PipelineConfigError
from batchgraph.pipeline.partition import partition_sequential
from batchgraph.pipeline.stage import Stage

__all__ = ["StageSpec", "build_local_stages", "materialise", "stage_specs", "sync_replicas"]

#: A stage given as a module, or as a zero-argument factory only its own rank calls.
StageSpec = nn.Module | Callable[[], nn.Module]


def materialise(module: nn.Module, device: torch.device, what: str = "the module") -> nn.Module:
    """Move ``module`` to ``device``; a module on ``meta`` gets fresh storage and init.

    A meta module has no values to move, so its storage is allocated on ``device`` and every
    submodule with ``reset_parameters`` (``_reset_parameters``: ``nn.MultiheadAttention``)
    re-initialises itself (load a state dict afterwards to set specific weights). A
    parameter or buffer that none of them sets would keep whatever the fresh memory held
    (a causal mask or rotary frequencies of garbage, silently): a floating one is NaN
    instead, so a step that uses it before a state_dict loads it shows NaN, and a
    ``RuntimeWarning`` names them all when built (``what`` names ``module``).

    Example:
        >>> with torch.device("meta"):
        ...     layer = nn.Linear(2, 3)
        >>> materialise(layer, torch.device("cpu")).weight.device
        device(type='cpu')
    """
    if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        return module.to(device)
    module = module.to_empty(device=device)
    with torch.no_grad():  # what no reset sets stays NaN (floating tensors), to be found
        for t in [*module.parameters(), *module.buffers()]:
            if t.is_floating_point() or t.is_complex():
                t.fill_(float("nan"))
    for sub in module.modules():
        reset = _reset_of(sub)
        if reset is not None:
            reset()
    missing = _uninitialised(module)
    if missing:
        warnings.warn(
            f"{what} was built on meta, and no reset_parameters() initialises "
            f"{', '.join(missing)}: allocated with to_empty, floating ones hold NaN and others "
            "whatever the memory held until a state_dict loads them (non-persistent buffers "
            "never are). Load them before training, initialise them in a reset_parameters() "
            "of their module (called on every submodule after allocation), or give this stage "
            "built on the CPU, or as a factory that builds it on its own rank",
            RuntimeWarning,
            stacklevel=2,
        )
    return module


def _uninitialised(module: nn.Module) -> list[str]:
    """The tensors of a just-allocated ``module`` that no reset set: floating ones still
    NaN; others (they cannot hold NaN) where their module has no reset at all."""
    missing = []
    for path, sub in module.named_modules():
        own = [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]
        for name, t in own:
            if t.is_floating_point() or t.is_complex():
                unset = bool(t.isnan().any())
            else:
                unset = _reset_of(sub) is None
            if unset:
                missing.append(f"{path + '.' if path else ''}{name} ({type(sub).__name__})")
    return missing


def _reset_of(module: nn.Module) -> Callable[[], object] | None:
    """``module``'s own re-initialisation, if it has one."""
    for name in ("reset_parameters", "_reset_parameters"):
        reset = getattr(module, name, None)
        if callable(reset):
            return reset  # type: ignore[no-any-return]
    return None


def stage_specs(module: nn.Sequential | Sequence[StageSpec], total: int) -> list[StageSpec]:
    """One module or factory per stage: ``module`` split by parameter count, or as given.

    Example:
        >>> len(stage_specs(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)), 2))
        2
    """
    if isinstance(module, nn.Sequential):
        return list(partition_sequential(module, total, cost="params"))
    return list(module)


def build_local_stages(
    module: nn.Sequential | Sequence[StageSpec],
    schedule: PipelineSchedule,
    device_index: int,
    device: torch.device,
    split_backward: set[int],
) -> dict[int, Stage]:
    """The :class:`Stage` objects ``device_index`` runs under ``schedule``, and only those.

    Args:
        module: an ``nn.Sequential`` (split into ``schedule.stages`` parts by parameter
            count; parameter counts work on ``meta``), or one module or factory per stage.
        schedule: the schedule (stage ``s`` runs on device ``s % devices``).
        device_index: this rank's device in the pipeline.
        device: where the stages run.
        split_backward: stages whose backward is split into I and W.

    Returns:
        ``{stage index: Stage}`` for this device's stages.

    Raises:
        PipelineConfigError: if the number of stage modules does not match the schedule.
    """
    total = schedule.stages
    specs = stage_specs(module, total)
    if len(specs) != total:
        raise PipelineConfigError(
            f"{len(specs)} stage modules for {total} stages ({schedule.devices} devices x "
            f"{schedule.chunks} chunks); give one per stage or an nn.Sequential to split"
        )
    built: dict[int, Stage] = {}
    for s in schedule.stages_of(device_index):
        spec = specs[s]
        mod = spec if isinstance(spec, nn.Module) else spec()
        what = f"stage {s} ({type(mod).__name__})"
        stage = Stage(materialise(mod, device, what), s, total, device)
        stage.split_backward = s in split_backward
        if schedule.microbatches > 1:  # each rank checks its stages as their inputs come
            stage.kept_checks = set()
        built[s] = stage
    return built


def sync_replicas(stages: dict[int, Stage], group: Any, src: int) -> None:
    """Copy the first replica's parameters and buffers of ``stages`` to every replica.

    Each rank builds (or initialises on ``meta``) its stages with its own random state,
    and scripts often seed each rank apart (``torch.manual_seed(seed + rank)``, for
    different dropout masks): the replicas would start apart and stay apart, however
    exactly their gradients are summed. As ``DistributedDataParallel`` does at
    construction, every replica starts from the first one's values. Collective over
    ``group`` (the ranks that run these stages, one per replica).

    Example (every rank of a 2 stages x 2 replicas job, after building its stages)::

        sync_replicas(stages, replica_group, src=topology.rank_of(topology.device, 0))
    """
    tensors = (t for s in sorted(stages) for t in (*stages[s].module.parameters(),
                                                  *stages[s].module.buffers()))  # fmt: skip
    for t in dict.fromkeys(tensors):  # a tensor shared by two of these stages once
        dist.broadcast(t.data, src=src, group=group)
