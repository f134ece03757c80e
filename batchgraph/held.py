"""Caches kept on the object they are for, so they die with it.

A ``weakref.WeakKeyDictionary`` cannot cache a module's call site or ``Binder``: the
value refers to its key (the site calls the module), so the dictionary's strong
reference to the value kept the key alive for good, and every module ever recorded
with (its parameters included) with it. Kept in the object's own ``__dict__``, the
object and its cache form a cycle that the garbage collector frees with the object.

The entry pickles and copies as an empty ``dict`` (``nn.Module`` pickles its
``__dict__``), so a copy of a module starts with no cache, and needs no batchgraph
to be loaded. An entry is only taken while its ``owner`` check holds, so a shallow
copy sharing the original's entry (``copy.copy``) or a wrapper that copied a
function's ``__dict__`` (``functools.wraps``) makes its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["held_on"]

T = TypeVar("T")


class _Held:
    __slots__ = ("owner_id", "value")

    def __init__(self, owner_id: int, value: Any) -> None:
        self.owner_id = owner_id
        self.value = value

    def __reduce__(self) -> tuple[type[dict[Any, Any]], tuple[()]]:
        return (dict, ())


def held_on(obj: Any, name: str, make: Callable[..., T], *args: Any) -> T:
    """The value cached on ``obj`` as ``name`` (in its ``__dict__``), ``make(*args)``
    if new (arguments rather than a closure: module sites are looked up per attribute
    read while recording).

    Example:
        >>> class Thing: pass
        >>> thing = Thing()
        >>> held_on(thing, "_cache", list) is held_on(thing, "_cache", list)
        True
    """
    d = obj.__dict__
    held = d.get(name)
    if type(held) is _Held and held.owner_id == id(obj):
        value: T = held.value
        return value
    value = make(*args)
    d[name] = _Held(id(obj), value)
    return value
