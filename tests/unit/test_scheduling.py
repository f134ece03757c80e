"""Scheduler behaviour: agenda vs depth, the lower bound, pinned launch counts."""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn

import batchgraph as bg
from tests.property.models import TreeModel


def test_agenda_batches_across_depths_where_depth_cannot() -> None:
    lin = bg.batched_func(nn.Linear(3, 3))
    tanh = bg.batched_func(torch.tanh)

    def example(i: int) -> Any:
        x = torch.full((3,), float(i))
        # Half the examples reach the linear layer one step later than the others.
        return lin(tanh(x)) if i % 2 else lin(x)

    results = {}
    for scheduler in ("agenda", "depth"):
        with bg.BatchingPolicy(scheduler=scheduler) as policy:
            hs = [example(i) for i in range(6)]
        results[scheduler] = bg.compute(hs)
        assert policy.stats is not None
        if scheduler == "agenda":
            assert (policy.stats.launches, policy.stats.lower_bound) == (2, 2)
        else:
            assert (policy.stats.launches, policy.stats.lower_bound) == (3, 2)
    # Each against the eager run: two schedulers agreeing with each other would also
    # agree on a wrong value of the rule both use.
    eager = [example(i) for i in range(6)]
    for scheduler, values in results.items():
        assert len(values) == len(eager), scheduler
        for got, want in zip(values, eager):
            torch.testing.assert_close(got, want, msg=scheduler)


def _fixed_trees(n: int, seed: int) -> list[Any]:
    rng = random.Random(seed)

    def tree(leaves: int) -> Any:
        if leaves == 1:
            return rng.randrange(20)
        k = rng.randint(1, leaves - 1)
        return (tree(k), tree(leaves - k))

    return [tree(rng.randint(1, 20)) for _ in range(n)]


def test_pinned_launch_counts_for_a_fixed_treelstm_batch() -> None:
    # A change in batching quality (or in dedupe) shows up here first.
    trees = _fixed_trees(32, seed=7)
    model = TreeModel()
    counts = {}
    for scheduler in ("agenda", "depth"):
        with bg.BatchingPolicy(scheduler=scheduler) as policy:
            hs = [model.logits(t) for t in trees]
        bg.compute(hs)
        assert policy.stats is not None
        counts[scheduler] = (policy.stats.launches, policy.stats.lower_bound, policy.stats.nodes)
    assert counts == {"agenda": PINNED_AGENDA, "depth": PINNED_DEPTH}


# (launches, lower bound, calls): agenda reaches the bound; by-depth cannot merge
# the output layer across trees of different heights.
PINNED_AGENDA = (11, 11, 349)
PINNED_DEPTH = (19, 11, 349)


def _gather_sources(scheduler: str) -> list[tuple[str, int, int, int]]:
    """Per gather of the fixed batch: (key label, sources, row selections, permutations)."""
    trees = _fixed_trees(32, seed=7)
    model = TreeModel()
    with bg.BatchingPolicy(scheduler=scheduler) as policy:
        hs = [model.logits(t) for t in trees]
    bg.compute(hs)
    schedule = policy.last_schedule
    assert schedule is not None
    out = []
    for step in schedule.steps:
        for plan in step.gathers:
            selects = sum(1 for _, _, rows in plan.parts if type(rows) is not range)
            label = policy.graph.keys[step.key].label
            out.append((label, len(plan.parts), selects, int(plan.perm is not None)))
    return out


def test_deep_steps_gather_from_a_carried_pool_not_from_every_earlier_step() -> None:
    # Launch counts of the gathers themselves: however deep the step, its inputs come
    # from the pool's carried rows plus the two outputs (h, c) of the step before, with
    # one cat and one index_select, never one index_select per earlier step.
    for scheduler in ("agenda", "depth"):
        gathers = _gather_sources(scheduler)
        cells = [g for g in gathers if "BinaryCell" in g[0]]
        assert len(cells) >= 8
        assert all(sources <= 3 and selects == 0 and perms <= 1
                   for _, sources, selects, perms in gathers), gathers


def test_a_later_compute_schedules_only_its_own_nodes() -> None:
    """A coroutine run's steps must not pay for every node recorded before them: the
    dependency arrays cover the uncomputed nodes only, and planning leaves the graph's
    locations as they were until execution."""
    from batchgraph.passes import prune
    from batchgraph.scheduling import build_schedule

    tanh = bg.batched_func(torch.tanh)
    with bg.BatchingPolicy() as policy:
        first = [tanh(torch.full((2,), float(i))) for i in range(50)]
    bg.compute(first)
    graph = policy.graph
    computed = len(graph)
    with policy:
        later = [tanh(h) for h in first[:3]]
    live = prune(graph, [h.node for h in later])
    assert live.base == computed
    assert len(live.pending) == len(live.consumers) == 3
    before = graph.node_loc[:]
    schedule = build_schedule(graph, live)
    assert graph.node_loc == before  # planned in place, then set back
    assert [n for step in schedule.steps for n in step.nodes] == [h.node for h in later]
    values = policy.compute(later)
    for h, v in zip(first[:3], values, strict=True):
        torch.testing.assert_close(v, torch.tanh(bg.compute(h)))


def test_the_lower_bound_counts_every_unbatchable_call() -> None:
    # Each example: a call registered as unbatchable, then a batchable one on its
    # result. The unbatchable calls launch one by one (3), the tanh once: the bound is
    # 3 + 1, not the 1 + 1 of a key that batched. (Before, no test had an unbatchable
    # call in a bound: counting it as batchable passed every test.)
    def doubled(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    f = bg.batched_func(doubled)
    tanh = bg.batched_func(torch.tanh)
    with bg.BatchingPolicy(rules={doubled: bg.UnbatchedKey}) as policy:
        hs = [tanh(f(torch.full((2,), float(v)))) for v in (1.0, -3.0, 2.0)]
    bg.compute(hs)
    assert policy.stats is not None
    assert [name.rsplit(".", 1)[-1] for name in policy.stats.unbatched_callables] == ["doubled"]
    assert (policy.stats.unbatched_calls, policy.stats.launches, policy.stats.lower_bound) == (
        3, 4, 4
    )
