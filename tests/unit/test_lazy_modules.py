"""Lazy modules (``nn.LazyLinear``) called while recording.

Shape inference runs on fake tensors, where a lazy module's first call could only
make meta parameters: recording failed with "does not accept these per-example
inputs ... found at least two devices, cpu and meta", on code that runs eagerly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import batchgraph as bg


class _Model(bg.BatchedModule):
    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def f(self, x: Any) -> Any:
        return self.head(x)


def test_a_lazy_module_is_initialized_by_its_first_recorded_call_as_eagerly() -> None:
    xs = [torch.randn(3) for _ in range(3)]
    torch.manual_seed(0)
    eager_model = _Model(nn.LazyLinear(4))
    eager = [eager_model.f(x) for x in xs]
    torch.manual_seed(0)
    model = _Model(nn.LazyLinear(4))
    with bg.BatchingPolicy() as policy:
        handles = [model.f(bg.batched_value(x)) for x in xs]
    got = bg.compute(handles)
    # The same initial weights (drawn where the first call is), the same values.
    torch.testing.assert_close(model.head.weight, eager_model.head.weight, rtol=0, atol=0)
    for want, value in zip(eager, got, strict=True):
        torch.testing.assert_close(value, want)
    assert policy.stats.launches <= 2  # the constants and one batched Linear


def test_a_lazy_submodule_inside_a_called_module_is_refused_with_what_to_do() -> None:
    model = _Model(nn.Sequential(nn.LazyLinear(4), nn.Tanh()))
    with bg.BatchingPolicy(), pytest.raises(ValueError, match=r"lazy modules .*\(0\).*eagerly first"):
        model.f(bg.batched_value(torch.randn(3)))
    model.f(torch.randn(3))  # initialized eagerly: now it records
    with bg.BatchingPolicy():
        handle = model.f(bg.batched_value(torch.randn(3)))
    assert bg.compute(handle).shape == (4,)


def test_a_function_calling_an_uninitialized_lazy_module_is_refused_and_leaves_it_lazy() -> None:
    # Its run on fake tensors initialized the module with meta parameters for good:
    # recording failed with a device error ("cpu and meta"), and every later eager
    # call with "Cannot copy out of meta tensor".
    lazy = nn.LazyLinear(3)
    step = bg.batched_func(lambda x: torch.tanh(lazy(x)))
    with bg.BatchingPolicy(), pytest.raises(ValueError, match=r"<lambda> calls lazy modules whose "
                                            r"parameters are not initialized yet \(LazyLinear\)"):
        step(bg.batched_value(torch.randn(4)))
    assert isinstance(lazy, nn.LazyLinear) and lazy.has_uninitialized_params()
    torch.manual_seed(0)
    want = torch.tanh(lazy(torch.ones(4)))  # its first call, eagerly: initialized now
    with bg.BatchingPolicy():
        handle = step(bg.batched_value(torch.ones(4)))
    torch.testing.assert_close(bg.compute(handle), want)


class _Method(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.lazy = nn.LazyLinear(2)
        self.lin = nn.Linear(3, 3)

    @bg.batched_func
    def score(self, x: Any, use_lazy: bool) -> Any:
        return self.lazy(x) if use_lazy else self.lin(x).sum()


# Its initializing pre-hook is no hook a batched call must warn of.
@pytest.mark.filterwarnings("error::batchgraph.rules.BatchedHooksWarning")
def test_a_method_reading_a_lazy_module_it_does_not_call_records() -> None:
    model = _Method()
    xs = [torch.randn(3) for _ in range(3)]
    with bg.BatchingPolicy():
        handles = [model.score(bg.batched_value(x), False) for x in xs]
    for x, got in zip(xs, bg.compute(handles), strict=True):
        torch.testing.assert_close(got, model.lin(x).sum())
    with bg.BatchingPolicy(), pytest.raises(ValueError, match=r"score calls lazy modules.*\(_Method.lazy\)"):
        model.score(bg.batched_value(xs[0]), True)
    assert model.lazy.has_uninitialized_params()
