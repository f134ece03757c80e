"""Static arguments (numbers, lists, tuples, dicts, NumPy arrays) are taken by value
when a call is recorded: equal ones batch together, and a change the caller makes to
one afterwards reaches neither that call nor later calls that share its cached
signature."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import batchgraph as bg

_SCALE = bg.batched_func(lambda x, s: x * s["k"][0] if isinstance(s, dict) else x * s[0][0])


@pytest.mark.parametrize("kind", ["list", "dict", "tuple of list", "array"])
def test_a_static_changed_after_recording_reaches_no_call(kind: str) -> None:
    def make(v: float) -> Any:
        return {"list": lambda: [[v]], "dict": lambda: {"k": [v]},
                "tuple of list": lambda: ([v],), "array": lambda: np.array([[v]])}[kind]()

    def change(s: Any) -> None:
        (s["k"] if kind == "dict" else s[0])[0] = 3.0

    x = torch.ones(2)
    mine = make(2.0)
    with bg.BatchingPolicy():
        first = _SCALE(bg.batched_value(x) * 1, mine)
        change(mine)  # eagerly `first` ran with 2.0 already
        equal = _SCALE(bg.batched_value(x) * 1, make(2.0))  # an equal, fresh argument
        changed = _SCALE(bg.batched_value(x) * 1, mine)
    got = bg.compute([first, equal, changed])
    assert [v[0].item() for v in got] == [2.0, 2.0, 3.0]


def test_equal_dicts_batch_into_one_launch() -> None:
    f = bg.batched_func(lambda x, opts: x * opts["scale"] + opts["shift"])
    xs = [torch.randn(3) for _ in range(5)]
    with bg.BatchingPolicy() as policy:
        hs = [f(bg.batched_value(x), {"scale": 2.0, "shift": 1}) for x in xs]
    got = bg.compute(hs)
    assert policy.stats.launches == 1  # each call's dict is a new object: keyed by value
    for value, x in zip(got, xs, strict=True):
        torch.testing.assert_close(value, x * 2.0 + 1)


@pytest.mark.parametrize("where", ["argument", "keyword", "list"])
def test_calls_with_a_nan_argument_batch_into_one_launch(where: str) -> None:
    # NaN is unequal to itself, and float("nan") a new object each time: each call's
    # signature missed the cache (a run on fake tensors per call, a cache entry per
    # call) and got a key of its own, so the calls never batched (101 launches).
    xs = [torch.randn(3) for _ in range(100)]

    def example(x: Any) -> Any:
        if where == "argument":
            return x.masked_fill(x > 0, float("nan"))
        if where == "keyword":
            return torch.nan_to_num(x.log(), nan=float("nan"), posinf=1.0)
        return torch.nn.functional.pad(x, [1, 1], value=float("nan")) * 2

    with bg.BatchingPolicy() as policy:
        handles = [example(bg.batched_value(x)) for x in xs]
    got = policy.compute(handles)
    assert policy.stats.launches <= 3  # the constants, then one or two calls
    for g, x in zip(got, xs, strict=True):
        torch.testing.assert_close(g, example(x), equal_nan=True)
