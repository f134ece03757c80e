"""A module shared by stages on different threads, its state changed in forward.

On threads, the stages of different devices run at once: a counter kept in Python by a
block that two stages share (``self.calls += 1``) lost updates (13 runs of 20 with
``sys.setswitchinterval(1e-6)``: 3600 calls counted of 4000), and a buffer updated in
place ran two kernels on one tensor. Stages sharing such a module now run one at a time
(batchgraph.pipeline.shared_modules): the counts, the loss and the gradients are one
device's. Stages sharing a torch.nn layer without state (weight tying) are not locked.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from batchgraph.pipeline import Pipeline
from tests.pipeline_models import SCHEDULES, assert_grads_equal, chunks_for, reference

# Updates per forward: many, so that a lost one is likely when threads interleave.
_UPDATES = 100


class Counted(nn.Module):
    """Counts its calls in Python and in a buffer; its output reads neither."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.calls = 0
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x: Tensor) -> Tensor:
        for _ in range(_UPDATES):
            self.calls += 1
            self.count.add_(1)
        return torch.tanh(self.lin(x))


@pytest.fixture(autouse=True)
def _switch_often() -> Iterator[None]:
    # Threads switch after every few bytecodes: a read-add-write of a count is split.
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _model(blocks: int) -> tuple[nn.Sequential, Counted]:
    torch.manual_seed(0)
    shared = Counted()
    mods: list[nn.Module] = []
    for _ in range(blocks):
        mods += [shared, nn.Linear(4, 4, dtype=torch.float64)]
    return nn.Sequential(*mods), shared


@settings(max_examples=8, deadline=None)
@given(stages=st.integers(2, 3), microbatches=st.integers(2, 8),
       schedule=st.sampled_from(SCHEDULES))
@example(stages=2, microbatches=8, schedule="gpipe")
def test_a_counter_shared_by_stages_counts_as_one_device(
    stages: int, microbatches: int, schedule: str
) -> None:
    blocks = stages * chunks_for(schedule)
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64)
    one, _ = _model(blocks)
    loss, grads = reference(one, x, y, nn.MSELoss())
    model, shared = _model(blocks)
    steps = 4  # the first runs locked for random numbers (pipeline.rng), the others not
    with Pipeline(model, stages=stages, microbatches=microbatches, schedule=schedule,
                  loss_fn=nn.MSELoss(), chunks=chunks_for(schedule)) as pipe:
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            torch.testing.assert_close(pipe.train_step(x, y), loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, grads)
    # One device counts each block's call per microbatch, as many as the model holds.
    expected = steps * microbatches * blocks * _UPDATES
    assert (shared.calls, int(shared.count)) == (expected, expected)


def test_a_tied_layer_without_state_is_not_locked() -> None:
    lin = nn.Linear(4, 4, dtype=torch.float64)
    model = nn.Sequential(lin, nn.Tanh(), nn.Linear(4, 4, dtype=torch.float64), lin)
    with Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss()) as pipe:
        assert all(stage.shared is None for stage in pipe._runtime.stages)
    model = _model(2)[0]
    with Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss()) as pipe:
        first, second = pipe._runtime.stages
        assert first.shared is second.shared is not None
