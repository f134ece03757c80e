"""Gradients with respect to an intermediate value handed out (README, "Execute").

Calls recorded on a handle read the batched tensor its value is a row of, so the
tensor handed out for it is not on their gradient's path. Recorded on the handed-out
tensor instead (computed first), the later calls give the eager gradients with respect
to it, in a policy and in a coroutine.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg


def _layer(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(3, 3).double()


@settings(deadline=None, max_examples=10)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 4))
def test_later_calls_recorded_on_the_computed_value_give_eager_gradients(seed: int, n: int) -> None:
    lin = _layer(seed)
    site = bg.batched_func(lin)
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(n)]
    with bg.BatchingPolicy() as policy:
        mids = policy.compute([site(x) for x in xs])
    with bg.BatchingPolicy() as policy:
        outs = policy.compute([torch.tanh(site(m)).sum() for m in mids])
    for x, mid, out in zip(xs, mids, outs, strict=True):
        eager_mid = lin(x)
        want = torch.autograd.grad(torch.tanh(lin(eager_mid)).sum(), eager_mid)[0]
        got = torch.autograd.grad(out, mid, retain_graph=True)[0]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_in_a_coroutine_calls_on_the_awaited_value_give_eager_gradients() -> None:
    lin = _layer(0)
    site = bg.batched_func(lin)

    async def saliency(x: torch.Tensor) -> torch.Tensor:
        mid = await bg.value(site(x))
        out = await bg.value(torch.tanh(site(mid)).sum())
        # The examples share the batched calls' graph: each keeps it for the others.
        return torch.autograd.grad(out, mid, retain_graph=True)[0]

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(3)]
    for got, x in zip(bg.run_all([saliency(x) for x in xs]), xs, strict=True):
        torch.testing.assert_close(got, asyncio.run(saliency(x)), rtol=0, atol=1e-12)


def test_an_intermediate_computed_with_its_later_calls_is_not_on_their_path() -> None:
    # The documented limit: a clear autograd error, not a wrong gradient.
    site = bg.batched_func(_layer(0))
    with bg.BatchingPolicy() as policy:
        mid = site(torch.ones(3, dtype=torch.float64))
        out = torch.tanh(mid).sum()
    mid_value, out_value = policy.compute([mid, out])
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(out_value, mid_value)
