"""Buffers replaced (not changed in place) between recording and compute, and by the
module's own forward.

* ``bn.running_mean = t`` (or ``register_buffer`` again) after calls were recorded:
  the batched calls read ``t`` where eagerly they read the old statistics, silently
  (max diff 5.0 below); refused now as an in-place change is (``BufferChangedError``).
* A forward assigning ``self.count = self.count + 1``: the run on fake tensors that
  infers a new signature's shape left a fake tensor in the module for good.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg
from batchgraph.inference import FakeTensor


class _Normed(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4).eval()

    def f(self, x: Any) -> Any:
        return self.bn(x)


_REPLACE = {
    "attribute": lambda bn, t: setattr(bn, "running_mean", t),
    "register_buffer": lambda bn, t: bn.register_buffer("running_mean", t),
}


@pytest.mark.parametrize("how", sorted(_REPLACE))
def test_a_buffer_replaced_between_record_and_compute_is_refused(how: str) -> None:
    torch.manual_seed(0)
    model = _Normed()
    xs = [torch.randn(2, 4) for _ in range(3)]
    want, bn = [model.f(x) for x in xs], model.bn
    with bg.BatchingPolicy() as policy:
        old = [model.f(x) for x in xs]
        _REPLACE[how](bn, torch.full((4,), 5.0))
        policy.compute(bg.batched_value(xs[0]).sum())  # a compute: the next calls note anew
        new = [model.f(x) for x in xs]
    with pytest.raises(bg.BufferChangedError, match=r"'running_mean'.*BatchNorm1d.*replaced"):
        policy.compute(old)
    for x, got in zip(xs, policy.compute(new), strict=True):  # recorded after: the new one
        torch.testing.assert_close(got, model.f(x))
    assert not torch.allclose(model.f(xs[0]), want[0])


class _Counting(nn.Module):
    """Counts its calls by replacing its buffer (out of place), as user code may."""

    batch_key = bg.StackKey

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1
        return x * 2


@settings(max_examples=20, deadline=None)
@given(st.lists(st.sampled_from(["record", "record", "compute"]), max_size=10))
def test_a_module_replacing_its_buffer_keeps_a_real_one_and_computes(ops: list[str]) -> None:
    # Its own replacements are the computation's: never refused, one per batched step.
    counting = _Counting()
    site = bg.batched_func(counting)
    pending: list[tuple[Any, torch.Tensor]] = []
    steps = 0
    with bg.BatchingPolicy() as policy:
        for i, op in enumerate([*ops, "compute"]):
            if op == "record":
                x = torch.full((3,), float(i))
                pending.append((site(bg.batched_value(x)), x * 2))
                assert not isinstance(counting.count, FakeTensor)
            elif pending:
                got = policy.compute([h for h, _ in pending])
                for g, (_, want) in zip(got, pending, strict=True):
                    torch.testing.assert_close(g, want)
                pending.clear()
                steps += 1
    assert type(counting.count) is torch.Tensor
    assert counting.count.item() == steps
