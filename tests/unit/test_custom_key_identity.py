"""A custom key whose ``identity()`` leaves out the input specs, with combine="stack".

Two calls with different per-example shapes then had equal keys and ran as one
call: compute failed inside the gather with torch.cat's bare "Sizes of tensors must
match except in dimension 0" (no key, no call, no advice). It is now refused where
the second call is recorded, saying what to change.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import pytest
import torch
from torch import nn

import batchgraph as bg


class _ByCallable(bg.BatchKey):
    def identity(self) -> Hashable:
        return id(self.fn)


def test_equal_stacked_keys_with_different_input_shapes_are_refused_when_recorded() -> None:
    double = bg.batched_func(lambda x: x * 2)
    with bg.BatchingPolicy(rules={double.fn: _ByCallable}):
        double(torch.randn(3))
        with pytest.raises(
            bg.ShapeMismatchError,
            match=r"_ByCallable\[.*input 0 is \(4,\) float32 on cpu and the earlier call's "
            r"\(3,\) float32 on cpu.*identity\(\) must include.*combine = \"list\"",
        ):
            double(torch.randn(4))


def test_equal_stacked_keys_with_equal_input_shapes_still_batch() -> None:
    double = bg.batched_func(lambda x: x * 2)
    xs = [torch.randn(3) for _ in range(3)]
    with bg.BatchingPolicy(rules={double.fn: _ByCallable}) as policy:
        handles = [double(x) for x in xs]
    for x, got in zip(xs, bg.compute(handles), strict=True):
        torch.testing.assert_close(got, x * 2)
    assert policy.stats.launches == 1


class _Unhashable(bg.BatchKey):
    def identity(self) -> Hashable:
        return [id(self.fn)]  # type: ignore[return-value]


def test_an_unhashable_identity_names_the_method() -> None:
    double = bg.batched_func(lambda x: x * 2)
    unhashable = pytest.raises(TypeError, match=r"_Unhashable\.identity\(\) returned \[\d+\], which")
    with bg.BatchingPolicy(rules={double.fn: _Unhashable}), unhashable:
        double(torch.randn(3))


def _stacked(fn: Any, call: Any, *, deterministic: bool = True) -> bg.BatchKey:
    return bg.StackKey(fn, call, deterministic=deterministic)


class _Doubler(nn.Module):
    batch_key = _stacked  # a factory, as BatchingPolicy(rules=...) takes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_a_key_factory_function_as_a_batch_key_class_attribute() -> None:
    # Read through the instance, the function was bound to the module.
    double = bg.batched_func(_Doubler())
    xs = [torch.randn(3) for _ in range(3)]
    with bg.BatchingPolicy() as policy:
        handles = [double(x) for x in xs]
    for x, got in zip(xs, bg.compute(handles), strict=True):
        torch.testing.assert_close(got, x * 2)
    assert policy.stats.launches == 1
