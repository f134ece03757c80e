"""Calls whose keys are equal but whose static arguments differ run apart.

A group of calls runs as one ``run`` of one key, and that key's ``self.call`` holds one
call's static arguments. A custom ``identity()`` that left them out (``id(self.fn)``,
or the callable and the input specs) made ``scale(x, 2.0)`` and ``scale(x, 3.0)`` one
group, and every call of it ran with the first call's value (``[2, 2], [2, 2], [2, 2]``
where eagerly ``[2, 2], [3, 3], [5, 5]``), silently, for stacked and list rules alike.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg


class _Scale(nn.Module):
    def forward(self, x: torch.Tensor, s: Any = 1.0, mode: str = "mul") -> torch.Tensor:
        factor = sum(s) if isinstance(s, list) else s
        return x * factor if mode == "mul" else x + factor


class _ByCallable(bg.StackKey):
    def identity(self) -> Hashable:
        return id(self.fn)


class _BySpecs(bg.StackKey):
    def identity(self) -> Hashable:
        return (id(self.fn), self.call.input_specs)


class _ListByCallable(bg.BatchKey):
    combine = "list"

    def identity(self) -> Hashable:  # lengths free too, as PackedSequenceKey's
        return id(self.fn)

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        return [self.call.apply(fn, [column[i] for column in inputs]) for i in range(size)]


_RULES = (_ByCallable, _BySpecs, _ListByCallable)
_STATICS = st.one_of(
    st.tuples(st.sampled_from([1.0, 2.0, -3.0]), st.just("mul")),
    st.tuples(st.sampled_from([0.5, 4.0]), st.just("add")),
    st.tuples(st.lists(st.integers(-2, 2), min_size=1, max_size=3), st.just("mul")),
)


@settings(max_examples=30, deadline=None)
@given(rule=st.sampled_from(_RULES), statics=st.lists(_STATICS, min_size=1, max_size=5),
       by_keyword=st.booleans())
def test_calls_with_other_static_arguments_compute_as_eagerly(
    rule: type[bg.BatchKey], statics: list[tuple[Any, str]], by_keyword: bool
) -> None:
    module = _Scale()
    module.batch_key = rule
    scale = bg.batched_func(module)
    xs = [torch.randn(3) for _ in statics]
    with bg.BatchingPolicy() as policy:
        if by_keyword:
            handles = [scale(bg.batched_value(x), s=s, mode=m) for x, (s, m) in zip(xs, statics)]
        else:
            handles = [scale(bg.batched_value(x), s, m) for x, (s, m) in zip(xs, statics)]
    for x, (s, m), got in zip(xs, statics, bg.compute(handles), strict=True):
        torch.testing.assert_close(got, module(x, s, m), rtol=0, atol=0)
    distinct = {(tuple(s) if isinstance(s, list) else s, m) for s, m in statics}
    # One launch per distinct static arguments, and one stack of the constants at most.
    assert policy.stats.launches <= len(distinct) + 1


def test_calls_with_equal_static_arguments_still_batch_under_a_custom_identity() -> None:
    # Lengths differ: a list rule leaving them out still runs them as one call.
    module = _Scale()
    module.batch_key = _ListByCallable
    scale = bg.batched_func(module)
    xs = [torch.randn(n) for n in (2, 5, 3)]
    with bg.BatchingPolicy() as policy:
        handles = [scale(x, 2.0) for x in xs]
    for x, got in zip(xs, bg.compute(handles), strict=True):
        torch.testing.assert_close(got, x * 2.0, rtol=0, atol=0)
    assert policy.stats.launches == 1


def test_gradients_follow_each_calls_own_static_argument() -> None:
    module = _Scale()
    module.batch_key = _ByCallable
    scale = bg.batched_func(module)
    xs = [torch.randn(3, requires_grad=True) for _ in range(3)]
    factors = [2.0, -1.0, 0.5]
    with bg.BatchingPolicy():
        handles = [scale(x, s) for x, s in zip(xs, factors)]
    torch.stack(bg.compute(handles)).sum().backward()
    for x, s in zip(xs, factors, strict=True):
        assert x.grad is not None
        torch.testing.assert_close(x.grad, torch.full((3,), s), rtol=0, atol=0)


def test_recurrent_layers_with_and_without_an_explicit_none_state_match_eager() -> None:
    # PackedSequenceKey leaves statics out of its identity: lstm(x) and lstm(x, None)
    # mean the same, and both still compute as eagerly.
    lstm = nn.LSTM(3, 4)
    run = bg.batched_func(lstm)
    xs = [torch.randn(n, 3) for n in (2, 4, 3)]
    with bg.BatchingPolicy():
        handles = [run(xs[0]), run(xs[1], None), run(xs[2])]
    for x, (out, (h, c)) in zip(xs, bg.compute(handles), strict=True):
        eager_out, (eager_h, eager_c) = lstm(x)
        torch.testing.assert_close(out, eager_out)
        torch.testing.assert_close(h, eager_h)
        torch.testing.assert_close(c, eager_c)
