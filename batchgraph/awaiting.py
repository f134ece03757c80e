"""``bg.value``: the awaitable that suspends a coroutine example until a handle is computed.

An example written as ``async def`` awaits ``bg.value(h)`` (or ``h`` itself) where it
needs a computed value to decide what to do next. The awaitable does not compute
anything: it *yields itself* to whoever drives the coroutine (``bg.run_all`` or
``bg.AsyncBatcher``), and the driver sends the value back once a batched step has
computed it::

    example coroutine            driver (run_all)
    ─────────────────            ────────────────
    h = model.step(x)   records
    await bg.value(h) ──yield Wait──▶ collects the Waits of all live examples
                                     policy.compute(all pending handles)  (one step)
    tok = ... ◀──send(tensor)──────── resumes each example with its value

On a plain tensor, or a handle that is already computed, the awaitable finishes at
once without yielding, so the very same coroutine also runs eagerly
(``asyncio.run(example())``, or ``coro.send(None)`` until ``StopIteration``).
"""

from __future__ import annotations

import asyncio
import numbers
import operator
import threading
from collections.abc import Generator
from typing import Any

import torch

from batchgraph.errors import (
    BatchgraphError,
    NotComputedError,
    PolicyClosedError,
    PolicyMismatchError,
)
from batchgraph.handle import ResultHandle
from batchgraph.notes import add_note
from batchgraph.policy import UNTRAVERSED, refuse_hidden_handles
from batchgraph.specs import (
    dataclass_fields,
    rebuild_dataclass,
    rebuild_mapping,
    rebuild_sequence,
)

__all__ = [
    "CoroutineExampleError",
    "DeadlockError",
    "UnsupportedAwaitError",
    "Wait",
    "check_max_steps",
    "explain",
    "foreign_handle_error",
    "unsupported_await",
    "value",
]


class _Driving(threading.local):
    """``active``: a batchgraph driver is stepping its examples on this thread now.

    Awaiting an uncomputed handle without one would hand our Wait to asyncio ("Task
    got bad yield") or hang; with this flag the await itself raises a clear error
    instead. Per thread, and not a ContextVar: a task that an example starts
    (``asyncio.create_task``, ``gather``, ``wait_for``) copies the example's context,
    but runs later, on its own, outside the driver.
    """

    active = False


DRIVING = _Driving()


class CoroutineExampleError(BatchgraphError, RuntimeError):
    """An example coroutine raised (``bg.run_all`` with ``return_exceptions=False``).

    Attributes:
        index: the first failing example.
        errors: every failing example's exception, by index.
        results: all results in order, with the exception in each failed slot, so the
            work of the examples that finished is not lost.
    """

    def __init__(self, message: str, index: int, errors: dict[int, BaseException],
                 results: list[Any]) -> None:
        super().__init__(message)
        self.index = index
        self.errors = errors
        self.results = results


class UnsupportedAwaitError(BatchgraphError, TypeError):
    """An example awaited something its batchgraph driver cannot resolve."""


class DeadlockError(BatchgraphError, RuntimeError):
    """Every live example waits, but nothing that the driver can compute is pending."""


class Wait:
    """What ``bg.value`` returns; awaiting it yields it to the driver if needed.

    Attributes:
        obj: the awaited structure (handles, tensors, lists/tuples/dicts of them).
        pending: its handles that were not computed when the Wait was made.
    """

    __slots__ = ("obj", "pending")

    def __init__(self, obj: Any, pending: list[ResultHandle]) -> None:
        self.obj = obj
        self.pending = pending

    def __await__(self) -> Generator[Wait, Any, Any]:
        if not self.pending:
            return resolve(self.obj)
        if not DRIVING.active:
            raise NotComputedError(
                f"awaiting {self.pending[0]!r}, which is not computed, outside a batchgraph "
                "driver: nothing would ever compute it. Run the coroutine with "
                "bg.run_all([...]) or AsyncBatcher.run(...), or compute it first "
                "(bg.compute). A task started inside an example (asyncio.create_task, "
                "gather, wait_for) runs outside the driver: await the coroutine itself."
            )
        # The driver sends the resolved structure back (or throws the example's error).
        return (yield self)

    def __repr__(self) -> str:
        return f"<bg.value waiting for {len(self.pending)} handle(s)>"


