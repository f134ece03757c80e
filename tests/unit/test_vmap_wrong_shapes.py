"""Ops that vmap runs without error but wrongly for an example's shape run one example
at a time, as eagerly (found by the differential fuzzer, test_wide_programs_property)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import batchgraph as bg

Roll = Callable[[torch.Tensor], torch.Tensor]

# A roll over all the elements (no dims), written each way torch takes it.
_FLAT_ROLLS: dict[str, Roll] = {
    "torch.roll": lambda t: torch.roll(t, 1),
    "method": lambda t: t.roll(-2),
    "empty dims": lambda t: t.roll(1, ()),
    "keywords": lambda t: torch.roll(t, shifts=3, dims=None),
    "in a function": bg.batched_func(lambda t: torch.roll(t * 2, 1) + t),
}


@pytest.mark.parametrize("name", sorted(_FLAT_ROLLS))
@given(values=st.lists(st.floats(-10, 10), min_size=2, max_size=5, unique=True))
def test_a_0d_value_rolled_over_all_its_elements_stays_as_eagerly(
    name: str, values: list[float]
) -> None:
    # vmap's batching rule for roll with no dims rolled the batch of 0-d values: each
    # example got another's value (and gradient), silently.
    roll = _FLAT_ROLLS[name]
    xs = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in values]
    eager = [roll(x) for x in xs]
    torch.stack(eager).sum().backward()
    eager_grads = [x.grad.clone() for x in xs if x.grad is not None]
    for x in xs:
        x.grad = None
    with bg.BatchingPolicy():
        handles = [roll(bg.batched_value(x)) for x in xs]
    got = bg.compute(handles)
    for g, want in zip(got, eager, strict=True):
        torch.testing.assert_close(g, want, rtol=0, atol=0)
    torch.stack(got).sum().backward()
    for x, grad in zip(xs, eager_grads, strict=True):
        torch.testing.assert_close(x.grad, grad)


@pytest.mark.parametrize("shape", [(3,), (2, 3)])
def test_a_ranked_value_rolled_over_all_its_elements_still_batches(shape: tuple[int, ...]) -> None:
    xs = [torch.randn(shape, dtype=torch.float64) for _ in range(3)]
    with bg.BatchingPolicy() as policy:
        handles = [torch.roll(bg.batched_value(x), 1) for x in xs]
    got = bg.compute(handles)
    for g, x in zip(got, xs, strict=True):
        torch.testing.assert_close(g, torch.roll(x, 1), rtol=0, atol=0)
    assert policy.stats is not None
    assert policy.stats.unbatched_calls == 0 and policy.stats.launches == 1
