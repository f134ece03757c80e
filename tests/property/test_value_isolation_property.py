"""A value an example changes in place reaches only the calls it should.

``bg.value`` hands out the example's own tensors. Each example runs a random
program: it records calls on small token ids and on values it holds (so identical
calls merge, across examples and across steps), reads values, and sometimes changes a
value in place: a freshly read one before letting its handle go (``v.add_``), or one
it goes on using. Under ``run_all`` every value read must equal the eager run, where
each example owns its tensors: calls recorded on a handle after its value changed
see the change, calls recorded before it (pending ones too) and other examples'
values do not.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

import batchgraph as bg
from tests.property.decoder_models import TokenModel, programs

OPS = ("token", "apply", "pending", "await", "change_token", "change_apply", "change_held")


class _Model(TokenModel):
    async def run(self, program: list[tuple[str, int]]) -> list[float]:
        held: list[Any] = [self.embed(bg.batched_value(0))]
        read: list[float] = []
        for op, arg in program:
            pick = held[arg % len(held)]
            if op == "token":
                held.append(self.embed(bg.batched_value(arg % 3)))  # merges
            elif op == "apply":
                held.append(self.lin(pick))  # merges where another example did the same
            elif op == "pending":  # recorded now, read (if ever) after later steps
                held.insert(0, self.lin(pick) * 0.5)
            elif op == "await":
                read.append(float((await bg.value(pick)).sum()))
            elif op == "change_held":  # later calls on pick see this; earlier ones not
                value = await bg.value(pick)
                value.mul_(-1.0)
                value[arg % value.shape[0]] += 3.0
            else:  # read a new value, change it in place, and let its handle go
                fresh = (self.embed(bg.batched_value(arg % 3)) if op == "change_token"
                         else self.lin(pick))
                value = await bg.value(fresh)
                read.append(float(value.sum()))
                value.add_(100.0)
                value[0] = -1.0
        for h in held:
            read.append(float((await bg.value(h)).sum()))
        return read


@given(seed=st.integers(0, 2**16), batch=programs(OPS, 12), groups=st.integers(1, 2), forget=st.booleans())
def test_changing_a_value_in_place_reaches_no_other_example(
    seed: int, batch: list[list[tuple[str, int]]], groups: int, forget: bool
) -> None:
    _Model(seed).assert_reads_equal_eager(batch, groups, forget_every_step=forget)
