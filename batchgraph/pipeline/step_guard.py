"""One step at a time per pipeline: calls from other threads wait, calls from inside refuse.

A step uses state that belongs to the whole pipeline: every stage's saved activations,
the communicator's messages, the loss's count of targets. Two steps at once mixed them
(one thread's ``train_step`` took the other's activations or found its messages "sent
twice"), so a call from another thread waits until the running step has ended, as
calling a model from several threads does on one device. A call made from inside a running
step (the loss function, a stage's forward or a hook, which run on the pipeline's own
threads, or the calling thread's own backward into the inputs' graph) would wait for
the step it is part of, forever: it is refused instead::

    caller thread         with guard.step("train_step"):   lock held, thread marked
    device threads          with guard.inside("train_step"):   marked for the job
    any marked thread       pipe.forward(...)  ->  PipelineReentrantError
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from batchgraph.pipeline.errors import PipelineReentrantError

__all__ = ["StepGuard"]


class StepGuard:
    """Serializes a pipeline's steps and refuses the ones started from inside a step.

    Example:
        >>> guard = StepGuard()
        >>> with guard.step("train_step"):
        ...     with guard.step("forward"):  # doctest: +ELLIPSIS
        ...         pass
        Traceback (most recent call last):
        ...
        batchgraph.pipeline.errors.PipelineReentrantError: pipe.forward() was called from inside a running train_step of the same pipeline ...
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Per thread: the name of the step this thread is part of (None outside any).
        self._local = threading.local()

    def _running(self) -> str | None:
        running: str | None = getattr(self._local, "running", None)
        return running

    @contextmanager
    def inside(self, what: str) -> Iterator[None]:
        """Mark this thread as running part of the step ``what`` (a device thread's job)."""
        previous = self._running()
        self._local.running = what
        try:
            yield
        finally:
            self._local.running = previous

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        """Run the call ``what`` (``"train_step"``, ``"forward"``, ``"reset"``) alone:
        wait for a step running on another thread; refuse one this thread is part of.

        Raises:
            PipelineReentrantError: if this thread is running part of a step already.
        """
        running = self._running()
        if running is not None:
            raise PipelineReentrantError(
                f"pipe.{what}() was called from inside a running {running} of the same "
                "pipeline (from its loss function, a stage's forward or a hook: they run "
                "on the pipeline's threads while the step waits for them), where it would "
                "wait for itself forever; call it before or after the step (outputs = "
                "pipe.forward(x) first, then pipe.train_step(x, y)), not from inside it"
            )
        with self._lock, self.inside(what):
            yield
