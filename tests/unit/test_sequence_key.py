"""The shipped custom key: variable-length sequences through recurrent layers."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn

import batchgraph as bg
from batchgraph.testing import assert_batched_matches_eager


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_packed_sequences_equal_eager_with_gradients(kind: type, bidirectional: bool) -> None:
    # Every output is compared, the final states too, and the gradients of a loss
    # weighting each of their elements: before, the loss summed the outputs only, so
    # final states that kept their values but sent their gradients nowhere (or to
    # another example) passed.
    layer = kind(3, 5, num_layers=2, bidirectional=bidirectional).double()
    rnn = bg.batched_func(layer)
    lengths = [4, 1, 7, 3, 7]
    xs = [torch.randn(n, 3, dtype=torch.float64, requires_grad=True) for n in lengths]
    report = assert_batched_matches_eager(rnn, xs, module=layer, rtol=0, atol=1e-10)
    assert report.gradients_compared == len(list(layer.parameters())) + len(xs)
    assert report.stats is not None and report.stats.launches == 1


def test_initial_state_is_batched_too() -> None:
    # The initial states require grad: their gradients are compared with eager ones
    # (before, none was, and a rule that detached them passed).
    layer = nn.LSTM(2, 4).double()
    lstm = bg.batched_func(layer)

    def state() -> torch.Tensor:
        return torch.randn(1, 4, dtype=torch.float64, requires_grad=True)

    cases = [(torch.randn(n, 2, dtype=torch.float64), (state(), state())) for n in (2, 5)]
    report = assert_batched_matches_eager(
        lambda case: lstm(*case), cases, module=layer, rtol=0, atol=1e-10
    )
    assert report.gradients_compared == len(list(layer.parameters())) + 2 * len(cases)
    assert report.stats is not None and report.stats.launches == 1


def test_a_user_key_through_the_policy_registry() -> None:
    """A user key class registered by module type decides batching and execution."""

    class SumRows(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum(0)

    class SumRowsKey(bg.BatchKey):
        combine = "list"
        runs: ClassVar[list[int]] = []

        def identity(self) -> object:  # any number of rows batches together
            return (id(self.fn), self.call.input_specs[0].shape[1:])  # type: ignore[union-attr]

        def run(self, fn, inputs, size):  # type: ignore[no-untyped-def]
            SumRowsKey.runs.append(size)
            padded = nn.utils.rnn.pad_sequence(list(inputs[0]), batch_first=True)
            return list(padded.sum(1))

    f = bg.batched_func(SumRows())
    xs = [torch.randn(n, 3) for n in (1, 4, 2)]
    with bg.BatchingPolicy(rules={SumRows: SumRowsKey}):
        hs = [f(x) for x in xs]
    out = bg.compute(hs)
    assert SumRowsKey.runs == [3]
    for x, o in zip(xs, out, strict=True):
        torch.testing.assert_close(o, x.sum(0))


def test_ragged_outputs_feed_stacked_consumers_by_length() -> None:
    """Per-example outputs of different lengths reach a Linear grouped by shape."""
    layer = nn.LSTM(2, 3).double()
    lstm = bg.batched_func(layer)
    head = bg.batched_func(nn.Linear(3, 1).double())
    xs = [torch.randn(n, 2, dtype=torch.float64) for n in (2, 3, 2, 3, 2)]
    eager = [head(lstm(x)[0]) for x in xs]
    with bg.BatchingPolicy() as policy:
        hs = [head(lstm(x)[0]) for x in xs]
    for e, b in zip(eager, bg.compute(hs), strict=True):
        torch.testing.assert_close(b, e, rtol=0, atol=1e-12)
    assert policy.stats is not None and policy.stats.launches == 3  # lstm, head x2 shapes
