"""``h[index] = value`` leaves ``h`` a tensor of its own shape and dtype, also where
fake tensors cannot size what the index selects.

A 0-d boolean mask (``h[h > 0] = v`` on a 0-d ``h``, ``h[torch.tensor(True)] = v``)
selects a number of elements known only from its value; the recorded assignment's
result was then of unknown structure, so ``h.shape`` failed ("does not stand for a
single tensor") and every later call ran one at a time, where eagerly ``h`` keeps its
shape (found by the DAG programs fuzzer).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import batchgraph as bg


def _assign(x: Any, mask_kind: int) -> list[Any]:
    z = x * 1
    if mask_kind == 0:
        z[z > 0] = 7.0
    elif mask_kind == 1:
        z[torch.tensor(True)] = z.sum() * 2
    else:
        z[torch.tensor(False)] = 3.0
    return [z, z * z.shape.numel(), z.sum()]


@given(
    shapes=st.lists(st.sampled_from([(), (3,), (2, 3), (0,)]), min_size=1, max_size=4),
    mask_kind=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_item_assignment_through_any_mask_keeps_shape_values_and_gradients(
    shapes: list[tuple[int, ...]], mask_kind: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_() for s in shapes]
    eager = [_assign(x, mask_kind) for x in xs]
    torch.stack([vs[-1] for vs in eager]).sum().backward()
    want_grads = [x.grad.clone() if x.grad is not None else None for x in xs]
    for x in xs:
        x.grad = None
    with bg.BatchingPolicy():
        handles = [_assign(bg.batched_value(x), mask_kind) for x in xs]
        assert [tuple(h[0].shape) for h in handles] == [tuple(x.shape) for x in xs]
        got = bg.compute(handles)
    for want, values in zip(eager, got):
        for w, g in zip(want, values):
            assert (g.shape, g.dtype) == (w.shape, w.dtype)
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    torch.stack([vs[-1] for vs in got]).sum().backward()
    for x, w in zip(xs, want_grads):
        torch.testing.assert_close(x.grad, w)


def test_a_value_that_does_not_fit_still_fails() -> None:
    x = torch.zeros(())
    with pytest.raises(RuntimeError):
        x.clone()[torch.tensor(True)] = torch.ones(3)
    # Known to keep its spec, the assignment still runs, and fails, as eagerly.
    with pytest.raises(bg.BatchedCallError, match="cannot be broadcast"):
        with bg.BatchingPolicy():
            z = bg.batched_value(x) * 1
            z[torch.tensor(True)] = torch.ones(3)
        bg.compute(z)
