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

from hypothesis import given
from hypothesis import strategies as st

import batchgraph as bg
from tests.property.decoder_models import TokenModel, programs

OPS = ("token", "apply", "pending", "await", "drop", "forget")


class _Model(TokenModel):
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


@given(seed=st.integers(0, 2**16), batch=programs(OPS, 14), groups=st.integers(1, 2), forget=st.booleans())
def test_every_value_an_example_reads_equals_eager(
    seed: int, batch: list[list[tuple[str, int]]], groups: int, forget: bool
) -> None:
    _Model(seed).assert_reads_equal_eager(batch, groups, forget_every_step=forget)
