"""Scheduling keeps the row count of each store on the graph: computed once per store."""

from __future__ import annotations

import torch

import batchgraph as bg
from batchgraph.passes import prune
from batchgraph.scheduling import _store_sizes, build_schedule


def _sizes_from_scratch(policy: bg.BatchingPolicy) -> list[int]:
    stores = policy.graph.stores
    return [-1 if not s or type(s[0]) is list else len(s[0]) for s in stores]


def test_store_sizes_follow_computes_and_drop_stores_of_a_failed_run() -> None:
    double = bg.batched_func(torch.mul)
    with bg.BatchingPolicy() as policy:
        x = [double(torch.ones(2) * i, 2.0) for i in range(3)]
        bg.compute(x)
        first = list(_store_sizes(policy.graph))
        assert first == _sizes_from_scratch(policy) and len(first) >= 2
        y = [double(h, 3.0) for h in x[:2]]
        bg.compute(y)
        assert _store_sizes(policy.graph) == _sizes_from_scratch(policy)
        assert len(policy.graph.store_sizes) > len(first)
        # Stores that are removed again (a failed run drops the ones it added) must not
        # keep their cached sizes: a cache longer than the stores is cut back.
        policy.graph.store_sizes.append(99)
        assert _store_sizes(policy.graph) == _sizes_from_scratch(policy)


def test_planning_a_schedule_leaves_the_sizes_of_the_stores_made_so_far() -> None:
    # The graph's own list, not a copy (a long-lived policy makes many stores, and
    # copying them at every compute took time growing with the run): a schedule
    # planned and not run (a failed compute) leaves no sizes of its steps behind.
    tanh = bg.batched_func(torch.tanh)
    with bg.BatchingPolicy() as policy:
        bg.compute(tanh(torch.zeros(2)))
        graph = policy.graph
        h = tanh(torch.ones(3))
        build_schedule(graph, prune(graph, [h.node]))
        assert len(graph.store_sizes) == len(graph.stores)
        assert _store_sizes(graph) == _sizes_from_scratch(policy)
