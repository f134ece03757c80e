"""Requests through ``AsyncBatcher`` give what each gives alone, whatever the timing.

Each request is a random tensor program (``tensor_programs``) that reads some of its
values as it goes, submitted from its own asyncio task after a random delay; some
tasks are cancelled after another random delay. Under random ``max_batch``,
``max_latency`` and ``groups``, every request that was not cancelled must return
exactly the eager values of its program (under ``no_grad``, as the batcher serves by
default), and a cancelled one must not disturb the others.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import batchgraph as bg
from tests.property.decoder_models import run_eagerly
from tests.property.tensor_programs import run_program_awaiting
from tests.property.test_tensor_ops_property import (
    _OPS,
    _inputs,
    examples,
    programs,
)

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")

timings = st.lists(st.tuples(st.integers(0, 4), st.none() | st.integers(0, 6)), min_size=1,
                   max_size=8)


@settings(max_examples=settings.default.max_examples)
@given(shared=programs, spec=examples, awaits=st.lists(st.booleans(), min_size=1, max_size=4),
       timing=timings, max_batch=st.integers(1, 4), latency=st.sampled_from([0.0, 0.002]),
       groups=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_requests_equal_eager_under_any_timing_and_cancellation(
    shared: list[tuple[str, int, int, int]],
    spec: list[tuple[tuple[int, ...], Any, int, bool]],
    awaits: list[bool],
    timing: list[tuple[int, int | None]],
    max_batch: int,
    latency: float,
    groups: int,
    seed: int,
) -> None:
    xs = [x.detach() for x in _inputs(spec, seed)]
    program_of = [own or shared for _, own, _, _ in spec]
    with torch.no_grad():
        eager = [run_eagerly(run_program_awaiting(_OPS, x, p, awaits))
                 for x, p in zip(xs, program_of)]

    async def request(batcher: bg.AsyncBatcher, i: int) -> Any:
        await asyncio.sleep(0.001 * timing[i % len(timing)][0])
        return await batcher.run(run_program_awaiting(_OPS, xs[i], program_of[i], awaits))

    async def main() -> list[Any]:
        async with bg.AsyncBatcher(max_batch=max_batch, max_latency=latency,
                                   groups=groups) as batcher:
            tasks = [asyncio.create_task(request(batcher, i)) for i in range(len(xs))]
            for i, task in enumerate(tasks):
                cancel_after = timing[i % len(timing)][1]
                if cancel_after is not None:
                    asyncio.get_running_loop().call_later(0.001 * cancel_after, task.cancel)
            return await asyncio.wait_for(
                asyncio.gather(*tasks, return_exceptions=True), timeout=60)

    got = asyncio.run(main())
    for i, (want, result) in enumerate(zip(eager, got)):
        if isinstance(result, asyncio.CancelledError):
            assert timing[i % len(timing)][1] is not None  # only those we cancelled
            continue
        assert not isinstance(result, BaseException), f"request {i}: {result!r}"
        assert len(result) == len(want)
        for j, (w, g) in enumerate(zip(want, result)):
            where = f"request {i}, value {j} (after {program_of[i][:j]})"
            assert (g.shape, g.dtype) == (w.shape, w.dtype), where
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, equal_nan=True, msg=where)
