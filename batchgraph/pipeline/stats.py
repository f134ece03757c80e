"""Pipeline statistics from what ran: busy time, bubbles and utilization.

Convention (seed 001's ``PipelineStats``, made precise)
------------------------------------------------------
The step's *window* runs from the earliest action start to the latest action end over all
devices. On each device, every moment of the window is either

* busy in a forward (``F``) or in a backward (``B``, ``I`` or ``W``), or
* idle: a *bubble*. An idle gap is charged to the phase of the action that comes *after*
  it (waiting for an activation is a forward bubble; waiting for a gradient is a backward
  bubble); idle time after a device's last action is charged to that action's phase (the
  drain). A device that ran nothing is idle for the whole window, charged to forward.

Then per device ``forward_time = forward busy + forward bubble`` and ``backward_time =
backward busy + backward bubble`` (the wall time of each phase, as in seed 001), so
``forward_time + backward_time`` is the window, and
``utilization = 1 - (forward_bubble + backward_bubble) / (forward_time + backward_time)``
is the busy fraction. The overall figures sum devices (device-seconds), so the overall
utilization is total busy time over ``devices x window``. Times are in seconds.

A device may run several stages (interleaved schedules); bubbles belong to devices, so
per-stage figures are busy times only (:attr:`PipelineStats.stage_forward` and
:attr:`PipelineStats.stage_backward`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from batchgraph.pipeline.actions import Action, ActionKind

__all__ = ["DeviceStats", "EventLike", "PipelineStats"]


class EventLike(Protocol):
    """Anything with a device, an action and measured start/end times (seconds)."""

    @property
    def device(self) -> int: ...

    @property
    def action(self) -> Action: ...

    @property
    def start(self) -> float: ...

    @property
    def end(self) -> float: ...


@dataclass(frozen=True)
class DeviceStats:
    """One device's share of a step; see the module docstring for the convention."""

    forward_busy: float = 0.0
    backward_busy: float = 0.0
    forward_bubble: float = 0.0
    backward_bubble: float = 0.0

    @property
    def forward_time(self) -> float:
        """Wall time of the forward phase: forward busy plus forward bubble."""
        return self.forward_busy + self.forward_bubble

    @property
    def backward_time(self) -> float:
        """Wall time of the backward phase: backward busy plus backward bubble."""
        return self.backward_busy + self.backward_bubble

    @property
    def bubble_time(self) -> float:
        """Idle time, both phases."""
        return self.forward_bubble + self.backward_bubble

    @property
    def utilization(self) -> float:
        """Busy fraction of the window, in [0, 1]."""
        total = self.forward_time + self.backward_time
        return 1.0 - self.bubble_time / total if total > 0 else 0.0


@dataclass(frozen=True)
class PipelineStats:
    """Statistics of one pipeline step.

    Build it with :meth:`from_events`. The seed-001 fields (``forward_time``,
    ``backward_time``, ``forward_bubble_time``, ``backward_bubble_time``,
    ``utilization``) are the sums over devices.

    Example:
        >>> from batchgraph.pipeline.actions import Action
        >>> from types import SimpleNamespace as E
        >>> events = [E(device=0, action=Action.parse("0F0"), start=0.0, end=1.0),
        ...           E(device=0, action=Action.parse("0B0"), start=2.0, end=4.0)]
        >>> stats = PipelineStats.from_events(events, devices=1)
        >>> stats.backward_bubble_time, stats.utilization
        (1.0, 0.75)
    """

    makespan: float = 0.0
    devices: dict[int, DeviceStats] = field(default_factory=dict)
    stage_forward: dict[int, float] = field(default_factory=dict)
    stage_backward: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_events(cls, events: Iterable[EventLike], devices: int | None = None) -> PipelineStats:
        """Compute the statistics of a step from its measured events.

        Args:
            events: one record per action run, with ``device``, ``action``, ``start``, ``end``.
            devices: how many devices took part (devices with no events count as idle);
                default: those that appear in ``events``.

        Returns:
            The statistics; all zero when there are no events.
        """
        evs = sorted(events, key=lambda e: (e.device, e.start))
        if not evs:
            return cls()
        t0 = min(e.start for e in evs)
        t1 = max(e.end for e in evs)
        window = t1 - t0
        ids = set(range(devices)) if devices is not None else set()
        ids.update(e.device for e in evs)
        per_device: dict[int, DeviceStats] = {}
        stage_f: dict[int, float] = {}
        stage_b: dict[int, float] = {}
        for dev in sorted(ids):
            mine = [e for e in evs if e.device == dev]
            busy = {True: 0.0, False: 0.0}  # key: is forward
            bubble = {True: 0.0, False: 0.0}
            cursor = t0
            for e in mine:
                fwd = e.action.kind is ActionKind.FORWARD
                bubble[fwd] += max(0.0, e.start - cursor)
                busy[fwd] += e.end - e.start
                cursor = max(cursor, e.end)
                table = stage_f if fwd else stage_b
                table[e.action.stage] = table.get(e.action.stage, 0.0) + (e.end - e.start)
            last_fwd = mine[-1].action.kind is ActionKind.FORWARD if mine else True
            bubble[last_fwd] += max(0.0, t1 - cursor)
            per_device[dev] = DeviceStats(busy[True], busy[False], bubble[True], bubble[False])
        return cls(window, per_device, stage_f, stage_b)

    def _sum(self, name: str) -> float:
        return float(sum(getattr(d, name) for d in self.devices.values()))

    @property
    def forward_time(self) -> float:
        """Forward phase wall time, summed over devices (seconds)."""
        return self._sum("forward_time")

    @property
    def backward_time(self) -> float:
        """Backward phase wall time, summed over devices (seconds)."""
        return self._sum("backward_time")

    @property
    def forward_bubble_time(self) -> float:
        """Idle time charged to the forward phase, summed over devices (seconds)."""
        return self._sum("forward_bubble")

    @property
    def backward_bubble_time(self) -> float:
        """Idle time charged to the backward phase, summed over devices (seconds)."""
        return self._sum("backward_bubble")

    @property
    def bubble_time(self) -> float:
        """All idle time, summed over devices (seconds)."""
        return self.forward_bubble_time + self.backward_bubble_time

    @property
    def utilization(self) -> float:
        """``1 - bubble / (forward_time + backward_time)``: the busy fraction, in [0, 1]."""
        total = self.forward_time + self.backward_time
        return 1.0 - self.bubble_time / total if total > 0 else 0.0

    @property
    def bubble_fraction(self) -> float:
        """``1 - utilization``: the idle fraction of ``devices x makespan``."""
        return 1.0 - self.utilization if self.devices else 0.0

    def summary(self) -> str:
        """A short multi-line table: one row per device and a total row."""
        lines = [
            f"{'device':>6} {'fwd busy':>9} {'bwd busy':>9} {'fwd bub':>9} {'bwd bub':>9} {'util':>6}"
        ]
        for dev, d in sorted(self.devices.items()):
            lines.append(
                f"{dev:>6} {d.forward_busy:9.4f} {d.backward_busy:9.4f} "
                f"{d.forward_bubble:9.4f} {d.backward_bubble:9.4f} {d.utilization:6.1%}"
            )
        lines.append(
            f"{'all':>6} {self._sum('forward_busy'):9.4f} {self._sum('backward_busy'):9.4f} "
            f"{self.forward_bubble_time:9.4f} {self.backward_bubble_time:9.4f} {self.utilization:6.1%}"
            f"   makespan {self.makespan:.4f} s"
        )
        return "\n".join(lines)
