"""The schedule validator: checks a schedule's invariants, names the first one broken.

Checked in this order (the first failure is raised, with the grid printout):

0. types: counts are ints >= 1, device keys ints, actions :class:`Action` objects of
   int stages and microbatches (an action given as its text, ``"0F0"``, is named, and
   so is how to parse it; no grid, as none can be drawn);
1. shape: devices are ``0..devices-1``; stages ``0..stages-1``; microbatches
   ``0..microbatches-1``; every action sits on the device that owns its stage
   (``stage % devices``);
2. no action appears twice;
3. completeness: every (stage, microbatch) has one F, and either one B, or one I and
   one W (never B together with I or W);
4. order on one device: F(s, mb) after F(s-1, mb), B/I(s, mb) after F(s, mb) and after
   B/I(s+1, mb), W after I, whenever both actions share a device;
5. order across devices: a unit-cost run of the timing engine must finish; if it
   sticks, that is a deadlock, and the message names each stuck device's head action
   and what it waits for (each list can look fine on its own and still deadlock);
6. optional in-flight limits: microbatches whose F is done and whose B/I is not, per
   stage, counted along the device's order (so independent of costs).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from batchgraph.pipeline.actions import Action, ActionKind, PipelineSchedule
from batchgraph.pipeline.grid import format_schedule
from batchgraph.pipeline.timing import dependencies, run_engine

__all__ = ["ScheduleError", "in_flight_peaks", "validate_schedule"]

_F = ActionKind.FORWARD
_B = ActionKind.BACKWARD
_I = ActionKind.BACKWARD_INPUT
_W = ActionKind.BACKWARD_WEIGHT


class ScheduleError(ValueError):
    """A schedule breaks an invariant; the message names it, the actions and the grid."""


def _fail(schedule: PipelineSchedule, message: str) -> ScheduleError:
    return ScheduleError(
        f"invalid schedule {schedule.name!r}: {message}\n\n{format_schedule(schedule)}"
    )


def _check_types(schedule: PipelineSchedule) -> None:
    """Counts, device keys and actions of the right types: the other checks (and the grid
    the errors show) read them as such, and failed inside with AttributeError or
    TypeError for an action given as its text ("0F0") or a device key as a string."""

    def bad(message: str) -> ScheduleError:  # no grid: it cannot be drawn from these
        return ScheduleError(f"invalid schedule {schedule.name!r}: {message}")

    def is_int(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    for name in ("stages", "devices", "microbatches", "chunks"):
        value = getattr(schedule, name)
        if not is_int(value) or value < 1:
            raise bad(f"{name} must be an int >= 1, got {value!r}")
    for device, actions in schedule.order.items():
        if not is_int(device):
            raise bad(
                f"order's key {device!r} is a {type(device).__name__}; the keys are device "
                f"numbers, ints 0..{schedule.devices - 1}"
            )
        if not isinstance(actions, list | tuple):
            raise bad(
                f"order[{device}] is a {type(actions).__name__}; give a list of the "
                "device's Actions in the order it runs them"
            )
        for n, a in enumerate(actions):
            if not (
                isinstance(a, Action)
                and is_int(a.stage)
                and isinstance(a.kind, ActionKind)
                and is_int(a.microbatch)
            ):
                parse = f"; write Action.parse({a!r})" if isinstance(a, str) else ""
                what = (  # its fields: str() of an Action needs an ActionKind
                    f"Action(stage={a.stage!r}, kind={a.kind!r}, microbatch={a.microbatch!r})"
                    if isinstance(a, Action)
                    else f"{a!r} ({type(a).__name__})"
                )
                raise bad(
                    f"order[{device}][{n}] is {what}, not an Action of an int stage, an "
                    f"ActionKind and an int microbatch{parse}"
                )


def _check_shape(schedule: PipelineSchedule) -> None:
    if schedule.stages != schedule.devices * schedule.chunks:
        raise _fail(
            schedule,
            f"stages={schedule.stages} must equal devices*chunks="
            f"{schedule.devices}*{schedule.chunks}; build schedules with make_schedule",
        )
    for device, actions in schedule.order.items():
        if not 0 <= device < schedule.devices:
            raise _fail(schedule, f"device {device} is out of range 0..{schedule.devices - 1}")
        for a in actions:
            if not 0 <= a.stage < schedule.stages:
                raise _fail(
                    schedule,
                    f"{a} on device {device}: stage {a.stage} is out of range 0..{schedule.stages - 1}",
                )
            if not 0 <= a.microbatch < schedule.microbatches:
                raise _fail(
                    schedule,
                    f"{a} on device {device}: microbatch {a.microbatch} is out of range "
                    f"0..{schedule.microbatches - 1}",
                )
            owner = schedule.device_of(a.stage)
            if owner != device:
                raise _fail(
                    schedule,
                    f"wrong device: {a} is on device {device}, but stage {a.stage} belongs to "
                    f"device {owner} (stage % devices)",
                )


def _check_counts(schedule: PipelineSchedule) -> None:
    counts = Counter(a for actions in schedule.order.values() for a in actions)
    for a, n in counts.items():
        if n > 1:
            raise _fail(schedule, f"duplicate action: {a} appears {n} times; each action runs once")
    for s in range(schedule.stages):
        for mb in range(schedule.microbatches):
            f, b, i, w = (Action(s, k, mb) in counts for k in (_F, _B, _I, _W))
            if not f:
                raise _fail(schedule, f"missing forward: {Action(s, _F, mb)} never runs")
            if b and (i or w):
                extra = Action(s, _I if i else _W, mb)
                raise _fail(
                    schedule,
                    f"both backwards: {Action(s, _B, mb)} and {extra} both run; use either B, "
                    "or I and W",
                )
            if not (b or i or w):
                raise _fail(
                    schedule,
                    f"missing backward: neither {Action(s, _B, mb)} nor {Action(s, _I, mb)} + "
                    f"{Action(s, _W, mb)} runs",
                )
            if i != w:
                have, lack = (Action(s, _I, mb), Action(s, _W, mb))
                if w:
                    have, lack = lack, have
                raise _fail(
                    schedule, f"split backward incomplete: {have} runs but {lack} never does"
                )


def _check_device_order(schedule: PipelineSchedule) -> None:
    split = {
        (a.stage, a.microbatch) for acts in schedule.order.values() for a in acts if a.kind is _I
    }
    for device, actions in schedule.order.items():
        position = {a: n for n, a in enumerate(actions)}
        for n, a in enumerate(actions):
            for dep in dependencies(a, schedule.stages, split):
                if dep in position and position[dep] > n:
                    raise _fail(
                        schedule,
                        f"order on device {device}: {a} (position {n}) must come after {dep} "
                        f"(position {position[dep]}), which it depends on",
                    )


def _check_deadlock(schedule: PipelineSchedule) -> None:
    result = run_engine(schedule, lambda _a: 1.0, lambda _a, _b: 0.0)
    if result.blocked:
        stuck = "; ".join(
            f"device {d} is stuck at {head}, waiting for {dep}"
            for d, (head, dep) in sorted(result.blocked.items())
        )
        raise _fail(schedule, f"deadlock: no device can go on: {stuck}")


def in_flight_peaks(schedule: PipelineSchedule, *, until: str = "backward") -> dict[int, int]:
    """Peak number of microbatches in flight per stage, counted along each device's order.

    A microbatch is in flight on stage ``s`` from the end of its F until the end of its
    B or I (``until="backward"``), or until the end of its W (``until="weight"``; for a
    B-only schedule both are the same). A device runs one action at a time and only its
    own actions change its stages' counts, so walking its list gives the exact peak under
    any costs.

    Args:
        schedule: the schedule.
        until: ``"backward"`` or ``"weight"``.

    Returns:
        ``{stage: peak}`` for every stage.

    Raises:
        ValueError: for another ``until``.

    Example:
        >>> from batchgraph.pipeline.schedules import make_schedule
        >>> in_flight_peaks(make_schedule("1f1b", stages=3, microbatches=8))
        {0: 3, 1: 2, 2: 1}
    """
    if until not in ("backward", "weight"):
        raise ValueError(f"until must be 'backward' or 'weight', got {until!r}")
    ends = {_B, _I} if until == "backward" else {_B, _W}
    peaks = dict.fromkeys(range(schedule.stages), 0)
    for actions in schedule.order.values():
        count: Counter[int] = Counter()
        for a in actions:
            if a.kind is _F:
                count[a.stage] += 1
                peaks[a.stage] = max(peaks.get(a.stage, 0), count[a.stage])
            elif a.kind in ends:
                count[a.stage] -= 1
    return peaks


def validate_schedule(
    schedule: PipelineSchedule, max_in_flight: int | Mapping[int, int] | None = None
) -> None:
    """Check every invariant of ``schedule``; raise on the first one broken.

    Args:
        schedule: the schedule to check.
        max_in_flight: optional limit on microbatches in flight (F done, B/I not done)
            per stage: one int for all stages, or ``{stage: limit}`` for some.

    Raises:
        ScheduleError: naming the invariant, the action(s) as ``"2F0"`` strings, and
            with the grid printout appended.

    Example:
        >>> from batchgraph.pipeline.schedules import make_schedule
        >>> validate_schedule(make_schedule("1f1b", stages=4, microbatches=8), max_in_flight=4)
    """
    _check_types(schedule)
    _check_shape(schedule)
    _check_counts(schedule)
    _check_device_order(schedule)
    _check_deadlock(schedule)
    if max_in_flight is None:
        return
    limits = (
        dict(max_in_flight)
        if isinstance(max_in_flight, Mapping)
        else dict.fromkeys(range(schedule.stages), max_in_flight)
    )
    peaks = in_flight_peaks(schedule)
    for stage in sorted(limits):
        if peaks.get(stage, 0) > limits[stage]:
            raise _fail(
                schedule,
                f"too many in flight: stage {stage} holds {peaks[stage]} microbatches between F "
                f"and B/I, limit {limits[stage]}",
            )
