"""When a rank posts its receives: a step's plan, and posting ahead during the fill.

Posting a receive costs a rank tens of microseconds of its own time (a buffer, and with
gloo a message to the sender saying where it goes), and a posted buffer holds memory
until its message lands. So each receive is posted once, on one of two occasions::

    action i:  [fill wait? post the step's later receives]  recv ─► compute ─► send  [post i+2's]

* by plan: right after action ``i`` finishes, the receives of action ``i + 2`` (their
  payload buffers too), so every message finds its receive posted one whole action
  before it is needed; a step posts those of its first two actions when it begins, so
  the first rank's first action starts without posting anything;
* during the fill: the step's first receive from another rank waits for the pipeline to
  fill (stage s for s forwards upstream; stage 0 for the whole forward chain and back),
  so right before it the rank posts the receives of its later actions, in order, until
  those hold ``budget`` bytes (one-transfer buffers and headers only: the payload
  buffers of larger messages are still posted by plan). A rank whose step fits the
  budget then spends nothing on posting between actions on its critical path.

gloo cannot tell whether a posted receive has landed without waiting on it (a receive's
``is_completed`` turns true only once it was waited), so the fill wait is known from
the plan, not probed. Anything else that can wait for an idle moment (the timeline
gather's receives on rank 0) is handed over as ``on_idle`` and runs there too (or at
the end of a step with no receive from another rank).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from batchgraph.pipeline.actions import Action, ActionKind
from batchgraph.pipeline.comm import MessageKey, MessageKind
from batchgraph.pipeline.stage import Stage

__all__ = ["FILL_POST_BYTES", "FillPosts", "StepPlan", "plan_step"]

#: Bytes of receives a rank may post ahead of plan during the fill, per step.
FILL_POST_BYTES = 1 << 20
_AHEAD = 2  # by plan, the receives of action i + _AHEAD are posted when action i ends


class _Poster(Protocol):
    def prefetch(self, keys: Sequence[MessageKey], *, payload: bool = False) -> None: ...
    def ahead_bytes(self, key: MessageKey) -> int: ...


class StepPlan(NamedTuple):
    """A step's actions as a rank's loop runs them, computed once (the schedule is static)."""

    #: (stage, action, key received, key sent, receives to post when the action ends)
    actions: list[tuple[Stage, Action, MessageKey | None, MessageKey | None, list[MessageKey]]]
    #: receives posted when the step begins (those of the first actions)
    first: list[MessageKey]
    #: every receive from another stage in the step: (index of the action, key), in order
    remote: list[tuple[int, MessageKey]]

    @property
    def fill_wait(self) -> int:
        """The index of the first action that receives from another rank (-1: none)."""
        return self.remote[0][0] if self.remote else -1


def plan_step(plan: Sequence[Action], stages: dict[int, Stage], num_stages: int) -> StepPlan:
    """The :class:`StepPlan` of a rank that runs ``plan`` on its ``stages``."""
    last = num_stages - 1
    own: list[list[MessageKey]] = []
    for a in plan:
        if a.kind is ActionKind.FORWARD and a.stage > 0:
            own.append([MessageKey(MessageKind.ACTIVATION, a.stage - 1, a.stage, a.microbatch)])
        elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) and a.stage < last:
            own.append([MessageKey(MessageKind.GRADIENT, a.stage + 1, a.stage, a.microbatch)])
        else:
            own.append([])
    actions = []
    for i, a in enumerate(plan):
        stage = stages[a.stage]
        after = own[i + _AHEAD] if i + _AHEAD < len(own) else []
        actions.append((stage, a, *stage.message_keys(a), after))
    first = [k for keys in own[:_AHEAD] for k in keys]
    remote = [(i, k) for i, keys in enumerate(own) for k in keys]
    return StepPlan(actions, first, remote)


class FillPosts:
    """One step's posting during the fill (see the module docstring).

    Args:
        comm: the communicator.
        plan: the step's plan.
        budget: bytes of receives this step may post ahead of plan.
        on_idle: called once: at the fill wait, or by :meth:`finish` if the step has none.

    Example:
        A rank's loop calls :meth:`post` right before the action at ``plan.fill_wait``
        receives, and :meth:`finish` after its last action.
    """

    __slots__ = ("_budget", "_comm", "_on_idle", "_plan")

    def __init__(
        self,
        comm: _Poster,
        plan: StepPlan,
        budget: int = FILL_POST_BYTES,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        self._comm, self._plan = comm, plan
        self._budget, self._on_idle = budget, on_idle

    def post(self) -> None:
        """Post the receives of the actions after the fill wait's next one, in order,
        within the budget; run ``on_idle``."""
        self._run_on_idle()
        # Up to the action after the fill wait, the plan has posted (or will post) them.
        horizon = self._plan.fill_wait + 1
        keys = []
        budget = self._budget
        for i, key in self._plan.remote:
            if i <= horizon:
                continue
            cost = self._comm.ahead_bytes(key)
            if cost > budget:
                break  # the rest is left to the plan: posted in order, never out of it
            budget -= cost
            keys.append(key)
        if keys:
            self._comm.prefetch(keys)

    def finish(self) -> None:
        """The step's actions are done: run ``on_idle`` if no fill wait came."""
        self._run_on_idle()

    def _run_on_idle(self) -> None:
        if self._on_idle is not None:
            on_idle, self._on_idle = self._on_idle, None
            on_idle()
