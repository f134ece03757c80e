"""A value handed out (by compute or an await), changed through ``.data``, then read
by a call recorded on its handle.

Before: ``.data`` is an alias with a version counter of its own, so the value's
version did not move and the call read the row as computed, where eagerly it read
the change (``y.data.add_(1)``: the later output off by the change, silently). Now
the compute compares the value with its row and refuses the difference, saying what
to write instead; a change that moves the version (``y.add_`` under no_grad) and a
change no later call reads still compute as eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import batchgraph as bg

Change = Callable[[torch.Tensor], object]


def _no_grad_add(y: torch.Tensor) -> None:
    with torch.no_grad():
        y.add_(1)


THROUGH_DATA: dict[str, Change] = {
    "data.add_": lambda y: y.data.add_(1),
    "data.copy_": lambda y: y.data.copy_(torch.ones(4)),
    "data[0] =": lambda y: y.data.__setitem__(0, 5.0),
}
SEEN: dict[str, Change] = {  # they move the version: calls after them read the change
    "no_grad add_": _no_grad_add,
    "detach().add_": lambda y: y.detach().add_(1),
    "nothing": lambda y: None,
}
REFUSED = "without moving its version counter"


class Model(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)


def _batched(model: Model, xs: list[torch.Tensor], change: Change, how: str) -> list[torch.Tensor]:
    """``lin(lin(x))`` per example, the first example's ``lin(x)`` handed out and
    ``change``d before the second call is recorded on its handle."""
    lin = model.lin
    if how.startswith("run_all"):
        async def example(i: int) -> torch.Tensor:
            h = lin(bg.batched_value(xs[i]))
            y = await bg.value(h)
            if i == 0:
                change(y)
            return await bg.value(lin(h))
        return list(bg.run_all([example(i) for i in range(len(xs))], groups=int(how[-1])))
    with bg.BatchingPolicy():
        hs = [lin(bg.batched_value(x)) for x in xs]
        if how == "one pending":  # the others' calls still pending at the hand-out
            change(bg.compute(hs[0]))
        else:
            change(bg.compute(hs)[0])
        outs = [lin(h) for h in hs]
    return list(bg.compute(outs))


HOWS = ["one pending", "all", "run_all 1", "run_all 2"]


@pytest.mark.parametrize("examples", [3, 9])  # 9: rows of one copy handed out at once
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("change", sorted(THROUGH_DATA) + sorted(SEEN))
def test_a_handed_out_value_changed_then_read_computes_as_eagerly_or_is_refused(
        change: str, how: str, grad: bool, examples: int) -> None:
    torch.manual_seed(0)
    model = Model()
    model.lin.requires_grad_(grad)
    xs = [torch.randn(4) for _ in range(examples)]
    fn = THROUGH_DATA.get(change) or SEEN[change]
    ys = [model.lin(x) for x in xs]
    fn(ys[0])
    want = [model.lin(y) for y in ys]
    if change in THROUGH_DATA:
        with pytest.raises(bg.BatchgraphError, match=REFUSED):
            _batched(model, xs, fn, how)
        return
    for g, w in zip(_batched(model, xs, fn, how), want, strict=True):
        torch.testing.assert_close(g, w)


def test_a_change_through_data_that_no_later_call_reads_is_left_alone() -> None:
    lin = Model().lin
    with bg.BatchingPolicy():
        hs = [lin(bg.batched_value(torch.randn(4))) for _ in range(2)]
        before = lin(hs[1])  # recorded before the hand-out: reads the value as computed
        y = bg.compute(hs[0])
        y.data.add_(1)
        other = lin(hs[1])
    got = bg.compute([before, other])
    torch.testing.assert_close(got[0], got[1])
