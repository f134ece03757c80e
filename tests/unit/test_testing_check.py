"""The user-facing batched-vs-eager check catches wrong batching and names the culprit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import batchgraph as bg
from batchgraph.testing import assert_batched_matches_eager


class Model(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.norm = nn.BatchNorm1d(2)

    def good(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class WrongKey(bg.StackKey):
    """A broken rule: reverses the batch, so example i gets example B-1-i's result."""

    def run(self, fn, inputs, size):  # type: ignore[no-untyped-def]
        return super().run(fn, inputs, size).flip(0)


def test_passes_on_correct_batching_and_reports() -> None:
    model = Model().double()
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(6)]
    report = assert_batched_matches_eager(model.good, xs, rtol=0, atol=1e-12)
    assert report.examples == 6 and report.outputs_compared == 6
    assert report.gradients_compared == 2  # lin.weight, lin.bias
    assert report.stats is not None and report.stats.launches == 2


def test_names_the_first_differing_example() -> None:
    model = Model().double()
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    with pytest.raises(AssertionError, match=r"example 0: output differs"):
        assert_batched_matches_eager(model.good, xs, rules={nn.Linear: WrongKey})


class DetachingKey(bg.StackKey):
    """A broken rule: right values, but cut off from autograd."""

    def run(self, fn, inputs, size):  # type: ignore[no-untyped-def]
        return super().run(fn, inputs, size).detach()


def test_names_the_parameter_whose_gradient_differs() -> None:
    model = Model().double()
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    with pytest.raises(AssertionError, match=r"gradient of lin.weight: eager set, batched none"):
        assert_batched_matches_eager(model.good, xs, rules={nn.Linear: DetachingKey})
