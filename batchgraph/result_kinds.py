"""The sequence kinds of a recorded call's result, at every depth.

A call returns handles nested as its eager result is (``recording.handles_for`` builds
tuples from the output spec); where the result holds a list, a namedtuple or one of
torch's named results (``torch.return_types.max``), the handles come back in that kind,
so that per-example code reads them as it reads the eager result: ``out[0].values``
of a function returning ``(x.max(0), x.min(0))``, ``out[2].first`` of one returning a
named pair inside a tuple.

The kind is ``None`` where every sequence is a plain tuple (the common case, and the
recording fast path), the result's own type where only the outermost sequence is of
another kind, and a ``NestedKind`` otherwise.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Union

from batchgraph.specs import rebuild_sequence

__all__ = ["NestedKind", "ResultKind", "rebuild_result", "result_kind"]


class NestedKind(NamedTuple):
    """A sequence's own kind and, per item, the item's ``ResultKind``."""

    kind: type
    items: tuple[Any, ...]


ResultKind = Union[type, NestedKind, None]


def result_kind(value: Any) -> ResultKind:
    """The sequence kinds of a call's result ``value`` (see the module docstring).

    Example:
        >>> import torch
        >>> result_kind((torch.zeros(1), None)) is None
        True
        >>> result_kind([torch.zeros(1)])
        <class 'list'>
        >>> result_kind((torch.zeros(1), [torch.zeros(1)]))
        NestedKind(kind=<class 'tuple'>, items=(None, <class 'list'>))
    """
    if not isinstance(value, (tuple, list)):
        return None
    items = tuple(result_kind(v) for v in value)
    kind = type(value)
    if all(item is None for item in items):
        return None if kind is tuple else kind
    return NestedKind(kind, items)


def rebuild_result(kind: ResultKind, handles: Any) -> Any:
    """``handles`` (tuples nested as the result) in the kinds ``kind`` says.

    Example:
        >>> rebuild_result(NestedKind(tuple, (None, list)), (1, (2, 3)))
        (1, [2, 3])
    """
    if kind is None:
        return handles
    if isinstance(kind, NestedKind):
        items = [rebuild_result(k, h) for k, h in zip(kind.items, handles)]
        return rebuild_sequence(kind.kind, items)
    return rebuild_sequence(kind, list(handles))
