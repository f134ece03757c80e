"""Property: every schedule the validator accepts runs, and trains as one device.

The schedules are drawn as random orders of the dependency graph (each device's list
is the order a random list-scheduling reached its actions), with each (stage,
microbatch) backward drawn whole (B) or split (I then W): far more orders than the
generators make, mixed backwards included. The validator must accept each, and the
threads runtime must give the single-device loss and gradients.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from batchgraph.pipeline import (
    Action,
    ActionKind,
    Pipeline,
    PipelineSchedule,
    simulate,
    validate_schedule,
)
from batchgraph.pipeline.timing import dependencies
from tests.pipeline_models import mlp, reference

_F, _B = ActionKind.FORWARD, ActionKind.BACKWARD
_I, _W = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


@st.composite
def valid_schedules(draw: st.DrawFn) -> PipelineSchedule:
    """A random valid schedule of 1-3 devices, 1-2 chunks and 1-4 microbatches."""
    p, v, m = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 4))
    stages = p * v
    pairs = [(s, mb) for s in range(stages) for mb in range(m)]
    split = {pair for pair in pairs if draw(st.booleans())}
    todo = []
    for s, mb in pairs:
        backward = (
            [Action(s, _I, mb), Action(s, _W, mb)] if (s, mb) in split else [Action(s, _B, mb)]
        )
        todo += [Action(s, _F, mb), *backward]
    done: set[Action] = set()
    order: dict[int, list[Action]] = {d: [] for d in range(p)}
    while todo:
        ready = [a for a in todo if all(d in done for d in dependencies(a, stages, split))]
        action = ready[draw(st.integers(0, len(ready) - 1))]
        todo.remove(action)
        done.add(action)
        order[action.stage % p].append(action)
    return PipelineSchedule(
        "drawn", stages=stages, devices=p, microbatches=m, chunks=v, order=order
    )


@given(schedule=valid_schedules())
def test_the_validator_accepts_every_dependency_order(schedule: PipelineSchedule) -> None:
    validate_schedule(schedule)
    result = simulate(schedule)
    assert set(result.times) == {a for acts in schedule.order.values() for a in acts}


@given(schedule=valid_schedules(), n=st.integers(4, 9))
def test_every_valid_schedule_trains_as_one_device(schedule: PipelineSchedule, n: int) -> None:
    torch.manual_seed(0)
    model = mlp(layers=2 * schedule.stages)
    x, y = torch.randn(n, 5, dtype=torch.float64), torch.randn(n, 3, dtype=torch.float64)
    want_loss, want = reference(model, x, y, nn.MSELoss())
    with Pipeline(model, schedule=schedule, loss_fn=nn.MSELoss()) as pipe:
        loss = pipe.train_step(x, y)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    for i, (p, g) in enumerate(zip(model.parameters(), want)):
        assert p.grad is not None and g is not None, f"parameter {i} has no gradient"
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-10)
