"""Embedding lookups with ``padding_idx`` or ``scale_grad_by_freq``: eager gradients.

Both make a weight's gradient depend on the example's own indices. Batched, they were
silently wrong: ``nn.Embedding(scale_grad_by_freq=True)``, stacked, counted each row
over the whole batch; ``F.embedding(ids, weight, padding_idx=p)`` ran through vmap,
which pads only the first example's row ``p``, so the other examples' padding
positions trained it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg

_ROWS = 6


def _lookups(kind: str, padding: int | None, freq: bool, weight: torch.Tensor) -> Any:
    if kind == "module":
        module = nn.Embedding(_ROWS, 3, padding_idx=padding, scale_grad_by_freq=freq)
        with torch.no_grad():
            module.weight.copy_(weight)
        return bg.batched_func(module), module.weight
    table = weight.clone().requires_grad_()

    def lookup(ids: Any) -> Any:
        return F.embedding(ids, table, padding_idx=padding, scale_grad_by_freq=freq)

    return lookup, table


@given(
    kind=st.sampled_from(["module", "function"]),
    padding=st.sampled_from([None, 0, 2, -1]),
    freq=st.booleans(),
    ids=st.lists(st.lists(st.integers(0, _ROWS - 1), min_size=4, max_size=4),
                 min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_embedding_gradients_are_eager(
    kind: str, padding: int | None, freq: bool, ids: list[list[int]], seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(_ROWS, 3, generator=gen)
    lookup, table = _lookups(kind, padding, freq, weight)
    indices = [torch.tensor(i) for i in ids]
    upstream = [torch.randn(4, 3, generator=gen) for _ in ids]
    eager = [lookup(i) for i in indices]
    with bg.BatchingPolicy():
        handles = [lookup(bg.batched_value(i)) for i in indices]
    got = bg.compute(handles)
    for want, value in zip(eager, got, strict=True):
        torch.testing.assert_close(value, want, rtol=0, atol=0)
    def loss(outs: list[Any]) -> Any:
        return sum((o * u).sum() for o, u in zip(outs, upstream, strict=True))

    (want_grad,) = torch.autograd.grad(loss(eager), table)
    (grad,) = torch.autograd.grad(loss(got), table)
    torch.testing.assert_close(grad, want_grad)


def test_frequency_counts_are_per_example() -> None:
    module = nn.Embedding(5, 2, scale_grad_by_freq=True)
    lookup = bg.batched_func(module)
    indices = [torch.tensor([1, 1, 2]), torch.tensor([1, 3, 3])]
    with bg.BatchingPolicy():
        handles = [lookup(bg.batched_value(i)) for i in indices]
    torch.stack(bg.compute(handles)).sum().backward()
    assert module.weight.grad is not None
    # Row 1: twice in the first example (1/2 each), once in the second (1): 2 in all.
    torch.testing.assert_close(module.weight.grad[:, 0], torch.tensor([0.0, 2.0, 1.0, 1.0, 0.0]))


def test_a_function_of_the_users_with_a_frequency_scaled_embedding_is_eager() -> None:
    # Through vmap, the lookup counted each row over the batch: it runs one at a time.
    torch.manual_seed(0)
    embed, out = nn.Embedding(5, 4, scale_grad_by_freq=True), nn.Linear(4, 2)
    encode = bg.batched_func(lambda ids: out(embed(ids)).tanh())
    indices = [torch.tensor([1, 1, 2]), torch.tensor([1, 3, 3])]
    eager = [encode(i) for i in indices]
    with bg.BatchingPolicy():
        handles = [encode(bg.batched_value(i)) for i in indices]
    got = bg.compute(handles)
    for want, value in zip(eager, got, strict=True):
        torch.testing.assert_close(value, want)
    (want_grad,) = torch.autograd.grad(sum(e.sum() for e in eager), embed.weight)
    (grad,) = torch.autograd.grad(sum(g.sum() for g in got), embed.weight)
    torch.testing.assert_close(grad, want_grad)
