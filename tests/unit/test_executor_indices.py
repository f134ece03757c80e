"""The executor's index tensors: one flat tensor per schedule, sliced per gather, moved once per device."""

from __future__ import annotations

import torch

import batchgraph as bg
from batchgraph.executor import Executor
from batchgraph.passes import prune
from batchgraph.scheduling import build_schedule
from tests.property.models import TreeModel


def test_index_lists_are_slices_of_one_tensor_on_every_device() -> None:
    model = TreeModel()
    trees = [(1, (2, 3)), ((4, 5), (6, (7, 8))), 9, (1, 2), ((3, 3), 3)]
    with bg.BatchingPolicy() as policy:
        handles = [model.logits(t) for t in trees]
    graph = policy.graph
    schedule = build_schedule(graph, prune(graph, [h.node for h in handles]))
    lists = [plan.perm for step in schedule.steps for plan in step.gathers if plan.perm]
    assert len(lists) >= 2
    executor = Executor(graph)
    executor._index_all(schedule)
    cpu = torch.device("cpu")
    flat = executor._flat_on[cpu]
    for rows in lists:
        index = executor._index(rows, cpu)
        assert index.tolist() == rows and index.data_ptr() >= flat.data_ptr()
    # Another device gets the whole flat tensor once; each list is a slice of it.
    meta = torch.device("meta")
    moved = [executor._index(rows, meta) for rows in lists]
    assert set(executor._flat_on) == {cpu, meta}
    assert [m.shape[0] for m in moved] == [len(rows) for rows in lists]
    assert all(m.device.type == "meta" for m in moved)
    # A list from outside the schedule still gets its own tensor.
    assert executor._index([2, 0], cpu).tolist() == [2, 0]
