"""Values read much later stay in their stores instead of riding along every gather.

A gather carries the rows that later steps of its pool still read (the frontier trick,
``batchgraph.gathering``). Rows whose last reader is far away (a tagger's per-word
states, read by the output layer after both directions) used to ride along through
every step: copies quadratic in the sentence length. They are now left in their
stores and read from there, once they are more than a few rows.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import torch
from hypothesis import given, settings
from torch import nn

import batchgraph as bg
from batchgraph.gathering import CARRY, CARRY_FAR_ELEMENTS, CARRY_HORIZON
from batchgraph.scheduling import Schedule, Step
from batchgraph.testing import assert_batched_matches_eager


class BiChain(bg.BatchedModule):
    """A forward and a backward chain over a sequence, then an output per position."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fwd = nn.Linear(width, width)
        self.bwd = nn.Linear(width, width)
        self.out = nn.Linear(2 * width, 3)

    def forward(self, xs: torch.Tensor) -> list[Any]:
        fwd, bwd = [], []
        h = g = None
        for x in xs:
            h = torch.tanh(self.fwd(x if h is None else x + h))
            fwd.append(h)
        for x in reversed(list(xs)):
            g = torch.tanh(self.bwd(x if g is None else x + g))
            bwd.append(g)
        return [self.out(torch.cat([f, b])) for f, b in zip(fwd, reversed(bwd), strict=True)]


def _carried(schedule: Schedule) -> int:
    return sum(plan.keep for step in schedule.steps for plan in step.gathers)


def test_rows_read_far_ahead_are_not_carried() -> None:
    # 40 sequences of 30 positions, width 32: every position's states wait for the
    # output layer, far more than CARRY_FAR_ELEMENTS elements after a few steps.
    torch.manual_seed(0)
    model = BiChain(32)
    seqs = [torch.randn(30, 32) for _ in range(40)]
    with torch.no_grad(), bg.BatchingPolicy() as policy:
        outs = [model(s) for s in seqs]
    bg.compute(outs)
    schedule = policy.last_schedule
    assert schedule is not None
    assert CARRY_FAR_ELEMENTS < 40 * 32 * 4
    # No gather carries rows of a value read more than CARRY_HORIZON steps later,
    # beyond CARRY_FAR_ELEMENTS elements' worth. Carrying everything until its last use
    # (the old plan) rode 278,480 rows along; pinned so a regression shows.
    assert _carried(schedule) == 13_480
    # The states' reader (the cat before the output layer) takes them from their
    # stores: a part per store, where the old plan had them all in one carry.
    assert max(_stored_parts(step) for step in schedule.steps) == 25  # was 1


def _stored_parts(step: Step) -> int:
    return sum(1 for plan in step.gathers for sid, _, _ in plan.parts if sid != CARRY)


def test_a_short_run_still_carries_everything() -> None:
    # Within the horizon nothing changes: the frontier is carried as before.
    torch.manual_seed(0)
    model = BiChain(8)
    seqs = [torch.randn(CARRY_HORIZON // 4, 8) for _ in range(6)]
    with torch.no_grad(), bg.BatchingPolicy() as policy:
        outs = [model(s) for s in seqs]
    bg.compute(outs)
    schedule = policy.last_schedule
    assert schedule is not None
    assert max(_stored_parts(step) for step in schedule.steps) <= 2


@settings(deadline=None, max_examples=8)
@given(
    examples=st.integers(1, 24),
    length=st.integers(1, 40),
    width=st.sampled_from([4, 16, 40]),
    scheduler=st.sampled_from(["agenda", "depth"]),
    seed=st.integers(0, 2**16),
)
def test_batched_equals_eager_when_rows_stay_behind(
    examples: int, length: int, width: int, scheduler: str, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = BiChain(width).double()
    seqs = [torch.randn(max(1, length - i % 5), width, generator=gen, dtype=torch.float64)
            .requires_grad_(i % 2 == 0) for i in range(examples)]
    assert_batched_matches_eager(model, seqs, rtol=1e-10, atol=1e-10, scheduler=scheduler)