def value(obj: Any) -> Wait:
    """Wait for ``obj`` to be computed; ``await`` it inside a coroutine example.

    Args:
        obj: a ``ResultHandle``, a tensor, or lists/tuples/dicts or dataclasses of
            them (other leaves inside containers pass through unchanged).

    Returns:
        An awaitable whose result is ``obj`` with every handle replaced by its
        per-example tensor (or tuple of tensors). A plain tensor, or a handle that is
        already computed, gives its value at once: the coroutine also runs eagerly.
        A value is the example's own tensor, as an eager result is: changing it in
        place reaches the calls recorded on its handle after the change, and neither
        those recorded before it (pending ones included) nor other examples' values.

    Raises:
        UnsupportedAwaitError: if ``obj`` is neither a handle, a tensor nor a container
            of them (a ``TypeError``).
        NotComputedError: when awaited outside a driver while a handle is pending.

    Example:
        >>> import batchgraph as bg, torch
        >>> async def example(x):
        ...     y = bg.batched_func(torch.tanh)(x)
        ...     return int((await bg.value(y)).argmax())
        >>> bg.run_all([example(torch.tensor([0.0, 1.0])), example(torch.tensor([2.0, 1.0]))])
        [1, 0]
    """
    if type(obj) is ResultHandle:  # the common case, kept short
        if obj._graph.node_loc[obj.node] >= 0:
            return Wait(obj, [])
        return Wait(obj, [obj])
    if isinstance(obj, torch.Tensor):
        return Wait(obj, [])
    if not isinstance(obj, (list, tuple, dict)) and dataclass_fields(obj) is None:
        raise UnsupportedAwaitError(
            f"bg.value expects a ResultHandle, a tensor, or lists/tuples/dicts (or "
            f"dataclasses) of them; "
            f"got {type(obj).__name__} ({obj!r:.60}). Await handles returned by recorded "
            "calls, and use plain Python values directly."
        )
    pending: list[ResultHandle] = []
    _pending(obj, pending)
    return Wait(obj, pending)


def check_max_steps(max_steps: object) -> None:
    """Refuse a ``max_steps`` that is not None or an int >= 0 where it is given, not
    at the first await (a comparison error there; a negative one failed them all)."""
    # Any integral number but bool (a numpy integer read from a config array).
    if max_steps is not None and (
        not isinstance(max_steps, numbers.Integral) or isinstance(max_steps, bool)
        or max_steps < 0
    ):
        raise ValueError(
            f"max_steps must be None (no limit) or an int >= 0 (the awaits an example may "
            f"make), got {max_steps!r}"
        )


# Added to a PolicyMismatchError raised in a driven example. Examples sharing a cache
# of handles (an encoder output per source sentence, say) work with one group, where
# every example records into one policy, and fail with several: say why, and what to do.
OWN_LANE = (
    "Each group of run_all(groups=k), and each lane of an AsyncBatcher, records into a "
    "policy of its own, so a handle can only be used by the examples of the group that "
    "recorded it. To share work between examples of different groups, share computed "
    "tensors (await the handle and keep its value), or run them as one group."
)

# Added to the error of a run_all example that awaited asyncio work (asyncio.sleep,
# an Event, a lock): asyncio itself raises, with no word of why there is no loop.
_NO_LOOP = (
    "Example {} used asyncio, but run_all steps its examples without an event loop, "
    "and a batched example can only await bg.value(...) or handles anyway. Do the "
    "asyncio work before or after run_all, or, inside a running event loop, hand each "
    "example to a bg.AsyncBatcher and do that work around batcher.run(...). To wait "
    "for several handles at once, await bg.value([h1, h2]), not asyncio.gather."
)

# Added to a PolicyClosedError raised in a driven example: its message speaks of a
# `with` block, which a server handing requests to an AsyncBatcher never wrote.
_ENDED_LANE = (
    "An AsyncBatcher drops a lane's policy once its examples have finished (a run_all's "
    "policies end with it), so a handle kept from an earlier example (a cache shared "
    "by requests) cannot be used by a later one. Keep its value instead: await the "
    "handle and store the tensor."
)

