"""AsyncBatcher across event loops: one asyncio.run after another, a loop shutting
down with examples pending, a worker cancelled from outside, and a second loop
running at the same time (refused)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest
import torch

import batchgraph as bg
from tests.integration.bridge_helpers import held_add, wait_until

square = bg.batched_func(torch.square)
add = bg.batched_func(torch.add)

_T = TypeVar("_T")


async def _powers(x: float, steps: int) -> float:
    """Squares ``x`` ``steps`` times, one batched step per await."""
    y = torch.tensor(x, dtype=torch.float64)
    for _ in range(steps):
        y = await bg.value(square(y))
    return float(y)


async def _count(x: float, closed: list[float] | None = None,
                 stepped: threading.Event | None = None) -> None:
    """Counts up from ``x`` forever, one batched step per await (each value is new, so
    no call merges with an earlier, computed one)."""
    try:
        y = torch.tensor(x, dtype=torch.float64)
        while True:
            y = await bg.value(add(y, 1.0))
            if stepped is not None:
                stepped.set()
    finally:
        if closed is not None:
            closed.append(x)


async def _run(batcher: bg.AsyncBatcher, x: float, steps: int = 1) -> float:
    result: float = await asyncio.wait_for(batcher.run(_powers(x, steps)), timeout=10)
    return result


def test_a_batcher_serves_one_asyncio_run_after_another() -> None:
    # The worker task of the first loop was kept: the second loop's calls were queued
    # for it and waited forever.
    batcher = bg.AsyncBatcher(max_latency=0.01)
    assert asyncio.run(_run(batcher, 2.0)) == 4.0
    assert asyncio.run(_run(batcher, 3.0, steps=2)) == 81.0
    asyncio.run(batcher.aclose())


def test_a_loop_closed_without_shutdown_does_not_keep_the_batcher() -> None:
    batcher = bg.AsyncBatcher(max_latency=0.01)
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(_run(batcher, 2.0)) == 4.0
    finally:
        loop.close()  # the worker task is left pending in the closed loop
    assert asyncio.run(_run(batcher, 3.0)) == 9.0
    asyncio.run(batcher.aclose())


def test_a_loop_ending_with_examples_pending_closes_them_and_the_next_loop_works() -> None:
    batcher = bg.AsyncBatcher(max_latency=0.0)
    closed: list[float] = []

    async def leave_one_running() -> asyncio.Future[None]:
        task = asyncio.ensure_future(batcher.run(_count(1.0, closed)))
        await asyncio.sleep(0.2)  # it is still decoding when asyncio.run ends
        return task

    asyncio.run(leave_one_running())
    assert closed == [1.0]  # its finally block ran as the loop shut down
    assert asyncio.run(_run(batcher, 3.0)) == 9.0
    asyncio.run(batcher.aclose())


def test_a_worker_cancelled_from_outside_is_restarted_by_the_next_call() -> None:
    async def main() -> tuple[float, float]:
        batcher = bg.AsyncBatcher(max_latency=0.01)
        first = await _run(batcher, 2.0)
        for task in asyncio.all_tasks():  # a shutdown routine cancelling everything
            if task is not asyncio.current_task():
                task.cancel()
        await asyncio.sleep(0.01)
        second = await _run(batcher, 3.0)
        await batcher.aclose()
        return first, second

    assert asyncio.run(main()) == (4.0, 9.0)


def test_a_second_loop_running_at_the_same_time_is_refused() -> None:
    batcher = bg.AsyncBatcher(max_latency=0.0)
    running, release = threading.Event(), threading.Event()

    async def other_loop() -> None:
        task = asyncio.ensure_future(batcher.run(_count(1.0, stepped=running)))
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 10)
        task.cancel()
        await batcher.aclose()

    thread = threading.Thread(target=asyncio.run, args=(other_loop(),))
    thread.start()
    try:
        assert running.wait(10)
        with pytest.raises(RuntimeError, match="running in another event loop"):
            asyncio.run(_run(batcher, 3.0))
    finally:
        release.set()
        thread.join(10)
    assert not thread.is_alive()


def test_a_loop_ending_during_a_step_closes_the_examples_not_in_it_too() -> None:
    batcher = bg.AsyncBatcher(max_batch=1, max_latency=0.0)  # one example per step
    closed: list[float] = []

    def slow_add(x: torch.Tensor) -> torch.Tensor:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.05)  # the loop ends while a step computes
        return x + 1

    slow = bg.batched_func(slow_add)

    async def count(x: float) -> None:
        try:
            y = torch.tensor(x, dtype=torch.float64)
            while True:
                y = await bg.value(slow(y))
        finally:
            closed.append(x)

    async def leave_two_running() -> list[asyncio.Task[Any]]:
        tasks = [asyncio.ensure_future(batcher.run(count(x))) for x in (1.0, 2.0)]
        await asyncio.sleep(0.3)
        return tasks

    asyncio.run(leave_two_running())
    assert sorted(closed) == [1.0, 2.0]


def test_aclose_after_its_loop_was_closed_stops_the_batcher() -> None:
    # aclose said the batcher ran "in another event loop, which has not finished"
    # (that loop was closed), and left the batcher's thread running.
    before = set(threading.enumerate())
    batcher = bg.AsyncBatcher(max_latency=0.01)
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(_run(batcher, 2.0)) == 4.0
    finally:
        loop.close()  # the worker task is left pending in the closed loop
    asyncio.run(batcher.aclose())
    for thread in set(threading.enumerate()) - before:
        thread.join(10)  # the batcher's thread, told to stop
        assert not thread.is_alive(), thread.name
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(_run(batcher, 3.0))


def test_an_aclose_refused_in_another_loop_leaves_the_batcher_open() -> None:
    # The refused aclose had marked the batcher closed: its own loop's next run was
    # refused ("this AsyncBatcher is closed").
    batcher = bg.AsyncBatcher(max_latency=0.0)
    started, release = threading.Event(), threading.Event()
    got: list[float] = []

    async def own_loop() -> None:
        got.append(await _run(batcher, 2.0))
        started.set()
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 10)
        got.append(await _run(batcher, 3.0))
        await batcher.aclose()

    thread = threading.Thread(target=asyncio.run, args=(own_loop(),))
    thread.start()
    try:
        assert started.wait(10)
        time.sleep(0.05)  # idle now (its worker stopped), its loop still running
        with pytest.raises(RuntimeError, match="running in another event loop"):
            asyncio.run(_run(batcher, 5.0))
        with pytest.raises(RuntimeError, match="running in another event loop"):
            asyncio.run(batcher.aclose())
    finally:
        release.set()
        thread.join(10)
    assert not thread.is_alive()
    assert got == [4.0, 9.0]


def _within(seconds: float, main: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """``asyncio.run(main())`` on a daemon thread; fail if it has not ended after
    ``seconds`` (a call the batcher never answers cannot be cancelled either: it
    waits for the batcher to end it, so the loop would never shut down)."""
    out: list[_T] = []
    thread = threading.Thread(target=lambda: out.append(asyncio.run(main())), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    assert out, "asyncio.run raised (see the thread's traceback above)"
    return out[0]


def test_a_call_made_while_a_cancelled_worker_waits_for_its_step_is_served() -> None:
    # The worker, cancelled during a step, waits for that step to end before it
    # stops; a call made meanwhile was queued for it and waited forever.
    add, release = held_add()

    async def held(x: float) -> float:
        return float(await bg.value(add(torch.tensor(x))))

    async def main() -> tuple[list[Any], float]:
        batcher = bg.AsyncBatcher(max_latency=0.0)
        first = asyncio.ensure_future(batcher.run(held(1.0)))
        await wait_until(lambda: sum(batcher.batch_sizes.values()) == 1)
        for task in asyncio.all_tasks():  # a shutdown routine cancelling everything
            if task is not asyncio.current_task():
                task.cancel()
        await asyncio.sleep(0.01)
        later = asyncio.ensure_future(batcher.run(_powers(3.0, 1)))
        await asyncio.sleep(0.05)
        release.set()
        done, _ = await asyncio.wait({later}, timeout=10)  # wait_for would cancel it
        assert later in done, "the call made meanwhile was never served"
        outcome = await asyncio.gather(first, return_exceptions=True)
        await batcher.aclose()
        return outcome, later.result()

    outcome, late = _within(30, main)
    assert isinstance(outcome[0], (RuntimeError, asyncio.CancelledError)), outcome
    assert late == 9.0


def test_a_worker_cancelled_twice_during_a_step_leaves_its_examples_to_the_step() -> None:
    # The second cancel cancelled the step's future, so its examples were closed
    # (their finally blocks ran, and could record) on the loop thread while the step
    # still computed their lane's graph on the batcher's thread.
    add, release = held_add()
    finally_ran_after_the_step: list[bool] = []

    async def held(x: float) -> float:
        try:
            return float(await bg.value(add(torch.tensor(x))))
        finally:
            finally_ran_after_the_step.append(release.is_set())

    async def main() -> list[Any]:
        batcher = bg.AsyncBatcher(max_latency=0.0)
        task = asyncio.ensure_future(batcher.run(held(1.0)))
        await wait_until(lambda: sum(batcher.batch_sizes.values()) == 1)
        for _ in range(2):  # a shutdown routine that cancels every task twice
            for other in asyncio.all_tasks():
                if other is not asyncio.current_task():
                    other.cancel()
            await asyncio.sleep(0.02)
        release.set()
        await wait_until(lambda: bool(finally_ran_after_the_step))
        return list(await asyncio.gather(task, return_exceptions=True))

    outcome = asyncio.run(main())
    assert finally_ran_after_the_step == [True]
    assert isinstance(outcome[0], (RuntimeError, asyncio.CancelledError)), outcome
