"""AsyncBatcher: independent asyncio tasks batched together; latency bound, cancellation,
error isolation, identical results with several lanes."""

from __future__ import annotations

import asyncio
import threading
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


def test_waiting_for_a_lanes_step_counts_toward_max_latency() -> None:
    # A call arriving while the lane computed waited for the step to end, and then
    # again max_latency from its admission: 2 s + 1.5 s here instead of 2 s.
    sleeps: list[float] = []

    def slow_double(x: torch.Tensor) -> torch.Tensor:
        if sleeps and threading.current_thread() is not threading.main_thread():
            time.sleep(sleeps.pop())  # the step on the batcher's thread
        return x * 2

    double = bg.batched_func(slow_double)

    async def example(v: float) -> float:
        return float(await bg.value(double(torch.tensor(v))))

    async def main() -> float:
        async with bg.AsyncBatcher(max_batch=2, max_latency=1.5) as batcher:
            # Warm the signature caches (a full batch: no wait for company).
            await asyncio.gather(batcher.run(example(0.0)), batcher.run(example(0.5)))
            sleeps.append(2.0)
            first = asyncio.ensure_future(  # a full batch: its step starts at once
                asyncio.gather(batcher.run(example(1.0)), batcher.run(example(2.0))))
            await asyncio.sleep(0.1)
            start = time.monotonic()
            assert await asyncio.wait_for(batcher.run(example(3.0)), 30) == 6.0
            elapsed = time.monotonic() - start
            assert await first == [2.0, 4.0]
            return elapsed

    elapsed = asyncio.run(main())
    assert elapsed < 2.0 + 0.9, elapsed  # the step's end (about 1.9 s), not 3.4 s


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
        with pytest.raises(RuntimeError, match="closed"):  # it used to enter
            async with batcher:
                pass

    asyncio.run(main())


@pytest.mark.parametrize("bad", [{"max_latency": float("nan")}, {"max_batch": 2.5},
                                 {"max_latency": -1.0}, {"groups": 0}])
def test_bad_settings_are_refused_when_the_batcher_is_made(bad: dict[str, Any]) -> None:
    # max_latency=nan was accepted and no step ever came due: the first call hung.
    # max_batch=2.5 failed in the worker ("slice indices must be integers").
    with pytest.raises(ValueError, match="need integers max_batch >= 1"):
        bg.AsyncBatcher(**bad)


def test_run_awaited_inside_an_example_is_refused_without_running_the_inner_one() -> None:
    # The example awaited run's future: "awaited <Future pending ...>, which a driver
    # cannot resolve", and the batcher ran the inner example anyway, for nobody.
    ran: list[float] = []
    square = bg.batched_func(torch.square)

    async def inner(x: float) -> float:
        ran.append(x)
        return float(await bg.value(square(torch.tensor(x))))

    async def outer(batcher: bg.AsyncBatcher, x: float) -> float:
        result: float = await batcher.run(inner(x))
        return result

    async def main() -> list[Any]:
        async with bg.AsyncBatcher(max_latency=0.0) as batcher:
            got = await asyncio.wait_for(asyncio.gather(
                batcher.run(outer(batcher, 2.0)), batcher.run(inner(3.0)),
                return_exceptions=True), 30)
        return list(got)

    got = asyncio.run(main())
    assert isinstance(got[0], bg.UnsupportedAwaitError)
    assert "await sub(x), not await batcher.run(sub(x))" in str(got[0])
    assert got[1] == 9.0
    assert ran == [3.0]


@pytest.mark.parametrize(("bad", "error", "match"), [
    ({"grad": "no"}, TypeError, "grad must be True or False"),
    ({"max_steps": "3"}, ValueError, "max_steps must be None"),
    ({"max_steps": -1}, ValueError, "max_steps must be None"),
    ({"max_graph_nodes": 1.5}, ValueError, "integer max_graph_nodes >= 1"),
    ({"make_policy": bg.BatchingPolicy()}, TypeError, "a new BatchingPolicy per call"),
    ({"max_latency": "0.1"}, ValueError, "max_latency >= 0"),
    ({"max_batch": True}, ValueError, "integers max_batch >= 1"),
])
def test_settings_the_worker_would_fail_on_are_refused_when_the_batcher_is_made(
    bad: dict[str, Any], error: type[Exception], match: str,
) -> None:
    # They were taken, and failed each call in the worker with an error that named no
    # setting; with grad="no" the calls waited forever and wait_for could not end them.
    with pytest.raises(error, match=match):
        bg.AsyncBatcher(**bad)


def test_numpy_numbers_are_taken_as_settings() -> None:
    # A numpy integer max_batch (from a config array) was refused as not an integer.
    import numpy as np

    batcher = bg.AsyncBatcher(max_batch=np.int64(2), max_latency=np.float32(0.01),
                              max_steps=np.int32(3), max_graph_nodes=np.int64(10))
    assert batcher.max_batch == 2


async def run_none() -> None:
    return None



