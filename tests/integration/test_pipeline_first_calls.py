"""A stage forward computing otherwise at its second call than at its first.

Before: a first-call flag (``out = lin(x) * (2 if self.seen else 1); self.seen =
True``, an HF-style ``if not self.initialized`` branch) or a count read by the output
(``self.n += 1; lin(x) * self.n``) trained silently otherwise than one device with
several microbatches (loss 1.6256 where one device's 1.2160): microbatch 1 on read what
microbatch 0 left. Now the kept-inputs check compares the operations computing each
stage's output over its two runs and refuses such a stage, naming it; ordinary models
(BatchNorm in eval, Dropout, LayerNorm, a table cached at the first call, a count nothing
reads) still train as one device.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchgraph.pipeline import Pipeline, PipelineConfigError
from tests.pipeline_models import SCHEDULES, assert_grads_equal, chunks_for, reference


class Flag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x) * (2 if self.seen else 1)
        self.seen = True
        return out


class Count(Flag):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n = getattr(self, "n", 0) + 1
        return self.lin(x) * self.n


class Table(Flag):
    """A table made at the first call of a length, read by every call; a count nothing
    reads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.seen:
            self.table = torch.arange(4, dtype=x.dtype) * 0.1
            self.seen = True
        self.calls = getattr(self, "calls", 0) + 1
        return self.lin(x) + self.table


def _ordinary(blocks: int) -> list[nn.Module]:
    return [nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.0),
                          nn.LayerNorm(4), nn.GELU(), Table())
            for _ in range(blocks)]


def _make(layer: type[nn.Module] | None, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers = _ordinary(blocks) if layer is None else [layer() for _ in range(blocks)]
    return nn.Sequential(*layers).double()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("layer", [Flag, Count])
def test_a_stage_reading_state_it_changed_is_refused(schedule: str, layer: type[nn.Module]
                                                    ) -> None:
    blocks = 2 * chunks_for(schedule)
    model = _make(layer, blocks)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    with pytest.raises(PipelineConfigError, match="otherwise at its second call"), Pipeline(
            model, stages=2, microbatches=2, schedule=schedule, loss_fn=nn.MSELoss(),
            chunks=chunks_for(schedule)) as pipe:
        pipe.train_step(x, y)
    # one microbatch runs as one device
    loss, grads = reference(_make(layer, blocks), x, y, nn.MSELoss())
    model = _make(layer, blocks)
    with Pipeline(model, stages=2, microbatches=1, schedule=schedule, loss_fn=nn.MSELoss(),
                  chunks=chunks_for(schedule)) as pipe:
        torch.testing.assert_close(pipe.train_step(x, y), loss)
    assert_grads_equal(model, grads)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_ordinary_stages_still_train_as_one_device(schedule: str) -> None:
    blocks = 2 * chunks_for(schedule)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    loss, grads = reference(_make(None, blocks).eval(), x, y, nn.MSELoss())
    model = _make(None, blocks).eval()
    with Pipeline(model, stages=2, microbatches=3, schedule=schedule, loss_fn=nn.MSELoss(),
                  chunks=chunks_for(schedule)) as pipe:
        torch.testing.assert_close(pipe.train_step(x, y), loss)
    assert_grads_equal(model, grads)
