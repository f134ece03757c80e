"""Every schedule runs each live node exactly once, after its inputs, within bounds."""

from __future__ import annotations

import pickle
from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st

import batchgraph as bg
from batchgraph.passes import prune
from batchgraph.scheduling import build_schedule, launch_lower_bound
from tests.property.models import DagModel, TreeModel
from tests.property.test_batched_equals_eager import dags, trees


def _check(policy: bg.BatchingPolicy, roots: list[int], scheduler: str) -> None:
    graph = policy.graph
    live = prune(graph, roots)
    schedule = build_schedule(graph, live, scheduler)
    pickle.loads(pickle.dumps(schedule))  # plain data
    position: dict[int, int] = {}
    for i, step in enumerate(schedule.steps):
        keys = {graph.node_key[n] for n in step.nodes}
        assert len(keys) == 1, "a step mixes keys"
        for n in step.nodes:
            assert n not in position, f"node {n} scheduled twice"
            position[n] = i
    assert sorted(position) == live.nodes, "scheduled nodes differ from the live nodes"
    for n, i in position.items():
        for s, _ in graph.node_inputs[n]:
            assert position[s] < i, f"node {n} runs before its input {s}"
    launches = sum(
        (1 if graph.keys[s.key].batchable else len(s.nodes))
        for s in schedule.steps
        if type(graph.keys[s.key]).__name__ != "ConstantKey"
    )
    assert launches >= launch_lower_bound(graph, live.nodes)


@given(batch=st.lists(trees(), min_size=1, max_size=10), scheduler=st.sampled_from(["agenda", "depth"]))
def test_tree_schedules_are_valid(batch: list[Any], scheduler: str) -> None:
    model = TreeModel()
    with bg.BatchingPolicy() as policy:
        handles = [model.logits(t) for t in batch]
    _check(policy, [h.node for h in handles], scheduler)


@given(examples=st.lists(dags(), min_size=1, max_size=6), scheduler=st.sampled_from(["agenda", "depth"]))
def test_dag_schedules_are_valid(examples: list[Any], scheduler: str) -> None:
    model = DagModel()
    with bg.BatchingPolicy() as policy:
        handles = [model.run(torch.randn(4), dag) for dag in examples]
    _check(policy, [h.node for h in handles], scheduler)