# Added to torch's error in an example whose own backward found saved tensors freed:
# it ran backward once, but another example of the same batched step had freed them.
_SHARED_GRAPH = (
    "Values computed in one batched step share one autograd graph: an example that "
    "calls backward() or torch.autograd.grad() on its values frees that graph for every "
    "example of the step. Pass retain_graph=True to backward inside examples."
)

# Added where an example awaited an asyncio future: most often asyncio.gather of
# sub-coroutines or handles, written to wait for several at once.
_GATHER = (
    "asyncio.gather, wait_for and create_task run their awaitables as tasks outside the "
    "batchgraph driver, which cannot compute them. To wait for several handles at once, "
    "await bg.value([h1, h2]) (or a dict or tuple of them); await sub-coroutines one "
    "after another: the other examples still batch with each of their steps."
)


def explain(err: BaseException, index: int) -> None:
    """Add a note saying why to ``err``, raised in driven example ``index``, where the
    cause is the batching and the error's own message cannot say so."""
    if isinstance(err, PolicyMismatchError):
        add_note(err, OWN_LANE)
    elif isinstance(err, PolicyClosedError):
        add_note(err, _ENDED_LANE)
    elif isinstance(err, RuntimeError):
        if str(err) == "no running event loop" or str(err).startswith(
                "There is no current event loop"):  # asyncio.gather, wait_for
            add_note(err, _NO_LOOP.format(index))
        elif "graph a second time" in str(err):
            add_note(err, _SHARED_GRAPH)


def unsupported_await(index: int, yielded: Any) -> UnsupportedAwaitError:
    """The error of example ``index``, whose await yielded ``yielded``, not a Wait."""
    # A bare None is what asyncio.sleep(0) yields: name it, "None" says little.
    what = ("None (asyncio.sleep(0) yields it)" if yielded is None
            else f"{yielded!r:.80} ({type(yielded).__name__})")
    err = UnsupportedAwaitError(
        f"example {index} awaited {what}, which a batchgraph driver cannot resolve: every "
        "other example would wait for it forever. Inside a batched example await only "
        "bg.value(...) or handles; do other asynchronous work outside it (with "
        "AsyncBatcher, around batcher.run)."
    )
    if isinstance(yielded, asyncio.Future):  # gather, wait_for, a task: the usual slip
        add_note(err, _GATHER)
    return err


def foreign_handle_error(index: int, does: str, handle: ResultHandle,
                         policy: str) -> PolicyMismatchError:
    """The error of example ``index`` that awaits or returns (``does``) a handle its
    driver cannot compute: not computed, and recorded in another policy."""
    err = PolicyMismatchError(
        f"example {index} {does} {handle!r}, not computed and recorded outside its own "
        f"policy {policy!r}; a driver computes only what its examples record. Create "
        "handles inside the example coroutine (or compute others first)."
    )
    add_note(err, OWN_LANE)
    return err


def _pending(obj: Any, out: list[ResultHandle]) -> None:
    if type(obj) is ResultHandle:
        if obj._graph.node_loc[obj.node] < 0:
            out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _pending(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _pending(x, out)
    elif (names := dataclass_fields(obj)) is not None:
        for name in names:
            _pending(getattr(obj, name), out)
    elif isinstance(obj, UNTRAVERSED):
        refuse_hidden_handles(obj)


def resolve(obj: Any) -> Any:
    """``obj`` with every (computed) handle replaced by its value.

    Raises:
        NotComputedError: if a handle in ``obj`` is still not computed.
    """
    if type(obj) is ResultHandle:
        return obj.value
    if isinstance(obj, list):
        return [resolve(x) for x in obj]
    if isinstance(obj, tuple):
        values = [resolve(x) for x in obj]
        if all(map(operator.is_, values, obj)):
            return obj  # no handle in it: kept as it is (a torch.Size stays one)
        return rebuild_sequence(type(obj), values)
    if isinstance(obj, dict):
        return rebuild_mapping(obj, ((k, resolve(v)) for k, v in obj.items()))
    if (names := dataclass_fields(obj)) is not None:
        return rebuild_dataclass(obj, names, resolve)
    return obj
