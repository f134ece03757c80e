"""``h.detach().requires_grad_()`` in per-example code: a new leaf, as eagerly.

``requires_grad_`` changes the tensor's own flag, not its values, so it never reaches
the tensors it shares memory with: eagerly ``z.detach().requires_grad_()`` makes a leaf
and leaves ``z`` as it was (the usual way to cut a graph and start a new one, as in
truncated backpropagation). It was refused as a change in place of a view of ``z``
("would change in place a view of another value (detach)"), with a hint
(``Tensor.requires_grad_(h.clone())``) that eagerly fails for a value that requires grad.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg


class _Cut(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def f(self, x: torch.Tensor, flag: bool, head: bool) -> torch.Tensor:
        z = self.a(x)
        cut = z.detach().requires_grad_(flag)
        out = self.b(cut) if head else cut * 2  # without parameters after the cut
        return (out + z).sum()  # z itself unchanged, still on its own graph


@settings(deadline=None, max_examples=15)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 4), flag=st.booleans(),
       head=st.booleans())
def test_a_new_leaf_cut_from_a_value_gives_eager_values_and_gradients(
    seed: int, n: int, flag: bool, head: bool
) -> None:
    torch.manual_seed(seed)
    eager = _Cut().double()
    model = copy.deepcopy(eager)
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(n)]
    want = [eager.f(x, flag, head) for x in xs]
    with bg.BatchingPolicy() as policy:
        handles = [model.f(x, flag, head) for x in xs]
    got = policy.compute(handles)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
        assert g.requires_grad == w.requires_grad
    torch.stack(want).sum().backward()
    torch.stack(got).sum().backward()
    for (name, p), q in zip(eager.named_parameters(), model.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-12)


def test_the_flag_of_a_tensor_the_caller_holds_is_still_refused() -> None:
    # Eagerly bg.batched_value(t) is t itself: its flag would change.
    with bg.BatchingPolicy(), pytest.raises(TypeError, match="tensor of the caller's"):
        bg.batched_value(torch.ones(3)).requires_grad_()
