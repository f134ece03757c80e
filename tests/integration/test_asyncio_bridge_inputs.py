"""AsyncBatcher and input tensors another task of the loop changes in place: a change
before the example's step starts is refused, one after it does not reach the step."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import batchgraph as bg
from tests.integration.bridge_helpers import held_add, wait_until

double = bg.batched_func(torch.mul)



async def _doubled(x: torch.Tensor) -> torch.Tensor:
    value: torch.Tensor = await bg.value(double(x, 2.0))
    return value



@settings(max_examples=5)
@given(values=st.lists(st.floats(-100, 100), min_size=1, max_size=4))
def test_a_change_after_the_step_started_does_not_reach_it(values: list[float]) -> None:
    # The step checked the tensor's version when it read it, on the batcher's thread:
    # a change the loop made after the step was handed over either failed the step
    # (ConstantChangedError, as here, where the step waited for the thread) or, landing
    # between the check and the read, reached it unseen. Eagerly the call read the
    # values it was recorded with.
    add, release = held_add()
    x = torch.tensor(values, dtype=torch.float64)
    want = x * 2

    async def main() -> tuple[float, torch.Tensor]:
        async with bg.AsyncBatcher(max_latency=0.0, groups=2) as batcher:
            # Lane 1's step holds the batcher's thread; lane 2's step queues behind it.
            first = asyncio.ensure_future(
                batcher.run(_held(add, torch.tensor(1.0, dtype=torch.float64))))
            await wait_until(lambda: sum(batcher.batch_sizes.values()) == 1)
            second = asyncio.ensure_future(batcher.run(_doubled(x)))
            await wait_until(lambda: sum(batcher.batch_sizes.values()) == 2)
            x.add_(1.0)  # another task reuses its buffer: the step has started
            release.set()
            return await asyncio.wait_for(first, 30), await asyncio.wait_for(second, 30)

    held, got = asyncio.run(main())
    assert held == 2.0
    torch.testing.assert_close(got, want, rtol=0, atol=0)


async def _held(add: Any, x: torch.Tensor) -> float:
    return float(await bg.value(add(x)))


def test_a_change_before_the_step_started_is_refused() -> None:
    # Copying the inputs when the step starts must not hide an earlier change.
    x = torch.ones(3, dtype=torch.float64)

    async def changed_while_waiting() -> torch.Tensor:
        h = double(x, 2.0)
        x.add_(1.0)  # after recording, before the step: eagerly the call saw ones
        value: torch.Tensor = await bg.value(h)
        return value

    async def main() -> Any:
        async with bg.AsyncBatcher(max_latency=0.0) as batcher:
            return await asyncio.wait_for(batcher.run(changed_while_waiting()), 30)

    with pytest.raises(bg.ConstantChangedError, match="changed in place before it was computed"):
        asyncio.run(main())


@pytest.mark.parametrize("input_in_inference", [True, False])
def test_inputs_of_a_loop_in_inference_mode(input_in_inference: bool) -> None:
    # An inference tensor has no version to read (reading it raised RuntimeError when
    # the step started), and a plain one copied in inference mode became one.
    with torch.inference_mode(input_in_inference):
        x = torch.ones(3, dtype=torch.float64)

    async def main() -> torch.Tensor:
        async with bg.AsyncBatcher(max_latency=0.0) as batcher:
            return await asyncio.wait_for(batcher.run(_doubled(x)), 30)

    with torch.inference_mode():
        got = asyncio.run(main())
    torch.testing.assert_close(got, x * 2)


def test_a_handle_cached_by_an_earlier_request_says_to_cache_its_value() -> None:
    # The error spoke of "a BatchingPolicy whose `with` block has ended": a server
    # handing requests to an AsyncBatcher never wrote one.
    cache: dict[str, Any] = {}

    async def request(x: torch.Tensor) -> torch.Tensor:
        if "h" not in cache:
            cache["h"] = double(x, 2.0)  # a handle, kept across requests
        value: torch.Tensor = await bg.value(double(cache["h"], 3.0))
        return value

    async def main() -> list[Any]:
        x = torch.ones(2, dtype=torch.float64)
        async with bg.AsyncBatcher(max_latency=0.0) as batcher:
            # Its lane is dropped as its result is handed back (it has no others).
            first = await asyncio.wait_for(batcher.run(request(x)), 30)
            later = await asyncio.gather(
                asyncio.wait_for(batcher.run(request(x)), 30), return_exceptions=True)
        return [first, *later]

    first, later = asyncio.run(main())
    torch.testing.assert_close(first, torch.full((2,), 6.0, dtype=torch.float64))
    assert isinstance(later, bg.PolicyClosedError)
    assert any("await the handle and store the tensor" in note
               for note in getattr(later, "__notes__", []))
