"""Stats from a real run: sane values, and more bubble with fewer microbatches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchgraph.pipeline import Pipeline, PipelineStats
from tests.pipeline_models import SleepLayer


def _run(schedule: str, m: int) -> PipelineStats:
    # Sleep layers: compute that releases the GIL, so stages overlap like real devices.
    layers = [SleepLayer(0.002, 0.004) for _ in range(4)]
    x = torch.randn(m * 2, 3, dtype=torch.float64)
    with Pipeline(
        layers, microbatches=m, schedule=schedule, loss_fn=nn.MSELoss(), timeout=30
    ) as pipe:
        # Warm-up: in its first step a stage of user-defined layers runs its forwards one
        # at a time, to learn whether they draw random numbers (see pipeline.rng).
        pipe.train_step(x, x)
        pipe.train_step(x, x)
        assert {e.device for e in pipe.timeline} == {0, 1, 2, 3}
        assert len(pipe.timeline) == sum(len(a) for a in pipe.schedule.order.values())
        return pipe.stats


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_stats_reasonable(schedule: str) -> None:
    one, eight = _run(schedule, 1), _run(schedule, 8)
    for stats in (one, eight):
        assert 0.0 <= stats.utilization <= 1.0
        assert stats.makespan > 0
        assert stats.forward_time > 0 and stats.backward_time > 0
        assert stats.forward_bubble_time >= 0 and stats.backward_bubble_time >= 0
        assert stats.forward_time + stats.backward_time == pytest.approx(4 * stats.makespan)
        assert set(stats.stage_forward) == {0, 1, 2, 3}
    # p = 4: m = 1 leaves each device idle ~3/4 of the time, m = 8 far less.
    assert one.bubble_fraction > eight.bubble_fraction
    assert one.utilization < 0.4 < eight.utilization
