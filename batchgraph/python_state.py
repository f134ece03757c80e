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
cannot be put back, only seen).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["DEPTH", "SEQUENCES", "SavedAttributes", "differs", "tensors_in"]

# A container value is looked into this deep (a dict of (cos, sin) tuples per length).
DEPTH = 3
# Sequences copied and put back in place (a deque of the last outputs as a list is).
SEQUENCES = (list, deque)
_CONTAINERS = (*SEQUENCES, dict, set)

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

    __slots__ = ("before", "contents", "module", "versions")

    def __init__(self, module: torch.nn.Module, exclude: Iterable[str] = (), *,
                 versions: bool = False) -> None:
        self.module = module
        skip = exclude if isinstance(exclude, (set, frozenset)) else frozenset(exclude)
        self.before = {k: v for k, v in vars(module).items() if k not in skip}
        found = {name: _containers(v, DEPTH, []) for name, v in self.before.items()
                 if isinstance(v, _CONTAINERS)}
        self.contents = {name: held for name, held in found.items() if held}
        self.versions = {name: v._version for name, v in self.before.items()
                         if versions and type(v) is torch.Tensor}

    def rebound(self, exclude: Iterable[str] = ()) -> set[str]:
        """The attributes bound, unbound or rebound since (``exclude`` aside)."""
        now, before = vars(self.module), self.before
        skip = exclude if isinstance(exclude, (set, frozenset)) else frozenset(exclude)
        return {name for name in {*before, *now} - skip
                if name not in before or name not in now or now[name] is not before[name]}

    def refilled(self, rebound: set[str]) -> set[str]:
        """The attributes, not among ``rebound``, whose containers hold other items."""
        return {name for name, held in self.contents.items()
                if name not in rebound and any(differs(c, old) for c, old in held)}

    def changed(self, exclude: Iterable[str] = ()) -> set[str]:
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
            else:
                now.pop(name, None)
            for held, old in self.contents.get(name, ()):
                if differs(held, old):
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
    else:
        return out
    if depth > 1:
        for v in items:
            _containers(v, depth - 1, out)
    return out


def differs(value: Any, old: Any) -> bool:
    """Whether the container ``value`` holds other items than its copy ``old`` (by identity).

    Example:
        >>> seen = [1, 2]
        >>> differs(seen, list(seen)), differs({3}, {3, 4})
        (False, True)
    """
    if isinstance(value, SEQUENCES):
        return not isinstance(old, list) or len(value) != len(old) or any(
            a is not b for a, b in zip(value, old))
    if isinstance(value, set):
        return not isinstance(old, set) or len(value) != len(old) or any(
            v not in old for v in value)
    return (not isinstance(value, dict) or not isinstance(old, dict)
            or value.keys() != old.keys() or any(value[k] is not old[k] for k in old))


def tensors_in(value: Any, depth: int = DEPTH) -> list[torch.Tensor]:
    """The tensors in ``value``: itself, or in its lists, deques, tuples and dicts,
    ``depth`` deep (a set's items are not looked into).

    Example:
        >>> t = torch.zeros(1)
        >>> len(tensors_in({"layer": [(t, t)], "n": 3}))
        2
    """
    if isinstance(value, torch.Tensor):
        return [value]
    if depth == 0:
        return []
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (*SEQUENCES, tuple)):
        return []
    return [t for v in value for t in tensors_in(v, depth - 1)]
