"""Values handed out by ``handle.value`` and ``bg.value``: row views of the batched
results, copied only where another handle stands for the same (merged) node."""

from __future__ import annotations

import torch
from torch import nn

import batchgraph as bg
from batchgraph.releasing import StoreReleaser
from tests.property.decoder_models import run_eagerly


def _linear() -> bg.BatchedFunc:
    torch.manual_seed(0)
    return bg.batched_func(nn.Linear(3, 3).double())


def test_merged_calls_hand_out_separate_values() -> None:
    lin, x = _linear(), torch.ones(3, dtype=torch.float64)
    with torch.no_grad(), bg.BatchingPolicy() as policy:
        a, b = lin(bg.batched_value(x)), lin(bg.batched_value(x))
        assert a.node == b.node  # merged: one row of one store
        policy.compute([a, b])
        va, vb = a.value, b.value
    expected = vb.clone()
    va.add_(1.0)
    assert torch.equal(vb, expected)
    assert torch.equal(b.value, expected)


def test_an_unmerged_value_is_a_view_of_its_store() -> None:
    lin = _linear()
    with torch.no_grad(), bg.BatchingPolicy() as policy:
        hs = [lin(bg.batched_value(torch.full((3,), float(i), dtype=torch.float64)))
              for i in range(3)]
        policy.compute(hs)
        store = policy.graph.stores[-1][0]
        values = [h.value for h in hs]
    for v in values:  # no copy for the common case: one owner
        assert v.untyped_storage().data_ptr() == store.untyped_storage().data_ptr()


def test_a_changed_value_is_not_merged_with_later() -> None:
    lin, x = _linear(), torch.ones(3, dtype=torch.float64)
    with torch.no_grad():
        expected = lin(x)
        with bg.BatchingPolicy() as policy:
            a = lin(bg.batched_value(x))
            policy.compute(a)
            a.value.mul_(0.0)  # the caller changes its own value
            b = lin(bg.batched_value(x))  # identical, but may not reuse a's changed row
            assert b.node != a.node
            policy.compute(b)
            assert torch.equal(b.value, expected)


def test_copies_of_merged_values_keep_their_gradients() -> None:
    lin, x = _linear(), torch.ones(3, dtype=torch.float64)
    with bg.BatchingPolicy() as policy:
        a, b = lin(bg.batched_value(x)), lin(bg.batched_value(x))
        policy.compute([a, b])
        (a.value * 2.0 + b.value).sum().backward()
    batched = lin.fn.weight.grad.clone()
    lin.fn.weight.grad = None
    (lin(x) * 2.0 + lin(x)).sum().backward()
    torch.testing.assert_close(batched, lin.fn.weight.grad)


def test_a_coroutine_changing_its_value_leaves_the_others_alone() -> None:
    lin, x = _linear(), torch.ones(3, dtype=torch.float64)

    async def example(change: bool) -> tuple[float, float]:
        value = await bg.value(lin(bg.batched_value(x)))  # merged across examples
        seen = float(value.sum())
        if change:
            value.mul_(0.0)
        again = await bg.value(lin(bg.batched_value(x)))  # identical call, later step
        return seen, float(again.sum())

    with torch.no_grad():
        eager = [run_eagerly(example(c)) for c in (True, False, True)]
        assert bg.run_all([example(c) for c in (True, False, True)]) == eager


def test_the_releaser_forgets_released_nodes() -> None:
    lin = _linear()
    policy = bg.BatchingPolicy()
    releaser = StoreReleaser(policy.graph)
    graph = policy.graph
    with torch.no_grad():
        with policy:
            a = lin(bg.batched_value(torch.ones(3, dtype=torch.float64)))
            b = lin(bg.batched_value(torch.ones(3, dtype=torch.float64)))
            c = lin(bg.batched_value(torch.zeros(3, dtype=torch.float64)))
        policy.compute([a, b, c])
        _ = c.value
        releaser._forget_from = 0  # scan at this step
        releaser.step()
        merged, changed = a.node, c.node
        assert merged in graph.shared and changed in graph.exposed
        del a, b, c  # nothing stands for the calls' store any more
        with policy:
            lin(bg.batched_value(torch.zeros(3, dtype=torch.float64)))  # a new generation
        releaser._forget_from = 0
        releaser.step()
    assert graph.stores[graph.node_loc[merged] >> 32] == []
    assert merged not in graph.shared and changed not in graph.exposed
