"""When a rank posts its receives: the step plan, and posting ahead during the fill."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from torch import nn

from batchgraph.pipeline import MessageKey, MessageKind, Stage, make_schedule
from batchgraph.pipeline.dist_posting import FillPosts, StepPlan, plan_step

ACT, GRAD = MessageKind.ACTIVATION, MessageKind.GRADIENT


class FakeComm:
    """Records posts; every key's receive holds ``size`` bytes."""

    def __init__(self, size: int = 100) -> None:
        self.size = size
        self.posted: list[tuple[MessageKey, bool]] = []

    def prefetch(self, keys: Sequence[MessageKey], *, payload: bool = False) -> None:
        self.posted += [(k, payload) for k in keys]

    def ahead_bytes(self, key: MessageKey) -> int:
        return self.size


def _plan(device: int, schedule: str = "1f1b", stages: int = 2, m: int = 4) -> StepPlan:
    sched = make_schedule(schedule, stages=stages, microbatches=m)
    mine = {s: Stage(nn.Identity(), s, stages) for s in range(stages)}
    return plan_step(sched.order[device], mine, stages)


def test_plan_posts_each_remote_receive_two_actions_ahead() -> None:
    plan = _plan(1)  # 1F0 1B0 1F1 1B1 ...: activations come from stage 0, B's gradient is local
    assert plan.first == [MessageKey(ACT, 0, 1, 0)]
    assert [str(a) for _, a, *_ in plan.actions][:4] == ["1F0", "1B0", "1F1", "1B1"]
    after = [keys for *_, keys in plan.actions]
    assert after[0] == [MessageKey(ACT, 0, 1, 1)]  # after 1F0: the receive of 1F1
    assert after[1] == [] and after[-1] == [] and after[-2] == []
    assert plan.remote == [(2 * mb, MessageKey(ACT, 0, 1, mb)) for mb in range(4)]
    posted_by_plan = plan.first + [k for keys in after for k in keys]
    assert posted_by_plan == [k for _, k in plan.remote]  # every receive, once, in order
    assert plan.fill_wait == 0


def test_first_rank_posts_nothing_before_its_first_action() -> None:
    plan = _plan(0)  # 0F0 0F1 0B0 ...: inputs are local
    assert plan.first == []
    assert plan.actions[0][4] == [MessageKey(GRAD, 1, 0, 0)]  # posted when 0F0 ends
    assert plan.fill_wait == 2  # 0B0 waits for the first gradient


def test_the_fill_wait_posts_the_later_receives_once_in_order() -> None:
    plan = _plan(1, m=6)
    comm = FakeComm()
    idle: list[int] = []
    fill = FillPosts(comm, plan, on_idle=lambda: idle.append(1))
    fill.post()
    # The receives of actions 0 and 1 are posted when the step begins; the plan would
    # post 1F1's (action 2) when 1F0 ends: the fill posts it and all later ones now,
    # without payload buffers (the plan posts those of large messages).
    assert comm.posted == [(MessageKey(ACT, 0, 1, mb), False) for mb in range(1, 6)]
    assert idle == [1]
    fill.finish()
    assert idle == [1]


def test_fill_posts_stop_at_the_budget_and_leave_the_rest_to_the_plan() -> None:
    plan = _plan(0, m=6)
    comm = FakeComm(size=100)
    FillPosts(comm, plan, budget=250).post()
    # 0B0 (action 2) waits; 0B1 (action 4) and later fit two at a time.
    assert [k.microbatch for k, _ in comm.posted] == [1, 2]
    comm.posted.clear()
    FillPosts(comm, plan, budget=50).post()
    assert comm.posted == []


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_on_idle_runs_once_even_without_a_fill_wait(schedule: str) -> None:
    plan = _plan(0, schedule, stages=1)  # one stage: nothing comes from another rank
    assert plan.remote == [] and plan.fill_wait == -1
    calls: list[int] = []
    fill = FillPosts(FakeComm(), plan, on_idle=lambda: calls.append(1))
    fill.finish()
    fill.finish()
    assert calls == [1]
