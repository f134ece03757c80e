"""Plain attributes of the modules a call reads: numbers, strings and tuples of them.

A batched call reads its module's attributes when it computes, not when it was
recorded: ``drop.p``, ``norm.eps``, ``conv.padding``, ``attention.dropout``, your own
module's ``self.temperature`` read in ``forward``. Eagerly each call used the values
of its time; batched, every call of a batch would use those of the compute. So they
are watched as the train/eval modes are (``batchgraph.key_reads``): noted with a
call signature when it is resolved (a change resolves it anew: ``conv.padding``
changes the output's shape), and per key id at a key's first call after each compute,
so calls recorded before and after a change never batch together, and ``compute``
refuses calls whose attributes changed since (``ModuleAttributeChangedError``).

Watched: each entry of the module's (and its submodules') ``__dict__`` whose value is
a number (NumPy's scalars too), bool, string, None, dtype, device or enum, or a tuple
of such, and which tensor a plain tensor attribute is (not a parameter or buffer, which
are watched apart: ``self.mask = other``), except ``nn.Module``'s own bookkeeping (its
mode and hook dicts). Not watched: changes inside a plain tensor attribute, attributes a module's ``forward`` changes itself (a
call counter, a cached length: found where its run on fake tensors, when a signature
is resolved, or a compute on the recording thread changed them; a compute on an
executor thread, a lane's of ``run_all`` or an ``AsyncBatcher``'s, finds none, as the
user's code may set a setting meanwhile), mutable containers (a list or dict, which a
forward may fill as it goes), values inside other objects (``self.cfg.scale`` of a
config object), and a recorded function's plain globals and closure cells
(``SCALE = 2.0`` read by a ``bg.batched_func``): keep those as they were until the
calls are computed.
"""

from __future__ import annotations

import enum
import numbers
import threading
import weakref
from collections.abc import Iterable, Sequence
from itertools import chain
from operator import is_
from typing import Any

import torch

from batchgraph.held import held_on

__all__ = [
    "MODULE_OWN", "AttributeCache", "Attributes", "attribute_cache", "changed_attributes",
    "note_own_names", "note_own_state", "plain_attributes", "spec_attributes",
]

# (index of the module in the list given, attribute name, tagged value), for each
# plain attribute, in the modules' order.
Attributes = tuple[tuple[int, str, Any], ...]

# What every module has in its __dict__ (its mode, parameter and hook dicts): its
# mode is watched apart, and the rest is not read by forward as a setting.
MODULE_OWN = frozenset(vars(torch.nn.Module()))
_SCALARS = frozenset({int, bool, str, complex, type(None), torch.dtype, torch.device})
# A sequence longer than this is taken for data, not a setting, and not watched.
_MAX_ITEMS = 64
_NOT_PLAIN = object()

# Per module, the attributes its forward changes itself (a counter, a cache): not
# settings of the caller's, and they would differ after every compute.
_OWN_STATE: weakref.WeakKeyDictionary[torch.nn.Module, frozenset[str]] = (
    weakref.WeakKeyDictionary()
)
_own_generation = 0  # moves when _OWN_STATE does: snapshots cached before are stale
# Both are changed by the recording thread and by computes (on an executor thread in
# run_all's lanes and AsyncBatcher's): one change at a time, none lost.
_own_lock = threading.Lock()
_HELD = "_batchgraph_attributes"  # where attribute_cache keeps its caches on a module


class AttributeCache:
    """``plain_attributes`` of a fixed list of modules, taken anew only where one of
    their ``__dict__`` values is another object than at the last look (or the
    attributes not watched changed): a look at 65 modules costs ~60 us instead of
    ~300 us. Modules whose ``__dict__`` holds pinned recording stubs while a policy
    records (a ``BatchedModule``'s, ``batchgraph.pinning``), ``pinning`` by index,
    are looked at in full every time.

    The values of the last look are held (an attribute's old value lives until the
    next look), so that an object freed and another made at its address cannot pass
    for it.

    Example:
        >>> drop = torch.nn.Dropout(0.1)
        >>> cache = AttributeCache([drop], ())
        >>> cache.now() is cache.now()   # nothing set in between: the same snapshot
        True
        >>> drop.p = 0.5
        >>> [value for _, name, (_, value) in cache.now() if name == "p"]
        [0.5]
    """

    __slots__ = ("dicts", "full", "last", "steady")

    def __init__(self, modules: Sequence[torch.nn.Module], pinning: Sequence[int]) -> None:
        self.full = [(i, modules[i]) for i in pinning]
        self.steady = [(i, m) for i, m in enumerate(modules) if i not in pinning]
        self.dicts = [vars(m) for _, m in self.steady]  # a module keeps its __dict__
        # The values of the last look and its snapshot: one tuple, replaced whole
        # (threads may look at once).
        self.last: tuple[tuple[Any, ...], Attributes | None] | None = None

    def now(self) -> Attributes | None:
        """The plain attributes of the modules now (``plain_attributes``)."""
        seen = (_own_generation, *chain.from_iterable([d.values() for d in self.dicts]))
        last = self.last
        # The very objects of the last look, by identity (no __eq__ runs: 1 == 1.0,
        # and a tensor's compares elementwise).
        if last is None or len(seen) != len(last[0]) or not all(map(is_, seen, last[0])):
            last = self.last = (seen, plain_attributes(self.steady))
        if not self.full:
            return last[1]
        found = (*(last[1] or ()), *(plain_attributes(self.full) or ()))
        return found or None


