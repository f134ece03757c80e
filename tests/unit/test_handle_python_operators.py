"""Python's operators and builtins on a handle give what they give on a tensor, bit for bit.

A handle's operator records the function the tensor's operator calls. Two did not:
``2 / h`` recorded ``torch.div(2, h)`` where a tensor computes ``h.reciprocal() * 2``
(a third of float32 results were 1 ulp apart, and a subnormal divisor gave 1e29 where
eagerly it is inf), and ``reversed(h)`` was Python's iterator over rows where on a
tensor it is ``t.flip(0)``, a tensor (``reversed(h) * 2`` failed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import batchgraph as bg

_DTYPES = [torch.float32, torch.float64, torch.int64, torch.float16]


def _eager_and_batched(fn: Callable[[Any], Any], xs: list[torch.Tensor]) -> tuple[Any, Any]:
    eager = [fn(x) for x in xs]
    with bg.BatchingPolicy():
        handles = [fn(bg.batched_value(x)) for x in xs]
    return eager, bg.compute(handles)


@given(
    shape=st.sampled_from([(), (1,), (5,), (2, 3)]),
    dtype=st.sampled_from(_DTYPES),
    numerator=st.sampled_from([3.0, 1e-10, 2, -7, True, np.float32(0.1)]),
    seed=st.integers(0, 2**16),
)
def test_a_number_divided_by_a_handle_is_bitwise_eager(
    shape: tuple[int, ...], dtype: torch.dtype, numerator: Any, seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    xs = [(torch.randn(shape, generator=gen) * 10).to(dtype) for _ in range(3)]
    xs.append(torch.full(shape, 1e-39).to(dtype))  # subnormal in float32: 1 / x is inf
    eager, got = _eager_and_batched(lambda x: numerator / x, xs)
    for want, value in zip(eager, got, strict=True):
        assert value.dtype == want.dtype
        torch.testing.assert_close(value, want, rtol=0, atol=0, equal_nan=True)


# (Integer arrays: torch's own operators promote a float32 tensor times an int64
# array to float64, where the array as a tensor keeps float32; not followed here.)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_numpy_array_divided_by_a_handle_is_eager(dtype: Any) -> None:
    xs = [torch.randn(3) for _ in range(2)]
    array = np.arange(1, 4).astype(dtype)
    eager, got = _eager_and_batched(lambda x: array / x, xs)
    for want, value in zip(eager, got, strict=True):
        assert value.dtype == want.dtype
        torch.testing.assert_close(value, want, rtol=0, atol=0)


def test_a_number_divided_by_a_handle_has_eager_gradients() -> None:
    torch.manual_seed(0)
    xs = [torch.randn(7, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    eager, got = _eager_and_batched(lambda x: 3.0 / x, xs)
    want = torch.autograd.grad(torch.stack(eager).sum(), xs)
    grads = torch.autograd.grad(torch.stack(got).sum(), xs)
    for a, b in zip(want, grads, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(4,), (3, 2), (2, 3, 2)])
def test_reversed_handle_is_the_tensor_flipped_along_dim_0(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    xs = [torch.randn(shape, requires_grad=True) for _ in range(3)]
    weights = torch.randn(shape)
    eager, got = _eager_and_batched(lambda x: reversed(x) * weights, xs)
    for want, value in zip(eager, got, strict=True):
        torch.testing.assert_close(value, want)
    want_grads = torch.autograd.grad(torch.stack(eager).sum(), xs)
    grads = torch.autograd.grad(torch.stack(got).sum(), xs)
    for a, b in zip(want_grads, grads, strict=True):
        torch.testing.assert_close(b, a)


def test_reversed_rows_iterate_as_on_a_tensor() -> None:
    xs = [torch.arange(6.0).view(3, 2) + i for i in range(2)]
    eager, got = _eager_and_batched(lambda x: torch.stack(list(reversed(x))), xs)
    for want, value in zip(eager, got, strict=True):
        torch.testing.assert_close(value, want)


def test_reversed_0d_handle_is_the_handle_itself() -> None:
    # Eagerly reversed(t) of a 0-d t is t: a change in place through either name
    # reaches both.
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.tensor(2.0)) * 1
        r = reversed(h)
        r += 1
        assert r is h
    assert bg.compute(h).item() == 3.0
