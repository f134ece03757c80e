"""A module's Python attributes, saved before a forward runs and put back after it.

A forward may keep state of its own in plain attributes: a counter (``self.calls += 1``),
a list or set of what it saw (``self.seen.append(x.shape)``), a cache of tensors, nested
(``self.cache["layer"]["k"] = k``), a deque of recent outputs, a running total changed
in place (``self.total += x.sum()``). Runs that are not the user's own calls must leave
none of it: batchgraph's runs on fake tensors (``module_state``), the pipeline's shape
probe on meta tensors (``pipeline.microbatch``) and a call the two-stage backward runs
again (``pipeline.unit_calls``). :class:`SavedAttributes` is what all three save and
compare: each attribute as bound, a shallow copy of each list, deque, dict and set in it
(nested ones too, ``DEPTH`` deep, as a nested cache changes only its inner dict), and
with ``versions`` the version counter of each plain tensor attribute (a change in place
cannot be put back, only seen). Plain objects of the user's in them (a
``SimpleNamespace``, a dataclass instance: ``plain_objects``) are looked into as
containers are, and so is the module's ``_buffers`` (a buffer registered in forward);
plain values (a count rebound to an equal one) are compared by value.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any, TypeVar

import torch

from batchgraph.plain_objects import Fields, fields_of, put_back_fields

__all__ = ["DEPTH", "PLAIN", "SEQUENCES", "SavedAttributes", "differs", "instances_in", "same",
           "tensors_in"]

_T = TypeVar("_T")

# A container value is looked into this deep (a dict of (cos, sin) tuples per length).
DEPTH = 3
# Sequences copied and put back in place (a deque of the last outputs as a list is).
SEQUENCES = (list, deque)
# Values compared by value: a count, a length, a torch.Size.
PLAIN = frozenset({int, float, bool, str, complex, type(None), torch.Size})
# Attribute values with no container or object of state in them (most of a module's).
_NOT_HELD = (int, float, bool, str, type(None), torch.Tensor, torch.nn.Module)
# Caches of batchgraph's own a module holds (held.held_on): no state of its forward.
_OURS = "_batchgraph"

Held = list[tuple[Any, Any]]


class SavedAttributes:
    """The Python attributes of ``module`` not in ``exclude``, as they are now.

    Example:
        >>> m = torch.nn.Linear(2, 2)
        >>> m.calls, m.seen = 0, {"a": [1]}
        >>> saved = SavedAttributes(m)
        >>> m.calls += 1
        >>> m.seen["a"].append(2)
        >>> sorted(saved.changed())
        ['calls', 'seen']
        >>> saved.put_back(saved.changed())
        >>> m.calls, m.seen
        (0, {'a': [1]})
    """

    __slots__ = ("before", "contents", "module", "skip", "versions")

    def __init__(self, module: torch.nn.Module, exclude: Iterable[str] = (), *,
                 versions: bool = False) -> None:
        self.module = module
        self.skip = exclude if isinstance(exclude, (set, frozenset)) else frozenset(exclude)
        attrs = vars(module)
        self.before = {k: v for k, v in attrs.items() if k not in self.skip}
        found = {name: _containers(v, DEPTH, []) for name, v in self.before.items()
                 if not isinstance(v, _NOT_HELD)}
        if (buffers := attrs.get("_buffers")) is not None:
            # Buffers registered or rebound by the forward (self.register_buffer("b", t)
            # in forward): kept state as an attribute's (a buffer changed in place, a
            # count of batches, is the buffer watch's: batchgraph.buffers).
            found["_buffers"] = [(buffers, dict(buffers))]
        self.contents = {name: held for name, held in found.items() if held}
        self.versions = {name: v._version for name, v in self.before.items()
                         if versions and type(v) is torch.Tensor}

    def rebound(self, exclude: Iterable[str] | None = None) -> set[str]:
        """The attributes bound, unbound or rebound since (to another object, or another
        value where it is a plain one: :func:`same`), those in ``exclude`` (by default
        those excluded when saved) and batchgraph's own caches aside."""
        now, before = vars(self.module), self.before
        skip = self.skip if exclude is None else frozenset(exclude)
        return {name for name in {*before, *now} - skip
                if not name.startswith(_OURS) and (
                    name not in before or name not in now or not same(now[name], before[name]))}

    def refilled(self, rebound: set[str]) -> set[str]:
        """The attributes, not among ``rebound``, whose containers hold other items."""
        return {name for name, held in self.contents.items()
                if name not in rebound and any(differs(c, old) for c, old in held)}

    def changed(self, exclude: Iterable[str] | None = None) -> set[str]:
        """The attributes rebound or refilled since."""
        rebound = self.rebound(exclude)
        return rebound | self.refilled(rebound)

    def changed_in_place(self) -> list[str]:
        """The plain tensor attributes changed in place since (saved with ``versions``)."""
        now = vars(self.module)
        return sorted(name for name, version in self.versions.items()
                      if now.get(name) is self.before[name]
                      and self.before[name]._version != version)

    def put_back(self, names: Iterable[str]) -> None:
        """Bind ``names`` as they were bound and their containers' items back in place."""
        now = vars(self.module)
        for name in names:
            if name in self.before:
                now[name] = self.before[name]
            elif name not in self.skip:
                now.pop(name, None)
            for held, old in self.contents.get(name, ()):
                if not differs(held, old):
                    continue
                if isinstance(old, Fields):
                    put_back_fields(held, old)
                    continue
                held.clear()
                if isinstance(held, SEQUENCES):
                    held.extend(old)
                else:
                    held.update(old)


