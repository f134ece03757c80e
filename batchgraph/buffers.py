"""Watching modules' buffers between recording and compute.

A batched call reads its module's buffers (``running_mean``, a counter) when it
computes, not when it was recorded, so a buffer changed in place in between (new
statistics loaded, an EMA update) would reach calls that eagerly ran before the
change. Parameters are watched by their version counters (``Graph.key_versions``);
buffers cannot be watched so simply: computations change them themselves (a
``BatchNorm`` in training mode counts its batches in ``num_batches_tracked``, once per
batched step; a module may count its calls in a buffer), a batch may hold several
steps of one module, and a later compute may run calls recorded before an earlier
one. (batchgraph's runs on fake tensors, a new signature's shape inference, leave real
buffers as they are: ``inference.on_fake_tensors``.)

So each buffer gets one ``Watch``, shared by every graph and thread, that tells the
changes batchgraph made from the others::

    version:   5 ──record──▶ 5 ──compute (counting)──▶ 8 ──user add_──▶ 9 ──▶ compute
    seen:      5             5   (busy: not looked at)  8                 9 (looked at)
    epoch:     5             5                          5                 9

``seen`` is the version batchgraph last saw the buffer at. While batchgraph runs code
that may change it (``computing``: a compute's steps) the watch
is *busy*, and afterwards ``seen`` moves to the version then: those changes are the
computation's own. Whenever batchgraph looks at a buffer that is not busy and finds
another version than ``seen``, something else changed it: ``epoch`` becomes that
version. A key notes the buffers' epochs where its calls are recorded (``epochs``, at
the first call of a key after each compute, with the parameters' versions), as part
of its identity; at compute a key whose noted epochs differ from the current ones
read buffers changed outside batchgraph since its calls were recorded, and is
refused. Calls recorded after such a change note the new epoch: they get a key id
of their own and compute (bg.run_all: a coroutine that changes a buffer between two
awaits and then records).

Only what moves a version counter is seen: torch's ``batch_norm`` updates the running
mean and variance without moving theirs (its ``num_batches_tracked += 1`` moves its
own, so an eager call in training mode between recording and compute is seen), while
``add_``, ``copy_`` and ``load_state_dict`` move them.

Looking at a busy buffer leaves it as it is (a lane of ``run_all`` recording while
another lane's step updates the statistics on an executor thread must not take that
step's changes for someone else's); a change made by other code while a step of the
buffer's module runs is taken for the step's, the one case not told apart.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "Watch", "buffers_kept", "buffers_of_kept", "computing", "epochs", "watch", "watches_of", "watches_read_by",
]


class Watch:
    """What batchgraph knows of one buffer; see the module docstring."""

    __slots__ = ("busy", "epoch", "ref", "seen")

    def __init__(self, tensor: torch.Tensor, ref: weakref.ref[torch.Tensor]) -> None:
        self.ref = ref
        self.seen = self.epoch = tensor._version
        self.busy = 0


# One watch per live buffer, by id (a tensor's == compares values, so tensors cannot
# key a WeakKeyDictionary); the weak reference forgets the watch with its tensor.
_WATCHES: dict[int, Watch] = {}
# Observing and marking busy happen under one lock: a lane's executor thread may
# start a step while the driver thread looks at the same buffer.
_LOCK = threading.Lock()


def watch(tensor: torch.Tensor) -> Watch:
    """The watch of ``tensor`` (made the first time it is asked for)."""
    found = _WATCHES.get(id(tensor))
    if found is not None and found.ref() is tensor:
        return found
    with _LOCK:
        found = _WATCHES.get(id(tensor))
        if found is None or found.ref() is not tensor:
            ref = weakref.ref(tensor, functools.partial(_forget, id(tensor)))
            found = _WATCHES[id(tensor)] = Watch(tensor, ref)
    return found


def _forget(key: int, ref: weakref.ref[torch.Tensor]) -> None:
    found = _WATCHES.get(key)
    if found is not None and found.ref is ref:
        del _WATCHES[key]


def watches_of(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], tuple[Watch, ...]]:
    """Names and watches of the buffers in ``named`` that can be watched (inference
    tensors keep no version counter)."""
    names: list[str] = []
    found: list[Watch] = []
    for name, tensor in named:
        if not tensor.is_inference():
            names.append(name)
            found.append(watch(tensor))
    return names, tuple(found)


def watches_read_by(fn: Any) -> tuple[Watch, ...]:
    """The watches of the buffers calls of ``fn`` read: a module's own (its
    submodules' included), or those of the modules a function reads
    (``captured_buffers``). For the slow paths that run ``fn`` outside a graph's
    compute (``Graph`` lists them once per module instead)."""
    from batchgraph.captured import captured_buffers  # captured imports nothing of ours

    named = fn.named_buffers() if isinstance(fn, torch.nn.Module) else captured_buffers(fn)
    return watches_of(named)[1]


def _observe(w: Watch) -> int:
    # Under _LOCK. A version batchgraph did not make is a change from outside.
    if not w.busy:
        tensor = w.ref()
        if tensor is None:
            return -1
        version = tensor._version
        if version != w.seen:
            w.seen = w.epoch = version
    return w.epoch


def epochs(watches: Sequence[Watch]) -> tuple[int, ...] | None:
    """Each buffer's epoch now: the version it was last changed to from outside
    batchgraph (or first seen at). None when a buffer is gone (replaced by a new
    tensor: ``model.double()``), for the caller to list the buffers anew."""
    with _LOCK:
        found = tuple([_observe(w) for w in watches])
    return None if -1 in found else found


@contextlib.contextmanager
def computing(watches: Sequence[Watch]) -> Iterator[None]:
    """Around batchgraph running code that may change these buffers (a compute's
    steps): their changes meanwhile are its own."""
    if not watches:
        yield
        return
    with _LOCK:
        for w in watches:
            _observe(w)  # a change from outside before this run still counts
            w.busy += 1
    try:
        yield
    finally:
        with _LOCK:
            for w in watches:
                w.busy -= 1
                tensor = w.ref()
                if tensor is not None:
                    w.seen = tensor._version


@contextlib.contextmanager
def buffers_kept(fn: Any) -> Iterator[None]:
    """Around a run of ``fn`` on fake tensors (a new signature's shape inference, the
    vmap probe): buffers it replaced are put back. In-place changes are skipped there
    (``inference._FakeRunGuard``), but a forward assigning ``self.count = self.count +
    1`` left a fake tensor in the module for good.

    Example:
        >>> class Counting(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.register_buffer("count", torch.zeros(()))
        ...     def forward(self, x):
        ...         self.count = self.count + 1
        ...         return x
        >>> m = Counting()
        >>> with buffers_kept(m):
        ...     _ = m(torch.ones(1))
        >>> m.count
        tensor(0.)
    """
    from batchgraph.captured import captured_parts  # captured imports nothing of ours

    modules = (list(fn.modules()) if isinstance(fn, torch.nn.Module)
               else [m for _, m in captured_parts(fn)[2]])
    with buffers_of_kept(modules):
        yield


@contextlib.contextmanager
def buffers_of_kept(modules: Sequence[torch.nn.Module]) -> Iterator[None]:
    """``buffers_kept`` for the modules listed (a caller that has the list already).

    Example:
        >>> norm = torch.nn.BatchNorm1d(2)
        >>> mean = norm.running_mean
        >>> with buffers_of_kept([norm]):
        ...     norm.running_mean = torch.ones(2)
        >>> norm.running_mean is mean
        True
    """
    saved = [(m._buffers, dict(m._buffers)) for m in modules]
    try:
        yield
    finally:
        for now, before in saved:
            if now.keys() != before.keys() or any(now[k] is not v for k, v in before.items()):
                now.clear()
                now.update(before)
