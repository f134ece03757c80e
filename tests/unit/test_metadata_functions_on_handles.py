"""torch's metadata functions on handles answer as on the eager tensors.

``torch.numel(h)``, ``torch.is_floating_point(h)``, ``torch.is_complex(h)`` and
``torch.result_type(h, other)`` were recorded as calls and refused ("a recorded call
must return a tensor"), where eager code gets a number, a bool or a dtype; the
methods (``h.numel()``) answered already.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import batchgraph as bg

_DTYPES = [torch.float32, torch.float16, torch.float64, torch.int64, torch.int8, torch.bool,
           torch.complex64]
_OTHERS: list[Any] = [2, 2.5, True, 1j, torch.tensor(1.5, dtype=torch.float64),
                      torch.ones(2, dtype=torch.int32), "handle"]


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(_DTYPES), shape=st.sampled_from([(), (3,), (2, 0)]),
       other=st.sampled_from(range(len(_OTHERS))), other_dtype=st.sampled_from(_DTYPES))
def test_metadata_functions_answer_as_on_tensors(
    dtype: torch.dtype, shape: tuple[int, ...], other: int, other_dtype: torch.dtype
) -> None:
    x = torch.zeros(shape, dtype=dtype)
    y = torch.zeros((), dtype=other_dtype)
    operand = _OTHERS[other]
    with bg.BatchingPolicy():
        h = bg.batched_value(x) * 1 if dtype != torch.bool else bg.batched_value(x) | False
        g = bg.batched_value(y) * 1 if other_dtype != torch.bool else bg.batched_value(y) | False
        got = (torch.numel(h), torch.is_floating_point(h), torch.is_complex(h),
               torch.result_type(h, g if operand == "handle" else operand),
               torch.result_type(g if operand == "handle" else operand, h))
    eager_operand = y if operand == "handle" else operand
    want = (torch.numel(x), torch.is_floating_point(x), torch.is_complex(x),
            torch.result_type(x, eager_operand), torch.result_type(eager_operand, x))
    assert got == want


def test_metadata_of_a_result_of_unknown_shape_is_refused_saying_so() -> None:
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.tensor([1.0, -1.0])) * 1
        selected = h[h > 0]
        with pytest.raises(TypeError, match=r"not known while recording.*h\[h > 0\]"):
            torch.numel(selected)
