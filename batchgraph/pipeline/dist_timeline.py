"""How a ``DistributedPipeline`` rank records its last step's timeline and statistics:
every rank's gathered on rank 0 (see :class:`~batchgraph.pipeline.dist_sync.TimelineGather`),
its own elsewhere."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchgraph.pipeline.dist_sync import TimelineGather, step_timeline
from batchgraph.pipeline.dist_topology import clock_offsets
from batchgraph.pipeline.stats import PipelineStats
from batchgraph.pipeline.trace import TimelineEvent

if TYPE_CHECKING:
    from batchgraph.pipeline.actions import PipelineSchedule
    from batchgraph.pipeline.dist_topology import ProcessGroups, Topology

__all__ = ["RankTimeline"]


class RankTimeline:
    """The timeline and statistics recording of ``DistributedPipeline`` (its base class)."""

    if TYPE_CHECKING:
        schedule: PipelineSchedule
        groups: ProcessGroups
        topology: Topology

    def _start_timeline(self, collect_stats: bool, timeout: float) -> None:
        """Align the ranks' clocks and, with ``collect_stats``, gather to rank 0 (collective)."""
        self.collect_stats = collect_stats
        self._offsets = clock_offsets(self.groups.control)
        self._gather: TimelineGather | None = None
        if collect_stats:
            t = self.topology
            self._gather = TimelineGather(
                self.schedule, t.rank, t.world, self.groups.control, self._offsets, timeout
            )
        self._events: list[TimelineEvent] = []
        self._stats = PipelineStats()

    def _record(self, events: list[tuple[float, float]], train: bool) -> None:
        if self._gather is not None:
            self._events = self._gather.finish(events)
        else:
            self._events = step_timeline(
                events, self.schedule, self.topology.rank, self.topology.world, train, None,
                self._offsets,
            )  # fmt: skip
        devices = self.topology.world if self.collect_stats and self.topology.rank == 0 else None
        self._stats = PipelineStats.from_events(self._events, devices=devices)
