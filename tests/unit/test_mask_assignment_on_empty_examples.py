"""``h[mask] = v`` (and other boolean-mask writes) on examples with no elements gives
the eager values.

vmap refuses a write through a boolean mask on real tensors, where its probe on fake
tensors passed; ``VmapKey`` then runs the calls one at a time. On examples with no
elements (a ``(0,)`` value, a ``(2, 0)`` one) torch's vmap fails it with an
``IndexError`` about the mask's shape rather than a ``RuntimeError``, and the fallback
was skipped: a ``BatchedCallError`` said the call fails alone too, where eagerly it runs
(found by the DAG programs fuzzer).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import batchgraph as bg


def _writes(x: Any) -> list[Any]:
    z = x * 1
    z[z > 0] = 7.0
    w = x * 2
    w[x < 0] = x.sum()
    return [z, w]


@given(
    shapes=st.lists(st.sampled_from([(0,), (2, 0), (0, 3), (3,), (2, 3)]), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_mask_writes_equal_eager_on_examples_with_and_without_elements(
    shapes: list[tuple[int, ...]], seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    eager = [_writes(x) for x in xs]
    with bg.BatchingPolicy():
        handles = [_writes(bg.batched_value(x)) for x in xs]
    for want, got in zip(eager, bg.compute(handles)):
        for w, g in zip(want, got):
            assert (g.shape, g.dtype) == (w.shape, w.dtype)
            torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(0,), (2, 0)])
def test_a_write_that_fails_eagerly_still_fails(shape: tuple[int, ...]) -> None:
    # The fallback runs the calls alone, as eagerly: a mask of another shape fails
    # there too, and the batch's error is reported.
    def bad(x: Any) -> Any:
        z = x * 1
        z[torch.ones(5, dtype=torch.bool)] = 1.0
        return z

    with pytest.raises(IndexError):
        bad(torch.zeros(shape))
    with pytest.raises(bg.BatchedCallError, match="fails too: IndexError: The shape of the mask"):
        with bg.BatchingPolicy():
            handle = bad(bg.batched_value(torch.zeros(shape)))
        bg.compute(handle)
