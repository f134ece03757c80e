"""A class-index mean called inside the user's loss function is refused where a
microbatch's share cannot give it, and exact where it can.

``loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten(),
ignore_index=-1)`` (nanoGPT's loss, padded sequences) was weighted as a plain mean: the
pipeline's loss and gradients were not one device's wherever microbatches held different
shares of ignored targets, without a word.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchgraph.pipeline import Pipeline, PipelineConfigError, StageError
from tests.pipeline_models import assert_grads_equal, reference

_W = torch.tensor([0.5, 2.0, 1.0, 1.0], dtype=torch.float64)


class _Tokens(nn.Module):
    """Per sample, 3 positions of 4 class logits: outputs (N, 3, 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 12)).double()

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x).reshape(x.shape[0], 3, 4)


class _Reshape(nn.Module):
    def forward(self, h: Tensor) -> Tensor:
        return h.reshape(h.shape[0], 3, 4)


def _flat(fn: Callable[..., Tensor], **kw: object) -> Callable[[Tensor, Tensor], Tensor]:
    return lambda out, y: fn(out.flatten(0, 1), y.flatten(), **kw)


def _targets(ignored: bool, fixed: bool = False) -> Tensor:
    y = torch.randint(0, 4, (8, 3))
    if fixed:  # one ignored position per sample: the same count per sample everywhere
        y[:, 2] = -1
    elif ignored:
        y[:2] = -1  # the first microbatch's samples padding, the others' none
        y[5, 1] = -1
    return y


@pytest.mark.parametrize(
    ("loss_fn", "name"),
    [
        (_flat(F.cross_entropy, ignore_index=-1), "cross_entropy"),
        (_flat(nn.CrossEntropyLoss(ignore_index=-1)), "cross_entropy"),
        (_flat(lambda o, t: F.nll_loss(F.log_softmax(o, -1), t, ignore_index=-1)), "nll_loss"),
        # No target ignored, but classes weighted: counts per sample differ too.
        (_flat(lambda o, t: F.cross_entropy(o, t.clamp(min=0), weight=_W)), "cross_entropy"),
    ],
    ids=["cross_entropy", "module", "nll_loss", "weights"],
)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_hidden_class_mean_that_microbatches_cannot_share_is_refused(
    loss_fn: Callable[[Tensor, Tensor], Tensor], name: str, schedule: str
) -> None:
    torch.manual_seed(0)
    model = _Tokens()
    x, y = torch.randn(8, 5, dtype=torch.float64), _targets(ignored=True)
    with (
        Pipeline(
            [model.body[:2], model.body[2:], _Reshape()], microbatches=4, schedule=schedule,
            loss_fn=loss_fn, timeout=30,
        ) as pipe,
        pytest.raises(StageError, match="the loss failed") as info,
    ):  # fmt: skip
        pipe.train_step(x, y)
    cause = info.value.__cause__
    assert isinstance(cause, PipelineConfigError)
    match = rf"calls F.{name} with reduction='mean' on class indices: .* per sample in the step's"
    assert re.search(match, str(cause)) and "splits exactly" in str(cause)


@pytest.mark.parametrize(
    ("m", "ignored", "fixed", "reduction"),
    [(4, False, False, "mean"), (4, True, True, "mean"), (1, True, False, "mean"),
     (4, True, False, "sum")],
    ids=["nothing-ignored", "same-count-per-sample", "one-microbatch", "summed-and-divided"],
)  # fmt: skip
def test_hidden_class_means_that_microbatches_share_are_exact(
    m: int, ignored: bool, fixed: bool, reduction: str
) -> None:
    torch.manual_seed(m)
    model = _Tokens()
    x, y = torch.randn(8, 5, dtype=torch.float64), _targets(ignored, fixed)
    count = int((y != -1).sum())
    if reduction == "sum":  # the refusal's advice: sum, and divide by the batch's count
        loss_fn = _flat(
            lambda o, t: F.cross_entropy(o, t, ignore_index=-1, reduction="sum") / count
        )
    else:
        loss_fn = _flat(F.cross_entropy, ignore_index=-1)
    want_loss, want = reference(model, x, y, loss_fn)
    with Pipeline(
        [model.body[:2], model.body[2:], _Reshape()], microbatches=m, loss_fn=loss_fn,
        reduction=reduction, timeout=30,
    ) as pipe:  # fmt: skip
        loss = pipe.train_step(x, y)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, want)
