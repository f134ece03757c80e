"""Property: on random MLPs, I + W equals a normal backward for inputs and parameters."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from batchgraph.pipeline.backward import TwoStageBackward

_ACTIVATIONS = [nn.ReLU, nn.Tanh, nn.GELU, nn.Identity]


@given(
    widths=st.lists(st.integers(1, 6), min_size=2, max_size=5),
    batch=st.integers(1, 5),
    acts=st.lists(st.integers(0, len(_ACTIVATIONS) - 1), min_size=4, max_size=4),
    norm=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_split_equals_autograd_on_random_mlps(
    widths: list[int], batch: int, acts: list[int], norm: bool, seed: int
) -> None:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if norm:
            layers.append(nn.LayerNorm(b))
        layers.append(_ACTIVATIONS[acts[i % len(acts)]]())
    net = nn.Sequential(*layers).double()
    x = torch.randn(batch, widths[0], dtype=torch.float64, requires_grad=True)
    g = torch.randn(batch, widths[-1], dtype=torch.float64)

    net(x).backward(g)
    ref = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
    ref_x = x.grad.clone()  # type: ignore[union-attr]
    net.zero_grad(set_to_none=True)

    x2 = x.detach().clone().requires_grad_(True)
    with TwoStageBackward(net) as split:
        with split.record() as tape:
            y = net(x2)
        (dx,) = tape.backward_input([y], [g], [x2])
        tape.backward_weight()
    assert dx is not None
    torch.testing.assert_close(dx, ref_x, rtol=1e-10, atol=1e-10)
    for p, r in zip(net.parameters(), ref):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, r, rtol=1e-10, atol=1e-10)
