"""A loss's reduction is read as the pipeline runs: a ``functools.partial``'s keyword and a
``reduction`` attribute changed after the pipeline was built weight microbatches right."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchgraph.pipeline import Pipeline
from tests.pipeline_models import assert_grads_equal, mlp, reference


def _partial_sum() -> Callable[[Tensor, Tensor], Tensor]:
    return functools.partial(F.mse_loss, reduction="sum")


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize(
    ("make_loss", "change"),
    [(_partial_sum, False), (nn.MSELoss, True)],
    ids=["partial", "changed-attribute"],
)
def test_sum_reduction_equals_single_device(
    schedule: str,
    make_loss: Callable[[], Callable[[Tensor, Tensor], Tensor]],
    change: bool,
) -> None:
    loss_fn = make_loss()
    model = mlp(layers=4)
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    pipe = Pipeline(model, stages=2, microbatches=3, schedule=schedule, loss_fn=loss_fn)
    if change:  # after the pipeline was built
        assert isinstance(loss_fn, nn.MSELoss)
        loss_fn.reduction = "sum"
    want_loss, want = reference(model, x, y, loss_fn)
    try:
        loss = pipe.train_step(x, y)
    finally:
        pipe.close()
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, want)
