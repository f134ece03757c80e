"""Rules with ``combine = "list"`` are held to the per-example specs, as stacked ones.

The executor checked a stacked rule's output shape and dtype per step, but a list
rule's per-example results went out unchecked: a rule that returned float64 for
float32 calls, dropped a row or added an output gave silently wrong values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import batchgraph as bg
from batchgraph.errors import BatchedCallError


def _compute_with(rule: type[bg.BatchKey], xs: Sequence[torch.Tensor]) -> list[Any]:
    double = bg.batched_func(lambda x: x * 2)
    with bg.BatchingPolicy(rules={double.fn: rule}):
        handles = [double(bg.batched_value(x)) for x in xs]
    result: list[Any] = bg.compute(handles)
    return result


class _Promoting(bg.BatchKey):
    combine = "list"

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        return [fn(x).double() for x in inputs[0]]


class _Truncating(bg.BatchKey):
    combine = "list"

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        return [fn(x)[:2] for x in inputs[0]]


class _Pairing(bg.BatchKey):
    combine = "list"

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        return [(fn(x), fn(x)) for x in inputs[0]]


class _Reversing(bg.BatchKey):
    combine = "list"

    def identity(self) -> Any:  # lengths free, as PackedSequenceKey's
        return id(self.fn)

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        return [fn(x) for x in inputs[0]][::-1]


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (_Promoting, r"\(3,\) torch\.float64 tensor on cpu .* example 0 .* returns \(3,\) float32"),
        (_Truncating, r"\(2,\) torch\.float32 tensor on cpu .* returns \(3,\) float32 on cpu"),
        (_Pairing, r"returned 2 tensor\(s\) for example 0 .* returns 1"),
    ],
)
def test_a_list_rule_that_changes_an_examples_result_fails_loudly(
    rule: type[bg.BatchKey], message: str
) -> None:
    with pytest.raises(BatchedCallError, match=message):
        _compute_with(rule, [torch.randn(3) for _ in range(3)])


def test_a_list_rule_that_reorders_examples_of_different_shapes_fails_loudly() -> None:
    with pytest.raises(BatchedCallError, match=r"example 0 \(row 0 .* another order"):
        _compute_with(_Reversing, [torch.randn(n) for n in (2, 3, 4)])


class _Faithful(bg.BatchKey):
    combine = "list"

    def identity(self) -> Any:
        return id(self.fn)

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        return [fn(x) for x in inputs[0]]


def test_a_faithful_list_rule_over_examples_of_different_shapes_matches_eager() -> None:
    xs = [torch.randn(n) for n in (2, 3, 4)]
    for x, got in zip(xs, _compute_with(_Faithful, xs), strict=True):
        torch.testing.assert_close(got, x * 2, rtol=0, atol=0)


class _Moving(bg.StackKey):
    """A broken rule: its batched results come out on another device."""

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        return super().run(fn, inputs, size).to("meta")


class _MovingList(bg.BatchKey):
    combine = "list"

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        return [fn(x).to("meta") for x in inputs[0]]


@pytest.mark.parametrize("rule", [_Moving, _MovingList])
def test_a_rule_that_moves_results_to_another_device_fails_loudly(
    rule: type[bg.BatchKey],
) -> None:
    # Shape and dtype were checked, not the device: results came back on it.
    with pytest.raises(BatchedCallError, match=r"on meta .*on cpu"):
        _compute_with(rule, [torch.randn(3) for _ in range(2)])


def test_errors_name_torch_functions_as_written() -> None:
    tanh = bg.batched_func(torch.tanh)
    with bg.BatchingPolicy(rules={torch.tanh: _Moving}):
        handles = [tanh(bg.batched_value(torch.randn(3))) for _ in range(2)]
    with pytest.raises(BatchedCallError, match=r"rules=\{torch\.tanh: bg\.VmapKey\}"):
        bg.compute(handles)
