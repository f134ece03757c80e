"""Examples that use asyncio itself: the errors say what happened and what to do."""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest
import torch

import batchgraph as bg

STATES = [torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
          for i in range(3)]


def _step() -> Any:
    return bg.batched_func(torch.nn.Linear(4, 4).double())


def test_a_task_started_inside_an_example_fails_with_a_clear_error() -> None:
    # The task runs outside the driver, but inherited the example's context: its
    # await handed our Wait to asyncio ("Task got bad yield: <bg.value ...>").
    step = _step()

    async def inner(x: torch.Tensor) -> torch.Tensor:
        value: torch.Tensor = await bg.value(step(x))
        return value

    async def example(x: torch.Tensor) -> torch.Tensor:
        task = asyncio.create_task(inner(x))
        await bg.value(step(x))  # the task runs while the example waits
        return await task

    async def main() -> list[Any]:
        async with bg.AsyncBatcher(max_latency=0.01) as batcher:
            return list(await asyncio.wait_for(asyncio.gather(
                *(batcher.run(example(x)) for x in STATES), return_exceptions=True
            ), timeout=30))

    for error in asyncio.run(main()):
        assert isinstance(error, bg.NotComputedError)
        assert "A task started inside an example (asyncio.create_task" in str(error)


def test_asyncio_work_inside_a_run_all_example_says_why_it_fails() -> None:
    step = _step()

    async def example(x: torch.Tensor) -> torch.Tensor:
        value: torch.Tensor = await bg.value(step(x))
        await asyncio.sleep(0.01)  # asyncio raises "no running event loop"
        return value

    with pytest.raises(bg.CoroutineExampleError) as info:
        bg.run_all([example(x) for x in STATES])
    cause = info.value.__cause__
    assert isinstance(cause, RuntimeError) and str(cause) == "no running event loop"
    assert any("run_all steps its examples without an event loop" in note
               for note in getattr(cause, "__notes__", []))


def test_asyncio_sleep_0_inside_an_example_is_named() -> None:
    # It yields a bare None: the error said only "awaited None (NoneType)".
    step = _step()

    async def example(x: torch.Tensor) -> torch.Tensor:
        value: torch.Tensor = await bg.value(step(x))
        await asyncio.sleep(0)
        return value

    (error,) = bg.run_all([example(STATES[0])], return_exceptions=True)
    assert isinstance(error, bg.UnsupportedAwaitError)
    assert "example 0 awaited None (asyncio.sleep(0) yields it)" in str(error)


def test_asyncio_gather_inside_an_example_says_how_to_wait_for_several_handles() -> None:
    """Before: only "awaited <_GatheringFuture pending>" (where asyncio finds an event
    loop set, though not running) or asyncio's "There is no current event loop", with
    no word of why gather fails or of bg.value([h1, h2]), which waits for several
    handles in one step."""
    step = _step()

    async def example(x: torch.Tensor) -> Any:
        return await asyncio.gather(bg.value(step(x)), bg.value(step(x * 2)))

    for loop in (None, asyncio.new_event_loop()):  # none set, or one not running
        asyncio.set_event_loop(loop)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # gather without a loop
                (error,) = bg.run_all([example(STATES[0])], return_exceptions=True)
        finally:
            asyncio.set_event_loop(None)
            if loop is not None:
                loop.close()
        assert isinstance(error, (bg.UnsupportedAwaitError, RuntimeError))
        assert any("await bg.value([h1, h2])" in note for note in error.__notes__)
