"""``as_strided`` on handles, counted from the example's own value.

Eagerly the offset counts from the start of the input's storage, which for a value
freshly computed is the value itself. A batched value is one row of a batch (its
storage starts at the first example, and the next example's row follows it), so the
call is made from the row's own start (``as_strided_from_start``): one-at-a-time
calls read the example's own elements instead of the first example's, and a view
reaching past the example's last element, which eagerly fails out of bounds of its
storage, fails too instead of reading the next example's elements. Where the input
is a recorded view of a value of its own (``h.t()``, ``h[1:]``, ``h.split(2)[1]``),
the call is made of that value instead (``of_viewed_value``), with the view's offset
(worked out on fake tensors): eagerly ``h.t().as_strided(...)`` reads ``h``'s memory
in ``h``'s order, not the transposed view's, and elements of ``h`` outside the view
(read without gradient, as eagerly). Where the input is eagerly a view of memory
batchgraph does not keep (a ``bg.batched_value`` of a view, views by a value), an
explicit offset, or elements past the input's own, are refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from batchgraph.aliasing import view_of
from batchgraph.graph import STORE_SHIFT
from batchgraph.handle import ResultHandle
from batchgraph.specs import TensorSpec

__all__ = ["AS_STRIDED", "as_strided_from_start", "of_viewed_value", "offset_from_start"]

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
    if made_by is not None:
        call = of_viewed_value(handle, size, stride, offset)
        if call is not None:
            return call
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
    # A view taken of a value handed out (h.t() after y = bg.compute(h)): the recorded
    # call reads its batched row, laid out in the view's order, not in y's memory.
    of_view = of_view or (made_by is not None and given is not None
                          and isinstance(given[0], torch.Tensor) and not given[0].is_contiguous())
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


def of_viewed_value(
    handle: ResultHandle, size: Sequence[int], stride: Sequence[int], offset: int | None,
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None:
    """The ``as_strided_from_start`` call made of the value ``handle``, a recorded view,
    views (through views of views), with the offset counted from that value's start,
    as eagerly (``offset``, else the view's own storage offset); None where it cannot
    be worked out (the value is no tensor of its own, was handed out, or the views
    cannot run on fake tensors), which leaves the call on the view itself.

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy():
        ...     h = bg.batched_func(torch.neg)(torch.arange(4.0).reshape(2, 2))
        ...     got = bg.compute(h.t().as_strided((4,), (1,)))
        >>> got   # h's memory in h's order, as eagerly
        tensor([-0., -1., -2., -3.])
    """
    from batchgraph.inference import on_fake_tensors  # it imports much of the package

    graph = handle._graph
    chain: list[tuple[int, int]] = []
    ref = (handle.node, handle.leaf)
    while view_of(graph, ref[0]) is not None:
        chain.append(ref)
        ref = graph.node_inputs[ref[0]][0]
    base, spec, loc = ref[0], graph.node_spec[ref[0]], graph.node_loc[ref[0]]
    if (type(spec) is not TensorSpec or ref[1] != 0
            or (loc >= 0 and not graph.stores[loc >> STORE_SHIFT])  # released
            or (not graph.node_inputs[base] and not _own(graph.constants.get(base)))):
        return None
    try:
        with on_fake_tensors():
            fake = view = torch.empty(spec.shape, dtype=spec.dtype, device=spec.device)
            for node, leaf in reversed(chain):
                key = graph.keys[graph.node_key[node]]
                specs = key.call.input_specs
                if not specs or specs[0] is None or tuple(specs[0].shape) != view.shape:
                    return None  # its first input is not the one it views
                others = [torch.empty(s.shape, dtype=s.dtype, device=s.device)
                          for s in specs[1:] if s is not None]
                if len(others) != len(specs) - 1:
                    return None
                out = key.call.apply(key.fn, [view, *others])
                view = out if isinstance(out, torch.Tensor) else tree_leaves(out)[leaf]
            if view.untyped_storage()._cdata != fake.untyped_storage()._cdata:
                return None
            start, in_order = int(view.storage_offset()), view.is_contiguous()
            shape, strides = tuple(view.shape), view.stride()
    except Exception:  # views by a value (h[i], i a handle): on the view, as before
        return None
    given = handle._out
    if given is not None:
        # A view taken of a value handed out (view_of_handed): that value is the
        # tensor the view's own is a view of, where it is laid out as the fakes were.
        real = given[0]
        if (not isinstance(real, torch.Tensor) or tuple(real.shape) != shape
                or real.stride() != strides or real.storage_offset() < start):
            return None
        whole = ResultHandle(graph, base, 0, spec)
        whole.handed(torch.as_strided(real, spec.shape, _contiguous(spec.shape),
                                      real.storage_offset() - start))
        return _strided_of(handle, whole, spec, size, stride, offset, start, shape, strides)
    if base in graph.handed_out:
        # Which handle's value (each handed out a tensor of its own) it views is not
        # kept: the call stays on the view, which reads the view's elements in the
        # view's order, as eagerly only where that is their order in memory.
        if in_order:
            return None
        raise TypeError(
            f"as_strided on {handle!r}, eagerly a view ({view_of(graph, handle.node)}) of "
            "a value already handed out whose elements it does not hold in memory order: "
            "eagerly as_strided reads that value's memory, which batchgraph cannot tell "
            "apart from another handle's copy. Take as_strided of the value handed out "
            "(y = bg.compute(h); y.as_strided(...)), or of .contiguous() of the view."
        )
    return _strided_of(handle, ResultHandle(graph, base, 0, spec), spec, size, stride, offset,
                       start, shape, strides)


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _strided_of(handle: ResultHandle, whole: Any, spec: TensorSpec, size: Sequence[int],
                stride: Sequence[int], offset: int | None, start: int,
                shape: tuple[int, ...], strides: tuple[int, ...],
                ) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """The call of ``as_strided_from_start`` on ``whole``, the value ``handle`` is a view
    of (of ``shape`` and ``strides`` at ``start`` in it)."""
    at = int(start) if offset is None else offset
    own = math.prod(spec.shape)
    reach = _elements_reached(size, stride, at)
    if reach > own:
        raise RuntimeError(_out_of_bounds(size, stride, at, reach, own) + f" (on {handle!r})")
    if reach:
        # Eagerly the gradient reaches only the elements of the view (as_strided's
        # backward is taken over its input): the others are read without one.
        held = torch.zeros(own, dtype=torch.bool)
        held[torch.arange(own).as_strided(shape, strides, start)] = True
        if not bool(held[torch.arange(own).as_strided(size, stride, at)].all()):
            from batchgraph.functional import batched_value  # it imports the recording side

            kept = batched_value(held.reshape(spec.shape).to(spec.device))
            whole = torch.where(kept, whole, whole.detach())
    return as_strided_from_start, (whole, size, stride, at), {}


def _own(value: object) -> bool:
    """Whether ``value`` is a tensor of its own: its storage holds it alone, in order."""
    return (isinstance(value, torch.Tensor) and value.is_contiguous()
            and value.storage_offset() == 0
            and value.untyped_storage().nbytes() == value.numel() * value.element_size())


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
