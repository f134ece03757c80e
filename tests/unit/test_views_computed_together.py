"""A view computed by the same compute as the value it views is handed out as a view
of that value, as eagerly: ``y, s = bg.compute((h, h[:, 1]))``, then ``y.add_(100)``
changes ``s``, and calls recorded on ``s`` afterwards read the change (before, ``s``
was a copy of its own: ``s * 2`` gave the old value, silently).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import batchgraph as bg

VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "column": lambda t: t[:, 1],
    "row": lambda t: t[0],
    "t": lambda t: t.t(),
    "reshape": lambda t: t.reshape(-1),
    "narrow": lambda t: t.narrow(1, 1, 2),
    "t-then-row": lambda t: t.t()[2],
    "select": lambda t: t.select(1, 3),
    "expand": lambda t: t[0].expand(2, 4),
    "diagonal": lambda t: t.diagonal(),
}


def _eager(x: torch.Tensor, view: str, change: str) -> tuple[torch.Tensor, ...]:
    y = x * 1
    s = VIEWS[view](y)
    if change == "base":
        y.add_(100)
    else:
        s.mul_(3)
    return y, s, s * 2, y + 1


@settings(max_examples=40, deadline=None)
@given(view=st.sampled_from(sorted(VIEWS)), change=st.sampled_from(["base", "view"]),
       view_first=st.booleans(), count=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_a_view_computed_with_its_value_follows_its_changes(
        view: str, change: str, view_first: bool, count: int, seed: int) -> None:
    assume(not (view == "expand" and change == "view"))  # eagerly an error
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
          for _ in range(count)]
    want = [_eager(x, view, change) for x in xs]
    xb = [x.detach().clone().requires_grad_() for x in xs]
    got = []
    with bg.BatchingPolicy():
        for x in xb:
            h = bg.batched_value(x) * 1
            v = VIEWS[view](h)
            if view_first:
                s, y = bg.compute((v, h))
            else:
                y, s = bg.compute((h, v))
            if change == "base":
                y.add_(100)
            else:
                s.mul_(3)
            later = bg.compute((v * 2, h + 1))
            got.append((y, s, *later))
    for w, g in zip(want, got, strict=True):
        for a, b in zip(w, g, strict=True):
            torch.testing.assert_close(b, a)
    sum((t * (i + 1)).sum() for w in want for i, t in enumerate(w)).backward()
    sum((t * (i + 1)).sum() for g in got for i, t in enumerate(g)).backward()
    for x, x2 in zip(xs, xb, strict=True):
        torch.testing.assert_close(x2.grad, x.grad)


@pytest.mark.parametrize("groups", [1, 2])
def test_a_coroutine_awaiting_a_value_and_its_view_together(groups: int) -> None:
    xs = [torch.randn(3, 4) for _ in range(4)]

    async def example(x: torch.Tensor) -> torch.Tensor:
        h = bg.batched_value(x) * 1
        y, s = await bg.value((h, h[:, 1]))
        y.add_(100)
        return await bg.value(s * 2)

    got = bg.run_all([example(x) for x in xs], groups=groups)
    for x, g in zip(xs, got, strict=True):
        torch.testing.assert_close(g, (x[:, 1] + 100) * 2)


def test_a_user_function_returning_a_view_stays_a_copy() -> None:
    # Whether the user's function returns a view would take running it (its effects
    # too): its value is handed out as a copy, as the README says.
    calls = []

    def first_row(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return t[0]

    with bg.BatchingPolicy():
        h = bg.batched_value(torch.zeros(2, 2)) * 1
        y, row = bg.compute((h, bg.batched_func(first_row)(h)))
    calls_after = len(calls)
    y.add_(1)
    assert row.tolist() == [0.0, 0.0]
    assert len(calls) == calls_after


# Views of several inputs: output i views input i (the view of the second input was
# taken as one of the first: rerun on the first's hand-out, it was a view of the second
# input's stored row, so changing it changed what later calls on that input read).
MULTI: dict[str, Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]] = {
    "broadcast_tensors": lambda a, t: torch.broadcast_tensors(a, t),
    "meshgrid": lambda a, t: torch.meshgrid(a[0], t[1], indexing="ij"),
    "atleast_2d": lambda a, t: torch.atleast_2d(a, t),
}


def _multi(h: torch.Tensor, compute: Callable[..., Any], view: str,
           change: str) -> tuple[torch.Tensor, ...]:
    a = h[0:1] * 1
    first, second = MULTI[view](a, h)
    ya, yh, v0, v1 = compute((a, h, first, second))
    {"first": ya, "second": yh, "view": v1}[change].add_(100)
    return (ya, yh, v0, v1, *compute((h * 1, second * 1)))


@pytest.mark.parametrize(("view", "change"), [
    (view, change) for view in sorted(MULTI) for change in ["first", "second", "view"]
    if (view, change) != ("meshgrid", "view")])  # eagerly an error: expanded outputs
def test_a_view_of_a_later_input_follows_that_inputs_value(view: str, change: str) -> None:
    xs = [torch.randn(3, 4) for _ in range(3)]
    want = [_multi(x * 1, lambda t: t, view, change) for x in xs]
    with bg.BatchingPolicy():
        got = [_multi(bg.batched_value(x) * 1, bg.compute, view, change) for x in xs]
    for w, g in zip(want, got, strict=True):
        for a, b in zip(w, g, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
