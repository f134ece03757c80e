"""Pipeline built from a list of Stage objects (DESIGN's public API): it trains as the
unsplit model, and Stages whose own index or count contradict the list are refused
instead of silently ignored."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from batchgraph.pipeline import Pipeline, PipelineConfigError, Stage


def _parts() -> tuple[nn.Module, nn.Module, nn.Module]:
    torch.manual_seed(0)
    return (nn.Sequential(nn.Linear(4, 8), nn.Tanh()), nn.Linear(8, 8), nn.Linear(8, 2))


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 6), st.sampled_from(["gpipe", "1f1b", "zb-h1"]))
def test_a_list_of_stages_trains_as_the_unsplit_model(microbatches: int, schedule: str) -> None:
    parts = _parts()
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    loss = nn.MSELoss()(parts[2](parts[1](parts[0](x))), y)
    expected = torch.autograd.grad(loss, [p for m in parts for p in m.parameters()])
    stages = [Stage(m, i, len(parts)) for i, m in enumerate(parts)]
    with Pipeline(stages, microbatches=microbatches, schedule=schedule,
                  loss_fn=nn.MSELoss()) as pipe:
        got_loss = pipe.train_step(x, y)
    torch.testing.assert_close(got_loss, loss.detach())
    got = [p.grad for m in parts for p in m.parameters()]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_stages_out_of_index_order_are_refused() -> None:
    # Before: the list ran in its order whatever the Stages' indices said.
    first, second, third = _parts()
    stages = [Stage(first, 0, 3), Stage(third, 2, 3), Stage(second, 1, 3)]
    with pytest.raises(PipelineConfigError, match=r"module\[1\] is Stage\(2/3, Linear.*"
                       r"give Stage\(\.\.\., index=1, num_stages=3\) there"):
        Pipeline(stages, microbatches=2, loss_fn=nn.MSELoss())


def test_stages_counting_other_stages_are_refused() -> None:
    first, second, _ = _parts()
    with pytest.raises(PipelineConfigError, match=r"module\[0\] is Stage\(0/3"):
        Pipeline([Stage(first, 0, 3), Stage(second, 1, 3)], microbatches=2)


def test_a_stages_count_that_differs_from_the_list_is_refused() -> None:
    # Before: stages=1 merged the two Stages into one, against "one per stage".
    first, second, _ = _parts()
    with pytest.raises(PipelineConfigError, match=r"a list of 2 Stages, one per stage, but "
                       r"stages=1 x chunks=1 asks for 1; leave stages= out"):
        Pipeline([Stage(first, 0, 2), Stage(second, 1, 2)], stages=1, microbatches=2)
