"""Who is who in a pipeline x data-parallel job, and the process groups it needs.

``world = stages x replicas``. Rank ``r`` is device ``r % stages`` of pipeline (replica)
``r // stages``; with 2 stages and 2 replicas::

                 device 0   device 1
    replica 0    rank 0  ─► rank 1        pipeline groups: {0, 1}, {2, 3}   (activations, gradients)
    replica 1    rank 2  ─► rank 3        replica groups:  {0, 2}, {1, 3}   (gradient all-reduce)
                                          control group:   all ranks       (config, clocks, stats)

so ``torchrun --nproc-per-node 4`` puts each pipeline on neighbouring ranks. The
pipeline owns these groups and destroys them when it fails, which is how its failure
reaches the other ranks (see :mod:`batchgraph.pipeline.dist_errors`).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from batchgraph.pipeline.actions import PipelineSchedule
from batchgraph.pipeline.dist_errors import AbortBoard
from batchgraph.pipeline.errors import PipelineConfigError

__all__ = ["ProcessGroups", "Topology", "check_same_config", "clock_offsets", "describe_schedule"]

_instances = 0  # pipelines built in this process; equal on every rank (all build alike)


@dataclass(frozen=True)
class Topology:
    """The place of ``rank`` in a ``stages x replicas`` grid of ranks.

    Example:
        >>> t = Topology(stages=2, replicas=2, rank=3)
        >>> t.device, t.replica, t.pipeline_ranks(), t.replica_ranks()
        (1, 1, [2, 3], [1, 3])
    """

    stages: int
    replicas: int
    rank: int

    @property
    def world(self) -> int:
        return self.stages * self.replicas

    @property
    def device(self) -> int:
        """This rank's device (position) in its pipeline."""
        return self.rank % self.stages

    @property
    def replica(self) -> int:
        """Which pipeline (data-parallel replica) this rank belongs to."""
        return self.rank // self.stages

    def rank_of(self, device: int, replica: int | None = None) -> int:
        """The global rank of ``device`` in ``replica`` (default: this rank's replica)."""
        return (self.replica if replica is None else replica) * self.stages + device

    def pipeline_ranks(self, replica: int | None = None) -> list[int]:
        return [self.rank_of(d, replica) for d in range(self.stages)]

    def replica_ranks(self, device: int | None = None) -> list[int]:
        d = self.device if device is None else device
        return [self.rank_of(d, j) for j in range(self.replicas)]


def describe_schedule(schedule: str | PipelineSchedule) -> str:
    """What the ranks must agree on: a name, or a custom schedule's whole order.

    Example:
        >>> from batchgraph.pipeline.schedules import make_schedule
        >>> describe_schedule("1f1b"), describe_schedule(make_schedule("gpipe", stages=2, microbatches=1))
        ('1f1b', 'gpipe[0F0 0B0;1F0 1B0]')
    """
    if isinstance(schedule, str):
        return schedule
    order = ";".join(" ".join(map(str, schedule.order[d])) for d in sorted(schedule.order))
    return f"{schedule.name}[{order}]"


def check_same_config(group: Any, config: Mapping[str, object]) -> None:
    """All-gather ``config`` over ``group`` and fail on every rank if any rank differs.

    Raises:
        PipelineConfigError: listing each rank's differing values.
    """
    configs: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(configs, dict(config), group=group)
    if all(c == configs[0] for c in configs):
        return
    keys = sorted({k for c in configs for k in c if any(c.get(k) != o.get(k) for o in configs)})
    rows = "; ".join(
        f"rank {r}: " + ", ".join(f"{k}={c.get(k)!r}" for k in keys) for r, c in enumerate(configs)
    )
    raise PipelineConfigError(
        f"the ranks built the pipeline differently ({rows}); every rank must pass the same "
        "schedule, stages, microbatches, chunks and replicas"
    )


def clock_offsets(group: Any) -> list[float]:
    """Per-rank offset of ``time.perf_counter()`` from rank 0's, to align timelines.

    On one host every process reads the same monotonic clock, so the offsets are 0. Across
    hosts they are estimated after a barrier (accurate to the barrier's skew, ~0.1 ms on
    a LAN).
    """
    dist.barrier(group=group)
    now = time.perf_counter()
    stamps: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(stamps, (socket.gethostname(), now), group=group)
    if len({host for host, _ in stamps}) == 1:
        return [0.0] * len(stamps)
    return [t - stamps[0][1] for _, t in stamps]


class ProcessGroups:
    """The control, pipeline and replica groups of one pipeline, created on every rank.

    ``new_group`` is collective over the whole world, so every rank creates every group,
    in the same order, and keeps the ones it belongs to.

    Args:
        topology: this rank's place.
        timeout: bound on every collective of these groups.
    """

    def __init__(self, topology: Topology, timeout: float) -> None:
        global _instances
        _instances += 1
        self.topology = topology
        self.timeout = timedelta(seconds=timeout)
        world = list(range(dist.get_world_size()))
        self.control: Any = dist.new_group(world, timeout=self.timeout)
        self.pipeline: Any = None
        self.replica: Any = None
        #: More groups of this rank (e.g. of the ranks sharing a tied parameter), destroyed
        #: with the rest.
        self.others: list[Any] = []
        store = None
        try:  # the default store hosts the abort board; without it failures still cascade
            store = dist.distributed_c10d._get_default_store()
        except Exception:
            store = None
        self.board = AbortBoard(store, f"batchgraph/pipeline/{_instances}")
        self._destroyed = False

    def create_data_groups(self) -> None:
        """Create the pipeline and replica groups (after the configuration was checked)."""
        t = self.topology
        for j in range(t.replicas):
            group = dist.new_group(t.pipeline_ranks(j), timeout=self.timeout)
            if j == t.replica:
                self.pipeline = group
        if t.replicas > 1:
            for d in range(t.stages):
                group = dist.new_group(t.replica_ranks(d), timeout=self.timeout)
                if d == t.device:
                    self.replica = group

    @property
    def backend(self) -> str:
        return str(dist.get_backend(self.control))

    def destroy(self) -> None:
        """Destroy this rank's groups (closing their connections); safe to call twice."""
        if self._destroyed:
            return
        self._destroyed = True
        for group in (self.pipeline, self.replica, *self.others, self.control):
            if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
                continue
            try:
                dist.destroy_process_group(group)
            except Exception:  # already gone with a failed peer: nothing left to close
                continue
        # A group is freed, and its connections closed, only with its last reference.
        self.control = self.pipeline = self.replica = None
        self.others = []
