"""Schedule reuse: equal structures hit the cache and get the schedule they would get anyway."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import batchgraph as bg
from batchgraph.passes import prune
from batchgraph.scheduling import build_schedule
from tests.property.models import TreeModel
from tests.unit.schedules import same_schedule

SHAPES = [((0, 0), 0), (0, (0, 0)), ((0, 0), (0, 0))]


def with_tokens(shape: Any, tokens: list[int]) -> Any:
    """The same tree shape with leaves numbered from ``tokens`` (all distinct)."""
    if isinstance(shape, int):
        return tokens.pop()
    return (with_tokens(shape[0], tokens), with_tokens(shape[1], tokens))


def batch_of(first_token: int) -> list[Any]:
    tokens = list(range(first_token, first_token + 20))
    return [with_tokens(s, tokens) for s in SHAPES]


def test_same_structure_other_tokens_hits_and_matches_a_fresh_schedule() -> None:
    model = TreeModel(vocab=100)
    collate = bg.GraphCollate(model, "logits")
    first = collate(batch_of(0))
    second = collate(batch_of(40))  # other token ids, same shapes and wiring
    assert (first.cache_hit, second.cache_hit) == (False, True)
    assert collate.cache is not None
    assert (collate.cache.hits, collate.cache.misses, collate.cache.hit_rate) == (1, 1, 0.5)
    # The reused schedule is exactly what scheduling the second batch would give.
    with bg.BatchingPolicy() as policy:
        hs = [model.logits(t) for t in batch_of(40)]
    fresh = build_schedule(policy.graph, prune(policy.graph, [h.node for h in hs]))
    assert same_schedule(second.schedule, fresh)
    expected = torch.stack(bg.compute(hs))
    assert torch.equal(bg.bind(second, model, stack=True), expected)


def test_other_structures_miss() -> None:
    collate = bg.GraphCollate(TreeModel(vocab=100), "logits")
    collate(batch_of(0))
    repeated_token = [((1, 1), 2), (3, (4, 5)), ((6, 7), (8, 9))]  # dedupe merges a leaf
    other_shapes = batch_of(0)[::-1]
    assert not collate(repeated_token).cache_hit
    assert not collate(other_shapes).cache_hit
    assert collate(batch_of(60)).cache_hit
    assert collate.cache is not None and collate.cache.hits == 1


def test_disabled_cache_and_eviction() -> None:
    collate = bg.GraphCollate(TreeModel(vocab=100), "logits", cache=False)
    collate(batch_of(0))
    assert not collate(batch_of(40)).cache_hit and collate.cache is None
    small = bg.GraphCollate(TreeModel(vocab=100), "logits", cache=bg.ScheduleCache(1))
    small(batch_of(0))
    small([(1, 2)])  # evicts the first structure
    assert not small(batch_of(40)).cache_hit
    with pytest.raises(ValueError, match="max_entries must be at least 1, got 0"):
        bg.ScheduleCache(0)


def test_same_keys_in_the_same_order_but_other_wiring_miss() -> None:
    # The signature's hash leaves out the inputs (cheap); equality must not.
    sub = bg.batched_func(torch.sub)
    cache = bg.ScheduleCache()
    graphs = []
    for swap in (False, True):
        with bg.BatchingPolicy() as policy:
            x, y = bg.batched_value(torch.ones(2)), bg.batched_value(torch.zeros(2))
            h = sub(y, x) if swap else sub(x, y)
        graphs.append((policy.graph, [h.node]))
    first, second = (bg.ScheduleCache.signature(g, roots, "agenda") for g, roots in graphs)
    assert hash(first) == hash(second) and first != second
    cache.store(first, build_schedule(graphs[0][0], prune(*graphs[0])))
    assert cache.lookup(second) is None and cache.lookup(first) is not None
