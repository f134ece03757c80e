"""Plain objects a module keeps its own state in, looked into as its lists and dicts are.

A forward may keep a tensor on an object of the user's rather than on the module
itself: ``self.cache = types.SimpleNamespace()`` in ``__init__`` and ``self.cache.ref
= x`` in forward, a dataclass instance, an object of a class with ``__slots__``. A
run on fake tensors (a new signature's shape inference, the vmap probe) left its fake
tensor there: the compute and every later eager call read it and failed ("aten.allclose:
DataDependentOutputException"). ``module_state.state_kept`` takes such an object's
fields as it takes a list's items, and puts them back after the run.

Looked into: ``types.SimpleNamespace``, dataclass instances, and instances of classes
of the user's (not of Python's, torch's, NumPy's or batchgraph's own, not modules,
tensors, classes, enums or callables), by their ``__dict__`` and ``__slots__``.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from typing import Any

import torch

__all__ = ["Fields", "fields_of", "put_back_fields"]

# Packages whose objects are not a forward's own state (their objects' fields are
# theirs to keep: a logger's cache, a generator's state).
_LIBRARIES = frozenset({
    "builtins", "torch", "batchgraph", "numpy", "collections", "enum", "functools",
    "typing", "threading", "weakref", "logging", "abc", "types", "contextlib",
})
_NOT_PLAIN = (torch.nn.Module, torch.Tensor, type, types.ModuleType, enum.Enum)
_MISSING = object()


class Fields(dict[str, Any]):
    """A plain object's fields (attribute name to value) at one time."""


def fields_of(value: Any) -> Fields | None:
    """The fields of ``value`` where it is a plain object a forward may keep state
    in, else None.

    Example:
        >>> import types
        >>> fields_of(types.SimpleNamespace(ref=None))
        {'ref': None}
        >>> fields_of([1, 2]) is None, fields_of(torch.nn.Linear(1, 1)) is None
        (True, True)
    """
    kind = type(value)
    if kind is not types.SimpleNamespace and (
            kind.__module__.partition(".")[0] in _LIBRARIES or isinstance(value, _NOT_PLAIN)
            or (callable(value) and not dataclasses.is_dataclass(kind))):
        return None
    fields = Fields(getattr(value, "__dict__", {}))
    for cls in kind.__mro__:
        slots = vars(cls).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__"):
                fields[name] = getattr(value, name, _MISSING)
    return fields if fields or hasattr(value, "__dict__") else None


def put_back_fields(value: Any, fields: Fields) -> None:
    """Give ``value`` the ``fields`` taken of it before (those set since removed).

    Example:
        >>> import types
        >>> box = types.SimpleNamespace(ref=None)
        >>> before = fields_of(box)
        >>> box.ref, box.more = 1, 2
        >>> put_back_fields(box, before)
        >>> box
        namespace(ref=None)
    """
    now = fields_of(value) or Fields()
    # object's own setters: a frozen dataclass's fields too
    for name in now.keys() - fields.keys():
        object.__delattr__(value, name)
    for name, old in fields.items():
        if old is _MISSING:
            if now.get(name, _MISSING) is not _MISSING:
                object.__delattr__(value, name)
        elif now.get(name, _MISSING) is not old:
            object.__setattr__(value, name, old)
