"""The dependency rules between actions, and the in-order timing engine.

Every consumer of schedule timing (the grid printer, the validator's deadlock check
and the cost simulator) runs the same engine, so "what the printer draws", "what the
validator accepts" and "what the simulator predicts" cannot drift apart.

Dependencies (``S`` stages in total)::

    F(s, mb)    needs F(s-1, mb)                       (activation from the stage before)
    B/I(s, mb)  needs F(s, mb) and B/I(s+1, mb)         (gradient from the stage after)
    W(s, mb)    needs I(s, mb)                          (what I stored for W)

The gradient of stage ``s+1`` comes from its ``B`` or, if the backward is split there,
from its ``I``; a schedule may mix the two per (stage, microbatch).

The engine is "as soon as possible, in order": each device runs its list front to back,
one action at a time, and an action starts when its device is free and every
dependency has ended (plus a transfer cost when the dependency ran on another device).
Because a start time depends only on those end times, the order in which devices are
advanced does not change the result, and a device whose head action can never become
ready means the whole schedule deadlocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from batchgraph.pipeline.actions import Action, ActionKind, PipelineSchedule

__all__ = ["EngineResult", "dependencies", "run_engine"]

_F = ActionKind.FORWARD
_B = ActionKind.BACKWARD
_I = ActionKind.BACKWARD_INPUT
_W = ActionKind.BACKWARD_WEIGHT


def _split_pairs(schedule: PipelineSchedule) -> set[tuple[int, int]]:
    """(stage, microbatch) pairs whose backward is split into I and W."""
    return {
        (a.stage, a.microbatch)
        for actions in schedule.order.values()
        for a in actions
        if a.kind is _I
    }


def dependencies(
    action: Action, num_stages: int, split: set[tuple[int, int]] | None = None
) -> tuple[Action, ...]:
    """The actions ``action`` must wait for.

    Args:
        action: the action.
        num_stages: total number of model stages in the schedule.
        split: (stage, microbatch) pairs whose backward is split into I and W; the
            gradient that ``B/I(s, mb)`` waits for comes from ``I(s+1, mb)`` when
            ``(s+1, mb)`` is in it, from ``B(s+1, mb)`` otherwise.

    Returns:
        The dependencies, as concrete actions.

    Example:
        >>> [str(a) for a in dependencies(Action.parse("1B0"), 3)]
        ['1F0', '2B0']
    """
    split = split or set()
    s, mb = action.stage, action.microbatch
    if action.kind is _F:
        return (Action(s - 1, _F, mb),) if s > 0 else ()
    if action.kind is _W:
        return (Action(s, _I, mb),)
    deps = [Action(s, _F, mb)]
    if s + 1 < num_stages:
        deps.append(Action(s + 1, _I if (s + 1, mb) in split else _B, mb))
    return tuple(deps)


@dataclass
class EngineResult:
    """What the engine computed: start/end per action run, and where it got stuck.

    ``blocked`` maps each device that could not finish to its head action and the first
    dependency that head is waiting for; it is empty when every action ran.
    """

    times: dict[Action, tuple[float, float]] = field(default_factory=dict)
    device_of: dict[Action, int] = field(default_factory=dict)
    blocked: dict[int, tuple[Action, Action]] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        return max((end for _, end in self.times.values()), default=0.0)


def run_engine(
    schedule: PipelineSchedule,
    duration: Callable[[Action], float],
    transfer: Callable[[Action, Action], float],
) -> EngineResult:
    """Time every action of ``schedule`` (as soon as possible, in each device's order).

    Args:
        schedule: the schedule; it need not be valid (the engine stops where it sticks).
        duration: cost of an action.
        transfer: extra delay on a dependency ``(producer, consumer)`` that crosses
            devices; it is not called for dependencies on the same device.

    Returns:
        An :class:`EngineResult`; ``blocked`` is non-empty on deadlock.

    Example:
        >>> s = PipelineSchedule("x", 2, 2, 1, 1, {0: [Action.parse("0F0"), Action.parse("0B0")],
        ...                                       1: [Action.parse("1F0"), Action.parse("1B0")]})
        >>> r = run_engine(s, lambda a: 1.0, lambda a, b: 0.5)
        >>> r.times[Action.parse("0B0")], r.blocked
        ((4.0, 5.0), {})
    """
    split = _split_pairs(schedule)
    result = EngineResult()
    heads = {d: 0 for d in schedule.order}
    free = {d: 0.0 for d in schedule.order}
    progress = True
    while progress:
        progress = False
        for device, actions in schedule.order.items():
            while heads[device] < len(actions):
                action = actions[heads[device]]
                ready = free[device]
                waiting: Action | None = None
                for dep in dependencies(action, schedule.stages, split):
                    if dep not in result.times:
                        waiting = dep
                        break
                    end = result.times[dep][1]
                    if result.device_of[dep] != device:
                        end += transfer(dep, action)
                    ready = max(ready, end)
                if waiting is not None:
                    result.blocked[device] = (action, waiting)
                    break
                result.blocked.pop(device, None)
                result.times[action] = (ready, ready + duration(action))
                result.device_of[action] = device
                free[device] = ready + duration(action)
                heads[device] += 1
                progress = True
    return result
