"""Stepping coroutine examples: the machinery ``run_all`` and ``AsyncBatcher`` share.

A *lane* is one ``BatchingPolicy`` and the examples that record into it. Its life is
a loop of two halves that never overlap for the same lane::

    step (driver thread)                       compute (driver or executor thread)
    ────────────────────                       ───────────────────────────────────
    resume each waiting example with its   ──▶ one policy.compute of every pending
    value; it records until its next await     handle of the lane (one batched step)
                                           ◀──

At the end of each compute, the lane policy's ``StoreReleaser`` frees the stored values
that nothing can read any more (``batchgraph.releasing``), so memory does not grow with
the number of steps.

Because a lane's examples are all suspended while its step computes, a lane's graph
is only ever touched by one thread at a time; the recording ContextVar is set only on
the driver thread, and computes run with no policy active (so a module that happens
to be a ``BatchedModule`` runs its real forward instead of recording).
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

import torch

from batchgraph.autocasting import (
    AutocastState,
    autocast_enabled,
    autocast_state,
    in_autocast_state,
)
from batchgraph.awaiting import (
    DRIVING,
    DeadlockError,
    Wait,
    _pending,
    explain,
    foreign_handle_error,
    resolve,
    unsupported_await,
)
from batchgraph.example_order import ExampleOrder
from batchgraph.handle import ResultHandle
from batchgraph.notes import add_note
from batchgraph.pinning import unpin_stubs
from batchgraph.placeholders import is_placeholder
from batchgraph.policy import BatchingPolicy
from batchgraph.recording import _ACTIVE
from batchgraph.specs import TensorSpec

__all__ = ["Example", "GradMode", "Lane"]

_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled

_inference_enabled = torch.is_inference_mode_enabled
_autocast_enabled = autocast_enabled


def _keep_modes(ex: Example, outer: bool, outer_inference: bool) -> None:
    """After ``ex`` suspended: keep its autograd modes, give the driver back its own."""
    if _inference_enabled() is not outer_inference:
        guard = torch._C._InferenceMode(outer_inference)  # saves the example's state
        guard.__enter__()  # type: ignore[no-untyped-call]
        ex.inference = guard
    mode = _grad_enabled()
    if mode is not outer:
        ex.grad = mode
        _set_grad_enabled(outer)
    elif ex.grad is not None:
        ex.grad = None


def _keep_autocast(ex: Example, outer: AutocastState | None) -> None:
    """After ``ex`` suspended: if its autocast state is not the driver's, keep it in a
    guard that puts the driver's back (leaving the guard restores the example's)."""
    if autocast_state() != outer:
        guard = in_autocast_state(outer)
        guard.__enter__()
        ex.autocast = guard


def _resume_modes(ex: Example) -> None:
    """Before ``ex`` resumes: the modes it had when it suspended."""
    if ex.grad is not None:
        _set_grad_enabled(ex.grad)
    guard = ex.inference
    if guard is not None:  # leaving the guard restores the example's whole state
        ex.inference = None
        guard.__exit__(None, None, None)
    cast = ex.autocast
    if cast is not None:
        ex.autocast = None
        cast.__exit__(None, None, None)


# Raised inside an example, these stop its driver (run_all raises them; an
# AsyncBatcher's event loop stops), as they stop an asyncio event loop: the user asked
# the program to end. Every other exception is the example's own error.
_STOPS_THE_DRIVER = (KeyboardInterrupt, SystemExit)

_T = TypeVar("_T")
# This module's frames, which resume examples (see _from_example).
_DRIVER_GLOBALS = globals()

GradMode = tuple[bool, bool]  # (grad enabled, inference mode): both are thread-local


def grad_mode() -> GradMode:
    """The calling thread's autograd mode, to be reproduced on an executor thread."""
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled()


