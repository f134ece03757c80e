"""``as_strided`` on a view of a value (``h.t().as_strided(size, stride)``) reads the
value's memory in the value's order, as eagerly: it is made of the value itself, with
the view's storage offset. Before, it read the view's batched row, whose layout is
the view's only while that row is a view of its batch: where it was gathered (a
copy, laid out in the view's order) it read the transposed elements, silently (also
for views taken of a value handed out, whose recorded call read that row).

Each generated program is run eagerly and batched, and values and gradients compared.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import batchgraph as bg

neg = bg.batched_func(torch.neg)

# Views of a (3, 4) value, and views of those.
VIEWS: list[Callable[[Any], Any]] = [
    lambda v: v.t(),
    lambda v: v[1:],
    lambda v: v[..., 1:],
    lambda v: v.split(1)[-1],
    lambda v: v.transpose(0, -1),
    lambda v: v.unsqueeze(0),
    lambda v: v.narrow(-1, 1, 1),
    lambda v: v.T if v.ndim == 2 else v,
]


def _viewed(v: Any, views: list[int]) -> Any:
    for i in views:
        v = VIEWS[i](v)
    return v


def _strided(v: Any, views: list[int], size: list[int], stride: list[int],
             offset: int | None) -> Any:
    v = _viewed(v, views)
    return v.as_strided(size, stride) if offset is None else v.as_strided(size, stride, offset)


@given(
    views=st.lists(st.integers(0, len(VIEWS) - 1), min_size=1, max_size=3),
    size=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    stride=st.lists(st.integers(0, 4), min_size=2, max_size=2),
    offset=st.one_of(st.none(), st.integers(0, 4)),
    gathered=st.booleans(),
    handed=st.booleans(),
)
def test_as_strided_of_a_view_reads_the_values_memory_as_eagerly(
    views: list[int], size: list[int], stride: list[int], offset: int | None,
    gathered: bool, handed: bool,
) -> None:
    stride = stride[: len(size)]
    xs = [torch.arange(12.0, dtype=torch.float64).reshape(3, 4) + 100 * i for i in range(2)]
    xs = [x.requires_grad_() for x in xs]
    try:
        _viewed(xs[0], views)
    except (RuntimeError, IndexError):  # t() of a 3-d view, narrow of an empty one
        assume(False)
    try:
        eager = [_strided(-x, views, size, stride, offset) * 2 for x in xs]
    except RuntimeError:  # out of bounds of the value's storage: so batched
        with bg.BatchingPolicy(), pytest.raises(RuntimeError, match="out of bounds"):
            bg.compute(_strided(neg(xs[0]), views, size, stride, offset))
        return
    with bg.BatchingPolicy():
        hs = [neg(x) for x in xs]
        if handed:  # the views are taken of the values handed out (view_of_handed)
            bg.compute(hs)
        if gathered:  # the first example's view computed alone: its row is a copy
            bg.compute(_viewed(hs[0], views) * 1)
        got = bg.compute([_strided(h, views, size, stride, offset) * 2 for h in hs])
    for g, e in zip(got, eager, strict=True):
        torch.testing.assert_close(g, e)
    got_grads = torch.autograd.grad(sum(g.sum() for g in got), xs)
    eager_grads = torch.autograd.grad(sum(e.sum() for e in eager), xs)
    for g, e in zip(got_grads, eager_grads, strict=True):
        torch.testing.assert_close(g, e)


def test_a_transposed_view_gathered_reads_the_value_in_its_order() -> None:
    xs = [torch.arange(12.0).reshape(3, 4) + 100 * i for i in range(2)]
    with bg.BatchingPolicy():
        hs = [neg(x) for x in xs]
        views = [h.t() for h in hs]
        bg.compute(views[0] * 1)  # the first example's view now lives in a store
        got = bg.compute([v.as_strided((4,), (1,)) for v in views])
    for x, g in zip(xs, got, strict=True):
        assert torch.equal(g, (-x).reshape(-1)[:4])


def test_as_strided_of_a_transposed_view_of_a_handed_out_value_is_refused() -> None:
    # Eagerly it reads y's memory; which handle's copy the view was of is not kept.
    with bg.BatchingPolicy():
        h = neg(torch.arange(12.0).reshape(3, 4))
        view = h.t()
        y = bg.compute(h)
        with pytest.raises(TypeError, match="memory order"):
            view.as_strided((4,), (1,))
        # A view of y taken after the hand-out is y's own view: as eagerly.
        assert torch.equal(bg.compute(h.t().as_strided((4,), (1,))), y.reshape(-1)[:4])
