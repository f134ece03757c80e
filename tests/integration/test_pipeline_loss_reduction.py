"""A loss's reduction is read as the pipeline runs: a ``functools.partial``'s keyword and a
``reduction`` attribute changed after the pipeline was built weight microbatches right."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchgraph.pipeline import Pipeline, PipelineConfigError
from tests.integration.test_pipeline_equals_single_device import log_probs_step_equals_single_device
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


_W = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)


class _PaddedCrossEntropy(nn.CrossEntropyLoss):
    """A subclass that only sets defaults: the same loss as its base."""

    def __init__(self) -> None:
        super().__init__(ignore_index=-100, label_smoothing=0.1)


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
@pytest.mark.parametrize(
    "loss_fn",
    [
        F.nll_loss,
        functools.partial(F.nll_loss, weight=_W, ignore_index=0),
        functools.partial(F.cross_entropy, ignore_index=-100, label_smoothing=0.1),
        _PaddedCrossEntropy(),
    ],
    ids=["F.nll_loss", "partial-nll-weight-ignore", "partial-ce-smoothing", "subclass"],
)
def test_functional_cross_entropy_with_ignored_targets_equals_single_device(
    schedule: str, loss_fn: Callable[[Tensor, Tensor], Tensor]
) -> None:
    # F.cross_entropy / F.nll_loss mean over the targets not ignored (-100 by default,
    # e.g. padding tokens), as their modules do: weighted by microbatch size instead,
    # microbatch [-100, -100] gave NaN and the others counted wrong.
    y = torch.tensor([-100, -100, 1, 2, 0, 1, 2])
    if isinstance(loss_fn, functools.partial) and loss_fn.keywords.get("ignore_index") == 0:
        y = torch.tensor([0, 0, 1, 2, 0, 1, 2])
    log_probs_step_equals_single_device(y, loss_fn, schedule, 4)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make_loss", "declared"),
    [
        (lambda: nn.MSELoss(reduction="sum"), "mean"),
        (lambda: nn.MSELoss(), "sum"),
        (lambda: functools.partial(F.mse_loss, reduction="sum"), "mean"),
        (lambda: nn.KLDivLoss(reduction="batchmean"), "mean"),
    ],
    ids=["sum-as-mean", "mean-as-sum", "partial", "batchmean-as-mean"],
)
def test_a_reduction_passed_against_the_losss_own_is_refused(
    make_loss: Callable[[], Callable[[Tensor, Tensor], Tensor]], declared: str
) -> None:
    # Taken as declared, the microbatch losses were weighted for the other reduction: an
    # MSELoss(reduction="sum") declared "mean" gave sum_i (n_i / N) * sum_i, silently.
    model = mlp(layers=4)
    with pytest.raises(PipelineConfigError, match=rf"reduction='{declared}' was passed, but"):
        Pipeline(model, stages=2, microbatches=3, loss_fn=make_loss(), reduction=declared)
    # Changed to disagree after the pipeline was built: refused at the step.
    loss_fn = nn.MSELoss()
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    with Pipeline(model, stages=2, microbatches=3, loss_fn=loss_fn, reduction="mean") as pipe:
        loss_fn.reduction = "sum"
        with pytest.raises(PipelineConfigError, match=r"reduction='mean' was passed, but"):
            pipe.train_step(x, y)
        loss_fn.reduction = "mean"  # agreeing again: exact
        want_loss, want = reference(model, x, y, loss_fn)
        loss = pipe.train_step(x, y)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, want)
