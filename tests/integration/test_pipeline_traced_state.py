"""Blocks of a traced (not nn.Sequential) model whose forward keeps Python state.

torch.fx runs a traced-through forward's Python once, when traced: such a block's
counter and list changed at the trace only (twice: both modes), never at a step. The
pipeline now calls such a block as a leaf, so its forward runs as written, once per
microbatch, as the unsplit model run on each microbatch keeps it; the model's own
forward keeping state is refused (see batchgraph.pipeline.traced_state).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from torch import Tensor, nn

from batchgraph.pipeline import Pipeline, PipelineConfigError
from batchgraph.pipeline.microbatch import split_microbatches
from tests.pipeline_models import assert_grads_equal, chunks_for, grid, reference


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.calls = 0
        self.seen: list[int] = []

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        self.seen.append(x.shape[0])
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    """Blocks in a ModuleList, called from the model's own (traced) forward."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block() for _ in range(blocks)])
        self.head = nn.Linear(4, 2, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        out: Tensor = self.head(x)
        return out


def _state(model: Net) -> list[tuple[int, list[int]]]:
    return [(b.calls, b.seen) for b in model.blocks if isinstance(b, Block)]


@settings(max_examples=16, deadline=None)
@given(**grid())
@example(stages=2, microbatches=3, schedule="1f1b")
def test_a_traced_models_stateful_blocks_keep_state_per_microbatch(
    stages: int, microbatches: int, schedule: str
) -> None:
    chunks = chunks_for(schedule)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    blocks = 2 * stages * chunks
    loss, grads = reference(Net(blocks), x, y, nn.MSELoss())
    kept = Net(blocks)
    with torch.no_grad():
        for (part,) in split_microbatches(x, microbatches):
            kept(part)
    model = Net(blocks)
    with Pipeline(model, stages=stages, microbatches=microbatches, schedule=schedule,
                  loss_fn=nn.MSELoss(), chunks=chunks) as pipe:
        assert _state(model) == _state(Net(blocks))  # building leaves nothing
        torch.testing.assert_close(pipe.train_step(x, y), loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, grads)
    assert _state(model) == _state(kept)


class Counting(Net):
    def __init__(self, blocks: int) -> None:
        super().__init__(blocks)
        self.steps = 0

    def forward(self, x: Tensor) -> Tensor:
        self.steps += 1
        return super().forward(x)


def test_a_traced_model_whose_own_forward_keeps_state_is_refused() -> None:
    model = Counting(4)
    with pytest.raises(PipelineConfigError, match=r"forward of Counting changes self\.steps"):
        Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss())
    assert model.steps == 0 and _state(model) == _state(Net(4))
