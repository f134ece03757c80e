"""``torch.func.functional_call`` on a ``BatchedModule``'s submodule in per-example code.

While a policy records, ``self.cell`` is a recording stub: ``functional_call(self.cell,
params, (h,))`` swapped the module's parameters for the call the stub recorded, which
runs when the batch computes, with the module's own parameters. After a plain call of
the module in the same batch, the given parameters were silently ignored (max diff
0.89 vs eager); else compute refused it, blaming a parameter change. It is refused where
recorded now, saying what to write; those forms give eager values.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg

_FUNCTIONAL = bg.batched_func(torch.func.functional_call)


class _Model(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(3, 3)

    def direct(self, x: Any, params: dict[str, torch.Tensor]) -> Any:
        return torch.func.functional_call(self.cell, params, (x,))

    @bg.batched_func
    def recorded(self, x: Any, params: dict[str, torch.Tensor]) -> Any:
        return torch.func.functional_call(self.cell, params, (x,))

    def passed(self, x: Any, params: dict[str, torch.Tensor]) -> Any:
        return _FUNCTIONAL(self.cell, params, (x,))  # the stub, as an argument


def _params(model: _Model, scale: float) -> dict[str, torch.Tensor]:
    return {k: v.detach() * scale for k, v in model.cell.named_parameters()}


@pytest.mark.parametrize("plain_call_first", [False, True])
def test_functional_call_on_a_stub_is_refused_where_recorded(plain_call_first: bool) -> None:
    model = _Model()
    x = torch.randn(3)
    with bg.BatchingPolicy():
        if plain_call_first:
            model.cell(bg.batched_value(x))
        with pytest.raises(TypeError, match=r"recording stub.*functional_call.*@bg\.batched_func"):
            model.direct(bg.batched_value(x), _params(model, 2.0))
    assert all(isinstance(p, nn.Parameter) for p in model.cell.parameters())  # put back


@settings(max_examples=10, deadline=None)
@given(scales=st.lists(st.floats(-2.0, 2.0), min_size=1, max_size=4),
       form=st.sampled_from(["recorded", "passed"]))
def test_the_advised_forms_use_each_examples_parameters(scales: list[float], form: str) -> None:
    torch.manual_seed(len(scales))
    model = _Model()
    xs = [torch.randn(3) for _ in scales]
    params = [_params(model, s) for s in scales]
    call = getattr(model, form)
    want = [model.direct(x, p) for x, p in zip(xs, params, strict=True)]  # eagerly
    with bg.BatchingPolicy():
        model.cell(bg.batched_value(xs[0]))  # a plain call of the module too
        handles = [call(bg.batched_value(x), p) for x, p in zip(xs, params, strict=True)]
    for got, w in zip(bg.compute(handles), want, strict=True):
        torch.testing.assert_close(got, w)
