"""max_steps stops examples that never finish, also ones that swallow every error."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

import pytest
import torch

import batchgraph as bg

double = bg.batched_func(torch.mul)


class _Hung(BaseException):
    """Not an Exception: the examples under test swallow those."""


@pytest.fixture(autouse=True)
def _deadline() -> Iterator[None]:
    def expire(signum: int, frame: FrameType | None) -> None:
        raise _Hung("ran past 60 s: an example loops forever")

    # A hang fails the test instead of blocking the suite; again every second, as an
    # example may swallow one.
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, 60, 1)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


async def _short(x: torch.Tensor) -> float:
    return float((await bg.value(double(x, 2.0))).sum())


async def _retries_an_unsupported_await() -> int:
    failures = 0
    while True:  # hung run_all before, max_steps or not: the refusal was not counted
        try:
            await asyncio.sleep(0)  # thrown back in as UnsupportedAwaitError
        except bg.UnsupportedAwaitError:
            failures += 1


async def _swallows_everything(x: torch.Tensor) -> None:
    while True:  # before, every later await raised DeadlockError at once: a busy loop
        with contextlib.suppress(Exception):
            x = await bg.value(double(x, 1.5))


@pytest.mark.parametrize("groups", [1, 2])
def test_max_steps_stops_an_example_that_catches_every_error(groups: int) -> None:
    got = bg.run_all(
        [_short(torch.ones(2)), _retries_an_unsupported_await(), _swallows_everything(torch.ones(2))],
        groups=groups, return_exceptions=True, max_steps=20,
    )
    assert got[0] == 4.0
    assert isinstance(got[1], bg.DeadlockError)  # the refused awaits count
    assert "example 1 is still running after 20 awaits" in str(got[1])
    assert isinstance(got[2], bg.DeadlockError)  # it caught that one too: it is closed
    assert "example 2 went on awaiting after max_steps (20)" in str(got[2])


def test_an_example_may_catch_the_first_deadlock_error_and_finish() -> None:
    async def cleans_up(x: torch.Tensor) -> str:
        try:
            while True:
                x = await bg.value(double(x, 1.5))
        except bg.DeadlockError:
            return "stopped"

    assert bg.run_all([cleans_up(torch.ones(2))], max_steps=5) == ["stopped"]
