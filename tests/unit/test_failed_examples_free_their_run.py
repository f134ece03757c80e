"""A run whose example raised frees its graph (and every value it stored) as soon as
the caller drops the results or the error, by reference counting, as a run without
errors does: the collector runs rarely while batches record (batchgraph.gcpause), so a
training or serving loop that meets failing examples must not depend on it."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import batchgraph as bg
from batchgraph import gcpause

_cell = bg.batched_func(nn.Linear(4, 4))


async def example(i: int, failing: int) -> torch.Tensor:
    x = torch.tanh(_cell(torch.full((4,), float(i))))
    value = await bg.value(x)
    if i == failing:
        raise ValueError(f"example {i} is bad")
    return value


@pytest.fixture
def no_collector() -> Iterator[list[weakref.ref[Any]]]:
    """Only reference counting frees; yields a list to hold the runs' graphs (weakly)."""
    gc.collect()
    gc.disable()
    graphs: list[weakref.ref[Any]] = []
    try:
        yield graphs
    finally:
        gc.enable()


def _policy(graphs: list[weakref.ref[Any]]) -> bg.BatchingPolicy:
    policy = bg.BatchingPolicy()
    graphs.append(weakref.ref(policy.graph))
    return policy


@pytest.mark.parametrize("failing", [0, 2])
def test_results_with_an_error_dropped_free_the_run(
        no_collector: list[weakref.ref[Any]], failing: int) -> None:
    active = gcpause._active
    results = bg.run_all([example(i, failing) for i in range(3)], return_exceptions=True,
                         make_policy=lambda: _policy(no_collector))
    assert isinstance(results[failing], ValueError)
    for i in {0, 1, 2} - {failing}:  # the others as eagerly
        assert torch.equal(results[i], torch.tanh(_cell(torch.full((4,), float(i)))))
    del results
    assert [g for g in no_collector if g() is not None] == []
    assert gcpause._active == active  # the collector's thresholds are restored


def test_a_raised_run_error_dropped_frees_the_run(no_collector: list[weakref.ref[Any]]) -> None:
    with pytest.raises(bg.CoroutineExampleError, match="example 1 is bad"):
        bg.run_all([example(i, 1) for i in range(3)], make_policy=lambda: _policy(no_collector))
    assert [g for g in no_collector if g() is not None] == []


def test_an_async_batcher_request_that_raised_frees_its_lane(
        no_collector: list[weakref.ref[Any]]) -> None:
    async def serve() -> list[Any]:
        async with bg.AsyncBatcher(max_batch=4, make_policy=lambda: _policy(no_collector)) as b:
            return await asyncio.gather(*[b.run(example(i, 1)) for i in range(3)],
                                        return_exceptions=True)

    results = asyncio.run(serve())
    assert isinstance(results[1], ValueError) and isinstance(results[0], torch.Tensor)
    del results
    assert no_collector and [g for g in no_collector if g() is not None] == []


def _out_of_range(x: torch.Tensor) -> torch.Tensor:
    return x[int(x.sum()) + 5]  # a value read: fails only when it computes


def test_a_compute_that_raised_frees_its_graph(no_collector: list[weakref.ref[Any]]) -> None:
    # Before, the message's eager error was kept as an exception in the diagnosing
    # frame, in a cycle with the batch-of-one error: the failed step's inputs and the
    # graph stayed alive until a cyclic collection.
    active = gcpause._active
    f = bg.batched_func(_out_of_range)
    with bg.BatchingPolicy() as policy:
        hs = [f(torch.ones(3)), f(torch.zeros(3))]
    no_collector.append(weakref.ref(policy.graph))
    with pytest.raises(bg.BatchedCallError, match="IndexError") as caught:
        bg.compute(hs)
    assert "Run alone, the call of example 0 (row 0) fails too: IndexError" in str(caught.value)
    del policy, hs, caught
    assert [g for g in no_collector if g() is not None] == []
    assert gcpause._active == active


def test_a_batched_call_failing_in_a_run_frees_the_run(
        no_collector: list[weakref.ref[Any]]) -> None:
    # The step's error is thrown into the example: its traceback held the driver's
    # frames computing the step, which held the examples, which held the error.
    f = bg.batched_func(_out_of_range)

    async def failing(x: torch.Tensor) -> torch.Tensor:
        return await bg.value(f(x))

    results = bg.run_all([failing(torch.ones(3)), failing(torch.zeros(3))],
                         return_exceptions=True, make_policy=lambda: _policy(no_collector))
    assert all(isinstance(r, bg.BatchedCallError) for r in results)
    del results
    assert no_collector and [g for g in no_collector if g() is not None] == []
