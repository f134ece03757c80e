"""``as_strided`` with an explicit ``storage_offset`` on handles counts from the
example's own value, as eagerly for a value freshly computed. Calls run one at a time
(a different offset per example) read the first example's elements, silently, before:
a batched value is a row of its batch, whose storage starts at the first example."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import batchgraph as bg

neg = bg.batched_func(torch.neg)


@given(
    count=st.integers(1, 4),
    offsets=st.lists(st.integers(0, 3), min_size=4, max_size=4),
    stride=st.integers(1, 2),
    method=st.booleans(),
    handed=st.booleans(),
)
def test_offsets_count_from_each_examples_value(
    count: int, offsets: list[int], stride: int, method: bool, handed: bool,
) -> None:
    xs = [torch.arange(8.0, dtype=torch.float64) + 10 * i for i in range(count)]

    def strided(v: torch.Tensor, offset: int) -> torch.Tensor:
        if method:
            return v.as_strided((2,), (stride,), offset)
        return torch.as_strided(v, (2,), (stride,), storage_offset=offset)

    eager = [strided(-x, offsets[i]) * 2 for i, x in enumerate(xs)]
    with bg.BatchingPolicy():
        hs = [neg(x) for x in xs]
        if handed:
            bg.compute(hs)
        got = bg.compute([strided(h, offsets[i]) * 2 for i, h in enumerate(hs)])
    for g, e in zip(got, eager, strict=True):
        torch.testing.assert_close(g, e)


def test_a_view_taken_of_a_handed_out_value_counts_from_that_value() -> None:
    xs = [torch.arange(6.0) + 10 * i for i in range(3)]
    with bg.BatchingPolicy():
        hs = [neg(x) for x in xs]
        ys = bg.compute(hs)
        views = bg.compute([h.as_strided((2,), (1,), 3) for h in hs])
    for x, y, v in zip(xs, ys, views, strict=True):
        assert torch.equal(v, (-x)[3:5])
        assert v.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


def test_an_offset_into_a_view_of_another_value_is_refused() -> None:
    with bg.BatchingPolicy():
        h = neg(torch.arange(6.0))
        # A recorded view of a value of its own: made of that value, as eagerly
        # (tests/unit/test_as_strided_of_views.py).
        assert torch.equal(bg.compute(torch.as_strided(h[2:], (2,), (1,), 1)),
                           torch.tensor([-1.0, -2.0]))
        with pytest.raises(TypeError, match=r"bg\.batched_value of a view"):
            bg.batched_value(torch.arange(6.0)[2:]).as_strided((2,), (1,), 1)
        # Without an offset the input's own start is used, as eagerly.
        got = bg.compute(h[2:].as_strided((2,), (2,)))
    assert torch.equal(got, torch.tensor([-2.0, -4.0]))


@given(
    size=st.lists(st.integers(0, 3), min_size=1, max_size=2),
    stride=st.lists(st.integers(0, 4), min_size=2, max_size=2),
    offset=st.one_of(st.none(), st.integers(0, 7)),
    handed=st.booleans(),
)
@example(size=[2], stride=[1, 0], offset=5, handed=False)
@example(size=[3], stride=[3, 0], offset=None, handed=True)
@example(size=[2, 2], stride=[3, 1], offset=1, handed=False)
def test_a_view_past_the_examples_elements_fails_as_eagerly(
    size: list[int], stride: list[int], offset: int | None, handed: bool,
) -> None:
    # Eagerly a value of its own ends its storage: reaching past it fails. Batched, the
    # next row of the batch follows (here the third example's, gathered for the later
    # call): one at a time, the calls read it, silently, before.
    xs = [torch.arange(6.0, dtype=torch.float64) + 10 * i for i in range(3)]
    stride = stride[: len(size)]

    def strided(v: Any) -> Any:
        if offset is None:
            return torch.as_strided(v, size, stride)
        return v.as_strided(size, stride, offset)

    try:
        eager: list[torch.Tensor] | None = [strided(-x) * 2 for x in xs[:2]]
    except RuntimeError:
        eager = None
    with bg.BatchingPolicy():
        hs = [neg(x) for x in xs]
        if handed:
            bg.compute(hs)
        if eager is None:
            with pytest.raises(RuntimeError, match="out of bounds"):
                strided(hs[0])
            return
        later = hs[2] * torch.exp(hs[0][:2] * 1).sum()
        got = bg.compute([strided(h) * 2 for h in hs[:2]] + [later])
    for g, e in zip(got, eager, strict=False):
        torch.testing.assert_close(g, e)


def test_a_batched_value_laid_out_otherwise_than_a_row_is_refused() -> None:
    # as_strided reads a tensor's storage in its own layout; a batched row is
    # contiguous from its start, so what it reads would differ.
    t = torch.arange(6.0).reshape(2, 3)
    with bg.BatchingPolicy():
        with pytest.raises(TypeError, match=r"bg\.batched_value of a view"):
            bg.batched_value(t.t()).as_strided((2,), (1,))
        # Past its own elements, a view reads the tensor it views eagerly.
        with pytest.raises(TypeError, match=r"bg\.batched_value of a view"):
            bg.batched_value(torch.arange(12.0)[:6]).as_strided((2,), (1,), 5)
        # Within the value's own elements, laid out as a row: as eagerly.
        sliced = torch.arange(12.0)[2:8]
        got = bg.compute([bg.batched_value(t).as_strided((2,), (3,)) * 1,
                          bg.batched_value(sliced).as_strided((2,), (2,)) * 1,
                          bg.batched_value(torch.arange(12.0)[:4]).as_strided((2,), (1,), 2) * 1])
    assert torch.equal(got[0], t.as_strided((2,), (3,)))
    assert torch.equal(got[1], sliced.as_strided((2,), (2,)))
    assert torch.equal(got[2], torch.tensor([2.0, 3.0]))
