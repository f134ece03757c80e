"""run_all and AsyncBatcher with examples that raise BaseExceptions: as an asyncio Task
keeps them, each fails its own example only, except KeyboardInterrupt and SystemExit,
which stop the driver."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import batchgraph as bg
from tests.property.decoder_models import make_decoder, run_eagerly

STATES = [torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
          for i in range(4)]


class _Abort(BaseException):
    """A user's own BaseException (not an Exception)."""


_RAISED = [_Abort, asyncio.CancelledError, GeneratorExit]


async def _example(model: Any, i: int, raised: type[BaseException]) -> list[int]:
    tokens: list[int] = await model.greedy(STATES[i], -1, 3)
    if i == 1:
        raise raised(f"stop {i}")
    return tokens


@pytest.mark.parametrize("raised", _RAISED)
def test_run_all_keeps_a_base_exception_in_its_examples_slot(raised: type[BaseException]) -> None:
    # It used to escape run_all, closing every other example: their results were lost
    # even with return_exceptions=True.
    model = make_decoder(20)
    want = [run_eagerly(model.greedy(h, -1, 3)) for h in STATES]
    got = bg.run_all([_example(model, i, raised) for i in range(4)], return_exceptions=True)
    assert type(got[1]) is raised and str(got[1]) == "stop 1"
    assert [got[0], got[2], got[3]] == [want[0], want[2], want[3]]
    with pytest.raises(bg.CoroutineExampleError, match="example 1 of 4 raised"):
        bg.run_all([_example(model, i, raised) for i in range(4)])


def test_keyboard_interrupt_in_an_example_stops_run_all() -> None:
    model = make_decoder(21)
    closed: list[int] = []

    async def example(i: int) -> list[int]:
        try:
            return await _example(model, i, KeyboardInterrupt)
        finally:
            closed.append(i)

    with pytest.raises(KeyboardInterrupt, match="stop 1"):
        bg.run_all([example(i) for i in range(4)], return_exceptions=True)
    assert sorted(closed) == [0, 1, 2, 3]  # the others were closed, not left suspended


@pytest.mark.parametrize("raised", _RAISED)
def test_a_base_exception_fails_only_its_async_batcher_caller(
    raised: type[BaseException],
) -> None:
    # The other callers used to wait forever: the exception escaped the batcher's
    # step callback, which asyncio only logs.
    model = make_decoder(22)
    want = [run_eagerly(model.greedy(h, -1, 3)) for h in STATES]

    async def main() -> tuple[list[Any], list[int]]:
        async with bg.AsyncBatcher(max_latency=0.01) as batcher:
            got = await asyncio.wait_for(asyncio.gather(
                *(batcher.run(_example(model, i, raised)) for i in range(4)),
                return_exceptions=True,
            ), timeout=30)
            later = await asyncio.wait_for(batcher.run(_example(model, 0, raised)), 30)
        return list(got), later

    got, later = asyncio.run(main())
    assert type(got[1]) is raised
    assert [got[0], got[2], got[3], later] == [want[0], want[2], want[3], want[0]]


def test_a_cancelled_example_whose_finally_raises_a_base_exception_stops_nothing_else() -> None:
    # Closing the cancelled example let the exception out of the batcher's worker:
    # every other caller failed with it.
    model = make_decoder(23)
    want = [run_eagerly(model.greedy(h, -1, 3)) for h in STATES]

    async def endless() -> None:
        try:
            await model.greedy(STATES[0], -1, 1_000_000)
        finally:
            raise _Abort("from finally")

    async def main() -> list[Any]:
        async with bg.AsyncBatcher(max_latency=0.0) as batcher:
            victim = asyncio.ensure_future(batcher.run(endless()))
            others = [asyncio.ensure_future(batcher.run(model.greedy(h, -1, 3)))
                      for h in STATES]
            await asyncio.sleep(0.05)
            victim.cancel()
            got = await asyncio.wait_for(asyncio.gather(*others), timeout=30)
            got.append(await asyncio.wait_for(batcher.run(model.greedy(STATES[1], -1, 3)), 30))
        return list(got)

    assert asyncio.run(main()) == [*want, want[1]]


def _refuse_negative(x: torch.Tensor) -> torch.Tensor:
    if (x < 0).any():  # value-dependent Python: each call runs on its own
        raise _Abort("negative")
    return x * 2


async def _doubled(value: float) -> float:
    return float(await bg.value(bg.batched_func(_refuse_negative)(torch.tensor(value))))


def test_a_base_exception_from_a_recorded_function_fails_only_its_example() -> None:
    # It escaped the step: run_all raised it, and every example of an AsyncBatcher's
    # step got it.
    values = [1.0, -1.0, 2.0]
    got = bg.run_all([_doubled(v) for v in values], return_exceptions=True)
    assert got[0] == 2.0 and got[2] == 4.0 and isinstance(got[1], _Abort)

    async def main() -> list[Any]:
        async with bg.AsyncBatcher(max_latency=0.01) as batcher:
            return list(await asyncio.wait_for(asyncio.gather(
                *(batcher.run(_doubled(v)) for v in values), return_exceptions=True
            ), timeout=30))

    got = asyncio.run(main())
    assert got[0] == 2.0 and got[2] == 4.0 and isinstance(got[1], _Abort)
