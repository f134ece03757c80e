"""A value handed out holding NaNs, or changed through ``.data`` from 0.0 to -0.0.

Before: ``handed_changes`` compared a handed-out value with its stored row by
``torch.equal``, for which NaN differs from NaN and -0.0 equals 0.0: a value with a
NaN handed out and left alone refused every later call reading its handle
(``ConstantChangedError`` for a change nobody made), and ``y.data[0] = -0.0`` on a
0.0 went unseen, so ``1 / h`` read the stored 0.0 (+inf where eagerly -inf),
silently. Now the two are compared bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import batchgraph as bg

SPECIALS = [math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 1.5]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]


@settings(max_examples=20, deadline=None)
@given(values=st.lists(st.sampled_from(SPECIALS), min_size=1, max_size=5),
       dtype=st.sampled_from(DTYPES), grad=st.booleans(), rows=st.integers(1, 3))
def test_a_value_with_nans_handed_out_and_left_alone_is_read_as_eagerly(
        values: list[float], dtype: torch.dtype, grad: bool, rows: int) -> None:
    grad = grad and dtype != torch.complex64
    xs = [torch.tensor(values, dtype=dtype, requires_grad=grad) for _ in range(rows)]
    with bg.BatchingPolicy():
        hs = [bg.batched_value(x) * 1 for x in xs]
        ys = bg.compute(hs)  # handed out, whole (several rows) or one
        later = [h + 1 for h in hs]
    for got, y in zip(bg.compute(later), ys, strict=True):
        torch.testing.assert_close(got, y + 1, equal_nan=True)


@pytest.mark.parametrize("grad", [False, True])
def test_zero_changed_to_negative_zero_through_data_is_refused(grad: bool) -> None:
    x = torch.tensor([0.0, 2.0], requires_grad=grad)
    with bg.BatchingPolicy():
        h = bg.batched_value(x) * 1
        y = bg.compute(h)
        y.data[0] = -0.0  # eagerly 1 / y gives -inf
        later = 1 / h
    assert (1 / y)[0].item() == -math.inf
    with pytest.raises(bg.ConstantChangedError, match=r"through \.data"):
        bg.compute(later)
