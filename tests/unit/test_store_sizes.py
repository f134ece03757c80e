"""Scheduling keeps the row count of each store on the graph: computed once per store."""

from __future__ import annotations

import torch

import batchgraph as bg
from batchgraph.scheduling import _store_sizes


def _sizes_from_scratch(policy: bg.BatchingPolicy) -> list[int]:
    stores = policy.graph.stores
    return [-1 if not s or type(s[0]) is list else len(s[0]) for s in stores]


def test_store_sizes_follow_computes_and_drop_stores_of_a_failed_run() -> None:
    double = bg.batched_func(torch.mul)
    with bg.BatchingPolicy() as policy:
        x = [double(torch.ones(2) * i, 2.0) for i in range(3)]
        bg.compute(x)
        first = _store_sizes(policy.graph)
        assert first == _sizes_from_scratch(policy) and len(first) >= 2
        y = [double(h, 3.0) for h in x[:2]]
        bg.compute(y)
        assert _store_sizes(policy.graph) == _sizes_from_scratch(policy)
        assert len(policy.graph.store_sizes) > len(first)
        # Stores that are removed again (a failed run drops the ones it added) must not
        # keep their cached sizes: a cache longer than the stores is cut back.
        policy.graph.store_sizes.append(99)
        assert _store_sizes(policy.graph) == _sizes_from_scratch(policy)


def test_store_sizes_is_a_copy() -> None:
    with bg.BatchingPolicy() as policy:
        h = bg.batched_func(torch.tanh)(torch.zeros(2))
    bg.compute(h)
    sizes = _store_sizes(policy.graph)
    sizes.append(7)
    assert 7 not in policy.graph.store_sizes
