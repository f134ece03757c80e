"""``bg.run_all``: run many coroutine examples together, one batched step at a time.

Per-example code that needs computed values to decide what to do next (a decoder
that stops at its own end token, a parser that follows its own predictions) is
written as ``async def`` and awaits ``bg.value(h)``. ``run_all`` steps every example
until it waits, computes everything pending as one ``policy.compute``, and resumes
them with real tensors, so value-dependent control flow still batches.

Several groups taking turns (``groups=k``): the examples are split into ``k`` lanes,
each with its own policy, and one lane records while another lane's step runs. How
they overlap depends on where the tensors live (``overlap="auto"``):

* ``"inline"`` (auto on CUDA): one thread. Kernels are asynchronous, so launching a
  lane's step returns at once; the driver then resumes the *previous* lane, whose
  values are ready or nearly so, while the device works on the step just launched::

      driver:  launch A0 │ launch B0 │ resume A (sync A0), record A1 │ launch A1 │ resume B ...
      device:            │ A0 ──────────── B0 ─────────────────────── A1 ──────

* ``"thread"``: a lane's step runs on one executor thread while the driver records
  another lane. Only kernels that release the GIL overlap with recording, so this
  pays for few large kernels and costs for many small ones (the two threads hand the
  GIL back and forth)::

      driver thread:   record A0 │ record B0 │ wait A0, record A1 │ wait B0, record B1 │ ...
      executor thread:           │ compute A0          │ compute B0          │ compute A1

* ``"parallel"``: as ``"thread"``, but each lane's step has an executor thread of its
  own, so on a CPU with cores to spare the lanes' kernels also run at the same time,
  each thread with the caller's intra-op thread count: ``k`` groups use up to ``k``
  times the cores one group does (never more than the process may use).

On the CPU, ``"auto"`` runs the first two batched steps of every lane inline and
measures them. When execution (mostly kernels, which release the GIL) took longer
than the Python around it (resuming the examples, which records, and scheduling),
the lanes go on ``"parallel"``; otherwise they stay ``"inline"``, because threads
would only pass the GIL back and forth. In ``benchmarks/decode.py`` on a 2-vCPU host
with one intra-op thread (64 examples, two groups against one), a GRU decoder with
8000 words chooses parallel (0.97-1.17x; one executor thread gave 0.71x) and one with
50 words chooses inline (0.73-0.75x; parallel gave 0.51x).

A lane is touched by one thread at a time: its examples are all suspended while it
computes. Results are identical to one group (the same calls, batched differently).
Other lanes' examples are not suspended, though, and may change in place a tensor the
step reads (one both groups use, or a value handed out and passed on): on executor
threads a step reads copies of its input tensors made when it is handed over
(``Lane.hold_inputs``), so a change after that does not reach it and one before is
refused, as with one group. Inline, nothing runs while a step computes.

Memory: after each step a lane releases the values that nothing can read any more
(no handle to them is left and no pending call takes them; see
``batchgraph.releasing``), so a long decode holds about one step's outputs, not all
of them.
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from concurrent.futures import Future
from contextlib import ExitStack
from typing import Any

import torch

from batchgraph.awaiting import CoroutineExampleError, check_max_steps, value
from batchgraph.policy import BatchingPolicy
from batchgraph.stepping import Example, GradMode, Lane, grad_mode
from batchgraph.threads import compute_pool, usable_cores

__all__ = ["run_all", "value"]


def run_all(
    coroutines: Iterable[Coroutine[Any, Any, Any]],
    groups: int = 1,
    return_exceptions: bool = False,
    *,
    max_steps: int | None = None,
    make_policy: Callable[[], BatchingPolicy] | None = None,
    overlap: str = "auto",
) -> list[Any]:
    """Run coroutine examples together and return their results in order.

    Each example runs until it awaits ``bg.value(h)`` (or ``h``). When every live
    example waits, all pending handles are computed as one batched step and each
    example resumes with its values. Handles left in a returned result are computed
    too. Recording between awaits works exactly as inside ``with BatchingPolicy()``.

    Args:
        coroutines: coroutine objects (``[decode(x) for x in batch]``), one per example.
        groups: split the examples into this many lanes that take turns: one lane's
            step computes while the next lane records.
        overlap: how lanes overlap (see the module docstring): ``"inline"``,
            ``"thread"``, ``"parallel"``, or ``"auto"`` (inline when the first steps
            record CUDA tensors; on the CPU, inline or parallel as the first two steps
            measure). Ignored for one group.
        return_exceptions: put a failing example's exception in its result slot
            instead of raising once the others have finished. ``KeyboardInterrupt``
            and ``SystemExit`` are not kept: they stop the run at once (the other
            examples are closed), as they stop an asyncio event loop.
        max_steps: fail an example that awaits more often than this (a coroutine that
            never finishes) with ``DeadlockError``, raised at its await; one that
            catches it and awaits again is closed. ``None`` for no limit.
        make_policy: builds each lane's policy (for custom rules or a scheduler);
            default ``BatchingPolicy()``.

    Returns:
        The examples' return values (handles in them replaced by tensors), in order.

    Raises:
        CoroutineExampleError: when an example raised and ``return_exceptions`` is False; it
            names the first failing example, chains its exception and carries every
            result (``.results``) and error (``.errors``).
        TypeError: if an item is not a coroutine, ``groups`` is not positive, or
            ``make_policy`` returns something other than a ``BatchingPolicy``.
        ValueError: for an unknown ``overlap``, a ``max_steps`` that is not None or an
            int >= 0, or a ``make_policy`` that returns one policy for two groups.

    Example:
        >>> import batchgraph as bg, torch
        >>> mul = bg.batched_func(torch.mul)
        >>> async def halvings(n):                 # how often n halves before it is <= 1
        ...     x = torch.tensor(float(n))
        ...     steps = 0
        ...     while (await bg.value(x)) > 1:        # each await is one batched step
        ...         x, steps = mul(x, 0.5), steps + 1
        ...     return steps
        >>> bg.run_all([halvings(n) for n in (1, 4, 16)])
        [0, 2, 4]
    """
    items = list(coroutines)
    for i, c in enumerate(items):
        if not inspect.iscoroutine(c):
            for other in items:  # run_all owns them: no "never awaited" warnings
                if inspect.iscoroutine(other):
                    other.close()
            raise TypeError(
                f"example {i} is {type(c).__name__}, not a coroutine: pass coroutine objects "
                "(call the async function: [example(x) for x in batch])"
            )
    try:
        if not isinstance(groups, int) or groups < 1:
            raise TypeError(f"groups must be a positive int, got {groups!r}")
        if overlap not in _OVERLAPS:
            raise ValueError(f"overlap must be one of {sorted(_OVERLAPS)}, got {overlap!r}")
        check_max_steps(max_steps)
    except (TypeError, ValueError):
        for c in items:  # never started: no "never awaited" warnings either
            c.close()
        raise
    examples = [Example(i, c) for i, c in enumerate(items)]
    if not examples:
        return []
    factory = make_policy or BatchingPolicy
    count = min(groups, len(examples))
    bounds = [len(examples) * g // count for g in range(count + 1)]
    try:
        policies = [factory() for _ in range(count)]
        if len({id(p) for p in policies}) < count:
            raise ValueError(
                "make_policy returned the same policy for two groups; each group records "
                "and releases its own graph, so make_policy must build a new policy per call"
            )
        lanes = [
            Lane(policy, examples[bounds[g] : bounds[g + 1]], max_steps)
            for g, policy in enumerate(policies)
        ]
        with ExitStack() as stack:
            for lane in lanes:
                stack.enter_context(lane.policy)  # open for recording; closed at the end
            if count == 1:
                _drive_one(lanes[0], grad_mode())
            else:
                _drive_turns(lanes, grad_mode(), overlap)
    finally:
        for ex in examples:  # only left unfinished when the driver itself was interrupted
            ex.close()
    return _results(examples, return_exceptions)


def _drive_one(lane: Lane, mode: GradMode) -> None:
    lane.start()
    while lane.live:
        lane.compute(lane.live, mode)
        lane.resume()


_OVERLAPS = frozenset({"auto", "inline", "parallel", "thread"})


def _drive_turns(lanes: list[Lane], mode: GradMode, overlap: str) -> None:
    for lane in lanes:
        lane.start()
    if overlap == "auto":
        if any(lane.records_on_cuda() for lane in lanes):
            overlap = "inline"
        else:
            overlap = _measure_cpu_steps(lanes, mode)
    if overlap == "inline":
        _drive_inline(lanes, mode)
    else:
        workers = 1 if overlap == "thread" else max(1, _spare_threads(len(lanes)))
        _drive_threaded(lanes, mode, workers)


# Measured steps per lane before "auto" chooses; the first pays one-time costs (shape
# inference, imports) that later steps do not, so only the ones after it count.
_PROBE_STEPS = 2


def _measure_cpu_steps(lanes: list[Lane], mode: GradMode) -> str:
    """Step every lane inline ``_PROBE_STEPS`` times and choose how the rest overlap:
    ``"parallel"`` when execution outweighed the Python around it in most lanes' measured
    steps, else ``"inline"``.

    Per lane, not summed: on a loaded host one step preempted by another process (a
    time slice of milliseconds, against a Python step of one) decided it alone (a
    python-bound run went parallel in 15 of 100 runs with 3 busy processes on 2 cores).
    """
    if _spare_threads(len(lanes)) < 2:
        return "inline"
    votes = measured = 0
    for probe in range(_PROBE_STEPS):
        for lane in lanes:
            if not lane.live:
                continue
            lane.compute(lane.live, mode)
            stats = lane.policy.stats
            start = time.perf_counter()
            lane.resume()
            resumed = time.perf_counter() - start
            if probe and stats is not None:
                measured += 1
                votes += stats.execute_seconds > stats.schedule_seconds + resumed
    return "parallel" if 2 * votes > measured else "inline"


def _spare_threads(lanes: int) -> int:
    """Executor threads that can compute at once: one per lane, as many as the cores
    the process may use hold at the caller's intra-op thread count."""
    return min(lanes, usable_cores() // max(1, torch.get_num_threads()))


def _drive_inline(lanes: list[Lane], mode: GradMode) -> None:
    # Two lanes in flight: launch one lane's step, then resume the lane launched
    # before it (its kernels were queued first, so they finish first).
    ready = deque(lane for lane in lanes if lane.live)
    launched: deque[Lane] = deque()
    while ready or launched:
        if ready:
            lane = ready.popleft()
            lane.compute(lane.live, mode)
            launched.append(lane)
            if len(launched) < 2 and ready:
                continue
        lane = launched.popleft()
        lane.resume()
        if lane.live:
            ready.append(lane)


def _drive_threaded(lanes: list[Lane], mode: GradMode, workers: int) -> None:
    # With one executor thread the lanes take turns on it; with more, their steps also
    # run at the same time. The driver waits for lanes in the order they were submitted
    # (first in, first out), so while it waits for one lane the next lane's step is
    # already queued or running.
    #
    # Steps that may draw random numbers (dropout, sampling) share the global
    # generator: run at the same time, their draws would interleave as the threads
    # happen to run, and a fixed seed would give other values run to run. So each such
    # step starts after the one submitted before it ends: the draws come in submission
    # order, the order inline and one-thread runs take too.
    with compute_pool("batchgraph-step", workers) as pool:
        inflight: deque[tuple[Lane, Future[None]]] = deque()
        last_random: list[Future[None] | None] = [None]

        def submit(lane: Lane) -> None:
            # The driver goes on resuming other lanes, whose examples may change in
            # place a tensor this step reads: it reads copies made now.
            lane.hold_inputs()
            if workers > 1 and lane.policy.graph.draws_random:
                if last_random[0] is not None:
                    last_random[0].exception()  # waits; its errors are re-raised below
                step = pool.submit(lane.compute, lane.live, mode)
                last_random[0] = step
            else:
                step = pool.submit(lane.compute, lane.live, mode)
            inflight.append((lane, step))

        for lane in lanes:
            if lane.live:
                submit(lane)
        while inflight:
            lane, step = inflight.popleft()
            step.result()  # per-example errors are kept on the examples; this re-raises bugs
            lane.resume()
            if lane.live:
                submit(lane)


def _results(examples: list[Example], return_exceptions: bool) -> list[Any]:
    results: list[Any] = [ex.error if ex.error is not None else ex.result for ex in examples]
    errors: dict[int, BaseException] = {
        ex.index: ex.error for ex in examples if ex.error is not None
    }
    for ex in examples:
        # Handed over: an error's traceback holds the driver's finished frames (each
        # frame holds its caller's), whose locals hold the examples. Kept here too, it
        # closed a cycle that kept the run's graph alive until a cyclic collection.
        ex.error = ex.throw = None
    if errors and not return_exceptions:
        first = min(errors)
        err = errors[first]
        others = sorted(errors)[1:]
        listed = ", ".join(map(str, others[:10])) + (
            f" and {len(others) - 10} more" if len(others) > 10 else "")
        more = f"; examples {listed} failed too" if others else ""
        said = str(err).rstrip(". ")  # its own full stop would end the sentence twice
        raise CoroutineExampleError(
            f"example {first} of {len(examples)} raised {type(err).__name__}: {said}{more}. "
            "The other examples finished; their results are in .results (pass "
            "return_exceptions=True to get them with each error in its slot).",
            first,
            errors,
            results,
        ) from err
    return results
