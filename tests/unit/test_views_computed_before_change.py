"""Views recorded before the value they view was handed out, computed (as the input
of another call) by the time the value changed in place: their stored rows are copies
of the value as it was, where eagerly they share its memory. Computing one gives the
view of the value handed out, and a call recorded on one after the change is refused,
as for views still pending (``batchgraph.handed_views``). Before, both read the stored
copy, silently: ``s = h[:, 1]`` computed for ``s * 2``, ``y += 100``, then ``s`` and
``s * 3`` missed the change.

Each case runs the same program eagerly (the values handed out are the tensors
themselves) and batched, in the three orders of computing the view and handing out
its value: the view computed by a compute after the hand-out, with it, or before it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

import batchgraph as bg

# When the view s (recorded before the hand-out) is computed, for s2 = s * 2:
ORDERS = ["after", "with", "before"]


def _program(order: str, batched: bool, x: torch.Tensor,
             then: Callable[[Any, Any], Any]) -> Any:
    """``h = neg(x)``, ``s = view(h)``, ``s * 2``; ``h`` handed out (``y``) and ``s``'s
    value computed in ``order``; ``y`` changed in place; then ``then(s, y)``."""
    neg = bg.batched_func(torch.neg) if batched else torch.neg
    compute = bg.compute if batched else (lambda v: v)
    with bg.BatchingPolicy() if batched else contextlib.nullcontext():
        h = neg(x)
        s = h[:, 1:]
        s2 = s * 2
        y = _hand_out(order, compute, h, s2)
        with torch.no_grad():
            y.add_(100)
        return then(s, y)


def _hand_out(order: str, compute: Callable[[Any], Any], h: Any, s2: Any) -> Any:
    """``h``'s value, handed out after, with or before ``s2`` (reading the view) is
    computed."""
    if order == "after":
        y = compute(h)
        compute(s2)
    elif order == "with":
        y, _ = compute([h, s2])
    else:
        compute(s2)
        y = compute(h)
    return y


@pytest.mark.parametrize("order", ORDERS)
def test_computing_the_view_gives_the_view_of_the_changed_value(order: str) -> None:
    x = torch.arange(12.0).reshape(3, 4)
    eager = _program(order, False, x, lambda s, y: (s, y))
    got, y = _program(order, True, x, lambda s, y: (bg.compute(s), y))
    assert torch.equal(got, eager[0])
    y.mul_(2)  # and it goes on sharing y's memory, as eagerly
    assert torch.equal(got, y[:, 1:])


@pytest.mark.parametrize("order", ORDERS)
def test_a_view_of_the_view_recorded_before_gives_the_view_of_the_changed_value(
        order: str) -> None:
    x = torch.arange(12.0).reshape(3, 4)

    def run(batched: bool) -> Any:
        neg = bg.batched_func(torch.neg) if batched else torch.neg
        compute = bg.compute if batched else (lambda v: v)
        with bg.BatchingPolicy() if batched else contextlib.nullcontext():
            h = neg(x)
            s = h[:, 1:]
            row = s[0]
            y = _hand_out(order, compute, h, s * 2)
            with torch.no_grad():
                y.add_(100)
            return compute(row)

    assert torch.equal(run(True), run(False))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("call", [lambda s: s * 3, lambda s: s * 2, lambda s: s.sum()],
                         ids=["new call", "identical call", "reduction"])
def test_a_call_on_the_view_after_the_change_is_refused(order: str, call: Any) -> None:
    # "identical call": s * 2 was merged with the s2 computed before, silently.
    x = torch.arange(12.0).reshape(3, 4)
    with pytest.raises(TypeError, match="cannot tell"):
        _program(order, True, x, lambda s, y: bg.compute(call(s)))


def test_a_call_on_the_view_recorded_before_the_hand_out_reads_the_value_as_it_was() -> None:
    x = torch.arange(12.0).reshape(3, 4)
    neg = bg.batched_func(torch.neg)
    with bg.BatchingPolicy():
        h = neg(x)
        s = h[:, 1:]
        s3 = s * 3
        y, _ = bg.compute([h, s * 2])
        y.add_(100)
        assert torch.equal(bg.compute(s3), -x[:, 1:] * 3)


def test_a_view_handed_out_with_its_value_is_a_view_of_it() -> None:
    # README: a view computed together with the value it views is a view of it, as
    # eagerly (batchgraph.views_together); a call on the view reads the change.
    x = torch.arange(12.0).reshape(3, 4)
    with bg.BatchingPolicy():
        h = bg.batched_func(torch.neg)(x)
        s = h[:, 1:]
        y, got = bg.compute([h, s])
        y.add_(100)
        assert torch.equal(got, 100 - x[:, 1:])
        assert torch.equal(bg.compute(s * 3), (100 - x[:, 1:]) * 3)


def test_coroutine_view_computed_for_an_earlier_await_is_refused_after_the_change() -> None:
    async def example(x: torch.Tensor) -> Any:
        h = bg.batched_func(torch.neg)(x)
        s = h[:, 1]
        s2 = s * 2
        y = await bg.value(h)
        y.add_(100)
        await bg.value(s2)  # computes s as it was
        return await bg.value(s * 2)  # eagerly reads the change

    results = bg.run_all([example(torch.zeros(2, 3))], return_exceptions=True)
    assert isinstance(results[0], TypeError) and "cannot tell" in str(results[0])
