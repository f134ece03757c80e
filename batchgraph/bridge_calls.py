"""An ``AsyncBatcher``'s bookkeeping: one ``run`` call, one lane, and how a caller's
cancellation and an example's outcome pass between them (``batchgraph.bridge``);
and the check of its settings.

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
import contextlib
import numbers
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from batchgraph.autocasting import in_autocast_state
from batchgraph.awaiting import check_max_steps
from batchgraph.policy import BatchingPolicy
from batchgraph.stepping import Example, Lane

__all__ = [
    "Call", "LaneState", "cancel_all", "check_settings", "driving", "resolve", "take_cancels",
]


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
    # Handed over: kept here too, the error closed a cycle through the driver's
    # finished frames in its traceback (see coroutines._results).
    ex.error = ex.throw = None


def cancel_all(state: LaneState) -> None:
    """The worker stopped: raise ``CancelledError`` in each of the lane's examples at
    its await, and close those that go on (nothing is left to resume them)."""
    examples = [c.example for c in state.calls.values() if not c.example.done]
    for ex in examples:
        ex.throw = asyncio.CancelledError()
    state.lane.resume(examples)
    state.lane.close([ex for ex in examples if not ex.done])


def check_settings(max_batch: int, max_latency: float, groups: int, grad: bool,
                   max_steps: int | None, max_graph_nodes: int,
                   make_policy: Callable[[], BatchingPolicy] | None) -> None:
    """Refuse ``AsyncBatcher`` settings its worker would fail on: it failed every
    caller then, with an error that did not name the setting (or, with a non-bool
    ``grad``, not at all: the calls waited forever, and a timeout could not end them)."""
    # `not max_latency >= 0` also refuses NaN, with which no step ever came due
    # (the first call waited forever); a float max_batch failed in the worker.
    if (not _is_int(max_batch) or not _is_int(groups) or max_batch < 1 or groups < 1
            or not isinstance(max_latency, numbers.Real) or not max_latency >= 0):
        raise ValueError(
            f"need integers max_batch >= 1 and groups >= 1, and max_latency >= 0 "
            f"seconds; got max_batch={max_batch!r}, groups={groups!r}, "
            f"max_latency={max_latency!r}"
        )
    if not isinstance(grad, bool):
        raise TypeError(f"grad must be True or False, got {grad!r}")
    check_max_steps(max_steps)  # as run_all's
    if not (_is_int(max_graph_nodes) and max_graph_nodes >= 1):
        raise ValueError(
            f"need an integer max_graph_nodes >= 1, got max_graph_nodes={max_graph_nodes!r}"
        )
    if make_policy is not None and not callable(make_policy):
        raise TypeError(
            f"make_policy must build a new BatchingPolicy per call (a class or a "
            f"function, such as lambda: bg.BatchingPolicy(...)), got "
            f"{type(make_policy).__name__}"
        )


def _is_int(value: object) -> bool:
    # Integral takes numpy's integers too; a bool is an int, but not a count.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@contextlib.contextmanager
def driving(grad: bool) -> Iterator[None]:
    """An ``AsyncBatcher``'s mode around code that runs its examples (see
    ``batchgraph.bridge``).

    Held only between awaits of the worker: a mode set across one would reach every
    other task on the loop thread.
    """
    # inference_mode(False) first: it turns grad on, and it leaves a loop thread's
    # inference mode (which would make every call give inference tensors) outside.
    # Autocast is per thread too: a task awaiting inside torch.autocast(...) left it
    # on, and the examples recorded their calls in its low precision.
    with (torch.inference_mode(False), torch.set_grad_enabled(grad),
          in_autocast_state(None)):
        yield
