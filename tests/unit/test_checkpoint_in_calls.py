"""Activation checkpointing (``torch.utils.checkpoint``) inside recorded calls.

A non-reentrant checkpoint runs its forward under vmap without error, but its backward
recomputes the forward outside vmap, on the batch's vmap-internal tensors: backward
failed with functorch's "Either your tensor may have escaped from inside a function
being vmapped", far from the call. Such calls now run one at a time (the vmap probe
refuses them), and so give eager values and gradients; so do reentrant checkpoints,
which the probe refused already.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import batchgraph as bg
from batchgraph.testing import assert_batched_matches_eager


class _Block(nn.Module):
    """A module whose forward checkpoints its feed-forward part, as in transformers."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> Any:
        return x + checkpoint(self.ff, x, use_reentrant=self.reentrant)


class _Model(bg.BatchedModule):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.block = _Block(reentrant)
        self.head = nn.Linear(4, 1)

    def f(self, x: torch.Tensor) -> Any:
        return self.head(self.block(x))


@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.integers(1, 3), min_size=1, max_size=4))
def test_a_module_checkpointing_its_forward_matches_eager(lengths: list[int]) -> None:
    # (The check compares gradients by torch.autograd.grad, which a reentrant
    # checkpoint refuses eagerly too: that one is tested by backward() below.)
    torch.manual_seed(len(lengths))
    model = _Model(reentrant=False).double()
    xs = [torch.randn(n, 4, dtype=torch.float64, requires_grad=True) for n in lengths]
    report = assert_batched_matches_eager(model.f, xs, rtol=0, atol=1e-10)
    assert report.gradients_compared > 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_function_calling_checkpoint_backpropagates_as_eagerly(reentrant: bool) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)

    def step(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda y: torch.tanh(lin(y)), x, use_reentrant=reentrant)

    xs = [torch.randn(4, requires_grad=True) for _ in range(3)]
    run = bg.batched_func(step)
    with bg.BatchingPolicy() as policy:
        handles = [run(bg.batched_value(x)) for x in xs]
    got = bg.compute(handles)
    assert any("step" in name for name in policy.stats.unbatched_callables)
    leaves = [lin.weight, lin.bias, *xs]
    # backward(), not autograd.grad: a reentrant checkpoint refuses the latter.
    torch.stack(got).pow(2).sum().backward()
    grads = [t.grad for t in leaves]
    for t in leaves:
        t.grad = None
    torch.stack([step(x) for x in xs]).pow(2).sum().backward()
    for t, g in zip(leaves, grads, strict=True):
        assert g is not None
        torch.testing.assert_close(g, t.grad)
