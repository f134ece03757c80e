"""Policies raise the collector's threshold while their graph lives and always restore it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import batchgraph as bg


def test_thresholds_stay_raised_while_the_graph_lives_and_are_restored_after() -> None:
    before = gc.get_threshold()
    with bg.BatchingPolicy() as outer:
        assert gc.get_threshold()[0] >= 50_000
        h = bg.batched_value(torch.ones(2)) * 2
        with pytest.raises(RuntimeError, match="boom"), bg.BatchingPolicy():
            raise RuntimeError("boom")
        assert gc.get_threshold()[0] >= 50_000  # the outer policy is still recording
    # Computing and the backward pass come after the `with` block: still quiet.
    assert gc.get_threshold()[0] >= 50_000
    outer.compute(h)
    assert gc.get_threshold()[0] >= 50_000
    graph = weakref.ref(outer.graph)
    del outer, h
    # Nothing refers back to the policy, so reference counting frees the whole graph.
    assert graph() is None
    assert gc.get_threshold() == before


def test_a_batch_is_freed_by_reference_counting_and_computes_without_its_policy() -> None:
    lin = nn.Linear(3, 2)
    f = bg.batched_func(lin)
    gc.disable()
    try:
        with bg.BatchingPolicy():  # no `as`: nothing holds the policy afterwards
            hs = [f(torch.ones(3)) for _ in range(4)]
        graph = weakref.ref(hs[0]._graph)
        assert graph() is not None and graph().policy is None
        out = bg.compute(hs)  # a stand-in policy with the same settings computes
        torch.testing.assert_close(torch.stack(out), lin(torch.ones(4, 3)))
        del hs
        assert graph() is None  # no cycle: freed without the collector
    finally:
        gc.enable()
