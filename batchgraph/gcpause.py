"""Fewer garbage-collector passes while a batch is recorded and computed.

Recording creates tens of thousands of small objects that all stay alive (nodes,
handles, index lists) until the batch's backward pass is done, so CPython's cyclic
collector, which runs every 700 net allocations, would rescan them over and over:
about a tenth of the time of a batch once, 2-3 ms of a 60 ms training step still
after that. From the moment a policy starts recording until its graph is freed
(after computing and the backward pass; the graph holds no reference back to its
policy, so reference counting frees it as soon as the caller lets go), and while
anything computes, the young-generation threshold is raised (collection still
happens, only less often, so memory stays bounded); the original thresholds are
restored when the last such period ends. A counter makes this correct when policies
nest or run in several threads.

Example:
    >>> import gc
    >>> before = gc.get_threshold()
    >>> with fewer_collections():
    ...     gc.get_threshold()[0] >= 50_000
    True
    >>> gc.get_threshold() == before
    True
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["fewer_collections"]

YOUNG_THRESHOLD = 50_000

# Reentrant: ``leave`` runs from a graph's finalizer, which the collector may call in
# the middle of ``enter`` (any allocation can start a collection) on the same thread.
_lock = threading.RLock()
_active = 0
_saved: tuple[int, int, int] | None = None


def enter() -> None:
    """Start a batch's quiet period (pair every call with ``leave``)."""
    global _active, _saved
    with _lock:
        # Counted first: a period that a finalizer ends from here on is another one,
        # so it cannot bring the count to zero and restore the thresholds under us.
        _active += 1
        if _active == 1:
            saved = gc.get_threshold()
            _saved = saved
            gc.set_threshold(max(saved[0], YOUNG_THRESHOLD), *saved[1:])


def leave() -> None:
    """End one quiet period; the last one restores the original thresholds."""
    global _active, _saved
    with _lock:
        _active -= 1
        if _active == 0 and _saved is not None:
            saved, _saved = _saved, None
            gc.set_threshold(*saved)


@contextmanager
def fewer_collections() -> Iterator[None]:
    """A quiet period as a context manager."""
    enter()
    try:
        yield
    finally:
        leave()