def attribute_cache(modules: Sequence[torch.nn.Module]) -> AttributeCache:
    """An ``AttributeCache`` of ``modules``: kept on the first (``held_on``), to serve
    every graph, where the others are its submodules (a module's own list, or a
    method's of its module), so that it holds nothing the first does not; a new one
    otherwise."""
    if not modules:
        return AttributeCache(modules, ())
    caches: dict[tuple[int, ...], AttributeCache] = held_on(modules[0], _HELD, dict)
    key = tuple([id(m) for m in modules])  # the cache holds them: ids stay theirs
    cache = caches.get(key)
    if cache is not None:
        return cache
    from batchgraph.module import BatchedModule  # which imports this module

    pinning = [i for i, m in enumerate(modules) if isinstance(m, BatchedModule)]
    cache = AttributeCache(modules, pinning)
    if len(modules) > 1 and not {*key} <= {id(m) for m in modules[0].modules()}:
        return cache
    if len(caches) >= 4:  # submodules replaced since: the oldest list goes
        del caches[next(iter(caches))]
    caches[key] = cache
    return cache


def plain_attributes(modules: Iterable[tuple[int, torch.nn.Module]]) -> Attributes | None:
    """The plain attributes of ``modules``, (index, module) pairs (see the module
    docstring), tagged with their types (``1`` and ``1.0`` scale an integer tensor
    differently), or None where they have none. Equal results mean calls compute with
    the same settings.

    Example:
        >>> drop = torch.nn.Dropout(0.1)
        >>> before = plain_attributes([(0, drop)])
        >>> drop.p = 0.5
        >>> [(name, value) for _, name, (_, value) in plain_attributes([(0, drop)])]
        [('p', 0.5), ('inplace', False)]
        >>> plain_attributes([(0, drop)]) == before
        False
    """
    found: list[tuple[int, str, Any]] = []
    append = found.append
    for i, module in modules:
        own = _OWN_STATE.get(module, ()) if _OWN_STATE else ()
        # A copy, taken at once: the loop may run Python (a proxy's __class__), while
        # another thread sets a new attribute (a forward computing on an executor).
        for name, value in tuple(vars(module).items()):
            kind = type(value)
            # The commonest kinds inline (this runs once per key and compute).
            if kind is int or kind is bool or kind is str:
                if name not in MODULE_OWN and name not in own:
                    append((i, name, (kind, value)))
            elif name not in MODULE_OWN and name not in own:
                tagged = _tag(value, 0)
                if tagged is not _NOT_PLAIN:
                    append((i, name, tagged))
    return tuple(found) if found else None


def _tag(value: Any, depth: int) -> Any:
    kind = type(value)
    if kind is float:
        # NaN equals nothing, itself included: the attribute would always differ.
        return (float, "nan") if value != value else (float, value)
    if kind in _SCALARS:
        return (kind, value)
    if isinstance(value, tuple):  # conv.padding, normalized_shape, torch.Size
        if kind is tuple and all([type(v) is int for v in value]):
            return (tuple, value)  # the commonest: (1,), (3, 3)
        if depth > 2 or len(value) > _MAX_ITEMS:
            return _NOT_PLAIN
        items = tuple([_tag(v, depth + 1) for v in value])
        return _NOT_PLAIN if _NOT_PLAIN in items else (kind, items)
    if isinstance(value, enum.Enum):
        return (kind, value)
    if isinstance(value, torch.Tensor):
        # A tensor kept as a plain attribute, not a buffer (self.mask = torch.tril(..),
        # a temperature as a 0-d tensor): rebinding it (self.mask = other) is a change;
        # its contents are the tensor's own (not compared: it may be large).
        return (torch.Tensor, _Same(value))
    if isinstance(value, numbers.Number) or _numpy_bool(kind):
        # NumPy scalars (self.scale = np.sqrt(d), a temperature from np.linspace) and
        # other numbers: settings as floats are, compared by value; NaN as float's.
        return (kind, "nan") if isinstance(value, numbers.Complex) and value != value else (
            kind, value)
    return _NOT_PLAIN


