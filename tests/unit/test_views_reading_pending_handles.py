"""Views of a value handed out that could not be taken of that value when recorded:
ones reading a handle not computed yet (``h.expand_as(g)``, ``g`` pending), and ones
taking handles in a list (``torch.meshgrid([h, g])``). Eagerly they share the value's
memory: computing one gives it as the value is then, and a call recorded on one
after the value changed in place is refused (``handed_views``) where a list's were
not seen as views at all. Both read the value as handed out, silently, before.

Each program is run eagerly and batched, and values and gradients compared.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import batchgraph as bg
from tests.unit.test_views_of_handed_out_values import assert_as_eager

neg = bg.batched_func(torch.neg)

# Views of the handed-out value h (shape (3,)) and g (shape (2, 3), pending when
# recorded): several outputs where the view gives several.
PENDING = {"expand_as", "meshgrid pending", "broadcast_tensors"}
VIEWS = {
    "expand_as": lambda h, g: [h.expand_as(g)],
    "meshgrid list": lambda h, g: list(torch.meshgrid([h, h], indexing="ij")),
    "meshgrid pending": lambda h, g: list(torch.meshgrid([h, g[0]], indexing="ij")),
    "broadcast_tensors": lambda h, g: list(torch.broadcast_tensors(h, g)),
    "atleast_2d list": lambda h, g: list(torch.atleast_2d([h])),
}


def _program(view: str, first: float, by: float, read: bool,
             batched: bool) -> tuple[list[torch.Tensor], Any]:
    """``h`` handed out as ``y``, ``y`` increased by ``first`` in place, a view taken of
    ``h`` (and ``g``), ``y`` multiplied in place by ``by`` (0: not changed), and the
    views computed (``read``: doubled, by a call recorded after the change)."""
    x = torch.arange(3.0, dtype=torch.float64).requires_grad_()
    with bg.BatchingPolicy() if batched else contextlib.nullcontext():
        h = neg(x) if batched else -x
        y = bg.compute(h) if batched else h
        if first:
            y.add_(first)
        ones = torch.ones(2, 3, dtype=torch.float64)
        g = neg(ones) if batched else -ones
        views = VIEWS[view](h, g)
        if by:
            y.mul_(by)
        wanted = [v * 2 for v in views] if read else views
        out = bg.compute(wanted) if batched else wanted
    (grad,) = torch.autograd.grad(sum(o.sum() for o in out), x)
    return [o.detach().clone() for o in out], grad


@given(view=st.sampled_from(sorted(VIEWS)), first=st.sampled_from([0.0, 1.0]),
       by=st.sampled_from([0.0, 3.0]), read=st.booleans())
def test_views_of_a_handed_out_value_with_pending_or_listed_inputs_are_as_eager(
    view: str, first: float, by: float, read: bool,
) -> None:
    if read and by and view in PENDING:
        # Recorded after the change, on a view not taken of y (g was pending): eagerly
        # it sees the change, which recording does not. The others are views of y.
        with pytest.raises(TypeError, match="cannot tell"):
            _program(view, first, by, read, batched=True)
        return
    eager, eager_grad = _program(view, first, by, read, batched=False)
    got, got_grad = _program(view, first, by, read, batched=True)
    assert_as_eager(got, got_grad, eager, eager_grad)


def test_a_view_of_handles_in_a_list_follows_the_value_taken_after_the_change() -> None:
    # Not refused: recorded after the change, as a view of the value as it is then.
    with bg.BatchingPolicy():
        h = neg(torch.arange(3.0))
        y = bg.compute(h)
        y.add_(1)
        a, b = torch.meshgrid([h, h], indexing="ij")
        got = bg.compute([a * 1, b * 1])
    eager = torch.meshgrid([y, y], indexing="ij")
    assert all(torch.equal(g, e) for g, e in zip(got, eager, strict=True))
