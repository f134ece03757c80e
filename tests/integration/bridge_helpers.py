"""Helpers the AsyncBatcher tests share: waiting for a condition inside the loop, and
a batched call whose steps compute until the test lets them go."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import batchgraph as bg


async def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Sleep in 1 ms turns until ``condition()`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.001)


def held_add() -> tuple[Any, threading.Event]:
    """A batched ``x + 1`` whose steps (on the batcher's thread) compute until the
    returned event is set; recorded on the loop thread (any other), it returns at once."""
    release = threading.Event()

    def held(x: torch.Tensor) -> torch.Tensor:
        # By the thread's name, not "not the main thread": a loop run on another
        # thread records there (shape inference calls this on fake tensors).
        if threading.current_thread().name.startswith("batchgraph-async"):
            release.wait(10)
        return x + 1

    return bg.batched_func(held), release
