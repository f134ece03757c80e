"""A recorded call's result keeps the eager result's sequence kinds at every depth.

Only the outermost kind was kept: a function returning ``(x.max(0), x.min(0))`` or
``(h, [a, b], Pair(c, d))`` gave plain tuples inside, so ``out[0].values`` and
``out[2].first`` raised ``AttributeError`` while recording, where eager code reads
them, and ``bg.compute`` handed back tuples for the lists and named tuples.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import batchgraph as bg


class Pair(NamedTuple):
    first: Any
    second: Any


def _extremes(x: torch.Tensor) -> Any:
    return x.max(0), x.min(0)


def _mixed(x: torch.Tensor) -> Any:
    return x.sin(), [x.cos(), x * 2], Pair(x + 1, (x - 1, [x * 3]))


def _kinds(value: Any) -> Any:
    """The kinds of ``value``'s sequences, nested as they are."""
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_kinds(v) for v in value))
    return type(value)


@settings(max_examples=10, deadline=None)
@given(count=st.integers(1, 4), rows=st.integers(1, 3))
def test_nested_result_kinds_come_back_as_eagerly(count: int, rows: int) -> None:
    extremes, mixed = bg.batched_func(_extremes), bg.batched_func(_mixed)
    xs = [torch.randn(rows, 3) for _ in range(count)]
    with bg.BatchingPolicy():
        recorded = [(extremes(x), mixed(x)) for x in xs]
        # Read while recording, as eager code reads them.
        reads = [(e[0].values * 2, e[1].indices, m[2].first + m[2].second[1][0])
                 for e, m in recorded]
    got = bg.compute(recorded)
    got_reads = bg.compute(reads)
    for x, result, read in zip(xs, got, got_reads, strict=True):
        eager = (_extremes(x), _mixed(x))
        assert _kinds(result) == _kinds(eager)
        for a, b in zip(torch.utils._pytree.tree_leaves(result),
                        torch.utils._pytree.tree_leaves(eager), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        e, m = eager
        torch.testing.assert_close(read[0], e[0].values * 2, rtol=0, atol=0)
        torch.testing.assert_close(read[1], e[1].indices, rtol=0, atol=0)
        torch.testing.assert_close(read[2], m[2].first + m[2].second[1][0], rtol=0, atol=0)
