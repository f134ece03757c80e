"""An ``AsyncBatcher``'s bookkeeping: one ``run`` call, one lane, and how a caller's
cancellation and an example's outcome pass between them (``batchgraph.bridge``).

A cancelled caller's example gets a ``CancelledError`` at its await (``take_cancels``
sets it to raise one when it resumes); the outcome then goes to the caller
(``resolve``)::

    >>> import asyncio
    >>> from batchgraph.stepping import Example
    >>> async def example():
    ...     return 1
    >>> async def main():
    ...     call = Call(Example(0, example()), asyncio.get_running_loop().create_future())
    ...     call.cancel = asyncio.CancelledError("client went away")
    ...     ex, = take_cancels([call])  # a waiting example: resumed, it raises this
    ...     ex.coro.close()
    ...     ex.done, ex.error = True, ex.throw  # as if it let the error out
    ...     resolve(call)
    ...     return call.future.cancelled()
    >>> asyncio.run(main())
    True
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

from batchgraph.stepping import Example, Lane

__all__ = ["Call", "LaneState", "cancel_all", "resolve", "take_cancels"]


class Call:
    """One ``run`` call: its example, its caller's future, and since when it waits."""

    __slots__ = ("cancel", "example", "future", "lane", "since", "stepped")

    def __init__(self, example: Example, future: asyncio.Future[Any]) -> None:
        self.example = example
        # Resolved by the worker alone (a caller's cancel reaches the example instead).
        self.future = future
        # Its caller was cancelled with this, not yet raised in the example.
        self.cancel: asyncio.CancelledError | None = None
        self.since = time.monotonic()
        self.stepped = False  # computed at least once (a running example)
        self.lane: LaneState | None = None


class LaneState:
    """One lane of a batcher: its ``Lane``, its calls, and whether it computes."""

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.calls: dict[int, Call] = {}  # by example id
        self.computing = False
        self.sealed = False
        self.abandoned = False  # its worker stopped: nothing resumes its examples
        self.step: asyncio.Future[None] | None = None  # while computing


def take_cancels(calls: Iterable[Call]) -> list[Example]:
    """The waiting examples whose callers were cancelled, each set to raise a new
    ``CancelledError`` (with the caller's message) when it resumes, as asyncio raises
    one at a cancelled task's await."""
    examples = []
    for call in calls:
        if call.cancel is not None and not call.example.done:
            call.example.throw = asyncio.CancelledError(*call.cancel.args)
            call.cancel = None
            examples.append(call.example)
    return examples


def resolve(call: Call) -> None:
    """Hand a finished example's outcome to its caller (a ``CancelledError`` it let
    out cancels the future: its caller's task ends cancelled)."""
    ex, future = call.example, call.future
    if future.done():
        return
    if call.cancel is not None:  # it ended before the cancellation reached it:
        future.cancel(*call.cancel.args[:1])  # asyncio drops the outcome then too
    elif isinstance(ex.error, asyncio.CancelledError):
        future.cancel(*ex.error.args[:1])
    elif ex.error is not None:
        future.set_exception(ex.error)
    else:
        future.set_result(ex.result)


def cancel_all(state: LaneState) -> None:
    """The worker stopped: raise ``CancelledError`` in each of the lane's examples at
    its await, and close those that go on (nothing is left to resume them)."""
    examples = [c.example for c in state.calls.values() if not c.example.done]
    for ex in examples:
        ex.throw = asyncio.CancelledError()
    state.lane.resume(examples)
    state.lane.close([ex for ex in examples if not ex.done])
