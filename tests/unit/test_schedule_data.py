"""A Schedule is plain data with a stats view, and device-placed scalar constants."""

from __future__ import annotations

import pickle

import torch
from torch import nn

import batchgraph as bg


def test_schedule_pickles_and_carries_stats() -> None:
    lin = bg.batched_func(nn.Linear(2, 2))
    with bg.BatchingPolicy() as policy:
        hs = [torch.tanh(lin(torch.full((2,), float(i)))) for i in range(5)]
    bg.compute(hs)
    schedule = policy.last_schedule
    assert schedule is not None
    copy = pickle.loads(pickle.dumps(schedule))
    assert [s.nodes for s in copy.steps] == [s.nodes for s in schedule.steps]
    assert copy.stats is not None
    assert (copy.stats.launches, copy.stats.lower_bound, copy.stats.nodes) == (2, 2, 10)
    assert copy.stats.mean_batch_size == 5.0


def test_scalar_constants_become_one_tensor_on_their_device() -> None:
    embed = bg.batched_func(nn.Embedding(10, 3))
    with bg.BatchingPolicy() as policy:
        hs = [embed(bg.batched_value(t, device="cpu")) for t in (1, 2, 3)]
    assert policy.graph.constants == {0: 1, 2: 2, 4: 3}  # kept as Python ints
    out = bg.compute(hs)  # (and let go once computed: policy.releaser)
    torch.testing.assert_close(torch.stack(out), embed(torch.tensor([1, 2, 3])))
    assert bg.batched_value(4, device="cpu").device == torch.device("cpu")
