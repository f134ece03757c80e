"""NumPy scalars as static arguments keep their type in a call's signature.

``np.float64(1.0) == np.int64(1)`` and they hash alike, so ``h + np.float64(1.0)``
found the cached signature of ``h + np.int64(1)`` (kept across policies) and computed
in int64 (``[1, 2, 3]``, eagerly ``[1., 2., 3.]``), and the two merged into one node in
one policy, silently; ``h / np.float64(-0.0)`` likewise took ``0.0``'s ``+inf``.
Python numbers were tagged with their type (``static_value``); NumPy's are too now.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import batchgraph as bg

_SCALARS = [np.int64(1), np.float64(1.0), np.float32(1.0), np.bool_(True), np.int32(1),
            np.float64(-0.0), np.float64(0.0), np.int64(0)]
_OPS = {
    "add": lambda t, s: t + s,
    "mul": lambda t, s: t * s,
    "true_divide": lambda t, s: t / s,
    "function": bg.batched_func(lambda t, s: t * s + s),
}


@settings(max_examples=40, deadline=None)
@given(op=st.sampled_from(sorted(_OPS)),
       scalars=st.lists(st.sampled_from(_SCALARS), min_size=2, max_size=4),
       dtype=st.sampled_from([torch.int64, torch.float32, torch.bool]))
def test_numpy_scalars_of_equal_value_and_other_type_compute_as_eagerly(
    op: str, scalars: list[Any], dtype: torch.dtype
) -> None:
    x = torch.tensor([1, 2, 0]).to(dtype)
    eager = [_OPS[op](x, s) for s in scalars]  # outside a policy: eagerly
    with bg.BatchingPolicy():
        handles = [_OPS[op](bg.batched_value(x) * 1, s) for s in scalars]
    for got, want in zip(bg.compute(handles), eager, strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
