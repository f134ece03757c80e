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

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


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


def test_names_the_output_cut_off_from_autograd() -> None:
    model = Model().double()
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    with pytest.raises(
        AssertionError,
        match=r"example 0: output: eager \(2,\) torch.float64 on cpu, requires_grad=True, "
        r"batched \(2,\) torch.float64 on cpu, requires_grad=False",
    ):
        assert_batched_matches_eager(model.good, xs, rules={nn.Linear: DetachingKey})


class DoubledGradientKey(bg.StackKey):
    """A broken rule: right values, requires grad, but twice the gradient."""

    def run(self, fn, inputs, size):  # type: ignore[no-untyped-def]
        out = super().run(fn, inputs, size)
        return out * 2 - out.detach()


def test_names_the_parameter_whose_gradient_differs() -> None:
    model = Model().double()
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    with pytest.raises(AssertionError, match=r"gradient of parameter lin.weight differs"):
        assert_batched_matches_eager(model.good, xs, rules={nn.Linear: DoubledGradientKey})


def test_a_lambda_has_the_gradients_of_what_it_closes_over_compared() -> None:
    # Before, a lambda (no __self__) had no gradient compared at all: a rule that
    # doubles gradients passed.
    model = Model().double()
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    report = assert_batched_matches_eager(lambda x: model.good(x), xs, rtol=0, atol=1e-12)
    assert report.gradients_compared == 2
    with pytest.raises(
        AssertionError, match=r"gradient of parameter captured tensor \d of shape \(2, 3\) differs"
    ):
        assert_batched_matches_eager(
            lambda x: model.good(x), xs, rules={nn.Linear: DoubledGradientKey}
        )


def test_output_cut_off_from_autograd_fails_without_gradient_checks() -> None:
    # Before, check_gradients=False compared values only: detached outputs passed.
    model = Model().double()
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    with pytest.raises(AssertionError, match=r"requires_grad=True, batched .*requires_grad=False"):
        assert_batched_matches_eager(
            model.good, xs, rules={nn.Linear: DetachingKey}, check_gradients=False
        )


def test_gradients_of_the_examples_own_tensors_are_compared() -> None:
    model = Model().double()
    xs = [torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    report = assert_batched_matches_eager(model.good, xs, rtol=0, atol=1e-12)
    assert report.gradients_compared == 2 + 4


def test_nan_where_eager_has_nan_matches() -> None:
    model = Model().double()
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(3)]
    report = assert_batched_matches_eager(
        lambda x: model.good(x) * float("nan"), xs, check_gradients=False
    )
    assert report.outputs_compared == 3


def test_a_function_that_records_nothing_warns() -> None:
    xs = [torch.randn(3) for _ in range(3)]
    with pytest.warns(UserWarning, match=r"recorded no call under the BatchingPolicy"):
        assert_batched_matches_eager(torch.tanh, xs)


class SwappedGradientKey(bg.StackKey):
    """A broken rule: right values, but example i's gradient goes to example B-1-i's row."""

    def run(self, fn, inputs, size):  # type: ignore[no-untyped-def]
        out = super().run(fn, inputs, size)
        return out.detach() + out.flip(0) - out.flip(0).detach()


def test_gradients_sent_to_another_examples_rows_fail() -> None:
    # The rule's output is the function's output: under a plain sum loss every row
    # would weigh 1, and swapping which row a gradient reaches would leave the
    # parameter gradients as they were. The check's pseudo-random weights tell them apart.
    model = Model().double()
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    with pytest.raises(AssertionError, match=r"gradient of parameter lin.weight differs"):
        assert_batched_matches_eager(model.linear, xs, rules={nn.Linear: SwappedGradientKey})


class InputDetachingKey(bg.StackKey):
    """A broken rule: right values and parameter gradients, none for the inputs."""

    def run(self, fn, inputs, size):  # type: ignore[no-untyped-def]
        return super().run(fn, [x.detach() for x in inputs], size)


def test_a_gradient_missing_on_one_side_fails() -> None:
    model = Model().double()
    xs = [torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    with pytest.raises(
        AssertionError, match=r"gradient of example 0: input: eager set, batched none"
    ):
        assert_batched_matches_eager(model.good, xs, rules={nn.Linear: InputDetachingKey})