def _in_context(ex: Example, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` in the example's own context, with the driver's recording policy
    active there too (``_ACTIVE`` is a ContextVar: set in the driver's context only,
    the example's calls would run eagerly instead of recording)."""
    context = ex.context
    if context is None:
        return fn(*args)
    return context.run(_recording_into, _ACTIVE.get(), fn, args)


def _from_example(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without its first entries, the driver's frames resuming the example:
    those hold the error (``throw``, the error thrown in) and the example, which
    holds it too, a cycle that kept the run's graph (and every value it stored) alive
    until a cyclic collection, made rare while batches record (batchgraph.gcpause)."""
    while tb is not None and tb.tb_frame.f_globals is _DRIVER_GLOBALS:
        tb = tb.tb_next
    return tb


def _recording_into(policy: BatchingPolicy | None, fn: Callable[..., _T],
                    args: tuple[Any, ...]) -> _T:
    token = _ACTIVE.set(policy)
    try:
        return fn(*args)
    finally:
        _ACTIVE.reset(token)


class Example:
    """One coroutine example and where it stands."""

    __slots__ = (
        "autocast", "context", "coro", "done", "error", "final", "grad", "index", "inference",
        "ready", "result", "steps", "throw", "wait",
    )

    def __init__(self, index: int, coro: Coroutine[Any, Any, Any],
                 context: contextvars.Context | None = None) -> None:
        self.index = index
        self.coro = coro
        # The context its code runs in (an AsyncBatcher's: a copy of its caller's, as
        # asyncio gives a task); None: the driver's.
        self.context = context
        self.wait: Wait | None = None  # what it waits for, while it waits
        self.final = False  # the wait is for handles in its returned result
        self.throw: BaseException | None = None  # to raise in it when it resumes
        self.ready: Any = None  # the computed value to send it when it resumes
        self.steps = 0
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        # Its own grad mode while suspended, where it differs from the driver's (it
        # awaited inside ``with torch.no_grad():``); None: the driver's.
        self.grad: bool | None = None
        self.inference: Any = None  # likewise for inference mode: the guard holding it
        self.autocast: Any = None  # and for autocast (see _keep_autocast)

    def close(self) -> None:
        """Close an unfinished coroutine (GeneratorExit inside it), quietly."""
        if not self.done:
            self.done = True
            self.wait = None
            # It closes in its own modes (its `with` blocks then restore them as they
            # exit), and the caller gets its grad mode back after.
            grad = _grad_enabled()
            _resume_modes(self)
            try:
                _in_context(self, self.coro.close)
            except BaseException as err:  # a finally block that raised: its error
                if isinstance(err, _STOPS_THE_DRIVER):
                    raise
                self.error = err  # (a BaseException too: it must not stop the driver)
            finally:
                _set_grad_enabled(grad)


def _clone_outside_inference(value: torch.Tensor) -> torch.Tensor:
    """``value.clone()`` made outside inference mode: made inside it, the copy of a plain
    tensor is an inference tensor, which keeps no version to check and cannot be saved
    for backward as the original could."""
    with torch.inference_mode(False):
        return value.clone()


class Lane:
    """A policy and the examples recording into it (see the module docstring).

    Args:
        policy: the lane's own policy.
        examples: its examples; not started yet.
        max_steps: an example awaiting more often than this fails with
            ``DeadlockError`` (it may never finish); ``None``: no limit.
    """

    def __init__(self, policy: BatchingPolicy, examples: list[Example],
                 max_steps: int | None = None, ordered: bool = True) -> None:
        if not isinstance(policy, BatchingPolicy):  # else: "... has no attribute 'graph'"
            raise TypeError(
                f"make_policy returned {type(policy).__name__} ({policy!r:.60}), not a "
                "bg.BatchingPolicy: it must build and return a new policy per call, as "
                "make_policy=lambda: bg.BatchingPolicy(...) does"
            )
        self.policy = policy
        policy.graph.merges_grad_steps = True  # see Graph.revive
        self.live = examples
        self.max_steps = max_steps
        self.steps = 0  # batched steps computed
        self.held: set[int] = set()  # constants hold_inputs copied (not to copy again)
        # run_all's examples in eager order where calls keep state (example_order);
        # an AsyncBatcher's callers (ordered=False) run concurrently, eagerly too.
        self.order = ExampleOrder() if ordered else None

    # -- driver thread ---------------------------------------------------------------
    def records_on_cuda(self) -> bool:
        """Whether the lane's graph holds CUDA tensors (its steps launch asynchronously)."""
        return any(
            type(spec) is TensorSpec and spec.device.type == "cuda"
            for spec in self.policy.graph.node_spec
        )

    def hold_inputs(self) -> None:
        """Copy the tensors the lane's next step reads as they are now, on the driver
        thread, before the step computes on another one.

        Other code of the driver's thread (another task of an AsyncBatcher's loop, the
        examples of run_all's other groups) may change such a tensor in place while
        the step runs: the step checks each tensor's version just before reading it,
        so a change landing between the check and the read went unseen, and the step
        read values eager code never saw. Copied here, where nothing else runs, a
        tensor changed before this point still fails the check (its copy is not
        made), and a later change does not reach the copy. Tensors that require grad
        are not copied (changing them in place is refused by torch where it matters),
        nor are inference tensors (nothing tracks their changes).
        """
        graph = self.policy.graph
        constants, versions, held = graph.constants, graph.constant_versions, self.held
        clone = _clone_outside_inference if _inference_enabled() else torch.Tensor.clone
        for n, value in constants.items():
            # Only plain tensors: a subclass's copy might not behave as the original.
            if n in held or type(value) is not torch.Tensor or value.requires_grad:
                continue
            # None: an inference tensor, whose version cannot even be read.
            version = versions.get(n)
            if version is not None and version == value._version and not is_placeholder(value):
                copy = clone(value)
                constants[n], versions[n] = copy, copy._version
                held.add(n)
        held.intersection_update(constants)  # computed ones are dropped from constants

    def start(self, examples: list[Example] | None = None) -> None:
        """Run new examples (default: the lane's own) up to their first await."""
        fresh = self.live if examples is None else examples
        if examples is not None:
            self.live.extend(examples)
        self._with_policy(fresh, initial=True)

    def resume(self, examples: list[Example] | None = None) -> None:
        """Hand each computed example (default: all live) its value or error and run it
        to its next await."""
        self._with_policy(self.live if examples is None else examples, initial=False)

    def close(self, examples: list[Example]) -> None:
        """Close examples (cancelled): ``finally`` blocks in them may still record."""
        token = _ACTIVE.set(self.policy)
        try:
            for ex in examples:
                ex.close()
        finally:
            _ACTIVE.reset(token)
            unpin_stubs()
        self.live = [ex for ex in self.live if not ex.done]

    def _with_policy(self, examples: list[Example], initial: bool) -> None:
        token = _ACTIVE.set(self.policy)
        graph = self.policy.graph
        driving, DRIVING.active = DRIVING.active, True
        try:
            for ex in examples:
                if ex.done:
                    continue
                start = len(graph.node_key)
                if initial:
                    if inspect.getcoroutinestate(ex.coro) != inspect.CORO_CREATED:
                        # Sending it None would resume it where it waits, with None
                        # as the value it awaited.
                        ex.done, ex.error = True, TypeError(
                            f"example {ex.index}'s coroutine was already started (it is "
                            "given twice, or was awaited elsewhere): pass a new coroutine "
                            "object per example, as [example(x) for x in batch] does"
                        )
                        continue
                    self._advance(ex, None, None)
                else:
                    self._wake(ex)
                if self.order is not None and graph.in_order:  # none: nothing to order
                    self.order.note(ex, start, len(graph.node_key))
        finally:
            DRIVING.active = driving
            _ACTIVE.reset(token)
            unpin_stubs()
        self.live = [ex for ex in self.live if not ex.done]

    def _wake(self, ex: Example) -> None:
        ex.wait = None
        error, ex.throw = ex.throw, None
        if error is not None:
            if ex.final:  # it has returned: the error (computing its result) is its outcome
                ex.done, ex.error = True, error  # (thrown in, it read "cannot reuse
                return  # already awaited coroutine")
            self._advance(ex, None, error)
            return
        value, ex.ready = ex.ready, None
        if ex.final:
            ex.result, ex.done = value, True
        else:
            self._advance(ex, value, None)

    def _advance(self, ex: Example, send: Any, throw: BaseException | None) -> None:
        coro = ex.coro
        graph = self.policy.graph
        # Grad mode is per thread, not per coroutine: an example that awaits inside
        # ``with torch.no_grad():`` would leave it off for the others (and, leaving the
        # block later, restore the mode it found: another example's). Each example
        # gets its own mode back when it resumes, and the driver's is kept around it.
        # The same holds for inference mode, which only a guard object can set, and
        # for autocast.
        outer, outer_inference = _grad_enabled(), _inference_enabled()
        outer_cast = autocast_state()
        while True:
            if ex.grad is not None or ex.inference is not None or ex.autocast is not None:
                _resume_modes(ex)
            try:
                if throw is None:
                    yielded = _in_context(ex, coro.send, send)
                else:
                    yielded = _in_context(ex, coro.throw, throw)
            except StopIteration as stop:
                _set_grad_enabled(outer)
                self._finish(ex, stop.value)
                return
            except BaseException as err:
                _set_grad_enabled(outer)
                if isinstance(err, _STOPS_THE_DRIVER):
                    raise
                # Any other exception fails this example alone, BaseExceptions included
                # (CancelledError, GeneratorExit, one of the user's own), as an asyncio
                # Task keeps them: escaping the driver, they ended every example of a
                # run_all, and left an AsyncBatcher's other callers waiting forever.
                explain(err, ex.index)
                ex.done, ex.error = True, err.with_traceback(_from_example(err.__traceback__))
                return
            if (_grad_enabled() is not outer or ex.grad is not None
                    or _inference_enabled() is not outer_inference):
                _keep_modes(ex, outer, outer_inference)
            if outer_cast is not None or _autocast_enabled():
                _keep_autocast(ex, outer_cast)
            throw = None
            # Refused awaits count too: one that catches their error and awaits again
            # looped here forever, max_steps or not.
            ex.steps += 1
            if self.max_steps is not None and ex.steps > self.max_steps:
                if ex.steps == self.max_steps + 1:  # it may clean up, or end, on this
                    throw = DeadlockError(
                        f"example {ex.index} is still running after {self.max_steps} awaits "
                        "(max_steps); it may never finish. Raise max_steps if it needs more."
                    )
                    continue
                self._stop_runaway(ex)
                return
            if type(yielded) is not Wait:
                throw = unsupported_await(ex.index, yielded)
                continue
            foreign = next((h for h in yielded.pending if h._graph is not graph), None)
            if foreign is not None:
                throw = foreign_handle_error(ex.index, "awaits", foreign, graph.name)
                continue
            ex.wait = yielded
            return

    def _stop_runaway(self, ex: Example) -> None:
        # It caught max_steps' DeadlockError and awaited on: closing it is all that
        # ends a `while True: try: ... except Exception: ...` loop.
        error = DeadlockError(
            f"example {ex.index} went on awaiting after max_steps ({self.max_steps}) "
            "stopped it with a DeadlockError, which it caught; it was closed. Let "
            "DeadlockError through, or raise max_steps if it needs more awaits."
        )
        ex.close()
        error.__context__, ex.error = ex.error, error  # a finally block's error, if any

    def _finish(self, ex: Example, result: Any) -> None:
        # A result may hold handles nobody awaited: compute them with the next step.
        pending: list[ResultHandle] = []
        _pending(result, pending)
        graph = self.policy.graph
        foreign = next((h for h in pending if h._graph is not graph), None)
        if foreign is not None:  # it would never be computed here (another group's)
            ex.done, ex.error = True, foreign_handle_error(
                ex.index, "returned", foreign, graph.name)
        elif pending:
            ex.wait, ex.final = Wait(result, pending), True
        else:  # computed handles (of any policy) become their values
            ex.result, ex.done = resolve(result), True

    # -- compute thread ----------------------------------------------------------------
    def compute(self, examples: list[Example], mode: GradMode) -> None:
        """One batched step for ``examples`` (all waiting); errors go to each ``ex.throw``.

        If the joint step fails, each example's handles are computed on their own, so
        only the examples whose calls fail get the error.
        """
        token = _ACTIVE.set(None)
        try:
            # Not inference_mode(False): that guard turns grad mode back on.
            guard = torch.inference_mode() if mode[1] else torch.set_grad_enabled(mode[0])
            with guard:
                self._compute(examples)
        finally:
            _ACTIVE.reset(token)
        self.steps += 1

    def _compute(self, examples: list[Example]) -> None:
        # policy.compute hands back each example's awaited structure with tensors in
        # place of handles: exactly what the example is resumed with.
        policy = self.policy
        waits = [ex.wait.obj for ex in examples if ex.wait is not None]
        assert len(waits) == len(examples), "only waiting examples are computed"
        order = self.order
        error = order.check(policy.graph) if order is not None else None
        if order is not None and error is not None:
            for ex in examples:
                ex.throw = error
            for ex in order.involved:  # finished already: their values are off too
                if ex.done and ex.error is None:
                    ex.error, ex.result = error, None
            return
        # A BaseException from a recorded function (one of the user's own) is as
        # much that example's error as an Exception: only those that stop the
        # driver are let out, else every example of the step would get it.
        try:
            values = policy.compute(waits)
        except BaseException as err:
            if isinstance(err, _STOPS_THE_DRIVER):
                raise
            values = None  # find out whose calls fail: one compute per example, below
        if values is not None:
            for ex, v in zip(examples, values):
                ex.ready = v
            return
        for ex, obj in zip(examples, waits):
            try:
                # Errors name the example by its driver's index: numbered by position in
                # this compute of one example, they would blame "example 0" (or 1, ...:
                # the example's own awaited handles), whichever example failed.
                ex.ready = policy._compute_example(obj, ex.index)
            except BaseException as err:
                if isinstance(err, _STOPS_THE_DRIVER):
                    raise
                add_note(err, f"(raised while computing example {ex.index}'s awaited values)")
                ex.throw = err
