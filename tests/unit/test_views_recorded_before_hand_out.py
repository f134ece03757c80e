"""Views recorded before the value they view was handed out (``last = h[0:2]``, then
``y = bg.compute(h)``): eagerly ``last`` is a view of ``y`` and follows its in-place
changes. Computing such a view gives the view of ``y``, calls recorded on it before
the hand-out read the value as it was, and a call recorded on it after the hand-out
where ``y`` changed since is refused (eagerly it read ``y`` before or after the
change, which recording does not see). Before, all of them read the stored value,
silently: ``y += 1; bg.compute(last * 2)`` missed the change.

Each generated program is run eagerly and batched, and values and gradients compared.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import batchgraph as bg
from tests.unit.test_views_of_handed_out_values import SEVERAL, VIEWS, assert_as_eager

Step = tuple[str, int, int]  # ("view", of which, which view), ("read", of which, 0), ("change", by, 0)

_view = st.tuples(st.just("view"), st.integers(0, 9), st.integers(0, len(VIEWS) - 1))
# Reads by a factor of 2 or 3: equal ones are identical calls (merged when recorded).
_read = st.tuples(st.just("read"), st.integers(0, 9), st.integers(0, 1))
_change = st.tuples(st.just("change"), st.integers(1, 3), st.just(0))
before_steps = st.lists(st.one_of(_view, _read), min_size=1, max_size=6)
after_steps = st.lists(st.one_of(_view, _read, _change), max_size=6)


def _negated(x: torch.Tensor) -> torch.Tensor:
    return torch.neg(x)


def _negated_transposed(x: torch.Tensor) -> torch.Tensor:
    return torch.neg(x).transpose(0, -1)  # laid out as a transpose, eagerly and handed out


def _program(before: list[Step], after: list[Step], computed: list[int], grad: bool,
             x: torch.Tensor, batched: bool, copies: list[bool],
             first: Any = _negated) -> tuple[list[torch.Tensor], Any, bool]:
    """Views (and calls on them) recorded before ``h``'s value is handed out, then the
    value changed in place outside recording, views and calls recorded after that,
    and the calls and the views numbered ``computed`` computed at the end; with
    whether the batched run was refused, as it may be where a call recorded after the
    hand-out read a view recorded before it (or a view of one) and the value changed
    after the hand-out: the one case batchgraph cannot tell.

    A "view" that copies as its input is laid out (``reshape(-1)`` of a transpose)
    reads it instead: the eager run notes which did in ``copies``, which the batched
    run (whose values are handles) follows."""
    views = VIEWS if not grad else VIEWS[:-SEVERAL]
    neg = bg.batched_func(first) if batched else first
    x = x.clone().requires_grad_(grad)
    reads: list[Any] = []
    with (bg.BatchingPolicy() if batched else contextlib.nullcontext()):
        h = neg(x)
        values = [h]
        early = [False]  # per value: a view recorded before the hand-out, or of one
        read_early = changed = False

        def record(kind: str, a: int, b: int, handed: bool) -> None:
            nonlocal read_early, changed
            if kind == "view":
                _, view, fits = views[b % len(views)]
                i = a % len(values)
                if fits(values[i]):
                    values.append(view(values[i]))
                    if not batched:
                        copies.append(values[-1].untyped_storage().data_ptr()
                                      != values[i].untyped_storage().data_ptr())
                    if copies[len(values) - 2]:  # a copy: a read of values[i], not a view
                        if handed and early[i]:
                            read_early = True
                            reads.append(values[-1])  # computed with the reads
                        early.append(False)
                    else:
                        early.append(not handed or early[i])
            elif kind == "read":
                i = a % len(values)
                reads.append(values[i] * (b + 2))
                read_early = read_early or (handed and early[i])
            else:
                changed = True
                with torch.no_grad():
                    y.add_(a)  # outside recording: batchgraph does not see it

        for step in before:
            record(*step, handed=False)
        y = bg.compute(h) if batched else h
        for step in after:
            record(*step, handed=True)
        wanted = reads + [values[1 + i % (len(values) - 1)] for i in computed if len(values) > 1]
        if read_early and changed and batched:
            # Refused, or (a read merged with an identical one that read the value
            # before the change, eagerly too) as eagerly.
            try:
                out = bg.compute(wanted)
            except TypeError as error:
                assert "cannot tell" in str(error)
                return [], None, True
        else:
            out = bg.compute(wanted) if batched else wanted
    total = sum(o.sum() for o in out)
    grads = None
    if grad and out and isinstance(total, torch.Tensor) and total.requires_grad:
        (grads,) = torch.autograd.grad(total, x)
    return [o.detach().clone() for o in out], grads, False


@given(before=before_steps, after=after_steps, computed=st.lists(st.integers(0, 9), max_size=3),
       shape=st.sampled_from([(3, 4), (2, 3, 4), (4,)]), grad=st.booleans(),
       first=st.sampled_from([_negated, _negated_transposed]))
def test_views_recorded_before_the_hand_out_follow_the_value_or_are_refused(
    before: list[Step], after: list[Step], computed: list[int], shape: tuple[int, ...],
    grad: bool, first: Any,
) -> None:
    x = torch.randn(shape, dtype=torch.float64)
    copies: list[bool] = []
    eager, eager_grad, _ = _program(before, after, computed, grad, x, False, copies, first)
    got, got_grad, refused = _program(before, after, computed, grad, x, True, copies, first)
    if not refused:  # else checked in the program
        assert_as_eager(got, got_grad, eager, eager_grad)


def test_a_view_computed_after_the_change_is_the_view_of_the_value() -> None:
    with bg.BatchingPolicy():
        h = bg.batched_func(torch.neg)(torch.zeros(3, 4))
        last = h[0:2]
        y = bg.compute(h)
        y.add_(1)
        got = bg.compute(last)
    assert torch.equal(got, torch.ones(2, 4))
    y.add_(1)  # and it goes on sharing y's memory, as eagerly
    assert torch.equal(got, torch.full((2, 4), 2.0))


def test_a_call_recorded_before_the_hand_out_reads_the_value_as_it_was() -> None:
    with bg.BatchingPolicy():
        h = bg.batched_func(torch.neg)(torch.zeros(3, 4))
        early = h.t()[1] * 2
        y = bg.compute(h)
        y.add_(1)
        assert torch.equal(bg.compute(early), torch.zeros(3))


def test_a_reshape_that_copies_a_transpose_before_the_hand_out_keeps_the_value_as_it_was() -> None:
    # Eagerly reshape(-1) of h.t() (not contiguous) is a copy made when it is called:
    # later changes of y do not reach it, nor calls reading it. Batched it was taken
    # for a view of the view and rederived from the changed y: 1.0 off, silently.
    with bg.BatchingPolicy():
        h = bg.batched_func(torch.neg)(torch.arange(6.0).reshape(2, 3))
        flat = h.t().reshape(-1)
        twice = flat * 2
        y = bg.compute(h)
        y.add_(1)
        got, got_twice = bg.compute([flat, twice])
    want = -torch.arange(6.0).reshape(2, 3).t().reshape(-1)
    assert torch.equal(got, want) and torch.equal(got_twice, want * 2)


def test_a_reshape_that_copies_a_value_laid_out_as_a_transpose_keeps_it_as_it_was() -> None:
    # The recorded function returns a transpose, eagerly and as handed out: reshape(-1)
    # of it, recorded before the hand-out, is a copy made then.
    with bg.BatchingPolicy():
        h = bg.batched_func(_negated_transposed)(torch.arange(6.0).reshape(2, 3))
        flat = h.reshape(-1)
        y = bg.compute(h)
        y.add_(1)
        got = bg.compute(flat)
    assert torch.equal(got, -torch.arange(6.0).reshape(2, 3).t().reshape(-1))


def test_a_reshape_that_copies_an_early_transpose_after_the_change_is_refused() -> None:
    # Recorded after the hand-out, the copy read y before or after its change: which,
    # recording does not see, as for any other read of the early view.
    with bg.BatchingPolicy():
        h = bg.batched_func(torch.neg)(torch.arange(6.0).reshape(2, 3))
        early = h.t()
        y = bg.compute(h)
        flat = early.reshape(-1)
        y.add_(1)
        with pytest.raises(TypeError, match=r"reshape.*reads a view \(t, .*cannot tell"):
            bg.compute(flat)


def test_a_reshape_that_is_a_view_of_an_early_view_follows_the_value() -> None:
    with bg.BatchingPolicy():
        h = bg.batched_func(torch.neg)(torch.arange(6.0).reshape(2, 3))
        early = h[1:]
        y = bg.compute(h)
        flat = early.reshape(-1)  # contiguous: a view, eagerly too
        y.add_(1)
        got = bg.compute(flat)
    assert torch.equal(got, -torch.arange(3.0, 6.0) + 1)
    assert got.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


def test_the_same_view_taken_again_after_the_hand_out_is_read_as_eagerly() -> None:
    # h[0] taken again after the hand-out was merged with the early h[0] (identical
    # calls), so a call on it could not be told from a call on the early one and was
    # refused once y changed; eagerly it read y before the change.
    with bg.BatchingPolicy():
        h = bg.batched_func(torch.neg)(torch.arange(12.0).reshape(3, 4))
        early = h[0]
        y = bg.compute(h)
        again = h[0]
        twice = again * 2
        y.add_(1)
        got_twice, got_early = bg.compute([twice, early])
    assert torch.equal(got_twice, -torch.arange(4.0) * 2)
    assert torch.equal(got_early, -torch.arange(4.0) + 1)  # the view of y, as eagerly


def test_a_call_on_an_early_view_after_the_change_is_not_merged_with_one_before() -> None:
    # s * 2 recorded after y changed was merged with the identical s * 2 recorded
    # before the hand-out, and read the value as it was, silently ([2, 8], eagerly
    # [202, 208]). Kept apart, it is refused, as with BatchingPolicy(dedupe=False).
    x = torch.arange(6.0).reshape(2, 3)
    with bg.BatchingPolicy():
        h = bg.batched_func(torch.neg)(x)
        early = h[:, 1]
        before = early * 2
        y = bg.compute(h)
        unchanged = early * 2  # eagerly read before the change: merged, as it was
        y.sub_(100)
        after = early * 2
        assert unchanged.node == before.node != after.node
        with pytest.raises(TypeError, match="cannot tell"):
            bg.compute([before, after])
        assert torch.equal(bg.compute(before), -x[:, 1] * 2)


def test_a_change_that_leaves_the_contents_is_no_change() -> None:
    with bg.BatchingPolicy():
        h = bg.batched_func(torch.neg)(torch.ones(3, 4))
        last = h[0:2]
        y = bg.compute(h)
        y += 0  # a new version, the same contents
        assert torch.equal(bg.compute(last * 2), torch.full((2, 4), -2.0))


def test_coroutine_views_recorded_before_their_await_follow_or_are_refused() -> None:
    async def example(x: torch.Tensor) -> torch.Tensor:
        h = bg.batched_func(torch.neg)(x)
        last = h[0:2]
        y = await bg.value(h)
        y.add_(1)
        return await bg.value(last * 2)

    async def unchanged(x: torch.Tensor) -> torch.Tensor:
        h = bg.batched_func(torch.neg)(x)
        last = h[0:2]
        await bg.value(h)
        return await bg.value(last * 2)

    async def view_itself(x: torch.Tensor) -> torch.Tensor:
        h = bg.batched_func(torch.neg)(x)
        first = h.t()[0]
        y = await bg.value(h)
        y.mul_(3)
        return await bg.value(first)  # eagerly y.t()[0], changed

    xs = torch.arange(6.0).reshape(2, 3)
    results = bg.run_all([example(torch.zeros(3)), unchanged(torch.ones(3)), view_itself(xs)],
                         return_exceptions=True)
    assert isinstance(results[0], TypeError) and "cannot tell" in str(results[0])
    assert torch.equal(results[1], torch.full((2,), -2.0))
    assert torch.equal(results[2], -3 * xs.t()[0])


@pytest.mark.parametrize("dedupe", [True, False])
def test_a_view_of_merged_calls_handed_out_twice_is_refused_after_a_change(dedupe: bool) -> None:
    # h1 and h2 are one node (identical calls merged), handed out as two tensors:
    # which one `last` views is not kept. Kept apart, it is h1's, as eagerly.
    x = torch.arange(4.0)
    with bg.BatchingPolicy(dedupe=dedupe):
        h1, h2 = bg.batched_func(torch.neg)(x), bg.batched_func(torch.neg)(x)
        last = h1[0:2]
        y1, _ = bg.compute([h1, h2])
        y1.add_(10)
        if dedupe:
            with pytest.raises(TypeError, match="merged"):
                bg.compute(last)
        else:
            assert torch.equal(bg.compute(last), y1[0:2])
