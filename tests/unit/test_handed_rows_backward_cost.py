"""Rows handed out together with grad take one backward for all of them.

Before (4ea3300): each row with grad was selected on its own, and each select's
backward makes a zero tensor of the whole column: a loss over n rows handed out by
one ``bg.compute`` cost n column-sized gradients in backward, quadratic in the rows
(4096 rows of 256: 1.0-1.8 s of backward where one stack takes 0.05 s). Now the rows
come out of one call whose backward stacks their gradients; they still change in
place as eager results do.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import batchgraph as bg


@settings(max_examples=10, deadline=None)
@given(count=st.integers(8, 24), changed=st.integers(0, 23), seed=st.integers(0, 99))
def test_rows_handed_out_with_grad_share_one_backward_and_match_eager(
        count: int, changed: int, seed: int) -> None:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(3, 3).double()
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(count)]
    want = [lin(x) for x in xs]
    with bg.BatchingPolicy():
        handles = [lin(bg.batched_value(x)) for x in xs]
    got = list(bg.compute(handles))
    # one backward node for all the rows (8 or more: one copy of the column), not
    # one select per row
    assert len({id(g.grad_fn) for g in got}) == 1
    weights = [float(i + 1) for i in range(count)]
    for rows in (want, got):  # an in-place change of one, as eagerly
        rows[changed % count].mul_(3)
    grads = [torch.autograd.grad(sum(w * r.sum() for w, r in zip(weights, rows)),
                                 list(lin.parameters())) for rows in (got, want)]
    for g, w in zip(*grads, strict=True):
        torch.testing.assert_close(g, w)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
