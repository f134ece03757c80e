"""BatchNorm in training, in a stage whose forward reads a value in Python (``.item()``
for logging), so the kept-inputs check runs it three times on real microbatches
(real_runs) and must undo what those runs wrote.

A batch norm updates its running statistics in place inside ``native_batch_norm``,
whose schema does not mark them as written: the check's WriteGuard saw no write and
left the three runs' updates in ``running_mean`` and ``running_var`` (the count,
``num_batches_tracked += 1``, was undone), so the model's statistics after a step were
not those of its forwards on the step's microbatches, silently (2 stages, 4
microbatches: running_mean sum 0.3869 where the microbatches' forwards give 0.2986),
and a model evaluated afterwards computed otherwise.
"""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from torch import Tensor, nn

from batchgraph.pipeline import Pipeline
from tests.pipeline_models import assert_grads_equal, chunks_for, grid, microbatch_reference

LOGGED: list[float] = []


class LoggedNorm(nn.Module):
    """Linear, BatchNorm1d and tanh, logging its input's mean (``.item()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.norm = nn.BatchNorm1d(4, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        LOGGED.append(x.mean().item())  # cannot run on meta tensors
        return torch.tanh(self.norm(self.lin(x)))


def _model(blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[LoggedNorm() for _ in range(blocks)])


def _statistics(model: nn.Module) -> list[list[float]]:
    return [[*m.running_mean.tolist(), *m.running_var.tolist(), int(m.num_batches_tracked)]
            for m in model.modules() if isinstance(m, nn.BatchNorm1d)]


@settings(max_examples=12, deadline=None)
@given(**grid())
@example(stages=2, microbatches=4, schedule="gpipe")
def test_running_statistics_are_the_microbatches_forwards(
    stages: int, microbatches: int, schedule: str
) -> None:
    blocks = stages * chunks_for(schedule)
    gen = torch.Generator().manual_seed(stages * 100 + microbatches)
    x = torch.randn(12, 4, dtype=torch.float64, generator=gen)
    y = torch.randn(12, 4, dtype=torch.float64, generator=gen)
    # One device, a microbatch at a time: each forward normalises by its microbatch's
    # statistics and updates the running ones once (what the pipeline promises).
    reference = _model(blocks)
    loss, grads = microbatch_reference(reference, x, y, microbatches)
    model = _model(blocks)
    with Pipeline(model, stages=stages, microbatches=microbatches, schedule=schedule,
                  loss_fn=nn.MSELoss(), chunks=chunks_for(schedule)) as pipe:
        torch.testing.assert_close(pipe.train_step(x, y), loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, grads)
    assert _statistics(model) == _statistics(reference)
