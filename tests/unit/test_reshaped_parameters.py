"""A parameter or buffer given another shape between batches (``p.data = t``,
``m.buf = t``): the next batch computes with the new shape, as eagerly; calls recorded
before such a change and computed after it are refused (``ParameterChangedError``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg

WIDTHS = st.integers(min_value=1, max_value=7)


class Scaled(nn.Module):
    """Reads a buffer whose shape is the output's."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(width, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum() * self.scale


def _inputs(n: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    return [torch.randn(4, generator=gen, dtype=torch.float64) for _ in range(n)]


def _batched(fn: Callable[[torch.Tensor], Any], xs: list[torch.Tensor]) -> list[torch.Tensor]:
    with bg.BatchingPolicy():
        return list(bg.compute([fn(x) for x in xs]))


def _assert_eager(fn: Callable[[torch.Tensor], Any], eager: Callable[[torch.Tensor], Any],
                  xs: list[torch.Tensor]) -> None:
    got = _batched(fn, xs)
    for x, value in zip(xs, got):
        torch.testing.assert_close(value, eager(x))


def _reshape_linear(lin: nn.Linear, width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    lin.weight.data = torch.randn(width, lin.in_features, generator=gen, dtype=torch.float64)
    if lin.bias is not None:
        lin.bias.data = torch.randn(width, generator=gen, dtype=torch.float64)


@settings(max_examples=6, deadline=None)
@given(WIDTHS, WIDTHS, st.booleans())
def test_a_function_reading_a_reshaped_parameter_computes_as_eagerly(
        first: int, second: int, bias: bool) -> None:
    lin = nn.Linear(4, first, bias=bias).double()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return lin(x).tanh() * 2

    batched = bg.batched_func(fn)
    xs = _inputs()
    _assert_eager(batched, fn, xs)
    _reshape_linear(lin, second)
    _assert_eager(batched, fn, xs)


@settings(max_examples=6, deadline=None)
@given(WIDTHS, WIDTHS, st.booleans())
def test_a_function_reading_a_reshaped_buffer_computes_as_eagerly(
        first: int, second: int, replace: bool) -> None:
    module = Scaled(first)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return module(x) + 1

    batched = bg.batched_func(fn)
    xs = _inputs()
    _assert_eager(batched, fn, xs)
    new = torch.arange(second, dtype=torch.float64)
    if replace:
        module.scale = new  # a new buffer tensor
    else:
        module.scale.data = new  # the same tensor, other data
    _assert_eager(batched, fn, xs)


@pytest.mark.parametrize("where", ["module", "submodule"])
def test_a_module_with_a_reshaped_parameter_computes_as_eagerly(where: str) -> None:
    inner = nn.Linear(4, 3).double()
    model = inner if where == "module" else nn.Sequential(inner, nn.Tanh())
    xs = _inputs()
    with bg.BatchingPolicy():  # one policy across the change: its sites are kept
        assert [tuple(v.shape) for v in bg.compute([model(x) for x in xs])] == [(3,)] * 3
        _reshape_linear(inner, 6)
        got = bg.compute([model(x) for x in xs])
    for x, value in zip(xs, got):
        torch.testing.assert_close(value, model(x))


def test_a_module_with_a_reshaped_buffer_computes_as_eagerly() -> None:
    module = Scaled(3)
    xs = _inputs()
    _assert_eager(module, module, xs)
    module.scale.data = torch.arange(5, dtype=torch.float64)
    _assert_eager(module, module, xs)
    module.scale = torch.arange(2, dtype=torch.float64)
    _assert_eager(module, module, xs)


def test_coroutines_after_a_reshape_compute_as_eagerly() -> None:
    lin = nn.Linear(4, 3).double()
    batched = bg.batched_func(lambda x: lin(x).relu())

    async def example(x: torch.Tensor) -> torch.Tensor:
        first = await batched(x)
        return await batched(x * first.sum())

    def eager(x: torch.Tensor) -> torch.Tensor:
        first = lin(x).relu()
        return lin(x * first.sum()).relu()

    xs = _inputs(4)
    for width in (3, 5, 2):
        _reshape_linear(lin, width)
        got = bg.run_all([example(x) for x in xs])
        for x, value in zip(xs, got):
            torch.testing.assert_close(value, eager(x))


def test_calls_recorded_before_a_reshape_are_refused_at_compute() -> None:
    # Eagerly they computed with the old shape; batched they would read the new one.
    lin = nn.Linear(4, 3).double()
    batched = bg.batched_func(lambda x: lin(x) * 2)
    xs = _inputs()
    _batched(batched, xs)  # the signature is cached
    with bg.BatchingPolicy():
        handles = [batched(x) for x in xs]
        _reshape_linear(lin, 6)
        with pytest.raises(bg.ParameterChangedError, match=r"p\.data = t"):
            bg.compute(handles)
