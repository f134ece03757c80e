"""A handle answers the tensor metadata known from its per-example spec as the eager
tensor does, so per-example code that asks (`x.nbytes`, `x.itemsize`) records alike."""

from __future__ import annotations

import pytest
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


# What is asked, and what it is read from (named in the error).
ASKED = {"shape": "shape", "dtype": "dtype", "device": "device", "ndim": "ndim",
         "size": "shape", "numel": "shape", "is_floating_point": "dtype", "itemsize": "dtype"}


@pytest.mark.parametrize("ask", ASKED)
@pytest.mark.parametrize("make", ["mask", "nonzero", "read"])
def test_metadata_of_a_data_dependent_result_says_why_and_what_to_write(
    ask: str, make: str,
) -> None:
    # Before: "TypeError: <ResultHandle ...> does not stand for a single tensor",
    # which said neither why (the shape depends on the values) nor what to write.
    x = torch.randn(5)
    with bg.BatchingPolicy():
        h = bg.batched_value(x)
        d = {"mask": lambda: h[h > 0], "nonzero": lambda: h.nonzero(),
             "read": lambda: h[h > 0] * 2}[make]()  # a call reading one
        with pytest.raises(TypeError, match=r"not known while recording.*bg\.compute") as err:
            value = getattr(d, ask)
            value() if callable(value) else value
    assert f"the {ASKED[ask]} of" in str(err.value)
    # and the computed value answers as eagerly
    assert bg.compute(d).shape == {"mask": x[x > 0], "nonzero": x.nonzero(),
                                   "read": x[x > 0] * 2}[make].shape
