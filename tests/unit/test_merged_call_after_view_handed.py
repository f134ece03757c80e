"""A call identical to one whose view was handed out is, eagerly, a tensor of its own:
changing it in place is no change of the handed-out view, and must not be refused.

``c = y.clone()``, a view of ``c`` handed out (``bg.compute(c[0])``, or ``c`` awaited
then ``c.reshape(-1)``), then ``z = y.clone(); z.add_(x)``: merged into ``c``'s node by
hash-consing, ``z`` shared the view's alias group, and its change in place was
refused as one reaching the handed-out view (found by a thorough random-seed run of
``test_dag_programs_property``, seed 32659).
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import batchgraph as bg

VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "reshape": lambda t: t.reshape(-1),
    "getitem": lambda t: t[0],
    "t": lambda t: t.t(),
    "narrow": lambda t: t.narrow(-1, 0, 2),
    "reshape-then-getitem": lambda t: t.reshape(-1)[1:3],
}


def _inputs(requires_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    return x.requires_grad_(requires_grad), y.requires_grad_(requires_grad)


def _eager(x: torch.Tensor, y: torch.Tensor, view: str) -> tuple[torch.Tensor, torch.Tensor]:
    c = y.clone()
    row = VIEWS[view](c)
    z = y.clone()
    z.add_(x)
    return row, z


@pytest.mark.parametrize("view", sorted(VIEWS))
@pytest.mark.parametrize("requires_grad", [False, True])
def test_twin_of_a_value_whose_view_was_computed_changes_in_place(
        view: str, requires_grad: bool) -> None:
    x, y = _inputs(requires_grad)
    want_row, want = _eager(x, y, view)
    xb, yb = (t.detach().clone().requires_grad_(requires_grad) for t in (x, y))
    with bg.BatchingPolicy(dedupe=True):
        hx, hy = bg.batched_value(xb), bg.batched_value(yb)
        c = hy.clone()
        row = bg.compute(VIEWS[view](c))
        z = hy.clone()
        z.add_(hx)
        got = bg.compute(z)
    torch.testing.assert_close(row, want_row.detach() if not requires_grad else want_row)
    torch.testing.assert_close(got, want)
    if requires_grad:
        (want * 2).sum().backward()
        (got * 2).sum().backward()
        torch.testing.assert_close(xb.grad, x.grad)
        torch.testing.assert_close(yb.grad, y.grad)


@pytest.mark.parametrize("view", sorted(VIEWS))
@pytest.mark.parametrize("groups", [1, 2])
def test_twin_in_a_coroutine_after_a_view_of_an_awaited_value(view: str, groups: int) -> None:
    inputs = [_inputs(True) for _ in range(3)]

    async def example(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hx, hy = bg.batched_value(x), bg.batched_value(y)
        c = hy.clone()
        await bg.value(c)
        row = VIEWS[view](c)  # a view of a handed-out value: handed out too
        z = hy.clone()
        z.add_(hx)
        return await bg.value(row), await bg.value(z)

    got = bg.run_all([example(x, y) for x, y in inputs], groups=groups)
    for (x, y), (row, z) in zip(inputs, got, strict=True):
        want_row, want = _eager(x, y, view)
        torch.testing.assert_close(row, want_row)
        torch.testing.assert_close(z, want)


def test_a_change_reaching_the_handed_out_view_is_still_refused() -> None:
    # ``c`` itself (not a merged twin) shares memory with the handed-out row: eagerly
    # its change reaches the row the caller holds.
    x, y = _inputs(False)
    with bg.BatchingPolicy(dedupe=True):
        hx, hy = bg.batched_value(x), bg.batched_value(y)
        c = hy.clone()
        bg.compute(c[0])
        with pytest.raises(TypeError, match=r"share memory with \(views of it\), some of them handed"):
            c.add_(hx)
