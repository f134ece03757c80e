"""A recorded callable drawing from Python's ``random`` or NumPy's global generator
gives each call its own draw, as eagerly.

A batched call runs the callable's Python once for the whole batch, so a LayerDrop
inside a module (``if self.training and random.random() < p: return x``) took one
decision for all 64 examples of a batch, and ``x + float(np.random.randn())`` added one
number to all of them; identical calls were merged into one besides. Such calls now
run one at a time and are never merged (``batchgraph.python_random``).
"""

from __future__ import annotations

import random

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg


class _LayerDrop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and random.random() < 0.5:
            return x * 1
        return self.lin(x)


def _noise(x: torch.Tensor) -> torch.Tensor:
    return x + float(np.random.randn())


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), same_input=st.booleans())
def test_a_layer_drop_decides_per_example(seed: int, same_input: bool) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    layer = _LayerDrop()
    site = bg.batched_func(layer)
    xs = [torch.randn(4) for _ in range(48)]
    if same_input:
        xs = [xs[0]] * len(xs)
    with bg.BatchingPolicy():
        handles = [site(bg.batched_value(x)) for x in xs]
    kept = []
    for x, got in zip(xs, bg.compute(handles), strict=True):
        dropped = torch.equal(got, x)
        assert dropped or torch.allclose(got, layer.lin(x))  # one of eager's two values
        kept.append(not dropped)
    assert any(kept) and not all(kept)  # all alike: 2 ** -47 per seed eagerly


@settings(max_examples=10, deadline=None)
@given(count=st.integers(2, 12))
def test_numpy_noise_is_drawn_per_example(count: int) -> None:
    noise = bg.batched_func(_noise)
    x = torch.zeros(3)
    with bg.BatchingPolicy():
        handles = [noise(bg.batched_value(x)) for _ in range(count)]
    got = bg.compute(handles)
    for g in got:  # each example one number, added to every element, as eagerly
        torch.testing.assert_close(g, g[:1].expand(3))
    assert len({float(g[0]) for g in got}) == count


def test_callables_drawing_nothing_of_python_still_batch() -> None:
    double = bg.batched_func(lambda x: x * 2)
    jitter = bg.batched_func(lambda x: x + torch.rand_like(x))
    xs = [torch.randn(3) for _ in range(4)]
    with bg.BatchingPolicy() as policy:
        doubled = bg.compute([double(x) for x in xs])
    torch.testing.assert_close(torch.stack(doubled), torch.stack(xs) * 2)
    assert policy.stats.unbatched_calls == 0
    with bg.BatchingPolicy() as policy:
        handles = [jitter(bg.batched_value(xs[0])) for _ in range(4)]
    assert len({tuple(t.tolist()) for t in bg.compute(handles)}) == 4
    assert policy.stats.unbatched_calls == 0
