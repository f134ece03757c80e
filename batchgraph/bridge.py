"""``AsyncBatcher``: batch coroutine examples that arrive independently in an asyncio loop.

A server handles each request in its own asyncio task. Each task hands its
per-example coroutine (the same ``async def`` that ``run_all`` drives) to a shared
batcher and awaits the result::

    batcher = bg.AsyncBatcher(max_batch=64, max_latency=0.005)

    async def handle(request):
        src = await parse(request)                            # ordinary asyncio work
        return await batcher.run(model.decode(src))           # batched with other requests

How it works. One worker task owns every example; it runs on the event loop thread:

1. *Admit*: a new example is started in a lane (a ``BatchingPolicy`` and its examples)
   that is not computing, and runs until its first await.
2. *Launch*: a lane whose examples all wait starts a step on the executor thread: the
   oldest ``max_batch`` waiting examples, computed as one ``policy.compute``. It
   launches at once if any of them has been computed before (a running decode does
   not wait: newcomers join its next step), if the batch is full, or once the oldest
   new example has waited ``max_latency`` for company.
3. *Resume*: when the step is done, the worker resumes those examples with their
   values; finished ones resolve their callers' futures.

Examples record on the event loop thread, as the loop's other code runs: between
awaits nothing else of the loop runs, as asyncio code expects (shared Python state
needs no lock; asyncio calls work). What would hold the loop long is kept off it:
steps compute on the executor thread, and torch's one-time fake-mode set-up (a first
call's shape inference: 1.3 s measured) runs there when the worker starts. A new call
signature's own shape inference (10-40 ms) still runs where the example records.

Rules that keep it correct:

* A lane's graph is touched by one thread at a time: while it computes, nothing is
  admitted to it, resumed or closed. Arrivals go to another idle lane (``groups``
  lanes take turns on the executor, as in ``run_all``) or wait for the step to end.
* Cancelling a caller's task cancels its example as asyncio cancels a task: the
  worker raises ``asyncio.CancelledError`` in the example at the await where it waits
  (at once, or when its lane's step ends), so its ``except asyncio.CancelledError:``
  and ``finally`` blocks run, and the caller's ``run`` ends with what the example
  does: if it lets the error out, ``run`` raises ``CancelledError`` and the caller's
  task ends cancelled; if it swallows it and goes on, it stays batched (its calls
  still run) and ``run`` returns its result, as an awaited coroutine that swallows
  a cancellation lets its task go on. An example that never started is closed
  without running (asyncio's cancel of a task that never ran). Its handles are no
  longer requested, so its pending calls are pruned from later steps. Other
  examples are not disturbed: a step they share still computes.
* A tensor an example passed to a call must stay as it is until its step starts
  (a change before is refused, as by ``compute``); the step reads a copy made then,
  so another task changing it in place while the step runs does not reach it.
  Parameters are not copied: change a model's weights in place (an optimizer step,
  a reload) only while no step runs; a change made during a step is not refused
  (the check is when it starts) and reaches the calls that read them after it.
* An example that raises fails only its own caller; a failing batched call is
  retried per example so only the examples whose calls fail get the error.
* Each example runs in a copy of its caller's context, as asyncio runs a new task:
  it sees the caller's ContextVars (a request id, a tracing span), and what it sets
  stays its own across its awaits (they shared the worker task's context).
* Examples run in the batcher's grad mode, not the event loop thread's: asyncio
  tasks share that thread, so whatever mode another task left set there (a handler
  awaiting inside ``torch.no_grad()``) would otherwise reach the recording. With
  ``grad=False`` examples record as under ``torch.no_grad()`` (their calls build no
  autograd graph, whatever mode the loop thread is in); with ``grad=True``, as with
  grad on and outside inference mode. Likewise, they run outside autocast. An
  example's own ``with torch.no_grad():``, ``torch.inference_mode()`` or
  ``torch.autocast(...)`` blocks hold within it, as eagerly.
* A batcher serves one event loop at a time. When its loop ends (``asyncio.run``
  returns) with examples unfinished, their callers fail and the examples are
  cancelled (``CancelledError`` at their await, then closed if they go on: nothing
  is left to resume them); a later loop's first ``run`` starts the batcher
  afresh there. A loop still running elsewhere keeps it: another loop is refused.
  Between bursts the worker stops (the next ``run`` starts one), so a loop run with
  ``loop.run_until_complete(batcher.run(...))`` and then closed leaves no task
  pending, and another loop may use the batcher once that one stopped. Its thread
  is kept for the next burst: ``aclose()`` (or ``async with``) stops it, as does
  dropping the batcher.
* Memory stays bounded: each step releases the values nothing can read any more
  (``batchgraph.releasing``); an empty lane is dropped, and a lane whose graph (its
  per-node bookkeeping) grows past ``max_graph_nodes`` takes no new examples and is
  dropped once they finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import time
import weakref
from collections import Counter
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from batchgraph.awaiting import DRIVING, UnsupportedAwaitError
from batchgraph.bridge_calls import (
    Call,
    LaneState,
    cancel_all,
    check_settings,
    driving,
    resolve,
    take_cancels,
)
from batchgraph.inference import warm_up, warmed_up
from batchgraph.policy import BatchingPolicy
from batchgraph.stepping import Example, Lane
from batchgraph.threads import compute_pool

__all__ = ["AsyncBatcher"]


class AsyncBatcher:
    """Batches coroutine examples from independent asyncio tasks (see the module docstring).

    Args:
        max_batch: most examples in one batched step.
        max_latency: seconds a new example may wait for others before its first step,
            counted from its ``run`` call (time spent waiting for a lane's step to end
            counts: it then starts with the lane's next step).
        groups: lanes that take turns: one computes while another records.
        grad: build autograd graphs (default False: serving needs none). With False,
            every example runs as if wrapped in ``torch.no_grad()``: values come back
            without history; with True, with grad on (an example's own ``no_grad`` or
            ``inference_mode`` blocks still hold).
        max_steps: fail an example after this many awaits (``DeadlockError``);
            None (the default) or an int >= 0.
        max_graph_nodes: retire a lane once its graph holds this many nodes.
        make_policy: builds each lane's ``BatchingPolicy``.

    Example:
        >>> import asyncio, batchgraph as bg, torch
        >>> square = bg.batched_func(torch.square)
        >>> async def example(x):
        ...     return float(await bg.value(square(torch.tensor(x))))
        >>> async def main():
        ...     async with bg.AsyncBatcher(max_latency=0.01) as batcher:
        ...         return await asyncio.gather(*(batcher.run(example(x)) for x in (1., 2.)))
        >>> asyncio.run(main())
        [1.0, 4.0]
    """

    def __init__(
        self,
        *,
        max_batch: int = 64,
        max_latency: float = 0.002,
        groups: int = 1,
        grad: bool = False,
        max_steps: int | None = None,
        max_graph_nodes: int = 200_000,
        make_policy: Callable[[], BatchingPolicy] | None = None,
    ) -> None:
        check_settings(max_batch, max_latency, groups, grad, max_steps, max_graph_nodes,
                       make_policy)
        self.max_batch = max_batch
        self.max_latency = max_latency
        self.groups = groups
        self.max_steps = max_steps
        self.max_graph_nodes = max_graph_nodes
        self._mode = (grad, False)
        self._make_policy = make_policy or BatchingPolicy
        self._arrivals: list[Call] = []
        self._lanes: list[LaneState] = []
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        # The loop it last served: an idle batcher has no worker, yet it is that
        # loop's until the loop stops (weakly: a closed loop is not kept).
        self._loop: weakref.ref[asyncio.AbstractEventLoop] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._closing = False
        self._count = 0
        self.batch_sizes: Counter[int] = Counter()  # steps computed, by batch size

    # -- public ----------------------------------------------------------------------
    async def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run one coroutine example batched with the others; return its result.

        Args:
            coro: a coroutine example (it awaits ``bg.value(...)`` or handles only).

        Returns:
            Its return value, handles replaced by tensors.

        Raises:
            Exception: whatever the example raised (only this caller sees it).
            asyncio.CancelledError: if the calling task is cancelled and the example lets
                the ``CancelledError`` raised at its await out (see the module docstring:
                an example that swallows it goes on, and its result is returned).
            RuntimeError: after ``aclose``.
            TypeError: if ``coro`` is not a coroutine.
            UnsupportedAwaitError: if awaited inside a batched example.
        """
        if not inspect.iscoroutine(coro):
            raise TypeError(
                f"AsyncBatcher.run takes a coroutine object (call the async function: "
                f"batcher.run(example(x))), got {type(coro).__name__}"
            )
        if DRIVING.active:  # awaited by an example's own code, as it records
            coro.close()
            # Else it awaited run's future ("awaited <Future pending ...>, which a
            # driver cannot resolve"), and the batcher still ran the inner example.
            raise UnsupportedAwaitError(
                "AsyncBatcher.run was awaited inside a batched example; an example "
                "can only await bg.value(...), handles, or coroutines that await "
                "them. To batch a sub-example as part of this one, await it directly "
                "(await sub(x), not await batcher.run(sub(x))); call batcher.run from "
                "ordinary asyncio code around the examples."
            )
        if self._closing:
            coro.close()
            raise RuntimeError("this AsyncBatcher is closed; create a new one")
        try:
            self._ensure_worker()
        except RuntimeError:
            coro.close()  # it never runs: no "never awaited" warning
            raise
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # Its code runs in a copy of this context, as asyncio runs a new task's: it
        # sees the caller's ContextVars, and what it sets stays its own.
        call = Call(Example(self._count, coro, contextvars.copy_context()), future)
        self._count += 1
        self._arrivals.append(call)
        self._poke()
        try:
            while True:
                try:
                    # Shielded: cancelling the caller must not cancel the future, whose
                    # outcome is the example's (it may swallow the cancellation).
                    return await asyncio.shield(future)
                except asyncio.CancelledError as err:
                    if future.done():  # the example let it out, or ended just before:
                        raise  # a cancelled await drops the outcome, as in asyncio
                    call.cancel = err  # the worker raises it in the example; wait for that
                    self._poke()
        finally:
            # This frame goes into the traceback of the example's error raised here,
            # which the call and the future hold: a cycle that kept the lane's graph,
            # and every value it stored, alive until the collector came by.
            del call, future

    async def aclose(self) -> None:
        """Finish every example already submitted, then stop the worker and its thread."""
        self._forget_closed_loop()
        # Before closing: an aclose refused here must not close the batcher under
        # the loop that owns it (its next run would be refused).
        self._check_loop()
        worker = self._worker
        self._closing = True
        if worker is not None and not worker.done():
            self._poke()
            await worker
        self._worker = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    async def __aenter__(self) -> AsyncBatcher:
        if self._closing:  # every run() in the block would be refused
            raise RuntimeError("this AsyncBatcher is closed; create a new one")
        self._ensure_worker()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- worker (event loop thread) --------------------------------------------------
    def _forget_closed_loop(self) -> None:
        """Abandon a worker whose loop was closed without cancelling it
        (``run_until_complete``, then ``close``): nothing will ever run it again."""
        worker = self._worker
        if worker is not None and not worker.done() and worker.get_loop().is_closed():
            self._abandon(RuntimeError("the event loop was closed"))

    def _ensure_worker(self) -> None:
        self._forget_closed_loop()
        self._check_loop()
        worker = self._worker
        if worker is None or worker.done():  # never started, or stopped with its event loop: start one in this loop
            self._wakeup = asyncio.Event()
            if self._pool is None:  # kept while idle: a thread per burst cost ~1 ms
                self._pool = compute_pool("batchgraph-async")
            # In a context of its own: a task copies its creator's, and the worker
            # kept the ContextVars of whichever request started it (its request
            # object, a tracing span) alive for as long as it ran.
            loop = asyncio.get_running_loop()
            self._worker = contextvars.Context().run(loop.create_task, self._work())
            self._loop = weakref.ref(loop)

    def _check_loop(self) -> None:
        """Refuse a call from another loop while the batcher's worker lives in one, or
        while the loop it last served (idle now) still runs."""
        worker = self._worker
        if worker is not None and not worker.done():
            owner: asyncio.AbstractEventLoop | None = worker.get_loop()
        else:
            owner = self._loop() if self._loop is not None else None
            if owner is not None and not owner.is_running():
                owner = None  # stopped (run_until_complete returned): it may move
        if owner is not None and owner is not asyncio.get_running_loop():
            raise RuntimeError(
                "this AsyncBatcher is running in another event loop, which has not "
                "finished; its examples and steps belong to that loop. Create one "
                "AsyncBatcher per event loop (or close it with aclose() there first)"
            )

    def _poke(self, *_: object) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    async def _work(self) -> None:
        wakeup = self._wakeup  # this worker's own: a later worker makes a new one
        assert wakeup is not None
        try:
            # torch's first run on fake tensors (a new call's shape inference) sets
            # fake mode up: 1.3 s that blocked the loop in the first recorded call.
            assert self._pool is not None
            if not warmed_up():  # a hop to the thread and back: ~0.2 ms
                await asyncio.get_running_loop().run_in_executor(self._pool, warm_up)
            while True:
                wakeup.clear()
                with driving(self._mode[0]):  # examples record here (start, close)
                    self._reap()
                    self._admit()
                    delay = self._launch()
                if not self._arrivals and not self._lanes:
                    # Idle: stop, with the thread; the next run starts a worker anew.
                    # Kept waiting, a loop run with run_until_complete and closed left
                    # it pending ("Task was destroyed but it is pending!") and its
                    # thread running until the next loop's first call.
                    self._stop_idle(wakeup)
                    return
                with contextlib.suppress(asyncio.TimeoutError):  # a deadline passed
                    await asyncio.wait_for(wakeup.wait(), delay)
        except BaseException as err:  # a bug or loop shutdown: no caller may hang
            if self._wakeup is not wakeup or isinstance(err, GeneratorExit):
                # A worker left pending in a closed loop, garbage now: the batcher's
                # state is a later worker's (or was abandoned when it started).
                raise
            steps = [s.step for s in self._lanes if s.step is not None]
            self._abandon(err)
            # Steps still computing close their examples when they end (finish): wait
            # for them, so that a loop shutting down runs the examples' finally blocks.
            # Not with gather: cancelled again, it cancelled the steps' futures, and
            # their examples were closed while the steps still computed their graphs.
            if steps:
                await asyncio.wait(steps)
            raise

    def _stop_idle(self, wakeup: asyncio.Event) -> None:
        """Forget the worker about to return. Its thread is kept for the next burst
        (starting one per burst cost ~1 ms a request); ``aclose`` stops it, and so
        does dropping the batcher (the pool's threads end with it)."""
        if self._wakeup is wakeup and not self._closing:  # else a later worker's state
            self._worker = None

    def _abandon(self, err: BaseException) -> None:
        """The worker stops (its event loop shuts down, or a bug): fail every caller,
        close their examples and forget the lanes and the thread, so that a later
        ``run`` (in this event loop or the next ``asyncio.run``'s) starts afresh."""
        # Gone from now: a stopping worker may still wait for its steps to end, and
        # calls made meanwhile were queued for it and waited forever. They start a
        # new worker (with a new thread) instead.
        self._worker = None
        arrivals, self._arrivals = self._arrivals, []
        lanes, self._lanes = self._lanes, []
        calls = [*arrivals, *(c for s in lanes for c in s.calls.values())]
        for call in arrivals:
            call.example.close()  # never started: close it quietly
        with driving(self._mode[0]):  # except and finally blocks may record
            for state in lanes:
                state.abandoned = True
                if not state.computing:  # else the step's end cancels them (finish)
                    cancel_all(state)
        stopped = err if isinstance(err, Exception) else RuntimeError(
            f"the AsyncBatcher's worker stopped ({type(err).__name__}) before this "
            "example finished: its event loop shut down, or the worker task was cancelled"
        )
        for call in calls:
            if not call.future.done() and not call.future.get_loop().is_closed():
                if call.cancel is not None:  # its caller was cancelled: it ends so
                    call.future.cancel()
                else:
                    call.future.set_exception(stopped)
        if self._pool is not None:
            self._pool.shutdown(wait=False)  # a step still running finishes on its own
            self._pool = None

    def _reap(self) -> None:
        """Cancel examples whose callers were, resolve finished ones, and retire empty
        lanes."""
        self._arrivals = [c for c in self._arrivals if not self._dropped(c)]
        for state in self._lanes:
            if state.computing:
                continue  # its examples are the executor's until the step ends
            cancelled = take_cancels(state.calls.values())
            if cancelled:
                state.lane.resume(cancelled)
            for key, call in list(state.calls.items()):
                ex = call.example
                if ex.done:
                    del state.calls[key]
                    resolve(call)
            if len(state.lane.policy.graph) > self.max_graph_nodes:
                state.sealed = True
        for state in self._lanes:
            if not state.calls and not state.computing:
                state.lane.policy.graph.open = False  # dropped: its handles are done
        self._lanes = [s for s in self._lanes if s.calls or s.computing]

    @staticmethod
    def _dropped(call: Call) -> bool:
        if call.cancel is not None:  # never started: nothing in it can see the error
            call.example.close()
            call.future.cancel()
            return True
        return False

    def _admit(self) -> None:
        """Start arrivals in an idle lane (or a new one, up to ``groups`` open lanes)."""
        if not self._arrivals:
            return
        open_lanes = [s for s in self._lanes if not s.sealed]
        idle = [s for s in open_lanes if not s.computing]
        if idle:
            state = max(idle, key=lambda s: len(s.calls))
        elif len(open_lanes) < self.groups:
            policy = self._make_policy()
            if any(s.lane.policy is policy for s in self._lanes):
                raise ValueError(
                    "make_policy returned a policy another lane still uses; each lane "
                    "records and releases its own graph, so make_policy must build a new "
                    "policy per call"
                )
            state = LaneState(Lane(policy, [], self.max_steps, ordered=False))
            state.lane.policy.graph.open = True  # recording only happens inside steps
            self._lanes.append(state)
        else:
            return  # every lane computes: the arrivals join when one is done
        arrivals, self._arrivals = self._arrivals, []
        # Each call's wait for company counts from its arrival (call.since), not from
        # here: one that waited for a lane's step to end has waited already, and
        # every call that arrived meanwhile is admitted with it.
        for call in arrivals:
            call.lane = state
            state.calls[id(call.example)] = call
        state.lane.start([c.example for c in arrivals])
        self._reap()  # examples that finished without awaiting anything

    def _launch(self) -> float | None:
        """Start steps for lanes that are ready; return how long until one may be."""
        now = time.monotonic()
        wait: float | None = None
        for state in self._lanes:
            if state.computing or not state.calls:
                continue
            calls = sorted(
                (c for c in state.calls.values() if c.example.wait is not None),
                key=lambda c: c.since,
            )
            if not calls:
                continue
            batch = calls[: self.max_batch]
            due = batch[0].since + self.max_latency
            if (len(batch) == self.max_batch or self._closing or now >= due
                    or any(c.stepped for c in batch)):
                self._start_step(state, batch)
            else:
                wait = due - now if wait is None else min(wait, due - now)
        return wait

    def _start_step(self, state: LaneState, batch: list[Call]) -> None:
        assert self._pool is not None
        state.computing = True
        examples = [c.example for c in batch]
        self.batch_sizes[len(examples)] += 1
        state.lane.hold_inputs()  # other tasks may change them while the step runs
        loop = asyncio.get_running_loop()
        step = state.step = loop.run_in_executor(
            self._pool, state.lane.compute, examples, self._mode
        )

        def done(step: asyncio.Future[None]) -> None:
            with driving(self._mode[0]):  # examples resume and record here
                finish(step)

        def finish(step: asyncio.Future[None]) -> None:
            state.computing, state.step = False, None
            if state.abandoned:  # the worker stopped while this step ran
                # All of the lane's examples, also those waiting outside this step.
                cancel_all(state)
                return
            error = step.exception() if not step.cancelled() else None
            if error is not None:  # only a bug gets here: per-example errors are kept
                for ex in examples:
                    ex.throw = error
            take_cancels(batch)  # raised at the await the step answered, not later
            state.lane.resume([ex for ex in examples if not ex.done])
            now = time.monotonic()
            for call in batch:
                call.stepped = True
                call.since = now
            self._poke()

        step.add_done_callback(done)
