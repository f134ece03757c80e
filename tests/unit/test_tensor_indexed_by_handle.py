"""``table[h]``: a plain tensor indexed by a handle (an embedding lookup by a recorded
index). torch's C indexing asks an index for its length before it dispatches to
``__torch_function__``; a handle that answered was read item by item (a recorded call
each) and torch warned "Using a non-tuple sequence for multidimensional indexing is
deprecated". It is now taken as one index, as a tensor is, with no warning, while
``len(h)`` in the example's own code still answers."""

from __future__ import annotations

import warnings

import pytest
import torch

import batchgraph as bg


@pytest.mark.parametrize("shape", [(2,), (2, 2), (4,)])
def test_a_tensor_indexed_by_a_handle_warns_nothing_and_records_one_call(
    shape: tuple[int, ...],
) -> None:
    torch.manual_seed(0)
    table = torch.randn(5, 3)
    indices = [torch.randint(0, 5, shape) for _ in range(3)]
    with bg.BatchingPolicy() as policy:
        hs = [bg.batched_value(i) for i in indices]
        before = policy.graph.calls_recorded
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows = [table[h] for h in hs]
            warnings.warn("the user's own warning", UserWarning, stacklevel=1)
    # Only the user's warning: no blanket filter hides it, and torch said nothing.
    assert [str(w.message) for w in caught] == ["the user's own warning"]
    # One getitem per example; before, also one per item of the index (h[0], h[1]...).
    assert policy.graph.calls_recorded - before == len(hs)
    for got, i in zip(bg.compute(rows), indices, strict=True):
        assert torch.equal(got, table[i])


def test_a_tensor_indexed_by_a_handle_inside_a_tuple_and_by_a_computed_index() -> None:
    table = torch.arange(15.0).reshape(5, 3)
    index = torch.tensor([4, 0])
    with bg.BatchingPolicy(), warnings.catch_warnings():
        warnings.simplefilter("error")
        h = bg.batched_value(index) + 0  # a call's result, not a constant
        got = bg.compute([table[h], table[h, 1], table[:, None][h]])
    assert torch.equal(got[0], table[index])
    assert torch.equal(got[1], table[index, 1])
    assert torch.equal(got[2], table[:, None][index])


def test_len_of_a_handle_still_answers_in_per_example_code() -> None:
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.zeros(4, 2))
        table = torch.arange(6.0)
        assert len(h) == 4
        assert [len(h)] == [4]
        assert table[len(h)] == 4.0  # len() called inside a subscript's index
        assert len(list(h)) == 4
