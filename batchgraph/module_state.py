"""What batchgraph's own runs of a forward leave in its modules' attributes.

batchgraph runs a call on fake tensors to learn its output (a new signature's shape
inference, the vmap probe, the grad and aliasing checks). A forward that keeps a
tensor it makes (``if self.mask is None: self.mask = torch.ones_like(x)``, a rotary
embedding's ``self.cos`` cached per length, ``self.cache[n] = table``) kept the
*fake* tensor of that run: the batched compute and every eager call after it read
it and failed ("aten.allclose: DataDependentOutputException") or returned fake
tensors. ``state_kept`` puts such a module's attributes back as they were before
the run, all those the run changed (a ``cached_len`` with its ``cos``, so they stay
consistent), and notes them as state the forward keeps itself
(``attributes.note_own_names``), as a run that changed them would have been.
Changes holding no tensor (a call counter) are left as they were before this file:
they are not settings either way.

It also tells whether a tensor kept was one of vmap's batched tensors
(``Kept.batched``): under ``torch.func.vmap`` such a forward keeps the whole batch
(``self.last_out = out``, a mask made from the batched input), a tensor that escaped
vmap and fails every later use, and where the forward reads it back in a later call
(``if self.ref is None: self.ref = x``) every example read its own value where
eagerly later calls read the first one's: other values, silently. The vmap probe
(``vmap_probe.probe_vmap``) runs such a call one example at a time instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from batchgraph.attributes import MODULE_OWN, note_own_names
from batchgraph.buffers import buffers_of_kept
from batchgraph.fake_mode import watching_changes
from batchgraph.python_state import DEPTH, SavedAttributes, tensors_in

__all__ = ["Kept", "changed_count", "kept_count", "state_kept"]

_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
# Runs that kept a tensor in a module (see kept_count).
_kept = [0]
# Of those, runs that changed a plain tensor attribute in place (see changed_count).
_changed = [0]


class Kept:
    """What a run inside ``state_kept`` kept (and was undone): ``names``, each as
    ``Class.attribute``, and whether one of them held a batched tensor of vmap's."""

    __slots__ = ("batched", "names")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.batched = False


@contextlib.contextmanager
def state_kept(fn: Any) -> Iterator[Kept]:
    """Around a run of ``fn`` on fake tensors: buffers it replaced are put back
    (``buffers.buffers_kept``), and so are the attributes of a module where the run left a
    tensor in one (rebound, or put into a list or dict the module holds).

    Example:
        >>> from batchgraph.inference import on_fake_tensors
        >>> class Caching(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.mask = None
        ...     def forward(self, x):
        ...         if self.mask is None:
        ...             self.mask = torch.ones_like(x)
        ...         return x * self.mask
        >>> m = Caching()
        >>> with state_kept(m) as kept, on_fake_tensors():
        ...     _ = m(torch.empty(3))
        >>> m.mask is None, kept.names
        (True, ['Caching.mask'])
    """
    modules = _modules(fn)
    saved = [SavedAttributes(m, MODULE_OWN) for m in modules]
    kept = Kept()
    with watching_changes() as changed, buffers_of_kept(modules):
        start = len(changed)
        try:
            yield kept
        finally:
            skipped = {id(t) for t in changed[start:]}
            del changed[start:]
            for attrs in saved:
                _put_back(attrs, kept)
                _note_changed_in_place(attrs.module, attrs.before, skipped, kept)


def kept_count() -> int:
    """How many times a run inside ``state_kept`` kept a tensor in a module (undone):
    a resolve that moved it found a forward keeping state of its own.

    Example:
        >>> before = kept_count()
        >>> with state_kept(torch.nn.Linear(2, 2)) as kept:
        ...     pass
        >>> kept_count() == before, kept.names
        (True, [])
    """
    return _kept[0]


def _modules(fn: Any) -> list[torch.nn.Module]:
    from batchgraph.captured import captured_parts  # captured imports nothing of ours

    if isinstance(fn, torch.nn.Module):
        return list(fn.modules())
    return [m for _, m in captured_parts(fn)[2]]


def _put_back(attrs: SavedAttributes, kept: Kept) -> None:
    changed = attrs.changed(MODULE_OWN)
    now = vars(attrs.module)
    tensors = [t for name in changed for t in tensors_in(now.get(name), DEPTH)]
    if not tensors:
        return  # no tensor of the run kept: a counter, as before
    _kept[0] += 1
    kept.batched = kept.batched or any(_wrapped(t) for t in tensors)
    kept.names.extend(f"{type(attrs.module).__name__}.{name}" for name in sorted(changed))
    attrs.put_back(changed)
    note_own_names(attrs.module, changed)


def _note_changed_in_place(module: torch.nn.Module, before: dict[str, Any],
                           skipped: set[int], kept: Kept) -> None:
    """Note the plain tensor attributes of ``module`` the run changed in place (a total
    carried across calls, ``self.total += x.sum(0)``; ``skipped``: the ids of the real
    tensors whose in-place changes the run skipped, so there is nothing to put back),
    as kept: the calls read state of their own, and run in recorded order."""
    if not skipped:
        return
    names = [name for name, t in before.items() if isinstance(t, torch.Tensor)
             and name not in MODULE_OWN and id(t) in skipped]
    if names:
        _kept[0] += 1
        _changed[0] += 1
        kept.names.extend(f"{type(module).__name__}.{name}" for name in sorted(names))


def changed_count() -> int:
    """How many times a run inside ``state_kept`` changed a module's plain tensor
    attribute in place (skipped): a resolve that moved it found a forward carrying a
    total across calls, which no batched run can give each call of.

    Example:
        >>> before = changed_count()
        >>> with state_kept(torch.nn.Linear(2, 2)):
        ...     pass
        >>> changed_count() == before
        True
    """
    return _changed[0]
