"""Policies raise the collector's threshold while their graph lives and always restore it."""

from __future__ import annotations

import gc
import importlib.util
import sys
import threading
import weakref
from types import FrameType, ModuleType
from typing import Any

import pytest
import torch
from torch import nn

import batchgraph as bg
from batchgraph import gcpause


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



def _fresh_gcpause() -> ModuleType:
    """A separate copy of batchgraph.gcpause: if it deadlocks, only the copy's lock
    stays taken, and the tests after this one still run."""
    spec = importlib.util.spec_from_file_location("gcpause_under_test", gcpause.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_finalizer_ending_a_period_inside_enter_does_not_deadlock() -> None:
    # A graph's finalizer calls leave(). The collector may run it in the middle of
    # enter() on the same thread, with enter's lock taken (any allocation can start a
    # collection; under hypothesis, its line tracer did): that hung for good.
    pause = _fresh_gcpause()
    before = gc.get_threshold()
    pause.enter()  # a graph alive before, freed while the next policy starts
    lines = 0

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal lines
        if frame.f_code is not pause.enter.__code__:
            return None
        if event == "line":
            lines += 1
            if lines == 2:  # past `with _lock:`: the lock is taken
                pause.leave()  # as that graph's finalizer would, run by the collector
        return tracer

    def start() -> None:
        sys.settrace(tracer)
        try:
            pause.enter()
        finally:
            sys.settrace(None)

    worker = threading.Thread(target=start, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "enter() deadlocked on a finalizer's leave()"
    assert lines >= 2
    # The finalizer ended the earlier period; the new one is on.
    assert pause._active == 1 and gc.get_threshold()[0] >= pause.YOUNG_THRESHOLD
    pause.leave()
    assert pause._active == 0 and gc.get_threshold() == before
