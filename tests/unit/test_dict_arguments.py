"""A dict holding handles or tensors is taken apart like a list when recorded.

Before: only lists and tuples were looked into; a dict was held by reference, so the
call's shape inference met handles instead of tensors and failed with a misleading
``NotATensorError`` ("returned ResultHandle").
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

import batchgraph as bg


def _gate(d: dict[str, Any]) -> torch.Tensor:
    """Per example: reads its dict's tensors by key (one a constant weight)."""
    return torch.tanh(d["x"] @ d["w"]) * d["scale"] + d["bias"]


def test_a_dict_of_handles_and_tensors_gives_eager_values_and_gradients() -> None:
    torch.manual_seed(0)
    w = torch.randn(3, 3, requires_grad=True)
    xs = [torch.randn(3, requires_grad=True) for _ in range(4)]
    gate = bg.batched_func(_gate)

    def example(x: Any) -> Any:
        # A handle, a recorded result, a constant tensor, and a number, in one dict.
        return gate({"x": x, "bias": x * 2, "w": w, "scale": 0.5})

    eager = [example(x) for x in xs]
    # Each example's output weighs i + 1: a plain sum could not tell whose rows a
    # gradient reached.
    want = torch.autograd.grad(sum((i + 1) * e.sum() for i, e in enumerate(eager)), [w, *xs])
    with bg.BatchingPolicy() as policy:
        handles = [example(bg.batched_value(x)) for x in xs]
    got = bg.compute(handles)
    grads = torch.autograd.grad(sum((i + 1) * g.sum() for i, g in enumerate(got)), [w, *xs])
    for value, expected in zip(got, eager, strict=True):
        torch.testing.assert_close(value, expected)
    for grad, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(grad, expected)
    # The four gate calls are one call (as with a list), after the four x * 2.
    assert policy.stats is not None and policy.stats.launches == 2


def test_the_call_gets_a_dict_of_its_own_of_the_same_kind() -> None:
    seen: list[Any] = []

    def keys_and_sum(d: Any, *, nested: Any) -> torch.Tensor:
        seen.append((type(d), list(d), type(nested[0])))
        return d["b"] - d["a"] + nested[0]["c"]

    f = bg.batched_func(keys_and_sum)
    a, b, c = torch.ones(2), torch.full((2,), 5.0), torch.full((2,), 10.0)
    with bg.BatchingPolicy():
        ha = bg.batched_value(a)
        given = OrderedDict([("b", bg.batched_value(b)), ("a", ha)])
        h = f(given, nested=[{"c": bg.batched_value(c)}])
        given["b"] = ha  # taken apart when recorded: a later change does not reach the call
    torch.testing.assert_close(bg.compute(h), b - a + c)
    assert seen and all(s == (OrderedDict, ["b", "a"], dict) for s in seen)


def test_equal_dicts_share_one_cached_signature() -> None:
    # Held by reference, a dict is unhashable: each call resolved a signature anew.
    add = bg.batched_func(lambda d: d["a"] + d["b"])
    with bg.BatchingPolicy() as policy:
        handles = [add({"a": bg.batched_value(torch.full((2,), float(i))), "b": 1})
                   for i in range(3)]
    assert [v.tolist() for v in bg.compute(handles)] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    assert policy.stats is not None and policy.stats.launches == 1
    assert len(add._bg_cache) == 1
