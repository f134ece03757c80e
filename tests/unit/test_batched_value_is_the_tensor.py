"""``bg.batched_value(t)`` is ``t`` itself eagerly: computing its handle gives ``t``
back, and calls recorded on the handle after ``t`` changed in place read it as it is
then, as eager calls would (they used to read the value stored at the first compute)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import batchgraph as bg
from tests.property.decoder_models import run_eagerly

tanh = bg.batched_func(torch.tanh)


def test_computing_the_handle_gives_the_tensor_itself() -> None:
    t = torch.zeros(2)
    with bg.BatchingPolicy():
        v = bg.batched_value(t)
        bg.compute(tanh(v))
        t += 1
        assert bg.compute(v) is t  # eagerly bg.batched_value(t) is t


@pytest.mark.parametrize("computed_before", [True, False])
def test_calls_recorded_after_a_change_read_the_changed_tensor(computed_before: bool) -> None:
    def run(t: torch.Tensor) -> list[torch.Tensor]:
        v = bg.batched_value(t)
        before = tanh(v) * 2
        if computed_before:
            before = bg.compute(before) if isinstance(before, bg.ResultHandle) else before
        t.mul_(3).add_(1)  # changed in place by the caller
        after = tanh(v) + v
        return [before, after]

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(3)]
    want = [run(x.clone()) for x in xs]
    if not computed_before:
        # The call recorded before the change would read the changed tensor when it
        # is computed: refused, as before (eagerly it read the old one).
        with bg.BatchingPolicy(), pytest.raises(Exception, match="changed"):
            bg.compute([run(x.clone()) for x in xs])
        return
    with bg.BatchingPolicy():
        got = bg.compute([run(x.clone()) for x in xs])
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b)


def test_an_example_changing_its_tensor_between_awaits_reads_it_as_eagerly() -> None:
    async def example(t: torch.Tensor) -> Any:
        v = bg.batched_value(t)
        first = await bg.value(tanh(v))
        t += 1
        second = await bg.value(tanh(v) * 2)
        return first, second, await bg.value(v)

    xs = [torch.randn(2, dtype=torch.float64) for _ in range(3)]
    want = [run_eagerly(example(x.clone())) for x in xs]
    got = bg.run_all([example(x.clone()) for x in xs])
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b)


def test_changing_the_handle_in_place_is_still_refused() -> None:
    t = torch.zeros(2)
    with bg.BatchingPolicy(), pytest.raises(TypeError, match=r"`\+=`"):
        v = bg.batched_value(t)
        v += 1
