"""A view recorded under no_grad (or in inference mode) of a value that requires grad
is handed out as eagerly: it requires grad (no_grad) but has no history, so no
gradient reaches the value through it.

Views of a value handed out (here ``bg.batched_value(x)``, which is ``x``) are taken
again of that value at hand-out (``handed_views.rederive``); that ran in the caller's
grad mode, so ``x[i]`` with ``i`` a 0-d handle got ``SelectBackward0`` and passed a
gradient to ``x`` where eagerly none flows (found by a random-seed run of the
long-lived policy state machine).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

import batchgraph as bg

VIEWS: dict[str, Callable[[Any], Any]] = {
    "index by a 0-d value": lambda v: v[v.sum(-1).argsort()[0]],
    "select by a 0-d value": lambda v: v.select(0, v.sum(-1).argsort()[1]),
    "int index": lambda v: v[1],
    "transpose": lambda v: v.t(),
    "narrow": lambda v: v.narrow(1, 1, 2),
}
MODES: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "no_grad": torch.no_grad,
    "inference": torch.inference_mode,
}


def _grad_to(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    if not out.requires_grad:
        return None
    weights = torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape) + 1
    (found,) = torch.autograd.grad((out * weights).sum(), x, allow_unused=True)
    return found


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("view", sorted(VIEWS))
def test_a_view_taken_without_grad_passes_no_gradient(view: str, mode: str) -> None:
    xs = [torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
          .requires_grad_() for i in range(3)]
    take = VIEWS[view]
    eager = []
    for x in xs:
        with MODES[mode]():
            eager.append(take(x))
    with bg.BatchingPolicy() as policy:
        handles = [bg.batched_value(x) for x in xs]
        with MODES[mode]():
            views = [take(h) for h in handles]
        got = policy.compute(views)
    for x, want, value in zip(xs, eager, got):
        torch.testing.assert_close(value.detach(), want.detach())
        assert value.requires_grad == want.requires_grad
        assert (value.grad_fn is None) == (want.grad_fn is None)
        assert _grad_to(value, x) is None and _grad_to(want, x) is None


def test_a_view_awaited_without_grad_in_a_coroutine_passes_no_gradient() -> None:
    x = torch.randn(3, 4, dtype=torch.float64).requires_grad_()

    async def example(v: Any) -> Any:
        with torch.no_grad():
            row = v[v.sum(-1).argsort()[0]]
        return await bg.value(row)

    (got,) = bg.run_all([example(x)])
    with torch.no_grad():
        want = x[x.sum(-1).argsort()[0]]
    torch.testing.assert_close(got.detach(), want.detach())
    assert got.requires_grad and got.grad_fn is None and _grad_to(got, x) is None


def test_a_view_taken_with_grad_still_passes_its_gradient() -> None:
    x = torch.randn(3, 4, dtype=torch.float64).requires_grad_()
    with bg.BatchingPolicy() as policy:
        h = bg.batched_value(x)
        got = policy.compute(h[h.sum(-1).argsort()[0]])
    want = x[x.sum(-1).argsort()[0]]
    found, expected = _grad_to(got, x), _grad_to(want, x)
    assert found is not None and expected is not None
    torch.testing.assert_close(found, expected)
