"""Parameters shared by stages on different ranks (tied weights), kept exact.

In one process, stages that share a parameter (an embedding reused by the output head)
share its ``.grad``, so autograd sums both uses. Across processes each rank holds a copy
and its backward gives only its own stages' part, so after a step the ranks that hold a
tied parameter sum their parts (one all-reduce per group of such ranks and dtype)::

    stage 0 (rank 0): emb ─┐                      ┌─ grad = part 0 + part 1
                           ├─ all_reduce(sum) ───►│
    stage 1 (rank 1): emb ─┘                      └─ grad = part 0 + part 1

Every holder then has the full gradient, so equal optimizers keep the copies equal; at
construction the copies are made equal (broadcast from the lowest rank that holds them:
stages built on ``meta`` are initialised on each rank separately).

Ties are found by object identity among the stage modules given to the pipeline (an
``nn.Sequential`` or a list of modules, which every rank builds alike); stages given as
factories are built on their own rank only, so their parameters cannot be tied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn

from batchgraph.pipeline.dist_build import StageSpec, stage_specs
from batchgraph.pipeline.dist_sync import allreduce_gradients
from batchgraph.pipeline.dist_topology import ProcessGroups
from batchgraph.pipeline.stage import Stage

__all__ = ["Tie", "TiedGradients", "describe_ties", "find_ties", "ties_of"]


@dataclass(frozen=True)
class Tie:
    """One parameter used by several stages: ``(stage, name in that stage's module)``."""

    holders: tuple[tuple[int, str], ...]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(s for s, _ in self.holders)

    def __str__(self) -> str:
        return " = ".join(f"stage {s} '{name}'" for s, name in self.holders)


def find_ties(specs: Sequence[nn.Module | Callable[[], nn.Module]]) -> list[Tie]:
    """The parameters that more than one stage module holds (factories are skipped).

    Example:
        >>> emb = nn.Embedding(4, 2)
        >>> [str(t) for t in find_ties([nn.Sequential(emb), nn.Sequential(nn.ReLU(), emb)])]
        ["stage 0 '0.weight' = stage 1 '1.weight'"]
    """
    holders: dict[nn.Parameter, list[tuple[int, str]]] = {}
    for s, spec in enumerate(specs):
        if isinstance(spec, nn.Module):
            for name, p in spec.named_parameters():
                holders.setdefault(p, []).append((s, name))
    return [Tie(tuple(h)) for h in holders.values() if len(h) > 1]


def ties_of(
    module: nn.Sequential | Sequence[StageSpec], total: int
) -> tuple[list[Tie], list[StageSpec] | None]:
    """The model's shared parameters and its ``total`` stage specs (``None`` if it does
    not split: raised again when the stages are built, after the ranks compared their
    configurations, which must include the ties: the groups that sum them are collective).

    Example:
        >>> emb = nn.Embedding(4, 2)
        >>> ties, specs = ties_of([nn.Sequential(emb), nn.Sequential(emb)], 2)
        >>> len(ties), len(specs)
        (1, 2)
    """
    try:
        specs = stage_specs(module, total)
    except Exception:
        return [], None
    return find_ties(specs), specs


def describe_ties(ties: Sequence[Tie]) -> str:
    """One line for the ranks' configuration check (they must agree on the groups)."""
    return "; ".join(map(str, ties))


class TiedGradients:
    """The groups of ranks that share parameters, and the sum of their gradients.

    Created on every rank, in the same order (``new_group`` is collective over the
    world), after the stages are built.

    Args:
        ties: the model's ties (:func:`find_ties`); those within one device need nothing.
        device_of: the device (position in a pipeline) of each stage.
        groups: this pipeline's groups (the new ones join them: a failing rank's
            destroying them wakes peers blocked in a sum).
        stages: this rank's built stages.
        timeout: bound on each collective.
    """

    def __init__(
        self,
        ties: Sequence[Tie],
        device_of: Callable[[int], int],
        groups: ProcessGroups,
        stages: dict[int, Stage],
        timeout: float,
    ) -> None:
        by_devices: dict[tuple[int, ...], list[Tie]] = {}
        for tie in ties:
            devices = tuple(sorted({device_of(s) for s in tie.stages}))
            if len(devices) > 1:
                by_devices.setdefault(devices, []).append(tie)
        self._groups: list[tuple[Any, list[nn.Parameter]]] = []
        copies: list[nn.Parameter] = []
        topology = groups.topology
        for devices, group_ties in sorted(by_devices.items()):
            for j in range(topology.replicas):
                ranks = [topology.rank_of(d, j) for d in devices]
                group = dist.new_group(ranks, timeout=timedelta(seconds=timeout))
                if topology.rank not in ranks:
                    continue
                groups.others.append(group)
                # Same order on every member: the ties' order, each by its first local holder.
                params = [_local(tie, stages) for tie in group_ties]
                for p in params:
                    dist.broadcast(p.data, src=ranks[0], group=group)
                self._groups.append((group, params))
                if topology.rank != ranks[0]:
                    copies.extend(params)
        self.params: list[nn.Parameter] = list(
            dict.fromkeys(p for _, params in self._groups for p in params)
        )
        #: This rank's tied parameters that a lower rank also holds: a model-wide sum over
        #: parameters (the gradient norm) counts them there only, as one device counts
        #: a shared parameter once.
        self.copies: list[nn.Parameter] = list(dict.fromkeys(copies))

    def release(self) -> None:
        """Forget the groups (after a failure: see ``DistributedPipeline._fail``)."""
        self._groups = []

    def allreduce(self) -> None:
        """Sum this step's gradients of the tied parameters over the ranks holding each.

        The caller stashes earlier gradients first (see
        :func:`~batchgraph.pipeline.dist_sync.stash_gradients`): only this step's parts
        may be summed.
        """
        for group, params in self._groups:
            allreduce_gradients(params, group, [None] * len(params))


def _local(tie: Tie, stages: dict[int, Stage]) -> nn.Parameter:
    for s, name in tie.holders:
        if s in stages:
            return stages[s].module.get_parameter(name)
    raise AssertionError(f"this rank holds none of {tie}")  # ranks come from the stages
