"""A coroutine object given twice, or one already started, is refused: resuming it
would hand it None as the value it awaited."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import batchgraph as bg

STATES = [torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
          for i in range(2)]
_STARTED = "coroutine was already started"


def _decoder() -> Any:
    step = bg.batched_func(torch.nn.Linear(4, 4).double())
    seen: list[Any] = []

    async def example(x: Any) -> Any:
        for _ in range(2):
            x = await bg.value(step(x))
            seen.append(x)
        return x

    return example, seen


def test_run_all_refuses_a_coroutine_given_twice() -> None:
    example, seen = _decoder()
    coro = example(STATES[0])
    got = bg.run_all([coro, coro, example(STATES[1])], return_exceptions=True)
    assert isinstance(got[0], torch.Tensor) and isinstance(got[2], torch.Tensor)
    assert isinstance(got[1], TypeError) and _STARTED in str(got[1])
    assert all(isinstance(v, torch.Tensor) for v in seen)  # it was sent None before


class _Pause:
    """An awaitable that suspends once (as a task's first await would)."""

    def __await__(self) -> Any:
        yield "paused"


def test_run_all_refuses_a_started_coroutine() -> None:
    step = bg.batched_func(torch.nn.Linear(4, 4).double())

    async def example(x: Any) -> Any:
        await _Pause()
        return await bg.value(step(x))

    coro = example(STATES[0])
    assert coro.send(None) == "paused"  # started elsewhere: it waits inside _Pause
    with pytest.raises(bg.CoroutineExampleError, match=_STARTED):
        bg.run_all([coro])
    coro.close()


def test_async_batcher_refuses_a_coroutine_given_twice() -> None:
    example, seen = _decoder()

    async def main() -> list[Any]:
        coro = example(STATES[0])
        async with bg.AsyncBatcher(max_latency=0.01) as batcher:
            return list(await asyncio.wait_for(asyncio.gather(
                batcher.run(coro), batcher.run(coro), return_exceptions=True
            ), timeout=30))

    got = asyncio.run(main())
    assert isinstance(got[0], torch.Tensor)
    assert isinstance(got[1], TypeError) and _STARTED in str(got[1])
    assert all(isinstance(v, torch.Tensor) for v in seen)
