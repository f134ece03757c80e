"""AsyncBatcher: independent asyncio tasks batched together; latency bound, cancellation,
error isolation, identical results with several lanes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

import batchgraph as bg
from tests.property.decoder_models import make_decoder, run_eagerly

STATES = [torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
          for i in range(12)]


def _stops(model: Any, max_len: int) -> list[int]:
    free = [run_eagerly(model.greedy(h, -1, max_len)) for h in STATES]
    return [seq[i % len(seq)] for i, seq in enumerate(free)]


@pytest.mark.parametrize("groups", [1, 2])
def test_independent_requests_batch_together_and_equal_eager(groups: int) -> None:
    model = make_decoder(7)
    stops = _stops(model, 10)
    eager = [run_eagerly(model.greedy(h, s, 10)) for h, s in zip(STATES, stops)]

    async def request(batcher: bg.AsyncBatcher, i: int) -> list[int]:
        await asyncio.sleep(0.001 * (i % 3))  # arrivals spread over a few milliseconds
        result: list[int] = await batcher.run(model.greedy(STATES[i], stops[i], 10))
        return result

    async def main() -> tuple[list[list[int]], bg.AsyncBatcher]:
        async with bg.AsyncBatcher(max_latency=0.02, groups=groups) as batcher:
            got = await asyncio.gather(*(request(batcher, i) for i in range(len(STATES))))
        return list(got), batcher

    got, batcher = asyncio.run(main())
    assert got == eager
    assert max(batcher.batch_sizes) > 1  # requests shared steps
    assert max(batcher.batch_sizes) <= len(STATES)


def test_max_batch_bounds_every_step() -> None:
    model = make_decoder(8)

    async def main() -> bg.AsyncBatcher:
        async with bg.AsyncBatcher(max_batch=4, max_latency=0.01) as batcher:
            await asyncio.gather(*(batcher.run(model.greedy(h, -1, 3)) for h in STATES))
        return batcher

    batcher = asyncio.run(main())
    assert max(batcher.batch_sizes) == 4
    assert sum(size * n for size, n in batcher.batch_sizes.items()) == 3 * len(STATES)


def test_a_lone_request_completes_within_max_latency_plus_slack() -> None:
    model = make_decoder(9)
    max_latency = 0.2

    async def main() -> float:
        async with bg.AsyncBatcher(max_latency=max_latency) as batcher:
            await batcher.run(model.greedy(STATES[0], -1, 2))  # warm the signature caches
            start = time.monotonic()
            await batcher.run(model.greedy(STATES[1], -1, 8))  # 8 steps, alone
            return time.monotonic() - start

    elapsed = asyncio.run(main())
    # Only the first step waits for company; the 7 later steps run at once.
    assert elapsed < max_latency + 1.0, elapsed
    assert elapsed >= max_latency * 0.9, elapsed


def test_cancelling_a_task_leaves_the_others_correct() -> None:
    model = make_decoder(10)
    closed: list[int] = []

    async def example(i: int) -> list[int]:
        try:
            # Example 0 never stops by itself; the others stop at max_len 6.
            return await model.greedy(STATES[i], -1, 10_000 if i == 0 else 6)
        finally:
            closed.append(i)

    want = [run_eagerly(model.greedy(h, -1, 6)) for h in STATES[1:6]]

    async def main() -> tuple[list[Any], list[int]]:
        async with bg.AsyncBatcher(max_latency=0.0) as batcher:
            victim = asyncio.ensure_future(batcher.run(example(0)))
            others = [asyncio.ensure_future(batcher.run(example(i))) for i in range(1, 6)]
            await asyncio.sleep(0.05)
            victim.cancel()
            results = await asyncio.gather(*others)
            with pytest.raises(asyncio.CancelledError):
                await victim
            sizes_before = dict(batcher.batch_sizes)
            late = await batcher.run(example(7))  # the batcher keeps working
            assert sum(batcher.batch_sizes.values()) - sum(sizes_before.values()) == 6
            assert batcher.batch_sizes.keys() - sizes_before.keys() <= {1}
        return [*results, late], closed

    results, closed_order = asyncio.run(main())
    assert results[:5] == want
    assert results[5] == run_eagerly(model.greedy(STATES[7], -1, 6))
    assert 0 in closed_order  # the cancelled example was closed (its finally ran)


def test_an_error_fails_only_its_caller() -> None:
    model = make_decoder(11)

    async def example(i: int) -> list[int]:
        tokens = await model.greedy(STATES[i], -1, 3)
        if i == 1:
            raise KeyError(f"bad request {i}")
        if i == 2:
            await asyncio.sleep(0.01)  # asyncio work inside an example: not allowed
        return tokens

    async def main() -> list[Any]:
        async with bg.AsyncBatcher(max_latency=0.01) as batcher:
            return list(await asyncio.gather(
                *(batcher.run(example(i)) for i in range(4)), return_exceptions=True
            ))

    got = asyncio.run(main())
    assert isinstance(got[1], KeyError)
    assert isinstance(got[2], bg.UnsupportedAwaitError)
    assert "example 2 awaited" in str(got[2])
    assert got[0] == run_eagerly(model.greedy(STATES[0], -1, 3))
    assert got[3] == run_eagerly(model.greedy(STATES[3], -1, 3))


def test_closed_batcher_refuses_new_work() -> None:
    async def main() -> None:
        batcher = bg.AsyncBatcher()
        await batcher.aclose()
        with pytest.raises(RuntimeError, match="closed"):
            await batcher.run(run_none())

    asyncio.run(main())


async def run_none() -> None:
    return None
