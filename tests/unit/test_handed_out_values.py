"""Values handed out by ``handle.value`` and ``bg.value``: the caller's own tensors, as
eager results are. Changing one in place reaches the calls recorded on its handle
afterwards, and neither the calls recorded before the change nor other examples."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import batchgraph as bg
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


def test_a_value_shares_no_memory_with_the_store() -> None:
    lin = _linear()
    with torch.no_grad(), bg.BatchingPolicy() as policy:
        hs = [lin(bg.batched_value(torch.full((3,), float(i), dtype=torch.float64)))
              for i in range(3)]
        policy.compute(hs)
        store = policy.graph.stores[-1][0]
        values = [h.value for h in hs]
    for v in values:  # other calls still read the store: a change must not reach it
        assert v.untyped_storage().data_ptr() != store.untyped_storage().data_ptr()


def test_every_read_of_a_handle_gives_the_same_tensor() -> None:
    lin = _linear()
    with torch.no_grad(), bg.BatchingPolicy() as policy:
        hs = [lin(bg.batched_value(torch.full((3,), float(i), dtype=torch.float64)))
              for i in range(10)]  # enough rows that compute hands them out together
        got = policy.compute(hs)
    assert all(h.value is v for h, v in zip(hs, got, strict=True))
    assert hs[0].value is hs[0].value


def test_an_identical_call_after_a_change_computes_afresh() -> None:
    lin, x = _linear(), torch.ones(3, dtype=torch.float64)
    with torch.no_grad():
        expected = lin(x)
        with bg.BatchingPolicy() as policy:
            a = lin(bg.batched_value(x))
            policy.compute(a)
            a.value.mul_(0.0)  # the caller changes its own value, not the stored one
            b = lin(bg.batched_value(x))  # identical: merged with a's node
            assert b.node == a.node
            policy.compute(b)
            assert torch.equal(b.value, expected)
            assert torch.equal(a.value, torch.zeros(3, dtype=torch.float64))


def _mask_first(v: torch.Tensor) -> None:
    v[0] = -100.0


def _calls_around_a_change(x: torch.Tensor, log_softmax: Any, lin: Any) -> Any:
    """Eager or recorded: calls on a value recorded before and after changing it."""
    logits = lin(x)
    before = log_softmax(logits, -1)  # pending while the value is changed
    value = bg.compute(logits) if isinstance(logits, bg.ResultHandle) else logits
    between = log_softmax(logits, -1)  # after the value was read, before the change
    _mask_first(value)
    after = log_softmax(logits, -1)
    twice = logits * 2.0
    return before, between, after, twice


def _eager_and_batched(lin: Any, log_softmax: Any, count: int) -> tuple[list[Any], Any]:
    """``_calls_around_a_change`` on ``count`` inputs, eagerly and batched, which must
    give equal values: both results."""
    xs = [torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
          for i in range(count)]
    eager = [_calls_around_a_change(x, log_softmax, lin) for x in xs]
    with bg.BatchingPolicy():
        recorded = [_calls_around_a_change(x, log_softmax, lin) for x in xs]
    got = bg.compute(recorded)
    for want, have in zip(eager, got):
        for w, h in zip(want, have):
            torch.testing.assert_close(h, w)
    return eager, got


@pytest.mark.parametrize("grad", [False, True])
def test_calls_before_and_after_a_change_see_what_eager_calls_see(grad: bool) -> None:
    lin = _linear()
    log_softmax = bg.batched_func(torch.log_softmax)
    with torch.set_grad_enabled(grad):
        eager, got = _eager_and_batched(lin, log_softmax, 4)
    if grad:
        weights = lin.__wrapped__.weight
        total = sum(sum(t.sum() for t in row) for row in got)
        (batched,) = torch.autograd.grad(total, weights)
        (expected,) = torch.autograd.grad(sum(sum(t.sum() for t in row) for row in eager), weights)
        torch.testing.assert_close(batched, expected)


def test_a_change_in_inference_mode_reaches_later_calls_only() -> None:
    lin = _linear()
    log_softmax = bg.batched_func(torch.log_softmax)
    with torch.inference_mode():  # inference tensors keep no version: always copied
        _eager_and_batched(lin, log_softmax, 3)


def test_a_coroutine_masking_its_logits_leaves_pending_calls_alone() -> None:
    lin = _linear()
    log_softmax = bg.batched_func(torch.log_softmax)

    async def example(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        logits = lin(x)
        scores = log_softmax(logits, -1)  # recorded before the mask, awaited after
        value = await bg.value(logits)
        value[value.argmax()] = -float("inf")  # ban the best word in place
        masked = log_softmax(logits, -1)  # recorded after: sees the mask
        before, after = await bg.value((scores, masked))
        return before, after, int(value.argmax())

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(9)]
    with torch.no_grad():
        eager = [run_eagerly(example(x)) for x in xs]
        got = bg.run_all([example(x) for x in xs])
    for (b, a, i), (gb, ga, gi) in zip(eager, got):
        torch.testing.assert_close(gb, b)
        torch.testing.assert_close(ga, a)
        assert gi == i


def test_copies_of_merged_values_keep_their_gradients() -> None:
    lin, x = _linear(), torch.ones(3, dtype=torch.float64)
    with bg.BatchingPolicy() as policy:
        a, b = lin(bg.batched_value(x)), lin(bg.batched_value(x))
        policy.compute([a, b])
        (a.value * 2.0 + b.value).sum().backward()
    batched = lin.__wrapped__.weight.grad.clone()
    lin.__wrapped__.weight.grad = None
    (lin(x) * 2.0 + lin(x)).sum().backward()
    torch.testing.assert_close(batched, lin.__wrapped__.weight.grad)


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
    releaser = policy.releaser  # steps after each compute; stepped again here to scan
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
        merged = a.node
        assert merged in graph.shared
        del a, b, c  # nothing stands for the calls' store any more
        with policy:
            lin(bg.batched_value(torch.full((3,), 2.0, dtype=torch.float64)))  # a new generation
        releaser._forget_from = 0
        releaser.step()
    assert graph.stores[graph.node_loc[merged] >> 32] == []
    assert merged not in graph.shared


@pytest.mark.parametrize("count", [1, 10])  # one read, and rows handed out together
def test_values_read_in_inference_mode_are_what_eager_values_are(count: int) -> None:
    lin = _linear()
    with torch.no_grad(), bg.BatchingPolicy() as policy:
        hs = [lin(bg.batched_value(torch.full((3,), float(i), dtype=torch.float64)))
              for i in range(count)]
    with torch.inference_mode():
        got = policy.compute(hs)
    for v in got:  # recorded outside inference mode: normal tensors, as eagerly
        assert not v.is_inference() and not v.requires_grad
        v.add_(1.0)  # and changing one outside inference mode works, as eagerly
    with torch.inference_mode(), bg.BatchingPolicy() as policy:
        hs = [lin(bg.batched_value(torch.ones(3, dtype=torch.float64))) for _ in range(count)]
        assert all(v.is_inference() for v in policy.compute(hs))


# Results whose structure is known only once computed (data-dependent shapes).
_positive = bg.batched_func(lambda x: x[x > 0])
_unique = bg.batched_func(lambda x: torch.unique(x, return_counts=True))
_double = bg.batched_func(lambda x: x * 2)
_total = bg.batched_func(lambda pair: pair[0].sum() + pair[1].sum())


def test_a_result_of_unknown_structure_is_kept_and_changes_reach_later_calls() -> None:
    xs = [torch.tensor([1.0, -2.0, 3.0]), torch.tensor([-1.0, 5.0])]
    with bg.BatchingPolicy() as policy:
        hs = [_positive(x) for x in xs]
        before = _double(hs[0])  # recorded before the change: sees the computed value
    assert hs[0].spec is None
    policy.compute([hs, before])
    value = hs[0].value
    assert hs[0].value is value
    value.mul_(10)
    with policy:
        after = _double(hs[0])
    torch.testing.assert_close(policy.compute(after), torch.tensor([20.0, 60.0]))
    torch.testing.assert_close(before.value, torch.tensor([2.0, 6.0]))


def test_a_changed_structure_of_unknown_shape_cannot_be_passed_by_its_handle() -> None:
    with bg.BatchingPolicy() as policy:
        h = _unique(torch.tensor([1.0, 1.0, 3.0]))
    values, counts = policy.compute(h)
    assert h.value[0] is values
    with policy:
        unchanged = _total(h)  # read but not changed: the computed result
    assert policy.compute(unchanged).item() == 7.0
    counts.mul_(10)
    with pytest.raises(bg.ConstantChangedError, match="Pass the changed value itself"), policy:
        _total(h)


def _cell_after_a_change(x: torch.Tensor, cell: Any) -> Any:
    """Eager or recorded: an LSTM state, read, changed in place, then passed on as a
    tuple ``(h, c)`` (the common form, which records through a fast path)."""
    h, c = cell(x)
    value = bg.compute(h) if isinstance(h, bg.ResultHandle) else h
    before = cell(x, (h, c))
    value.mul_(-2.0)
    after = cell(x, (h, c))
    return before, after


def test_a_changed_state_inside_a_tuple_reaches_later_calls_only() -> None:
    torch.manual_seed(0)
    cell = bg.batched_func(nn.LSTMCell(3, 3).double())
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(3)]
    with torch.no_grad():
        eager = [_cell_after_a_change(x, cell) for x in xs]
        with bg.BatchingPolicy():
            recorded = [_cell_after_a_change(x, cell) for x in xs]
        got = bg.compute(recorded)
    for want, have in zip(eager, got, strict=True):
        torch.testing.assert_close(have, want, rtol=0, atol=1e-12)
    # The change mattered: the calls before and after it differ.
    assert not torch.allclose(eager[0][0][0], eager[0][1][0])
