"""Whole-tensor ``max``/``min``/``median``/``nanmedian`` of values with ties: eagerly
the gradient goes in equal parts to every element equal to the result; batched through
vmap it went to one of them, silently (``x.max()`` of ``[[1, 2, 2], [2, 0, 2]]``: 1 to
one 2 where eager code gives 0.25 to each). Each example here is compared with its
eager run: values bit for bit, first- and second-order gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import batchgraph as bg

OPS: dict[str, Callable[[Any], Any]] = {
    "torch.max": torch.max, "torch.min": torch.min, "torch.median": torch.median,
    "torch.nanmedian": torch.nanmedian, "max": lambda h: h.max(), "min": lambda h: h.min(),
    "median": lambda h: h.median(), "nanmedian": lambda h: h.nanmedian(),
}

# Few distinct values, so that ties are the rule; NaN, infinities and -0.0 among them.
_element = st.sampled_from([0.0, -0.0, 1.0, 2.0, -1.0, math.inf, -math.inf, math.nan])
_shape = st.sampled_from([(), (1,), (4,), (2, 3), (3, 1, 2)])
_example = _shape.flatmap(
    lambda shape: st.lists(_element, min_size=math.prod(shape), max_size=math.prod(shape))
    .map(lambda xs: torch.tensor(xs, dtype=torch.float64).reshape(shape)))


def _run(op: Callable[[Any], Any], xs: list[torch.Tensor], batched: bool
         ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Values, gradients of a weighted sum and gradients of a sum of those (second
    order) with respect to each example."""
    leaves = [x.clone().requires_grad_() for x in xs]
    if batched:
        with bg.BatchingPolicy():
            handles = [op(bg.batched_value(leaf) * 1) for leaf in leaves]
        values = bg.compute(handles)
    else:
        values = [op(leaf * 1) for leaf in leaves]
    loss = sum((v * (i + 2) * leaf.sum()).sum() for i, (v, leaf) in enumerate(zip(values, leaves)))
    assert isinstance(loss, torch.Tensor)
    grads = torch.autograd.grad(loss, leaves, create_graph=True)
    second = torch.autograd.grad(sum(g.sum() for g in grads), leaves, allow_unused=True)
    zeros = [torch.zeros_like(x) if g is None else g for g, x in zip(second, xs)]
    return ([v.detach() for v in values], [g.detach() for g in grads], zeros)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN to NaN (the sign of a zero aside: which of 0.0 and -0.0 tied for the
    maximum is picked is not eager's to promise)."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        (torch.isnan(a) & torch.isnan(b) | (a == b)).all())


@settings(deadline=None, max_examples=40)
@given(name=st.sampled_from(sorted(OPS)), xs=st.lists(_example, min_size=1, max_size=5))
def test_values_and_gradients_are_eager_ones(name: str, xs: list[torch.Tensor]) -> None:
    eager = _run(OPS[name], xs, batched=False)
    got = _run(OPS[name], xs, batched=True)
    for kind, want, have in zip(("value", "gradient", "second-order gradient"), eager, got):
        for i, (a, b) in enumerate(zip(want, have)):
            assert _same(a, b), f"{name} example {i}: {kind} {b} where eagerly {a}"


def test_the_gradient_is_shared_by_the_ties() -> None:
    x = torch.tensor([[1.0, 2.0, 2.0], [2.0, 0.0, 2.0]], dtype=torch.float64,
                     requires_grad=True)
    with bg.BatchingPolicy():
        h = bg.batched_value(x).max()
        other = bg.batched_value(torch.ones(2, 3)).max()
    bg.compute([h, other])[0].backward()
    assert x.grad is not None
    assert torch.equal(x.grad, torch.tensor([[0.0, 0.25, 0.25], [0.25, 0.0, 0.25]],
                                            dtype=torch.float64))


@pytest.mark.parametrize("name", sorted(OPS))
def test_integer_values_batch_as_eagerly(name: str) -> None:
    if "median" in name:
        xs = [torch.tensor([[3, 1], [1, 2]]), torch.tensor([5, 5, 4])]
    else:
        xs = [torch.tensor([[3, 1], [1, 2]]), torch.tensor([True, False])]
    with bg.BatchingPolicy() as policy:
        handles = [OPS[name](bg.batched_value(x)) for x in xs]
    for got, x in zip(bg.compute(handles), xs):
        assert _same(got, OPS[name](x))
    assert policy.stats.unbatched_calls == 0


class _MaxNormalized(torch.nn.Module):
    def __init__(self, op: Callable[[Any], Any]) -> None:
        super().__init__()
        self.op, self.scale = op, torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (self.op(x * self.scale) + 10.0)


@pytest.mark.parametrize("name", sorted(OPS))
def test_a_function_or_module_reducing_whole_values_inside_computes_eager_gradients(
        name: str) -> None:
    # Through vmap (a VmapKey call), the ties' gradient went to one element.
    op = OPS[name]
    module = _MaxNormalized(op)
    xs = [torch.tensor([[1.0, 2.0, 2.0], [2.0, 0.0, 2.0]], dtype=torch.float64),
          torch.tensor([[3.0, 3.0, 1.0], [0.0, 3.0, 1.0]], dtype=torch.float64)]
    for fn in (lambda v: op(v) * 2, module):
        eager = _run(fn, xs, batched=False)
        got = _run(bg.batched_func(fn), xs, batched=True)
        for want, have in zip(eager, got):
            for a, b in zip(want, have):
                assert _same(a, b), f"{name}: {b} where eagerly {a}"
    with torch.no_grad():
        assert torch.equal(module.scale, torch.tensor(1.5, dtype=torch.float64))
