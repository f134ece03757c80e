"""AsyncBatcher between bursts: an idle batcher keeps no task in its event loop, so a
loop run with ``run_until_complete`` and closed leaves nothing pending, and another
loop may use it once the first stopped (a loop still running keeps it: in
test_asyncio_bridge_loops)."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest
import torch

import batchgraph as bg

square = bg.batched_func(torch.square)


async def _square(x: float) -> float:
    return float(await bg.value(square(torch.tensor(x, dtype=torch.float64))))


async def _run(batcher: bg.AsyncBatcher, x: float) -> float:
    result: float = await asyncio.wait_for(batcher.run(_square(x)), timeout=10)
    return result


@pytest.mark.parametrize("requests", [1, 3])
def test_run_until_complete_then_close_leaves_no_task_pending(requests: int) -> None:
    # The worker task waited for the next request in the closed loop: "Task was
    # destroyed but it is pending!" when collected.
    batcher = bg.AsyncBatcher(max_latency=0.001)
    loop = asyncio.new_event_loop()
    try:
        for i in range(requests):
            assert loop.run_until_complete(_run(batcher, float(i + 2))) == (i + 2) ** 2
    finally:
        loop.close()
    assert not asyncio.all_tasks(loop), asyncio.all_tasks(loop)
    assert asyncio.run(_run(batcher, 3.0)) == 9.0
    asyncio.run(batcher.aclose())


def test_a_dropped_idle_batcher_stops_its_thread() -> None:
    before = set(threading.enumerate())
    batcher = bg.AsyncBatcher(max_latency=0.001)
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(_run(batcher, 2.0)) == 4.0
    finally:
        loop.close()
    del batcher
    gc.collect()
    for thread in set(threading.enumerate()) - before:
        thread.join(10)
        assert not thread.is_alive(), thread.name


def test_a_loop_that_stopped_without_closing_does_not_refuse_the_next() -> None:
    # The worker kept the batcher in the first loop, stopped but not closed: the next
    # loop's call was refused as "running in another event loop, which has not
    # finished", though nothing of it was running.
    batcher = bg.AsyncBatcher(max_latency=0.001)
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(_run(batcher, 2.0)) == 4.0
        assert asyncio.run(_run(batcher, 3.0)) == 9.0
        assert loop.run_until_complete(_run(batcher, 4.0)) == 16.0
    finally:
        loop.close()
    asyncio.run(batcher.aclose())
