"""The schedule simulator: predicted timing of a schedule under per-action costs.

Conventions (the tests pin numbers in these terms):

* **Timing**: each device runs its list in order, one action at a time, each as soon as
  its device is free and its dependencies have ended; a dependency produced on another
  device adds the transfer cost (see :mod:`batchgraph.pipeline.timing`).
* **Makespan**: the end of the last action; every device is counted from time 0 to the
  makespan, so a device's idle time includes waiting for its first input and for the
  others to finish.
* **Bubble fraction**: ``sum(idle) / (devices * makespan)``, the share of all device
  time spent idle. With equal stage costs GPipe and 1F1B give ``(p-1)/(m+p-1)``.
* **In flight** (``peak_in_flight``): a microbatch is in flight on a stage from the end
  of its F to the end of its B or I, the activations 1F1B bounds (seed 004).
  ``peak_weight_pending`` counts until the end of W instead: a split schedule keeps, for
  each such microbatch, what W needs (the gradients at the layer outputs and the layer
  inputs), typically smaller than the full activations; for B-only schedules the two
  counts are equal. Both are counted along each device's order, so they do not depend
  on costs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TypeAlias

from batchgraph.pipeline.actions import Action, ActionKind, PipelineSchedule
from batchgraph.pipeline.timing import run_engine
from batchgraph.pipeline.trace import TimelineEvent
from batchgraph.pipeline.validate import in_flight_peaks, validate_schedule

__all__ = ["ActionCosts", "CostSpec", "SimulationResult", "simulate"]

#: A cost: one number for every stage, ``{stage: cost}`` (other stages keep the
#: default), or a function of the stage.
CostSpec: TypeAlias = float | Mapping[int, float] | Callable[[int], float]

_FIELD_OF_KIND = {
    ActionKind.FORWARD: "forward",
    ActionKind.BACKWARD: "backward",
    ActionKind.BACKWARD_INPUT: "backward_input",
    ActionKind.BACKWARD_WEIGHT: "backward_weight",
}


@dataclass(frozen=True)
class ActionCosts:
    """Cost of each kind of action, and of moving a tensor between devices.

    Each field is a :data:`CostSpec`. ``transfer`` is keyed by the stage that produced
    the tensor and is paid only when producer and consumer sit on different devices.

    Example:
        >>> c = ActionCosts(forward={0: 3.0}, transfer=0.5)
        >>> c.cost(Action.parse("0F0")), c.cost(Action.parse("1F0")), c.cost(Action.parse("1B0"))
        (3.0, 1.0, 2.0)
    """

    forward: CostSpec = 1.0
    backward: CostSpec = 2.0
    backward_input: CostSpec = 1.0
    backward_weight: CostSpec = 1.0
    transfer: CostSpec = 0.0

    def _lookup(self, name: str, stage: int) -> float:
        spec = getattr(self, name)
        if isinstance(spec, Mapping):
            default = next(f.default for f in fields(self) if f.name == name)
            value = float(spec.get(stage, default))  # type: ignore[arg-type]
        elif callable(spec):
            value = float(spec(stage))
        else:
            value = float(spec)
        if not math.isfinite(value) or value < 0:  # `nan < 0` is False
            raise ValueError(
                f"ActionCosts.{name} for stage {stage} is {value}; costs must be finite and >= 0"
            )
        return value

    def cost(self, action: Action) -> float:
        """The cost of ``action`` (by its kind and stage)."""
        return self._lookup(_FIELD_OF_KIND[action.kind], action.stage)

    def transfer_cost(self, producer: Action, consumer: Action) -> float:
        """The delay on a cross-device dependency (keyed by the producer's stage)."""
        del consumer  # one cost per produced tensor, whoever consumes it
        return self._lookup("transfer", producer.stage)

    @classmethod
    def parse(cls, text: str) -> ActionCosts:
        """Read ``"F,B,I,W"`` or ``"F,B,I,W,T"`` (T: transfer), e.g. ``"1,2,1,1"``.

        Raises:
            ValueError: if ``text`` is not 4 or 5 finite non-negative numbers separated by
                commas.

        Example:
            >>> ActionCosts.parse("1,2,1,1,0.5").transfer
            0.5
        """
        parts = [p.strip() for p in text.split(",")]
        try:
            values = [float(p) for p in parts]
        except ValueError:
            values = []
        if len(values) not in (4, 5) or not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(
                f"costs {text!r}: expected 4 or 5 finite non-negative numbers 'F,B,I,W[,T]', "
                "e.g. '1,2,1,1'"
            )
        return cls(*values)


@dataclass
class SimulationResult:
    """What :func:`simulate` predicts for a schedule; see the module doc for conventions."""

    schedule: PipelineSchedule
    costs: ActionCosts
    makespan: float
    busy: dict[int, float]
    idle: dict[int, float]
    stage_busy: dict[int, float]
    times: dict[Action, tuple[float, float]]
    peak_in_flight: dict[int, int]
    peak_weight_pending: dict[int, int]
    events: list[TimelineEvent] = field(default_factory=list)

    @property
    def bubble_time(self) -> float:
        """Idle time summed over devices."""
        return sum(self.idle.values())

    @property
    def bubble_fraction(self) -> float:
        """``sum(idle) / (devices * makespan)``; 0 for an empty schedule."""
        total = self.schedule.devices * self.makespan
        return self.bubble_time / total if total > 0 else 0.0

    def summary(self) -> str:
        """A few lines: makespan, bubble, busy/idle per device, peak in flight per stage.

        Example:
            >>> from batchgraph.pipeline.schedules import make_schedule
            >>> print(simulate(make_schedule("gpipe", stages=1, microbatches=2)).summary())
            makespan: 6
            bubble: 0.0000 of device time (idle 0 over 1 devices)
            busy per device: 0: 6
            idle per device: 0: 0
            peak in flight per stage (F done, B/I not): 0: 2
        """
        lines = [
            f"makespan: {self.makespan:g}",
            f"bubble: {self.bubble_fraction:.4f} of device time (idle {self.bubble_time:g} "
            f"over {self.schedule.devices} devices)",
            "busy per device: " + ", ".join(f"{d}: {b:g}" for d, b in sorted(self.busy.items())),
            "idle per device: " + ", ".join(f"{d}: {b:g}" for d, b in sorted(self.idle.items())),
            "peak in flight per stage (F done, B/I not): "
            + ", ".join(f"{s}: {n}" for s, n in sorted(self.peak_in_flight.items())),
        ]
        if self.schedule.split_backward:
            lines.append(
                "peak waiting for W per stage (F done, W not): "
                + ", ".join(f"{s}: {n}" for s, n in sorted(self.peak_weight_pending.items()))
            )
        return "\n".join(lines)


def simulate(schedule: PipelineSchedule, costs: ActionCosts | None = None) -> SimulationResult:
    """Validate ``schedule`` and predict its timing under ``costs``.

    Args:
        schedule: the schedule.
        costs: per-action costs; default F=1, B=2, I=1, W=1, transfer 0.

    Returns:
        A :class:`SimulationResult` with makespan, per-device busy and idle time, bubble
        fraction, per-action start/end times, peak in-flight microbatches per stage and
        the planned :class:`TimelineEvent` list (sorted by start, then device).

    Raises:
        ScheduleError: if the schedule is invalid (see :func:`validate_schedule`).
        ValueError: if a cost is negative.

    Example:
        >>> from batchgraph.pipeline.schedules import make_schedule
        >>> r = simulate(make_schedule("1f1b", stages=4, microbatches=8))
        >>> r.makespan, round(r.bubble_fraction, 4)
        (33.0, 0.2727)
    """
    costs = costs or ActionCosts()
    validate_schedule(schedule)
    run = run_engine(schedule, costs.cost, costs.transfer_cost)
    makespan = run.makespan
    busy = dict.fromkeys(range(schedule.devices), 0.0)
    stage_busy = dict.fromkeys(range(schedule.stages), 0.0)
    events: list[TimelineEvent] = []
    for action, (start, end) in run.times.items():
        device = run.device_of[action]
        busy[device] += end - start
        stage_busy[action.stage] += end - start
        events.append(TimelineEvent(device, action, start, end))
    events.sort(key=lambda e: (e.start, e.device, e.end))
    return SimulationResult(
        schedule=schedule,
        costs=costs,
        makespan=makespan,
        busy=busy,
        idle={d: makespan - b for d, b in busy.items()},
        stage_busy=stage_busy,
        times=dict(run.times),
        peak_in_flight=in_flight_peaks(schedule),
        peak_weight_pending=in_flight_peaks(schedule, until="weight"),
        events=events,
    )
