"""A tuple of one tensor reaches the loss as that tuple, as on one device.

Targets given as ``(y,)`` and a last stage returning ``(h,)`` were handed to ``loss_fn``
as the bare tensors: a loss written for the tuples (``out[0]``, ``targets[0]``) then
read the first sample's row instead, broadcast it against the others, and trained on
that without an error (torch warns about the broadcast only where the shapes differ).
``pipe.forward`` returned the tensor where the model returns ``(h,)``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from batchgraph.pipeline import Pipeline, StageMismatchError
from tests.pipeline_models import assert_grads_equal, mlp, reference

_SCHEDULES = ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"]


def _first_of_each(out: Tensor | tuple[Tensor, ...], targets: tuple[Tensor, ...]) -> Tensor:
    # Given the bare tensors, out[0] and targets[0] are rows of the same shape: no error,
    # no broadcasting warning, the first sample's loss only.
    return F.mse_loss(out[0], targets[0])


class _InTuple(nn.Module):
    """The model's last layer: returns its input inside a tuple of one."""

    def forward(self, h: Tensor) -> tuple[Tensor]:
        return (h,)


@settings(max_examples=12, deadline=None)
@given(
    schedule=st.sampled_from(_SCHEDULES),
    m=st.integers(1, 4),
    extra=st.integers(0, 3),
)
def test_one_element_tuples_reach_the_loss_as_tuples(schedule: str, m: int, extra: int) -> None:
    torch.manual_seed(m * 10 + extra)
    body = mlp(layers=4, width=4, outputs=4)
    n = m + extra
    x = torch.randn(n, 5, dtype=torch.float64)
    y = torch.randn(n, 4, dtype=torch.float64)

    class Whole(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.wrap = body, _InTuple()

        def forward(self, inputs: Tensor) -> tuple[Tensor]:
            return self.wrap(self.body(inputs))

    whole = Whole()
    want_loss, want = reference(whole, x, (y,), _first_of_each)  # type: ignore[arg-type]
    stages = [body[:2], body[2:4], body[4:6], nn.Sequential(body[6], _InTuple())]
    chunks = 2 if schedule == "interleaved-1f1b" else 1
    with Pipeline(
        stages, microbatches=m, schedule=schedule, chunks=chunks, loss_fn=_first_of_each,
        timeout=30,
    ) as pipe:  # fmt: skip
        loss = pipe.train_step(x, (y,))
        out = pipe.forward(x)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(whole, want)
    assert isinstance(out, tuple) and len(out) == 1
    with torch.no_grad():
        torch.testing.assert_close(out[0], whole(x)[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("targets", ["tensor", "tuple", "list"])
def test_targets_reach_the_loss_as_given(targets: str) -> None:
    seen: list[type] = []

    def loss_fn(out: Tensor, target: Tensor | tuple[Tensor, ...]) -> Tensor:
        seen.append(type(target))
        return F.mse_loss(out, target if isinstance(target, Tensor) else target[0])

    model = mlp(layers=4)
    x = torch.randn(6, 5, dtype=torch.float64)
    y = torch.randn(6, 3, dtype=torch.float64)
    given = {"tensor": y, "tuple": (y,), "list": [y]}[targets]
    want_loss, want = reference(model, x, y, nn.MSELoss())
    with Pipeline(model, stages=2, microbatches=3, loss_fn=loss_fn, timeout=30) as pipe:
        loss = pipe.train_step(x, given)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, want)
    assert set(seen) == {Tensor if targets == "tensor" else tuple}


@pytest.mark.parametrize("schedule", _SCHEDULES)
def test_a_split_sequential_may_end_in_a_tuple_of_one(schedule: str) -> None:
    # An nn.Sequential split by the pipeline: its last stage returning (h,) was refused
    # ("returned a tuple of one tensor"), which only a stage before a cut must not do.
    torch.manual_seed(3)
    model = nn.Sequential(*mlp(layers=4, width=4, outputs=4), _InTuple())
    x = torch.randn(6, 5, dtype=torch.float64)
    y = torch.randn(6, 4, dtype=torch.float64)
    want_loss, want = reference(model, x, (y,), _first_of_each)  # type: ignore[arg-type]
    chunks = 2 if schedule == "interleaved-1f1b" else 1
    with Pipeline(model, stages=2, microbatches=3, schedule=schedule, chunks=chunks,
                  loss_fn=_first_of_each, timeout=30) as pipe:
        loss = pipe.train_step(x, (y,))
        out = pipe.forward(x)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, want)
    assert isinstance(out, tuple) and len(out) == 1


def test_a_stage_before_a_cut_returning_a_tuple_of_one_is_still_refused() -> None:
    model = nn.Sequential(nn.Linear(5, 4).double(), _InTuple(), _Unwrap(), nn.Linear(4, 3).double())
    x = torch.randn(4, 5, dtype=torch.float64)
    pipe = Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss(), cost="uniform",
                    timeout=30)  # the cut: after _InTuple
    with pipe, pytest.raises(StageMismatchError, match="returned a tuple of one tensor"):
        pipe.train_step(x, torch.randn(4, 3, dtype=torch.float64))


class _Unwrap(nn.Module):
    def forward(self, h: tuple[Tensor]) -> Tensor:
        return h[0]
