"""AsyncBatcher cancellation as asyncio does it: the cancelled caller's example sees
``CancelledError`` at its await (its ``except`` blocks run), may swallow it and go on,
and the other examples of its lane are not disturbed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import batchgraph as bg
from tests.integration.bridge_helpers import held_add, wait_until
from tests.property.decoder_models import Decoder, make_decoder, run_eagerly

STATES = [torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
          for i in range(6)]


async def _decode(model: Decoder, h: Any, steps: int, log: list[str],
                  swallow: bool) -> list[int]:
    """Greedy decoding of ``steps`` tokens, one batched step per await; logs each await,
    and what it does with a cancellation (raising it again unless ``swallow``)."""
    tokens: list[int] = []
    tok = 0
    for _ in range(steps):
        h = model.cell(model.embed(bg.batched_value(tok)), h)
        try:
            tok = int((await bg.value(model.out(h))).argmax())
            tokens.append(tok)
        except asyncio.CancelledError as err:
            log.append(f"cancelled {err.args}")
            if not swallow:
                raise
            tok = 0  # decodes on from the start token; -1 marks where it landed
            tokens.append(-1)
        finally:
            log.append("await")
    return tokens



@settings(max_examples=6)
@given(victim=st.integers(0, 5), after=st.integers(1, 4))
def test_a_cancelled_example_sees_cancelled_error_at_its_await(victim: int, after: int) -> None:
    # Closing it instead ran only its finally blocks: `except CancelledError` never ran.
    model = make_decoder(31)
    want = [run_eagerly(_decode(model, h, 8, [], False)) for h in STATES]
    logs: list[list[str]] = [[] for _ in STATES]

    async def main() -> tuple[list[Any], asyncio.Task[Any]]:
        async with bg.AsyncBatcher(max_latency=0.0) as batcher:
            tasks = [asyncio.ensure_future(batcher.run(_decode(model, h, 8, log, False)))
                     for h, log in zip(STATES, logs)]
            await wait_until(lambda: logs[victim].count("await") >= after)
            tasks[victim].cancel("client went away")
            got = await asyncio.wait_for(
                asyncio.gather(*tasks, return_exceptions=True), timeout=30)
        return list(got), tasks[victim]

    got, victim_task = asyncio.run(main())
    assert victim_task.cancelled()  # the caller's task ends cancelled
    assert logs[victim][-2:] == ["cancelled ('client went away',)", "await"]  # where it waited
    assert [g for i, g in enumerate(got) if i != victim] == [
        w for i, w in enumerate(want) if i != victim]


def test_an_example_that_swallows_the_cancellation_goes_on_and_its_result_returns() -> None:
    # As an awaited coroutine that swallows a cancellation lets its task go on.
    model = make_decoder(32)
    log: list[str] = []

    async def main() -> tuple[list[int], list[list[int]]]:
        async with bg.AsyncBatcher(max_latency=0.0) as batcher:
            victim = asyncio.ensure_future(batcher.run(_decode(model, STATES[0], 8, log, True)))
            others = [asyncio.ensure_future(batcher.run(_decode(model, h, 8, [], False)))
                      for h in STATES[1:]]
            await wait_until(lambda: log.count("await") >= 3)
            victim.cancel()
            got = await asyncio.wait_for(victim, 30)  # not cancelled: it went on
            return got, list(await asyncio.gather(*others))

    got, others = asyncio.run(main())
    assert log.count("cancelled ()") == 1
    where = got.index(-1)
    assert 3 <= where < 8 and len(got) == 8
    assert others == [run_eagerly(_decode(model, h, 8, [], False)) for h in STATES[1:]]
    # Before the cancellation and after it, the tokens are the eager ones: the state
    # went on from the same h (the cancelled step's token is lost).
    assert got[:where] == run_eagerly(_decode(model, STATES[0], 8, [], False))[:where]



def test_a_cancellation_during_a_step_reaches_the_example_when_the_step_ends() -> None:
    add, release = held_add()
    seen: list[str] = []

    async def example() -> float:
        try:
            return float(await bg.value(add(torch.tensor(1.0))))
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def main() -> asyncio.Task[Any]:
        async with bg.AsyncBatcher(max_latency=0.0) as batcher:
            task = asyncio.ensure_future(batcher.run(example()))
            await wait_until(lambda: sum(batcher.batch_sizes.values()) == 1)
            task.cancel()
            await asyncio.sleep(0.05)
            assert not task.done() and seen == []  # the step still holds the example
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 30)
        return task

    assert asyncio.run(main()).cancelled()
    assert seen == ["cancelled"]


def test_an_example_cancelled_before_it_started_never_runs() -> None:
    add, release = held_add()
    ran: list[float] = []

    async def example(x: float) -> float:
        ran.append(x)
        return float(await bg.value(add(torch.tensor(x))))

    async def main() -> tuple[asyncio.Task[Any], float]:
        async with bg.AsyncBatcher(max_latency=0.0) as batcher:
            first = asyncio.ensure_future(batcher.run(example(1.0)))
            await wait_until(lambda: sum(batcher.batch_sizes.values()) == 1)
            # The lane computes: this one waits for it, not started yet.
            task = asyncio.ensure_future(batcher.run(example(2.0)))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 30)
            release.set()
            return task, await asyncio.wait_for(first, 30)

    task, first = asyncio.run(main())
    assert task.cancelled() and first == 2.0
    assert ran == [1.0]


def test_a_loop_shutting_down_raises_cancelled_error_in_unfinished_examples() -> None:
    batcher = bg.AsyncBatcher(max_latency=0.0)
    log: list[str] = []
    model = make_decoder(33)

    async def leave_one_running() -> asyncio.Future[Any]:
        task = asyncio.ensure_future(batcher.run(_decode(model, STATES[0], 10_000, log, True)))
        await wait_until(lambda: log.count("await") >= 2)
        return task

    asyncio.run(leave_one_running())  # cancels the caller and the worker as it ends
    assert "cancelled ()" in log  # its except block ran; it went on, so it was closed
    assert log[-1] == "await"  # the finally block of the await it was closed at


@pytest.mark.parametrize("how", ["timeout", "wait_for"])
def test_a_caller_timing_out_gets_timeout_error_and_its_example_its_except_block(
    how: str,
) -> None:
    # asyncio.timeout and wait_for cancel the awaiting task and turn the cancellation
    # into TimeoutError; that holds while the example handles its CancelledError.
    model = make_decoder(34)
    log: list[str] = []

    async def main() -> list[int]:
        async with bg.AsyncBatcher(max_latency=0.0) as batcher:
            # Started and warm (fake mode set up): else it may time out unstarted.
            await asyncio.wait_for(batcher.run(_decode(model, STATES[2], 1, [], False)), 30)
            endless = _decode(model, STATES[0], 1_000_000, log, False)
            with pytest.raises(TimeoutError):
                if how == "timeout":
                    async with asyncio.timeout(0.2):
                        await batcher.run(endless)
                else:
                    await asyncio.wait_for(batcher.run(endless), 0.2)
            # The batcher goes on serving.
            return list(await asyncio.wait_for(
                batcher.run(_decode(model, STATES[1], 4, [], False)), 30))

    assert asyncio.run(main()) == run_eagerly(_decode(model, STATES[1], 4, [], False))
    assert log[-2:] == ["cancelled ()", "await"]


def test_a_caller_cancelled_while_its_returned_handles_compute_ends_cancelled() -> None:
    # Its example had returned: the CancelledError thrown into the finished coroutine
    # came back as RuntimeError("cannot reuse already awaited coroutine").
    add, release = held_add()

    async def returns_unawaited() -> Any:
        return add(torch.tensor(1.0))  # computed by the batcher after it returns

    async def main() -> tuple[asyncio.Task[Any], Any]:
        async with bg.AsyncBatcher(max_latency=0.0) as batcher:
            task = asyncio.ensure_future(batcher.run(returns_unawaited()))
            await wait_until(lambda: sum(batcher.batch_sizes.values()) == 1)
            task.cancel()
            await asyncio.sleep(0.02)
            release.set()
            outcome = (await asyncio.gather(task, return_exceptions=True))[0]
            return task, outcome

    task, outcome = asyncio.run(main())
    assert task.cancelled(), outcome