_LOOP_MODES = {"grad": torch.enable_grad, "no_grad": torch.no_grad,
               "inference_mode": torch.inference_mode}


def _linear_examples(grad: bool, loop_mode: str) -> tuple[torch.nn.Linear, list[Any]]:
    """Three examples through a Linear, each returning a value it awaited and a handle
    computed after its last await, with the event loop run in ``loop_mode``, or
    (``"other_task_in_no_grad"``) beside another task that awaits inside
    ``torch.no_grad()`` all along, which leaves grad off on the loop thread."""
    lin = torch.nn.Linear(6, 6).double()
    step = bg.batched_func(lin)

    async def example(x: torch.Tensor) -> tuple[Any, Any]:
        y = await bg.value(step(x))
        return y, step(y)

    async def main() -> list[Any]:
        async with bg.AsyncBatcher(max_latency=0.01, grad=grad) as batcher:
            release = asyncio.Event()

            async def other_request() -> None:
                with torch.no_grad():
                    await release.wait()

            other = asyncio.ensure_future(other_request())
            await asyncio.sleep(0)  # it enters no_grad and waits
            if loop_mode != "other_task_in_no_grad":
                release.set()
                await other
            got = await asyncio.gather(*(batcher.run(example(h)) for h in STATES[:3]))
            release.set()
            await other
        return list(got)

    with _LOOP_MODES.get(loop_mode, torch.enable_grad)():
        return lin, asyncio.run(main())


@pytest.mark.parametrize("loop_mode", ["grad", "other_task_in_no_grad", "inference_mode"])
def test_grad_false_values_carry_no_autograd_graph(loop_mode: str) -> None:
    # grad=False is documented as "serving needs none": the examples' calls used to
    # record with grad on (the loop thread's mode) and come back with a grad_fn.
    lin, got = _linear_examples(False, loop_mode)
    for (y, z), x in zip(got, STATES[:3]):
        for value in (y, z):
            assert not value.requires_grad and value.grad_fn is None
            assert not value.is_inference()
        with torch.no_grad():
            torch.testing.assert_close(z, lin(lin(x)))


@pytest.mark.parametrize("loop_mode", ["grad", "no_grad", "other_task_in_no_grad",
                                       "inference_mode"])
def test_grad_true_builds_graphs_whatever_mode_the_loop_thread_is_in(loop_mode: str) -> None:
    # Grad mode is per thread, and asyncio tasks share the loop thread: a handler that
    # awaits inside no_grad used to switch the batcher's recording off with it.
    lin, got = _linear_examples(True, loop_mode)
    assert all(z.grad_fn is not None for _, z in got)
    (have,) = torch.autograd.grad(torch.stack([z.sum() for _, z in got]).sum(), lin.weight)
    (want,) = torch.autograd.grad(
        torch.stack([lin(lin(x)).sum() for x in STATES[:3]]).sum(), lin.weight
    )
    torch.testing.assert_close(have, want)


def test_an_examples_own_grad_mode_holds_inside_the_batcher() -> None:
    lin = torch.nn.Linear(6, 6).double()
    step = bg.batched_func(lin)

    async def example(i: int) -> Any:
        if i == 0:
            with torch.enable_grad():  # as eagerly: grad on inside the block
                return await bg.value(step(STATES[i]))
        if i == 1:
            with torch.no_grad():
                return await bg.value(step(STATES[i]))
        return await bg.value(step(STATES[i]))

    async def main(grad: bool) -> list[Any]:
        async with bg.AsyncBatcher(max_latency=0.01, grad=grad) as batcher:
            return list(await asyncio.gather(*(batcher.run(example(i)) for i in range(3))))

    assert [v.requires_grad for v in asyncio.run(main(False))] == [True, False, False]
    assert [v.requires_grad for v in asyncio.run(main(True))] == [True, False, True]


def test_examples_run_outside_autocast_another_task_left_on_and_keep_their_own() -> None:
    # Autocast is per thread, as grad mode is: a task awaiting inside torch.autocast
    # left it on for the batcher, whose examples then computed in bfloat16.
    lin = torch.nn.Linear(6, 6)
    step = bg.batched_func(lin)
    x = torch.randn(6)

    async def example(own_autocast: bool) -> torch.Tensor:
        if own_autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                value: torch.Tensor = await bg.value(step(x))
                return value
        value = await bg.value(step(x))
        return value

    async def main() -> list[torch.Tensor]:
        async with bg.AsyncBatcher(max_latency=0.01) as batcher:
            release = asyncio.Event()

            async def other_request() -> None:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    await release.wait()

            other = asyncio.ensure_future(other_request())
            await asyncio.sleep(0)  # it enters autocast and waits
            got = await asyncio.wait_for(asyncio.gather(
                batcher.run(example(False)), batcher.run(example(True))), timeout=30)
            release.set()
            await other
        return list(got)

    plain, cast = asyncio.run(main())
    assert plain.dtype == torch.float32 and cast.dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(plain, lin(x))
