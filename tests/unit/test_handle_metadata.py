"""A handle answers the tensor metadata known from its per-example spec as the eager
tensor does, so per-example code that asks (`x.nbytes`, `x.itemsize`) records alike."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import batchgraph as bg

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
          torch.int32, torch.int64, torch.bool, torch.complex64]


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(DTYPES), st.lists(st.integers(0, 4), max_size=3))
def test_byte_sizes_match_the_eager_tensor(dtype: torch.dtype, shape: list[int]) -> None:
    # Before: "ResultHandle has no attribute 'nbytes'" (and 'itemsize'), though
    # element_size() and numel(), from which they follow, were answered.
    x = torch.zeros(shape, dtype=dtype)
    with bg.BatchingPolicy():
        h = bg.batched_value(x)
        got = (h.itemsize, h.nbytes, h.element_size(), h.numel())
    assert got == (x.itemsize, x.nbytes, x.element_size(), x.numel())
