"""Values handed out together, with grad, changed in place by the caller.

Rows handed out at once were the outputs of one ``unbind`` of a copy: autograd refuses
an in-place change of one (``ys[0].add_(1)``: "Output 0 of Unbind is a view and is
being modified inplace"), and after a change of one under ``no_grad`` any use of
another in autograd, where eagerly each result is a tensor of its own and both work.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg


def _no_grad_add(y: torch.Tensor) -> None:
    with torch.no_grad():
        y.add_(1)


CHANGES: dict[str, Callable[[torch.Tensor], object]] = {
    "add_": lambda y: y.add_(1),
    "mul_": lambda y: y.mul_(2),
    "setitem": lambda y: y.__setitem__(0, 5.0),
    "no_grad add_": _no_grad_add,
    "detach().add_": lambda y: y.detach().add_(1),
}


class Model(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)


def _loss(outs: list[torch.Tensor], ys: list[torch.Tensor]) -> torch.Tensor:
    return sum(((i + 1) * (o.sum() + y.pow(2).sum()) for i, (o, y) in enumerate(zip(outs, ys))),
               torch.zeros(()))


@settings(max_examples=30, deadline=None)
@given(count=st.integers(1, 12), which=st.data(), change=st.sampled_from(sorted(CHANGES)),
       seed=st.integers(0, 2**16))
def test_a_row_handed_out_with_grad_changes_in_place_as_eagerly(
        count: int, which: st.DataObject, change: str, seed: int) -> None:
    torch.manual_seed(seed)
    model = Model()
    xs = [torch.randn(4) for _ in range(count)]
    i = which.draw(st.integers(0, count - 1))
    ys = [model.lin(x) for x in xs]
    CHANGES[change](ys[i])
    want = [model.lin(y) for y in ys]
    _loss(want, ys).backward()
    want_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    with bg.BatchingPolicy():
        hs = [model.lin(bg.batched_value(x)) for x in xs]
        got_ys = bg.compute(hs)
        CHANGES[change](got_ys[i])
        got = bg.compute([model.lin(h) for h in hs])
    for g, w in zip([*got, *got_ys], [*want, *ys], strict=True):
        torch.testing.assert_close(g, w)
    _loss(got, got_ys).backward()
    for p, w in zip(model.parameters(), want_grads, strict=True):
        torch.testing.assert_close(p.grad, w)


@pytest.mark.parametrize("groups", [1, 2])
def test_coroutine_examples_change_their_rows_in_place_with_grad(groups: int) -> None:
    torch.manual_seed(0)
    model = Model()
    xs = [torch.randn(4) for _ in range(9)]

    async def example(x: torch.Tensor) -> torch.Tensor:
        y = await bg.value(model.lin(bg.batched_value(x)))
        y.mul_(2)
        return y * 3

    got = bg.run_all([example(x) for x in xs], groups=groups)
    for x, g in zip(xs, got, strict=True):
        torch.testing.assert_close(g, model.lin(x) * 6)
    sum(g.sum() for g in got).backward()
