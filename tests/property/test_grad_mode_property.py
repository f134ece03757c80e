"""Calls recorded under ``torch.no_grad()`` stay out of the gradient, as eagerly.

Each example runs a random chain of calls, some of them inside ``torch.no_grad()``
(the same modules in both modes, so their batches split by mode); outputs and
parameter gradients must equal the eager run.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg
from batchgraph.testing import assert_batched_matches_eager

OPS = ("linear", "tanh", "mix", "scale")
plans = st.lists(
    st.tuples(st.sampled_from(OPS), st.integers(0, 9), st.booleans()), min_size=1, max_size=8
)


class _Chain(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 3)
        self.lin = nn.Linear(3, 3)
        self.mix = nn.Linear(6, 3)

    def run(self, example: tuple[torch.Tensor, list[tuple[str, int, bool]]]) -> Any:
        x, plan = example
        values = [self.inp(x)]
        for op, parent, without_grad in plan:
            a = values[parent % len(values)]
            with torch.no_grad() if without_grad else contextlib.nullcontext():
                if op == "linear":
                    v = self.lin(a)
                elif op == "tanh":
                    v = torch.tanh(a)
                elif op == "mix":
                    v = self.mix(torch.cat([a, values[-1]], dim=-1))
                else:
                    v = a * 0.5 + 1.0
            values.append(v)
        total = values[0]
        for v in values[1:]:
            total = total + v
        return total


@given(plans_=st.lists(plans, min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_no_grad_regions_match_eager(plans_: list[list[tuple[str, int, bool]]], seed: int) -> None:
    torch.manual_seed(seed)
    model = _Chain().double()
    examples = [(torch.randn(3, dtype=torch.float64), plan) for plan in plans_]
    assert_batched_matches_eager(model.run, examples, rtol=0, atol=1e-10)
