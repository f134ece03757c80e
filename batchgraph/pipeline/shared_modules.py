"""Modules that stages on different threads share: their forwards run one at a time.

A module may sit in several stages (the same block called twice, ``nn.Sequential(block,
lin, block)``, or layers sharing one block as ALBERT's do). On threads, stages of
different devices run at once, and a forward changing such a module's state does so
from two threads: ``self.calls += 1`` is a read, an add and a write in Python, so one
thread's count overwrote the other's (a counter of 50 calls per microbatch counted
3600 of 4000 in 13 runs of 20 with ``sys.setswitchinterval(1e-6)``), and an in-place
update of a buffer (``BatchNorm``'s running statistics) runs two kernels on one
tensor. One device changes it once per call, in order.

:func:`shared_locks` gives the stages sharing a module that may keep state one lock
per group, which a stage holds around each of its actions (its forward, the loss, and a
backward that may run forward code again: activation checkpointing): those stages run
one at a time, as one device would, and the other stages still overlap them. A module
may keep state unless it and its submodules are ``torch.nn``'s own layers without
buffers or hooks (a shared ``nn.Linear`` or ``nn.Embedding``, weight tying, is not
locked).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from batchgraph.pipeline.stage import Stage

__all__ = ["lock_shared", "shared_locks"]


def _may_keep_state(module: nn.Module) -> bool:
    """Whether ``module``'s forward may change its state: code that is not torch.nn's, a
    buffer (updated in place, as BatchNorm's statistics), or a hook."""
    for m in module.modules():
        if (not type(m).__module__.startswith("torch.nn.") or m._buffers
                or m._forward_hooks or m._forward_pre_hooks):
            return True
    return False


def shared_locks(modules: Sequence[nn.Module],
                 threads: Sequence[int]) -> list[threading.Lock | None]:
    """A lock for each stage that shares a module which may keep state with a stage on
    another thread (one per group of such stages), else None.

    Args:
        modules: the stage modules, in order.
        threads: the thread (device) each stage runs on.

    Example:
        >>> class Counted(nn.Linear):
        ...     def forward(self, x):
        ...         self.calls = getattr(self, "calls", 0) + 1
        ...         return super().forward(x)
        >>> block, lin = Counted(2, 2), nn.Linear(2, 2)
        >>> locks = shared_locks([nn.Sequential(block), lin, nn.Sequential(block)], [0, 1, 2])
        >>> locks[0] is locks[2] is not None, locks[1]
        (True, None)
        >>> shared_locks([nn.Sequential(lin), nn.Sequential(lin)], [0, 1])  # weight tying
        [None, None]
    """
    owners: dict[int, list[int]] = {}  # a module's id -> the stages holding it
    found: dict[int, nn.Module] = {}
    for k, root in enumerate(modules):
        for m in root.modules():
            owners.setdefault(id(m), []).append(k)
            found[id(m)] = m
    group = list(range(len(modules)))  # union-find of the stages sharing state

    def top(k: int) -> int:
        while group[k] != k:
            k = group[k]
        return k

    for key, stages in owners.items():
        if len({threads[k] for k in stages}) > 1 and _may_keep_state(found[key]):
            for k in stages[1:]:
                group[top(k)] = top(stages[0])
    sizes: dict[int, int] = {}
    for k in range(len(modules)):
        sizes[top(k)] = sizes.get(top(k), 0) + 1
    locks = {root: threading.Lock() for root, n in sizes.items() if n > 1}
    return [locks.get(top(k)) for k in range(len(modules))]


def lock_shared(stages: Sequence[Stage], thread_of: Callable[[int], int]) -> None:
    """Set each stage's ``shared`` lock (:func:`shared_locks`; ``thread_of``: a stage
    index's thread).

    Example:
        >>> import torch
        >>> from batchgraph.pipeline.stage import Stage
        >>> norm = nn.BatchNorm1d(2)  # buffers: its statistics are updated in place
        >>> stages = [Stage(nn.Sequential(norm), k, 2, torch.device("cpu")) for k in (0, 1)]
        >>> lock_shared(stages, lambda k: k)
        >>> stages[0].shared is stages[1].shared is not None
        True
    """
    for stage, lock in zip(stages, shared_locks([s.module for s in stages],
                                                [thread_of(s.index) for s in stages])):
        stage.shared = lock
