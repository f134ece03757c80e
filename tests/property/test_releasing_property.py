"""Releasing dead values never loses one an example can still read.

Each example runs a random program over the handles it holds: it records new calls
(on small token ids, so identical calls merge across steps), records calls it does
not await yet (pending across steps), awaits some handles, and drops others (or all
but the newest, so whole steps become unreachable). Every
value it reads under ``run_all`` (which releases as it goes) must equal the eager run
of the same coroutine.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg
from tests.property.decoder_models import run_eagerly

OPS = ("token", "apply", "pending", "await", "drop", "forget")
programs = st.lists(
    st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 7)), min_size=1, max_size=14),
    min_size=1,
    max_size=5,
)


class _Model(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = bg.batched_func(nn.Embedding(3, 4).double())
        self.lin = bg.batched_func(nn.Linear(4, 4).double())

    async def run(self, program: list[tuple[str, int]]) -> list[float]:
        held: list[Any] = [self.embed(bg.batched_value(0))]
        read: list[float] = []
        for op, arg in program:
            pick = held[arg % len(held)] if held else None
            if op == "token" or pick is None:
                held.append(self.embed(bg.batched_value(arg % 3)))  # merges across steps
            elif op == "apply":
                held.append(self.lin(pick).tanh())
            elif op == "pending":  # recorded now, read (if ever) after later steps
                held.insert(0, self.lin(pick) * 0.5)
            elif op == "await":
                read.append(float((await bg.value(pick)).sum()))
            elif op == "drop":
                del held[arg % len(held)]
            else:  # keep only the newest: earlier steps' values become unreachable
                del held[:-1]
        for h in held:  # everything still held is read at the end
            read.append(float((await bg.value(h)).sum()))
        return read


@given(seed=st.integers(0, 2**16), batch=programs, groups=st.integers(1, 2))
def test_every_value_an_example_reads_equals_eager(
    seed: int, batch: list[list[tuple[str, int]]], groups: int
) -> None:
    model = _Model(seed)
    with torch.no_grad():
        eager = [run_eagerly(model.run(p)) for p in batch]
        got = bg.run_all([model.run(p) for p in batch], groups=groups, overlap="inline")
    assert len(got) == len(eager)
    for g, e in zip(got, eager):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
