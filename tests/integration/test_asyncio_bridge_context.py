"""AsyncBatcher examples run in a copy of their caller's context, as asyncio runs a
new task: they see the caller's ContextVars (a request id, a tracing span), and what
one sets is its own, across its awaits."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import weakref

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import batchgraph as bg

REQUEST: contextvars.ContextVar[int] = contextvars.ContextVar("request", default=-1)
OWN: contextvars.ContextVar[int] = contextvars.ContextVar("own", default=-1)
double = bg.batched_func(torch.mul)


async def _example(steps: int) -> tuple[list[int], list[int], float]:
    """Reads the caller's REQUEST before each await, and its own OWN (set once)."""
    seen, own = [], []
    OWN.set(REQUEST.get() * 10)
    x = torch.tensor(1.0, dtype=torch.float64)
    for _ in range(steps):
        seen.append(REQUEST.get())
        x = await bg.value(double(x, 2.0))  # the others run meanwhile
        own.append(OWN.get())
    return seen, own, float(x)


@settings(max_examples=5)
@given(steps=st.lists(st.integers(1, 4), min_size=2, max_size=6))
def test_each_example_sees_its_own_callers_context(steps: list[int]) -> None:
    # They ran in the worker task's context (a copy of whichever task started the
    # worker): every example saw that task's REQUEST, and the last OWN any of them set.
    async def request(batcher: bg.AsyncBatcher, i: int) -> tuple[list[int], list[int], float]:
        REQUEST.set(i)
        got: tuple[list[int], list[int], float] = await batcher.run(_example(steps[i]))
        assert OWN.get() == -1  # the example's own setting stayed in its context
        return got

    async def main() -> tuple[list[tuple[list[int], list[int], float]], bg.AsyncBatcher]:
        REQUEST.set(99)  # the task that starts the worker
        async with bg.AsyncBatcher(max_latency=0.01) as batcher:
            return list(await asyncio.wait_for(asyncio.gather(
                *(request(batcher, i) for i in range(len(steps)))), 30)), batcher

    got, batcher = asyncio.run(main())
    # They recorded and shared steps (run eagerly, the values would be the same).
    assert max(batcher.batch_sizes) > 1
    for i, (seen, own, value) in enumerate(got):
        assert seen == [i] * steps[i]
        assert own == [i * 10] * steps[i]
        assert value == 2.0 ** steps[i]


def test_the_request_that_starts_the_batcher_is_not_kept_alive_by_it() -> None:
    # The worker task copied the context of the request whose run() started it, and
    # kept that request's ContextVars (here its request object) for as long as it ran.
    class Request:
        pass

    held: contextvars.ContextVar[Request] = contextvars.ContextVar("held")

    async def handle(batcher: bg.AsyncBatcher) -> weakref.ref[Request]:
        request = Request()
        held.set(request)
        await batcher.run(_example(1))
        return weakref.ref(request)

    async def main() -> bool:
        batcher = bg.AsyncBatcher(max_latency=0.0)  # started by the first request
        ref = await asyncio.wait_for(asyncio.ensure_future(handle(batcher)), 30)
        gc.collect()
        alive = ref() is not None
        await batcher.aclose()
        return alive

    assert not asyncio.run(main())