class _Same:
    """A tensor attribute's tag: equal to the tag of the very same tensor only."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor  # held: its id cannot pass to another tensor meanwhile

    def __eq__(self, other: object) -> bool:
        return type(other) is _Same and other.tensor is self.tensor

    def __hash__(self) -> int:
        return id(self.tensor)

    def __repr__(self) -> str:
        t = self.tensor
        return f"tensor{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} at {id(t):#x}"


def spec_attributes(attrs: Attributes | None) -> Attributes | None:
    """``attrs`` as far as a call's output spec may depend on them: a plain tensor
    attribute by its shape, dtype, device and whether it requires grad, not by which
    tensor it is. A signature resolved under other attributes is resolved anew (a
    run on fake tensors); a mask rebound per batch (self.mask = make_mask()) to a
    tensor like the last is not another (it cost ~15 ms per signature per batch).

    Example:
        >>> drop = torch.nn.Dropout(0.1)
        >>> drop.mask = torch.ones(3)
        >>> then = spec_attributes(plain_attributes([(0, drop)]))
        >>> drop.mask = torch.zeros(3)
        >>> spec_attributes(plain_attributes([(0, drop)])) == then
        True
    """
    if attrs is None or not any([type(tagged[1]) is _Same for _, _, tagged in attrs]):
        return attrs
    return tuple([(i, name, _layout(tagged)) for i, name, tagged in attrs])


def _layout(tagged: Any) -> Any:
    kind, value = tagged
    if type(value) is _Same:
        t = value.tensor
        return (kind, (tuple(t.shape), t.dtype, t.device, t.requires_grad))
    return tagged


def _numpy_bool(kind: type) -> bool:
    # numpy.bool_ is registered with no number ABC (numpy is not imported here).
    return kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")


def note_own_state(
    modules: Sequence[torch.nn.Module], before: Attributes | None, after: Attributes | None,
) -> None:
    """Take the attributes of ``modules`` that differ between ``before`` and
    ``after`` (noted around a run of their forward: on fake tensors, or a compute's)
    for state the forward keeps itself: no longer watched."""
    if after == before:
        return
    changed: dict[int, set[str]] = {}
    then, now = set(before or ()), set(after or ())
    for i, name, _ in then ^ now:
        changed.setdefault(i, set()).add(name)
    for i, names in changed.items():
        note_own_names(modules[i], names)


def note_own_names(module: torch.nn.Module, names: Iterable[str]) -> None:
    """Take ``module``'s attributes ``names`` for state its forward keeps itself (a
    run of it changed them, and was undone: ``module_state``): no longer watched.

    Example:
        >>> drop = torch.nn.Dropout(0.1)
        >>> note_own_names(drop, ["p"])
        >>> sorted(_OWN_STATE[drop])
        ['p']
    """
    global _own_generation
    with _own_lock:
        _OWN_STATE[module] = _OWN_STATE.get(module, frozenset()) | frozenset(names)
        # After the table: a look in between, under the old table, must not be kept
        # as one under the new generation (it listed the forward's state as settings).
        _own_generation += 1


def changed_attributes(
    modules: Sequence[torch.nn.Module], names: Sequence[str], then: Attributes | None,
    now: Attributes | None,
) -> list[str]:
    """The attributes of ``modules`` (named ``names[i] + '.'``, or bare for an empty
    name) that differ between ``then`` and ``now``, each as ``name: old -> new``;
    attributes a forward changes itself (found since ``then`` was noted) do not
    count."""
    current = {(i, name): value for i, name, value in now or ()}
    old = {(i, name): value for i, name, value in then or ()
           if name not in _OWN_STATE.get(modules[i], ())}
    shown = []
    for i, name in sorted({*old, *current}):
        a, b = old.get((i, name)), current.get((i, name))
        if a != b:
            where = f"{names[i]}.{name}" if names[i] else name
            shown.append(f"{where}: {_show(a)} -> {_show(b)}")
    return shown


def _show(tagged: Any) -> str:
    if tagged is None:
        return "(not set)"
    kind, value = tagged
    if isinstance(kind, type) and issubclass(kind, tuple):
        # Tuples of ints are kept as they are (_tag), other items tagged.
        inner = ", ".join(repr(v) if type(v) is int else _show(v) for v in value)
        return f"({inner}{',' if len(value) == 1 else ''})"
    # A NaN is tagged "nan" (_tag), for a number of any kind.
    return "nan" if kind is not str and isinstance(value, str) else repr(value)
