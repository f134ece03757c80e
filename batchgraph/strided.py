"""``as_strided`` on handles with an explicit ``storage_offset``.

Eagerly the offset counts from the start of the input's storage, which for a value
freshly computed is the value itself. A batched value is one row of a batch (its
storage starts at the first example), so the offset is taken from the row's own
start (``as_strided_from_start``): one-at-a-time calls read the example's own
elements instead of the first example's. Where the input is eagerly a view of
another value (``h[1:]``, or a ``bg.batched_value`` of a view), its storage starts
before it, in memory batchgraph does not keep: refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from batchgraph.aliasing import view_of
from batchgraph.handle import ResultHandle

__all__ = ["AS_STRIDED", "as_strided_from_start", "offset_from_start"]

AS_STRIDED: frozenset[Callable[..., Any]] = frozenset({torch.as_strided, torch.Tensor.as_strided})


def as_strided_from_start(
    input: torch.Tensor, size: Sequence[int], stride: Sequence[int], storage_offset: int,
) -> torch.Tensor:
    """``torch.as_strided`` with ``storage_offset`` counted from ``input``'s own first
    element rather than from its storage's.

    Example:
        >>> row = torch.arange(6.0).reshape(2, 3)[1]
        >>> as_strided_from_start(row, (2,), (1,), 1)
        tensor([4., 5.])
    """
    return torch.as_strided(input, size, stride, input.storage_offset() + storage_offset)


def offset_from_start(
    args: tuple[Any, ...], kwargs: dict[str, Any],
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None:
    """The call ``as_strided_from_start`` makes of an ``as_strided`` call on a handle
    given an explicit ``storage_offset``; None where none is given (the input's own
    offset is then kept, as eagerly).

    Raises:
        TypeError: where the input is eagerly a view of another value, whose memory
            before it the offset may reach.
    """
    names = ("input", "size", "stride", "storage_offset")
    bound = dict(zip(names, args, strict=False))
    for name, value in kwargs.items():
        bound["input" if name == "self" else name] = value
    offset = bound.get("storage_offset")
    handle = bound.get("input")
    if offset is None or type(handle) is not ResultHandle:
        return None
    graph = handle._graph
    made_by = view_of(graph, handle.node)
    given = handle._out
    if made_by is not None or (not graph.node_inputs[handle.node] and given is not None
                               and isinstance(given[0], torch.Tensor)
                               and given[0].storage_offset() != 0):
        what = f"a view ({made_by})" if made_by else "a bg.batched_value of a view"
        raise TypeError(
            f"as_strided with storage_offset={offset} on {handle!r}, which is eagerly "
            f"{what} of another tensor: the offset counts from that tensor's storage, "
            "which batched values do not share. Take as_strided of the tensor it views, "
            "or leave out storage_offset (the input's own start is used)."
        )
    return as_strided_from_start, (handle, bound["size"], bound["stride"], offset), {}
