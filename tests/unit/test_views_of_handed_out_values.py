"""Views of a value already handed out (``y = bg.compute(h)``, then ``h[0]``,
``h.t()``, ``h.split(2)``) follow ``y`` as eagerly: a change of ``y`` in place, made
outside recording, reaches the calls recorded on them afterwards (not those before),
and computing one gives a view of ``y``. Calls recorded on them after such a change
read the old value, silently, before.

Each generated program is run eagerly and batched, and values and gradients compared.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import batchgraph as bg

View = tuple[str, Callable[[Any], Any], Callable[[Any], bool]]

# Views of one value; the last three return several views (autograd refuses to use
# those after their base changed in place, so they run without grad).
VIEWS: list[View] = [
    ("[0]", lambda v: v[0], lambda v: v.ndim >= 1),
    ("[..., ::2]", lambda v: v[..., ::2], lambda v: v.ndim >= 1),
    ("t()", lambda v: v.t(), lambda v: v.ndim == 2),
    ("transpose(0, -1)", lambda v: v.transpose(0, -1), lambda v: v.ndim >= 2),
    ("unsqueeze(0)", lambda v: v.unsqueeze(0), lambda v: True),
    ("narrow(-1, 1, 1)", lambda v: v.narrow(-1, 1, 1), lambda v: v.ndim >= 1 and v.shape[-1] > 1),
    ("diagonal()", lambda v: v.diagonal(), lambda v: v.ndim >= 2),
    ("expand", lambda v: v.expand(2, *v.shape), lambda v: True),
    ("movedim(0, -1)", lambda v: v.movedim(0, -1), lambda v: v.ndim >= 1),
    ("reshape(-1)", lambda v: v.reshape(-1), lambda v: True),
    ("T", lambda v: v.T, lambda v: v.ndim == 2),
    ("unbind(0)[-1]", lambda v: v.unbind(0)[-1], lambda v: v.ndim >= 1),
    ("split(1, -1)[0]", lambda v: v.split(1, -1)[0], lambda v: v.ndim >= 1),
    ("chunk(2, 0)[0]", lambda v: v.chunk(2, 0)[0], lambda v: v.ndim >= 1),
]
SEVERAL = 3  # the last ones return several views

Step = tuple[str, int, int]  # ("view", of which, which view), ("change", by, 0), ("read", of which, 0)

steps = st.lists(
    st.one_of(
        st.tuples(st.just("view"), st.integers(0, 9), st.integers(0, len(VIEWS) - 1)),
        st.tuples(st.just("change"), st.integers(1, 3), st.just(0)),
        st.tuples(st.just("read"), st.integers(0, 9), st.just(0)),
    ),
    min_size=1, max_size=10,
)


def _program(steps: list[Step], grad: bool, x: torch.Tensor, batched: bool) -> tuple[Any, Any]:
    """The program: a value computed and handed out, views taken of it and of its
    views, the value changed in place outside recording, calls recorded on views."""
    views = VIEWS if not grad else VIEWS[:-SEVERAL]
    neg = bg.batched_func(torch.neg) if batched else torch.neg
    x = x.clone().requires_grad_(grad)
    reads = []
    with (bg.BatchingPolicy() if batched else contextlib.nullcontext()):
        h = neg(x)
        y = bg.compute(h) if batched else h
        values = [h]
        for kind, a, b in steps:
            if kind == "view":
                _, view, fits = views[b % len(views)]
                v = values[a % len(values)]
                if fits(v):
                    values.append(view(v))
            elif kind == "change":
                with torch.no_grad():
                    y.add_(a)  # outside recording: batchgraph does not see it
            else:
                reads.append(values[a % len(values)] * (len(reads) + 2))
        out = [bg.compute(r) if batched else r for r in reads]
    total = sum(o.sum() for o in out)
    grads = None
    if grad and out and total.requires_grad:
        (grads,) = torch.autograd.grad(total, x)
    return [o.detach() for o in out], grads


@given(steps=steps, shape=st.sampled_from([(3, 4), (2, 3, 4), (4,)]), grad=st.booleans())
def test_views_of_a_handed_out_value_follow_its_changes_as_eagerly(
    steps: list[Step], shape: tuple[int, ...], grad: bool,
) -> None:
    x = torch.randn(shape, dtype=torch.float64)
    eager, eager_grad = _program(steps, grad, x, batched=False)
    got, got_grad = _program(steps, grad, x, batched=True)
    assert_as_eager(got, got_grad, eager, eager_grad)


def assert_as_eager(got: list[torch.Tensor], got_grad: Any, eager: list[torch.Tensor],
                    eager_grad: Any) -> None:
    """The batched program's values and gradient are the eager program's."""
    assert len(got) == len(eager)
    for g, e in zip(got, eager, strict=True):
        torch.testing.assert_close(g, e)
    if eager_grad is None:
        assert got_grad is None
    else:
        torch.testing.assert_close(got_grad, eager_grad)


def test_computing_a_view_gives_a_view_of_the_value() -> None:
    with bg.BatchingPolicy():
        h = bg.batched_func(torch.neg)(torch.zeros(3, 4))
        y = bg.compute(h)
        row = bg.compute(h[1])
    y.add_(1)  # eagerly the row sees this: it is y's memory
    assert torch.equal(row, torch.ones(4))
    assert row.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


def test_a_view_of_a_batched_value_tensor_follows_the_tensor() -> None:
    t = torch.zeros(2, 3)
    with bg.BatchingPolicy():
        row = bg.batched_value(t)[0]
        t += 5
        got = bg.compute(row * 2)
    assert torch.equal(got, torch.full((3,), 10.0))


def test_a_call_on_a_view_recorded_before_the_change_reads_the_old_value() -> None:
    # Eagerly the call read the view before the change.
    with bg.BatchingPolicy():
        h = bg.batched_func(torch.neg)(torch.zeros(3, 4))
        y = bg.compute(h)
        doubled = h[0] * 2
        y.add_(1)
        after = h[0] * 2
        got = bg.compute([doubled, after])
    assert torch.equal(got[0], torch.zeros(4))
    assert torch.equal(got[1], torch.full((4,), 2.0))


def test_views_of_handed_out_values_are_still_batched_calls() -> None:
    with bg.BatchingPolicy() as policy:
        hs = [bg.batched_func(torch.neg)(torch.full((3,), float(i))) for i in range(4)]
        bg.compute(hs)
        rows = [h[1:] for h in hs]
        assert {policy.graph.node_key[r.node] for r in rows} == {policy.graph.node_key[rows[0].node]}
        assert [policy.graph.node_inputs[r.node] for r in rows] == [((h.node, 0),) for h in hs]
        got = bg.compute([r * 2 for r in rows])
    assert [g.tolist() for g in got] == [[-2.0 * i] * 2 for i in range(4)]


def test_views_of_values_not_handed_out_are_still_recorded() -> None:
    # A coroutine's calls on values it has not read stay batched calls.
    with bg.BatchingPolicy() as policy:
        h = bg.batched_func(torch.neg)(torch.zeros(3, 4))
        row = h[0]
        assert row._out is None
        assert policy.graph.node_inputs[row.node] == ((h.node, 0),)


def test_a_function_returning_its_input_is_still_one_recorded_call() -> None:
    # The user's own functions are recorded even where they return an input: running
    # them eagerly per example would lose their batching.
    def passthrough(x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, state

    fn = bg.batched_func(passthrough)
    with bg.BatchingPolicy() as policy:
        h = bg.batched_func(torch.neg)(torch.zeros(3))
        bg.compute(h)
        doubled, state = fn(torch.ones(3), h)
        assert (h.node, 0) in policy.graph.node_inputs[doubled.node]
        assert doubled._out is None and state._out is None
        assert torch.equal(bg.compute(doubled), torch.full((3,), 2.0))


@given(index=st.integers(-2, 1), computed=st.booleans(), by=st.integers(1, 3))
def test_an_index_by_a_0d_integer_tensor_is_a_view(index: int, computed: bool, by: int) -> None:
    # Eagerly y[i], i a 0-d integer tensor, is y.select(0, i): a view of y. Whether it
    # is one cannot be seen on fake tensors (it reads i's value); it was taken for no
    # view, so a change of y did not reach the calls recorded on it afterwards.
    x = torch.arange(6.0).reshape(2, 3)
    eager_y = -x
    eager_row = eager_y[torch.tensor(index)]
    eager_y.add_(by)
    with bg.BatchingPolicy():
        h = bg.batched_func(torch.neg)(x)
        i = bg.batched_value(torch.tensor(index))
        if computed:  # an index computed by a call rather than given
            i = bg.batched_func(torch.clone)(torch.tensor(index))
            bg.compute(i)
        y = bg.compute(h)
        row = h[i]
        y.add_(by)
        got = bg.compute(row * 2)
    torch.testing.assert_close(got, eager_row * 2)


def test_an_in_place_change_reaches_an_index_by_a_0d_integer_tensor() -> None:
    # Recorded h += 1 changes the row eagerly, which batched values cannot follow:
    # refused, as for h[0], rather than read as before the change.
    with bg.BatchingPolicy():
        h = bg.batched_func(torch.neg)(torch.zeros(2, 3))
        row = h[bg.batched_value(torch.tensor(1))]
        h += 1
        with pytest.raises(TypeError, match="shares memory eagerly"):
            bg.compute(row * 2)


def test_alias_checks_do_not_run_the_users_functions_on_real_values() -> None:
    # Whether a call makes a view is worked out on fake tensors; where those cannot
    # run it (indexing by a value), torch's own operations run once on real zeros,
    # but not the user's code, whose effects (random draws here) would show.
    def pick(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return x[i] + torch.rand(())

    torch.manual_seed(0)
    with bg.BatchingPolicy():
        h = bg.batched_func(torch.neg)(torch.zeros(3, 4))
        i = bg.batched_value(torch.tensor(1))
        bg.batched_func(pick)(h, i)
        state = torch.get_rng_state()
        h += 1  # finds the values sharing memory with h: asks whether pick makes a view
        assert torch.equal(torch.get_rng_state(), state)