def _containers(value: Any, depth: int, out: Held) -> Held:
    if isinstance(value, SEQUENCES):
        out.append((value, list(value)))
        items: Any = value
    elif isinstance(value, dict):
        out.append((value, dict(value)))
        items = value.values()
    elif isinstance(value, set):
        out.append((value, set(value)))
        return out  # hashable items: no container to look into
    elif isinstance(value, tuple):
        items = value
    elif (fields := fields_of(value)) is not None:
        out.append((value, fields))
        items = fields.values()
    else:
        return out
    if depth > 1:
        for v in items:
            _containers(v, depth - 1, out)
    return out


def differs(value: Any, old: Any) -> bool:
    """Whether the container or plain object ``value`` holds other items than its copy
    ``old`` (by identity, or by value where both are plain: :func:`same`).

    Example:
        >>> seen = [1, 2]
        >>> differs(seen, list(seen)), differs({3}, {3, 4}), differs([2.0], [2.0])
        (False, True, False)
    """
    if isinstance(old, Fields):
        value = fields_of(value)
    elif isinstance(value, SEQUENCES):
        return not isinstance(old, list) or len(value) != len(old) or any(
            not same(a, b) for a, b in zip(value, old))
    elif isinstance(value, set):
        return not isinstance(old, set) or len(value) != len(old) or any(
            v not in old for v in value)
    return (not isinstance(value, dict) or not isinstance(old, dict)
            or value.keys() != old.keys() or any(not same(value[k], old[k]) for k in old))


def same(a: Any, b: Any) -> bool:
    """``a is b``, or equal values of one of Python's plain kinds (a count rebound to
    an equal one is no change; a tensor made anew is).

    Example:
        >>> n = 10 ** 6
        >>> same(n, n + 1 - 1), same(1, True), same(torch.zeros(1), torch.zeros(1))
        (True, False, False)
    """
    if a is b:
        return True
    kind = type(a)
    return kind is type(b) and kind in PLAIN and bool(a == b)


def tensors_in(value: Any, depth: int = DEPTH) -> list[torch.Tensor]:
    """The tensors in ``value``: itself, or in its lists, deques, tuples, dicts and plain
    objects' fields, ``depth`` deep (a set's items are not looked into).

    Example:
        >>> import types
        >>> t = torch.zeros(1)
        >>> len(tensors_in({"layer": [(t, t)], "n": 3})), len(tensors_in(types.SimpleNamespace(t=t)))
        (2, 1)
    """
    return instances_in(value, torch.Tensor, depth)


def instances_in(value: Any, kind: type[_T], depth: int = DEPTH) -> list[_T]:
    """The instances of ``kind`` in ``value``, found as :func:`tensors_in` finds tensors.

    Example:
        >>> gen = torch.Generator()
        >>> instances_in({"noise": [gen], "n": 3}, torch.Generator) == [gen]
        True
    """
    if isinstance(value, kind):
        return [value]
    if depth == 0:
        return []
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (*SEQUENCES, tuple)):
        fields = fields_of(value)
        if fields is None:
            return []
        value = fields.values()
    return [t for v in value for t in instances_in(v, kind, depth - 1)]
