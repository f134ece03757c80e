"""``as_strided`` with an explicit ``storage_offset`` on handles counts from the
example's own value, as eagerly for a value freshly computed. Calls run one at a time
(a different offset per example) read the first example's elements, silently, before:
a batched value is a row of its batch, whose storage starts at the first example."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
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
        with pytest.raises(TypeError, match=r"storage_offset=1 .* a view \(getitem\)"):
            torch.as_strided(h[2:], (2,), (1,), 1)
        with pytest.raises(TypeError, match=r"bg\.batched_value of a view"):
            bg.batched_value(torch.arange(6.0)[2:]).as_strided((2,), (1,), 1)
        # Without an offset the input's own start is used, as eagerly.
        got = bg.compute(h[2:].as_strided((2,), (2,)))
    assert torch.equal(got, torch.tensor([-2.0, -4.0]))
