"""A schedule built as data runs as given: ``Pipeline(model, schedule=s)`` takes its
devices, chunks and microbatches, and trains as on one device.

Before, the counts had to be passed again (``stages=2, chunks=2, microbatches=4`` for a
schedule that holds them): left out, ``Pipeline`` asked for ``stages=``, then said the
schedule "is for 4 stages and 4 microbatches, but the pipeline has 2 stages and
microbatches=1", naming neither ``chunks`` nor that the schedule already knew.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from batchgraph.pipeline import (
    Action,
    ActionKind,
    Pipeline,
    PipelineConfigError,
    PipelineSchedule,
    make_schedule,
    validate_schedule,
)
from tests.pipeline_models import assert_grads_equal, mlp, reference


def _split_some_backwards(schedule: PipelineSchedule, seed: int) -> PipelineSchedule:
    """``schedule`` with some B's split into I, and its W right after or at the end."""
    rnd = random.Random(seed)
    order: dict[int, list[Action]] = {}
    for device, actions in schedule.order.items():
        out: list[Action] = []
        held: list[Action] = []
        for a in actions:
            if a.kind is not ActionKind.BACKWARD or rnd.random() < 0.3:
                out.append(a)
                continue
            out.append(Action(a.stage, ActionKind.BACKWARD_INPUT, a.microbatch))
            held.append(Action(a.stage, ActionKind.BACKWARD_WEIGHT, a.microbatch))
            if rnd.random() < 0.5:
                out.append(held.pop(0))
        order[device] = out + held
    return PipelineSchedule(
        "hand", schedule.stages, schedule.devices, schedule.microbatches, schedule.chunks, order
    )


@settings(max_examples=10, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]),
    p=st.integers(1, 3),
    v=st.integers(1, 2),
    m=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
def test_a_schedule_object_gives_the_counts_and_trains_exactly(
    name: str, p: int, v: int, m: int, seed: int
) -> None:
    chunks = v if name == "interleaved-1f1b" else 1
    schedule = _split_some_backwards(
        make_schedule(name, stages=p, microbatches=m, chunks=chunks), seed
    )
    validate_schedule(schedule)
    torch.manual_seed(seed)
    model = mlp(layers=6)  # 11 layers: enough for 3 devices x 2 chunks
    x = torch.randn(m + 2, 5, dtype=torch.float64)
    y = torch.randn(m + 2, 3, dtype=torch.float64)
    want_loss, want = reference(model, x, y, nn.MSELoss())
    with Pipeline(model, schedule=schedule, loss_fn=nn.MSELoss(), timeout=30) as pipe:
        assert pipe.schedule is schedule and len(pipe.stage_modules) == p * chunks
        loss = pipe.train_step(x, y)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, want)


@pytest.mark.parametrize(
    ("given", "match"),
    [
        (
            {"stages": 3},
            r"stages=3 was passed with schedule 'interleaved-1f1b', which has devices=2",
        ),
        ({"microbatches": 2}, r"microbatches=2 was passed .* which has microbatches=4"),
        ({"chunks": 1}, r"chunks=1 was passed .* which has chunks=2: leave chunks= out"),
    ],
)
def test_counts_that_disagree_with_the_schedule_are_refused(
    given: dict[str, int], match: str
) -> None:
    schedule = make_schedule("interleaved-1f1b", stages=2, microbatches=4, chunks=2)
    with pytest.raises(PipelineConfigError, match=match):
        Pipeline(mlp(layers=4), schedule=schedule, **given)  # type: ignore[arg-type]
    # Agreeing ones are fine.
    Pipeline(mlp(layers=4), schedule=schedule, stages=2, microbatches=4, chunks=2).close()
