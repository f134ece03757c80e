"""A handed-out value requires grad iff its eager counterpart does, whatever the other
examples batched with it: ``f(b)`` for a ``b`` without grad, batched with ``f(a)`` for an
``a`` that requires grad, gives a value without grad (``.numpy()`` works, no
``grad_fn``), as eagerly; gradients of the values that do require grad are unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import batchgraph as bg


def _flags(values: list[torch.Tensor]) -> list[tuple[bool, bool]]:
    return [(v.requires_grad, v.grad_fn is not None) for v in values]


def _example(f: Any, g: Any, x: torch.Tensor) -> Any:
    # Two calls deep, so the mixed batch reaches the second call through the first.
    return g(f(x) * 2.0).sum(0)


@pytest.mark.parametrize("count", [2, 12])  # one handle at a time, and rows of one copy
def test_a_value_computed_from_inputs_without_grad_does_not_require_grad(count: int) -> None:
    torch.manual_seed(0)
    f, g = bg.batched_func(torch.tanh), bg.batched_func(torch.sigmoid)
    xs = [torch.randn(3, 4, requires_grad=i % 2 == 0) for i in range(count)]
    eager = [_example(f, g, x) for x in xs]
    with bg.BatchingPolicy() as policy:
        hs = [_example(f, g, x) for x in xs]
    values = bg.compute(hs)
    assert policy.stats is not None and policy.stats.launches < 3 * count  # batched
    assert _flags(values) == _flags(eager)
    for v, e in zip(values, eager):
        torch.testing.assert_close(v, e)
        if not e.requires_grad:
            assert v.numpy().shape == (4,)  # failed: "Can't call numpy() on Tensor that requires grad"
    # The gradients of those that require grad are exactly the eager ones.
    sum(v.sum() for v in values if v.requires_grad).backward()
    batched = [x.grad.clone() for x in xs if x.requires_grad]
    for x in xs:
        x.grad = None
    sum(e.sum() for e in eager if e.requires_grad).backward()
    for got, want in zip(batched, [x.grad for x in xs if x.requires_grad]):
        torch.testing.assert_close(got, want)


def test_a_module_with_parameters_that_require_grad_gives_values_that_do() -> None:
    torch.manual_seed(0)
    lin = bg.batched_func(nn.Linear(3, 2))
    frozen = nn.Linear(3, 2).requires_grad_(False)
    fr = bg.batched_func(frozen)
    tanh = bg.batched_func(torch.tanh)
    a, b = torch.randn(3, requires_grad=True), torch.randn(3)
    with bg.BatchingPolicy():
        # tanh batches the three: only the frozen layer's example has no grad eagerly.
        hs = [tanh(lin(b)), tanh(fr(a)), tanh(fr(b))]
    values = bg.compute(hs)
    assert [v.requires_grad for v in values] == [True, True, False]


def test_a_function_reading_a_tensor_that_requires_grad_gives_values_that_do() -> None:
    class Holder:  # reached through an object's attribute: not a captured tensor
        def __init__(self) -> None:
            self.w = torch.ones(3, requires_grad=True)

        def scale(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    holder = Holder()
    scale, tanh = bg.batched_func(holder.scale), bg.batched_func(torch.tanh)
    a, b = torch.randn(3, requires_grad=True), torch.randn(3)
    with bg.BatchingPolicy():
        hs = [tanh(a), tanh(scale(b)), tanh(b)]
    values = bg.compute(hs)
    assert [v.requires_grad for v in values] == [True, True, False]
    values[1].sum().backward()
    torch.testing.assert_close(holder.w.grad, torch.tanh(b * 1.0).pow(2).neg().add(1) * b)


def test_a_call_recorded_under_no_grad_batched_with_one_that_requires_grad() -> None:
    tanh = bg.batched_func(torch.tanh)
    a = torch.randn(3, requires_grad=True)
    with bg.BatchingPolicy():
        h = tanh(a)
        with torch.no_grad():
            off = tanh(a)
        both = [h + 1.0, off + 1.0]  # recorded with grad: only the first requires it
    values = bg.compute(both)
    assert [v.requires_grad for v in values] == [True, False]


def test_a_constant_that_requires_grad_gives_values_that_do() -> None:
    tanh = bg.batched_func(torch.tanh)
    a, b = torch.randn(3, requires_grad=True), torch.randn(3)
    with bg.BatchingPolicy():
        hs = [tanh(bg.batched_value(a)), tanh(bg.batched_value(b))]
    assert [v.requires_grad for v in bg.compute(hs)] == [True, False]


def test_read_one_handle_at_a_time_values_match_eager() -> None:
    tanh = bg.batched_func(torch.tanh)
    a, b = torch.randn(3, requires_grad=True), torch.randn(3)
    with bg.BatchingPolicy() as policy:
        ha, hb = tanh(a), tanh(b)
    policy.compute([ha, hb])
    assert ha.value.requires_grad and not hb.value.requires_grad
    assert hb.value.grad_fn is None


def test_merged_calls_without_grad_hand_out_values_without_grad() -> None:
    tanh = bg.batched_func(torch.tanh)
    a, b = torch.randn(3, requires_grad=True), torch.randn(3)
    with bg.BatchingPolicy():
        hs = [tanh(a)] + [tanh(b) for _ in range(10)]  # merged into one node
    values = bg.compute(hs)
    assert values[0].requires_grad and not any(v.requires_grad for v in values[1:])


@pytest.mark.parametrize("count", [2, 12])
def test_coroutine_values_match_eager(count: int) -> None:
    tanh = bg.batched_func(torch.tanh)

    async def example(x: torch.Tensor) -> tuple[bool, bool]:
        y = await bg.value(tanh(x))
        z = await bg.value(tanh(y * 2.0))
        return y.requires_grad, z.requires_grad

    xs = [torch.randn(3, requires_grad=i == 0) for i in range(count)]
    results = bg.run_all([example(x) for x in xs])
    assert results == [(i == 0, i == 0) for i in range(count)]


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap's soft_margin_loss
def test_a_target_gathered_with_values_that_require_grad_is_not_taken_to_require_it() -> None:
    # The examples' inputs (which require grad) and targets (which do not) have one
    # spec: stacked together as constants, the targets required grad in the batch,
    # and soft_margin_loss, which refuses a target that requires grad, failed at
    # compute with BatchedCallError ("not differentiable with respect to argument
    # 'target'") for code that runs eagerly.
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).double()
    xs = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    ys = [torch.randn(3, 4, dtype=torch.float64) for _ in range(3)]

    def loss(x: Any, y: Any) -> Any:
        return F.soft_margin_loss(bg.batched_func(lin)(x), torch.sigmoid(y))

    want = [loss(x, y) for x, y in zip(xs, ys, strict=True)]
    with bg.BatchingPolicy():
        handles = [loss(bg.batched_value(x), bg.batched_value(y)) for x, y in zip(xs, ys, strict=True)]
    got = bg.compute(handles)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    weighted = [sum((i + 1) * v for i, v in enumerate(vs)) for vs in (got, want)]
    params = [*xs, *lin.parameters()]
    for g, w in zip(torch.autograd.grad(weighted[0], params),
                    torch.autograd.grad(weighted[1], params), strict=True):
        torch.testing.assert_close(g, w)
