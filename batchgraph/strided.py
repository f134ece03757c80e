"""``as_strided`` on handles, counted from the example's own value.

Eagerly the offset counts from the start of the input's storage, which for a value
freshly computed is the value itself. A batched value is one row of a batch (its
storage starts at the first example, and the next example's row follows it), so the
call is made from the row's own start (``as_strided_from_start``): one-at-a-time
calls read the example's own elements instead of the first example's, and a view
reaching past the example's last element, which eagerly fails out of bounds of its
storage, fails too instead of reading the next example's elements. Where the input
is eagerly a view of another value (``h[1:]``, or a ``bg.batched_value`` of a view),
its storage reaches before and after it, into memory batchgraph does not keep: an
explicit offset, or elements past the input's own, are refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from batchgraph.aliasing import view_of
from batchgraph.handle import ResultHandle
from batchgraph.specs import TensorSpec

__all__ = ["AS_STRIDED", "as_strided_from_start", "offset_from_start"]

AS_STRIDED: frozenset[Callable[..., Any]] = frozenset({torch.as_strided, torch.Tensor.as_strided})


def as_strided_from_start(
    input: torch.Tensor, size: Sequence[int], stride: Sequence[int], storage_offset: int,
) -> torch.Tensor:
    """``torch.as_strided`` with ``storage_offset`` counted from ``input``'s own first
    element rather than from its storage's, kept within ``input``'s own elements.

    Raises:
        RuntimeError: where the view reaches past ``input``'s last element (eagerly,
            for a value of its own, out of bounds of its storage).

    Example:
        >>> row = torch.arange(6.0).reshape(2, 3)[1]
        >>> as_strided_from_start(row, (2,), (1,), 1)
        tensor([4., 5.])
    """
    reach = _elements_reached(size, stride, storage_offset)
    if reach > input.numel():
        raise RuntimeError(_out_of_bounds(size, stride, storage_offset, reach, input.numel()))
    return torch.as_strided(input, size, stride, input.storage_offset() + storage_offset)


def offset_from_start(
    args: tuple[Any, ...], kwargs: dict[str, Any],
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None:
    """The call ``as_strided_from_start`` makes of an ``as_strided`` call on a handle
    (offset 0 where none is given: the input's own start, as eagerly); None where the
    input is no handle.

    Raises:
        TypeError: where the input is eagerly a view of another value and the call
            gives an offset, or reaches past the input's elements: eagerly it reads
            memory of that value, which batched values do not share.
        RuntimeError: where the call reaches past the elements of a value of its own
            (eagerly out of bounds of its storage).
    """
    names = ("input", "size", "stride", "storage_offset")
    bound = dict(zip(names, args, strict=False))
    for name, value in kwargs.items():
        bound["input" if name == "self" else name] = value
    handle = bound.get("input")
    if type(handle) is not ResultHandle:
        return None
    offset = bound.get("storage_offset")
    size, stride = bound["size"], bound["stride"]
    graph = handle._graph
    made_by = view_of(graph, handle.node)
    given = handle._out
    eager = given[0] if given is not None and not graph.node_inputs[handle.node] else None
    spec = handle.spec
    own = math.prod(spec.shape) if type(spec) is TensorSpec else None
    reach = _elements_reached(size, stride, offset or 0)
    beyond = own is not None and reach > own
    of_view = isinstance(eager, torch.Tensor) and (
        # An explicit offset counts from its storage's start, before it.
        (offset is not None and eager.storage_offset() != 0)
        # A batched row is laid out contiguously; as_strided reads the tensor's own layout.
        or not eager.is_contiguous()
        # Elements past its own are another tensor's, which eagerly it may read.
        or (beyond and eager.untyped_storage().nbytes() > eager.numel() * eager.element_size()))
    if of_view or (made_by is not None and (offset is not None or beyond)):
        what = f"a view ({made_by})" if made_by else "a bg.batched_value of a view"
        reads = (f"storage_offset={offset}" if offset is not None
                 else f"size={tuple(size)}, stride={tuple(stride)}")
        raise TypeError(
            f"as_strided with {reads} on {handle!r}, which is eagerly {what} of another "
            "tensor: it reads that tensor's storage, which batched values do not share. "
            "Take as_strided of the tensor it views, or keep within the input's own "
            "elements without storage_offset (the input's own start is used)."
        )
    if beyond:
        raise RuntimeError(_out_of_bounds(size, stride, offset or 0, reach, own or 0)
                           + f" (on {handle!r})")
    return as_strided_from_start, (handle, size, stride, offset or 0), {}


def _elements_reached(size: Sequence[int], stride: Sequence[int], offset: int) -> int:
    """How many elements from the start a view of ``size`` and ``stride`` at
    ``offset`` needs (0 for an empty view)."""
    if any(s == 0 for s in size):
        return 0
    return offset + 1 + sum((s - 1) * abs(st) for s, st in zip(size, stride, strict=False))


def _out_of_bounds(size: Sequence[int], stride: Sequence[int], offset: int, reach: int,
                   own: int) -> str:
    return (
        f"as_strided with size={tuple(size)}, stride={tuple(stride)}, "
        f"storage_offset={offset} needs {reach} elements from the start of a value of "
        f"{own}: out of bounds of its storage, as eagerly (in a batch it would read "
        "another example's elements). Keep size, stride and offset within the value."
    )
