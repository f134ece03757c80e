"""A block repeated within one stage (``nn.Sequential(block, block)``, layers sharing
one block as ALBERT's do), and weights tied between two layers of a stage.

The shape probe and the kept-inputs check swapped meta copies into the stage with
``torch.func.functional_call``, which swapped a repeated block's tensors under both of
its names and put a meta copy back: its parameters were left on meta and the first step
failed ("Tensor on device meta is not on the expected device cpu"), under every
schedule. They now train as one device.
"""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from batchgraph.pipeline import Pipeline
from tests.pipeline_models import SCHEDULES, assert_grads_equal, chunks_for, reference


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.lin(x))


def _model(blocks: int, kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    shared = Block()  # "albert": one block for every layer, in every stage
    mods: list[nn.Module] = []
    for _ in range(blocks):
        if kind == "albert":
            mods += [shared, shared]
        elif kind == "repeated":
            block = Block()
            mods += [block, block]
        else:  # "tied": two layers of a stage share a weight
            first, second = Block(), Block()
            second.lin.weight = first.lin.weight
            mods += [first, second]
    return nn.Sequential(*mods)


@settings(max_examples=12, deadline=None)
@given(stages=st.integers(1, 3), microbatches=st.integers(1, 4),
       schedule=st.sampled_from(SCHEDULES), kind=st.sampled_from(["albert", "repeated", "tied"]))
@example(stages=2, microbatches=2, schedule="1f1b", kind="repeated")
@example(stages=2, microbatches=3, schedule="gpipe", kind="albert")
def test_a_block_repeated_in_a_stage_trains_as_one_device(
    stages: int, microbatches: int, schedule: str, kind: str
) -> None:
    chunks = chunks_for(schedule)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    loss, grads = reference(_model(stages * chunks, kind), x, y, nn.MSELoss())
    model = _model(stages * chunks, kind)
    with Pipeline(model, stages=stages, microbatches=microbatches, schedule=schedule,
                  loss_fn=nn.MSELoss(), chunks=chunks) as pipe:
        torch.testing.assert_close(pipe.train_step(x, y), loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, grads)
    assert all(p.device.type == "cpu" for p in model.parameters())
