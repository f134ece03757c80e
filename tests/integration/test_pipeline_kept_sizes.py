"""A stage forward keeping its input's batch size and reading it at later calls.

``if self.n is None: self.n = x.shape[0]`` keeps microbatch 0's size where one device
keeps the batch's, and an output read of it computes otherwise (1f1b, 2 microbatches:
loss 0.8991 where one device's 0.8727), silently: the kept-inputs check ran both of
its runs on inputs of one size, and a size is no value it marks. It now runs a second
size after the first, and again on the state as it was, and refuses where the two
compute otherwise. A size read afresh each call, a table per size, and a forward taking
one size only are not refused.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from torch import Tensor, nn

from batchgraph.pipeline import Pipeline
from tests.integration.test_pipeline_kept_inputs import _finite
from tests.pipeline_models import grid, refused_or_one_device, stacked, step_per_microbatch


class KeepsSize(nn.Module):
    """Scales by a batch size kept at its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.n: int | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.n is None:
            self.n = x.shape[0]
        return torch.tanh(self.lin(x)) * (1 + 1 / self.n)


class ItemKeepsSize(KeepsSize):
    """KeepsSize, reading a value in Python first (no meta run: the real runs)."""

    def forward(self, x: Tensor) -> Tensor:
        _finite(x)
        return super().forward(x)


class SizeTables(nn.Module):
    """A table per batch size, and the last size kept for inspection: nothing kept is
    read by another size's call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.tables: dict[int, Tensor] = {}
        self.last = 0

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        if n not in self.tables:
            self.tables[n] = torch.ones(n, 1, dtype=x.dtype)
        self.last = n
        return torch.tanh(self.lin(x)) * self.tables[n]


class OneSize(nn.Module):
    """Takes inputs of 3 rows only (a reshape of a fixed size)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.lin(x.reshape(3, 4)))


@pytest.mark.parametrize("layer", [KeepsSize, ItemKeepsSize])
@settings(max_examples=10, deadline=None)
@given(**grid())
@example(stages=2, microbatches=2, schedule="1f1b")
def test_a_batch_size_kept_and_read_back_is_refused(
    layer: type[nn.Module], stages: int, microbatches: int, schedule: str
) -> None:
    refused_or_one_device(layer, stages, microbatches, schedule,
                          r"stage 0 \(\w+\) computes its output otherwise at its second "
                          r"call .*self\.n = x\.shape\[0\]")


@settings(max_examples=10, deadline=None)
@given(**grid())
@example(stages=2, microbatches=3, schedule="zb-h1")
def test_tables_per_size_train_as_one_device(stages: int, microbatches: int,
                                             schedule: str) -> None:
    step_per_microbatch(lambda blocks: stacked(blocks, SizeTables),
                        lambda m: [sorted(t.tables) for t in m.modules()
                                   if isinstance(t, SizeTables)],
                        stages, microbatches, schedule)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_forward_taking_one_size_only_is_not_refused(schedule: str) -> None:
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    model = stacked(2, OneSize)
    with Pipeline(model, stages=2, microbatches=2, schedule=schedule,
                  loss_fn=nn.MSELoss()) as pipe:
        loss = pipe.train_step(x, y)
    parts = [nn.MSELoss()(stacked(2, OneSize)(x[i:i + 3]), y[i:i + 3]) for i in (0, 3)]
    torch.testing.assert_close(loss, sum(parts) / 2, rtol=1e-10, atol=1e-10)
