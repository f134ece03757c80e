"""A coroutine object given twice, or one already started, is refused: resuming it
would hand it None as the value it awaited. Bad arguments (groups, overlap,
max_steps) are refused before any example starts, and the coroutines are closed."""

from __future__ import annotations

import asyncio
import inspect
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


@pytest.mark.parametrize("max_steps", ["3", -1, 2.5, True])
def test_a_bad_max_steps_is_refused_up_front(max_steps: Any) -> None:
    """Before: a str failed each example's first await with "'>' not supported
    between instances of 'int' and 'str'" (in an AsyncBatcher, from its worker task),
    and a negative limit failed every example at its first await."""
    example, _ = _decoder()
    coros = [example(x) for x in STATES]
    with pytest.raises(ValueError, match=r"max_steps must be None \(no limit\) or an int >= 0"):
        bg.run_all(coros, max_steps=max_steps)
    # Closed, as for other bad arguments: no "coroutine was never awaited" warnings.
    assert all(inspect.getcoroutinestate(c) == inspect.CORO_CLOSED for c in coros)
    with pytest.raises(ValueError, match=r"max_steps must be None"):
        bg.AsyncBatcher(max_steps=max_steps)


def test_bad_groups_or_overlap_close_the_coroutines() -> None:
    example, _ = _decoder()
    for kwargs in ({"groups": 0}, {"groups": 2, "overlap": "threads"}):
        coros = [example(x) for x in STATES]
        with pytest.raises((TypeError, ValueError)):
            bg.run_all(coros, **kwargs)
        assert all(inspect.getcoroutinestate(c) == inspect.CORO_CLOSED for c in coros)
    # 0 is a limit, not a bad argument: every example fails at its first await.
    got = bg.run_all([example(x) for x in STATES], max_steps=0, return_exceptions=True)
    assert all(isinstance(g, bg.DeadlockError) for g in got)


@pytest.mark.parametrize("made", [None, bg.BatchingPolicy])  # forgot to return; or to call
def test_a_make_policy_that_returns_no_policy_is_a_clear_error(made: Any) -> None:
    """Before: AttributeError "'NoneType' object has no attribute 'graph'" (or "type
    object 'BatchingPolicy' has no attribute 'graph'"), from deep in the driver."""
    example, _ = _decoder()
    coros = [example(x) for x in STATES]
    with pytest.raises(TypeError, match=r"make_policy returned .* not a bg.BatchingPolicy"):
        bg.run_all(coros, make_policy=lambda: made)
    assert all(inspect.getcoroutinestate(c) == inspect.CORO_CLOSED for c in coros)

    async def main() -> Any:
        batcher = bg.AsyncBatcher(make_policy=lambda: made)
        return await batcher.run(example(STATES[0]))

    with pytest.raises(TypeError, match=r"make_policy returned .* not a bg.BatchingPolicy"):
        asyncio.run(main())


def test_the_error_of_failed_examples_reads_as_one_sentence_and_counts_them() -> None:
    """Before: "... Compute it first.. The other examples ..." (the example's own full
    stop, then ours), and of 14 other failing examples only the first 10 were named,
    with no word of the rest."""

    async def fails(i: int) -> None:
        raise ValueError(f"bad input {i}.")

    with pytest.raises(bg.CoroutineExampleError) as info:
        bg.run_all([fails(i) for i in range(15)])
    message = str(info.value)
    assert "raised ValueError: bad input 0; examples 1, 2, " in message
    assert "9, 10 and 4 more failed too. The other examples" in message
    assert ".." not in message
