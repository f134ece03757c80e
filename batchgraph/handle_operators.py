"""The operators of ``ResultHandle``: ``h + 1``, ``h > 0``, ``h += g``, ``h[i] = v``, ``~mask``.

Each records the torch function the tensor operator calls (``torch.add`` for ``+``,
``torch.bitwise_and`` for ``&``), with the same operand order, so a handle's operators
batch like any other call and mean what they mean on a per-example tensor. Kept apart
from ``batchgraph.handle`` (what a handle is and how its value is read) because the
operators are many and alike.
"""

from __future__ import annotations

from collections.abc import Callable, Set
from typing import TYPE_CHECKING, Any, cast

import torch

from batchgraph.aliasing import alias_group, note_change, view_of
from batchgraph.specs import TensorSpec

if TYPE_CHECKING:
    from batchgraph.handle import ResultHandle

__all__ = ["TensorOperators"]


def _not_bound(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    raise RuntimeError("batchgraph.handle_operators is used before batchgraph.handle is loaded")


# batchgraph.recording imports batchgraph.handle, whose class takes these operators:
# the recorder is bound once both modules are loaded (at the end of batchgraph.handle).
_record: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any] = _not_bound


class TensorOperators:
    """Python's operators on a recorded value (a mixin of ``ResultHandle``).

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy():
        ...     h = bg.batched_func(torch.tanh)(torch.zeros(2))
        ...     mask = (h >= 0) & (h < 1)
        >>> bg.compute(mask)
        tensor([True, True])
    """

    __slots__ = ()

    def __add__(self, other: Any) -> Any:
        return _binary(torch.add, (self, other))

    def __radd__(self, other: Any) -> Any:
        return _binary(torch.add, (other, self))

    def __sub__(self, other: Any) -> Any:
        return _binary(torch.sub, (self, other))

    def __rsub__(self, other: Any) -> Any:
        return _binary(torch.sub, (other, self))

    def __mul__(self, other: Any) -> Any:
        return _binary(torch.mul, (self, other))

    def __rmul__(self, other: Any) -> Any:
        return _binary(torch.mul, (other, self))

    def __truediv__(self, other: Any) -> Any:
        return _binary(torch.div, (self, other))

    def __rtruediv__(self, other: Any) -> Any:
        if not isinstance(other, torch.Tensor):  # a number or a NumPy array
            # As a tensor computes `7 / t`: t.reciprocal() * 7, which rounds otherwise
            # than torch.div(7, t) (7 / 3 is one float32 ulp off, and 1e-10 / t of a
            # subnormal t is inf eagerly, 1e29 by div). An array goes as a tensor, as
            # the other operators take arrays.
            if _is_ndarray(other):
                other = torch.as_tensor(other)
            return _binary(torch.Tensor.__rtruediv__, (self, other))
        return _binary(torch.div, (other, self))

    def __pow__(self, other: Any) -> Any:
        return _binary(torch.pow, (self, other))

    def __rpow__(self, other: Any) -> Any:
        return _binary(torch.pow, (other, self))

    def __floordiv__(self, other: Any) -> Any:
        return _binary(torch.floor_divide, (self, other))

    def __rfloordiv__(self, other: Any) -> Any:
        return _binary(torch.floor_divide, (other, self))

    def __mod__(self, other: Any) -> Any:
        return _binary(torch.remainder, (self, other))

    def __rmod__(self, other: Any) -> Any:
        return _binary(torch.remainder, (other, self))

    # Masks: `(h > 0) & keep`, `~done`. Commutative, so the reflected forms record
    # the same call (the torch functions want the tensor first).
    def __and__(self, other: Any) -> Any:
        return _binary(torch.bitwise_and, (self, other))

    __rand__ = __and__

    def __or__(self, other: Any) -> Any:
        return _binary(torch.bitwise_or, (self, other))

    __ror__ = __or__

    def __xor__(self, other: Any) -> Any:
        return _binary(torch.bitwise_xor, (self, other))

    __rxor__ = __xor__

    def __invert__(self) -> Any:
        return _record(torch.bitwise_not, (self,), {})

    def __pos__(self) -> Any:
        return _record(torch.positive, (self,), {})

    def __lshift__(self, other: Any) -> Any:
        return _binary(torch.bitwise_left_shift, (self, other))

    def __rlshift__(self, other: Any) -> Any:
        return _binary(torch.bitwise_left_shift, (other, self))

    def __rshift__(self, other: Any) -> Any:
        return _binary(torch.bitwise_right_shift, (self, other))

    def __rrshift__(self, other: Any) -> Any:
        return _binary(torch.bitwise_right_shift, (other, self))

    # Augmented assignment (`h += g`) changes a tensor in place: every name bound to it
    # sees the change (`states.append(h); h += d` changes the state appended). The
    # handle itself then stands for the new value, which gives exactly that; see
    # ``_in_place``. (`@=` is not in place on tensors: it rebinds, as here.)
    def __iadd__(self, other: Any) -> Any:
        return _in_place(cast("ResultHandle", self), torch.add, other, "+=")

    def __isub__(self, other: Any) -> Any:
        return _in_place(cast("ResultHandle", self), torch.sub, other, "-=")

    def __imul__(self, other: Any) -> Any:
        return _in_place(cast("ResultHandle", self), torch.mul, other, "*=")

    def __itruediv__(self, other: Any) -> Any:
        return _in_place(cast("ResultHandle", self), torch.div, other, "/=")

    def __ifloordiv__(self, other: Any) -> Any:
        return _in_place(cast("ResultHandle", self), torch.floor_divide, other, "//=")

    def __imod__(self, other: Any) -> Any:
        return _in_place(cast("ResultHandle", self), torch.remainder, other, "%=")

    def __ipow__(self, other: Any) -> Any:
        return _in_place(cast("ResultHandle", self), torch.pow, other, "**=")

    def __iand__(self, other: Any) -> Any:
        return _in_place(cast("ResultHandle", self), torch.bitwise_and, other, "&=")

    def __ior__(self, other: Any) -> Any:
        return _in_place(cast("ResultHandle", self), torch.bitwise_or, other, "|=")

    def __ixor__(self, other: Any) -> Any:
        return _in_place(cast("ResultHandle", self), torch.bitwise_xor, other, "^=")

    def __ilshift__(self, other: Any) -> Any:
        return _in_place(cast("ResultHandle", self), torch.bitwise_left_shift, other, "<<=")

    def __irshift__(self, other: Any) -> Any:
        return _in_place(cast("ResultHandle", self), torch.bitwise_right_shift, other, ">>=")

    # `h[index] = value` changes a tensor in place too: the handle stands for a copy
    # with the item set (``set_item``), with the same refusals as `+=`.
    def __setitem__(self, index: Any, item: Any) -> None:
        handle = cast("ResultHandle", self)
        shared = _refuse_shared(handle, "h[index] = value",
                                "h = h.clone() first, then h[index] = value on the copy")
        _rebind(handle, _record(set_item, (handle, index, item), {}), shared, "h[index] = value")

    def __matmul__(self, other: Any) -> Any:
        return _binary(torch.matmul, (self, other))

    def __rmatmul__(self, other: Any) -> Any:
        return _binary(torch.matmul, (other, self))

    # Comparisons record elementwise ops (masks), == and != included, as on tensors:
    # `if h == eos:` must fail as `if h > 0:` does (its truth is not known yet), not
    # quietly compare identities. Hashing stays by identity, as a tensor's does.
    __hash__ = object.__hash__

    def __eq__(self, other: Any) -> Any:  # type: ignore[override]
        return _binary(torch.eq, (self, other))

    def __ne__(self, other: Any) -> Any:  # type: ignore[override]
        return _binary(torch.ne, (self, other))

    def __lt__(self, other: Any) -> Any:
        return _binary(torch.lt, (self, other))

    def __le__(self, other: Any) -> Any:
        return _binary(torch.le, (self, other))

    def __gt__(self, other: Any) -> Any:
        return _binary(torch.gt, (self, other))

    def __ge__(self, other: Any) -> Any:
        return _binary(torch.ge, (self, other))

    def __neg__(self) -> Any:
        return _record(torch.neg, (self,), {})

    def __reversed__(self) -> Any:
        # As a tensor's: ``reversed(t)`` is ``t.flip(0)``, a tensor (Python's reversed
        # iterator over rows would fail at `reversed(h) * 2`), and a 0-d ``t`` itself.
        spec = cast("ResultHandle", self).spec
        if type(spec) is TensorSpec and not spec.shape:
            return self
        return _record(torch.Tensor.__reversed__, (self,), {})

    def __abs__(self) -> Any:
        return _record(torch.abs, (self,), {})


def _in_place(handle: ResultHandle, fn: Callable[..., Any], other: Any, symbol: str) -> Any:
    """``handle {symbol} other``: record ``fn(handle, other)`` and make ``handle`` stand
    for it, as an eager tensor changed in place stands for its new value.

    Calls recorded on the handle before take the old value, as they did eagerly. As
    eagerly, the result keeps the handle's shape and dtype (a broadcast that would
    grow it, or a dtype it cannot be cast back to, fails). Refused where the change
    would reach other tensors eagerly: the tensor given to ``bg.batched_value``, and
    values sharing memory with the handle's (views; see ``batchgraph.aliasing``)."""
    shared = _refuse_shared(handle, symbol, f"h = h {symbol[:-1]} other")
    result = _binary(fn, (handle, other))
    if result is NotImplemented:
        return NotImplemented
    spec, new = handle.spec, result.spec
    if type(spec) is TensorSpec and type(new) is TensorSpec:
        if new.shape != spec.shape:
            raise RuntimeError(
                f"output with shape {list(spec.shape)} doesn't match the broadcast shape "
                f"{list(new.shape)} (`{symbol}` on {handle!r} keeps its shape, as on a tensor)"
            )
        if new.dtype != spec.dtype:
            if not torch.can_cast(new.dtype, spec.dtype):
                raise RuntimeError(
                    f"result type {new.dtype} can't be cast to the desired output type "
                    f"{spec.dtype} (`{symbol}` on {handle!r} keeps its dtype, as on a tensor)"
                )
            result = result.to(spec.dtype)
    return _rebind(handle, result, shared, symbol)


def set_item(value: torch.Tensor, index: Any, item: Any) -> torch.Tensor:
    """``value`` with ``[index] = item`` done on a copy: what ``h[index] = item``
    records (``h`` then stands for it, as for ``h += g``).

    Example:
        >>> set_item(torch.zeros(3), 1, 5.0)
        tensor([0., 5., 0.])
    """
    out = value.clone()
    out[index] = item
    return out


def _refuse_shared(handle: ResultHandle, symbol: str, instead: str,
                   flag_only: bool = False) -> set[int]:
    """Refuse to change ``handle`` in place (by ``symbol``) where eagerly the change
    would reach a tensor of the caller's: the tensor given to ``bg.batched_value``,
    itself or through a view. Else return the nodes whose values share memory with
    the handle's eagerly (views; ``batchgraph.aliasing``), to note as changed once the
    new value is recorded (``_rebind``).

    ``flag_only``: the change is to the tensor's own flag (``requires_grad_``), which
    never reaches the tensors it shares memory with (``z.detach().requires_grad_()``
    makes a leaf, z stays); only a tensor the caller holds is refused."""
    graph = handle._graph
    view = None if flag_only else view_of(graph, handle.node)
    if view is not None:
        if symbol == "h[index] = value":
            hint = "; to set an item of y[i], index y at once: y[i, j] = v, not y[i][j] = v"
        elif symbol.endswith("=") and " " not in symbol:  # an augmented assignment
            hint = f"; for `y[i] {symbol} v` write y[i] = y[i] {symbol[:-1]} v"
        else:
            hint = ""
        raise TypeError(
            f"`{symbol}` on {handle!r} would change in place a view of another value "
            f"({view}): eagerly the change reaches that value too, which cannot be "
            f"recorded. Make a new value instead: {instead}{hint}."
        )
    group = set() if flag_only else alias_group(graph, handle.node)
    for n in group or (handle.node,):
        # (A constant whose value a coroutine lane released is still the caller's.)
        if isinstance(graph.constants.get(n), torch.Tensor) or n in graph.dropped_tensors:
            whose = "it is" if n == handle.node else "it shares memory with"
            # Calls recorded on the handle after a change of the tensor itself read it.
            what_to_do = ("Change that tensor instead (calls recorded on the handle "
                          "afterwards read it), or make a new value"
                          if n == handle.node else "Make a new value instead")
            raise TypeError(
                f"`{symbol}` on {handle!r} would change in place a tensor of the caller's "
                f"({whose} the tensor given to bg.batched_value, which eagerly returns that "
                "tensor itself): eagerly the change reaches it, which cannot be recorded. "
                f"{what_to_do}: {instead}."
            )
    if handle._out is not None:
        # Its value was handed out (compute, an await): eagerly the caller's tensor is
        # that value and changes too; a recorded change cannot reach it.
        raise TypeError(
            f"`{symbol}` on {handle!r} would change in place a value already handed out "
            "(by compute or an await): eagerly the tensor you hold changes too, which a "
            "recorded change cannot reach. Change the tensor you hold instead (calls "
            f"recorded on the handle then read it), or make a new value: {instead}."
        )
    if any(n in graph.handed_out for n in group if n != handle.node):
        # A value sharing its memory was handed out: the caller may hold it, and
        # eagerly it would change too.
        raise TypeError(
            f"`{symbol}` on {handle!r} would change in place a value other tensors share "
            "memory with (views of it), some of them handed out already (by compute or "
            "an await): eagerly the change reaches them too, which cannot be recorded. "
            f"Make a new value instead: {instead}."
        )
    return group


def _rebind(handle: ResultHandle, result: ResultHandle, shared: Set[int] = frozenset(),
            symbol: str = "") -> ResultHandle:
    """Make ``handle`` stand for ``result``'s value (its change in place by
    ``symbol``); the values in ``shared`` (``_refuse_shared``) keep the old one, and
    are noted as changed: a compute that reads them afterwards is refused."""
    if shared:
        note_change(handle._graph, set(shared), handle.node, f"`{symbol}` on {handle!r}")
    handle.node, handle.leaf, handle.spec = result.node, result.leaf, result.spec
    handle._gen, handle._out = result._gen, None
    return handle



def _binary(fn: Callable[..., Any], args: tuple[Any, Any]) -> Any:
    """An operator's call, recorded; NotImplemented for an operand it does not take,
    as a tensor's operators answer (so ``h == None`` is False and ``h + "a"`` raises
    Python's own TypeError)."""
    try:
        return _record(fn, args, {})
    except TypeError:
        if not any(_is_ndarray(a) for a in args):
            return NotImplemented
    # A tensor's operators take a NumPy array as a tensor of its dtype (`t + array`),
    # where torch's functions refuse it: so do these, on this slow path only.
    try:
        return _record(fn, tuple(torch.as_tensor(a) if _is_ndarray(a) else a for a in args), {})
    except TypeError:
        return NotImplemented


def _is_ndarray(a: Any) -> bool:
    kind = type(a)
    return kind.__name__ == "ndarray" and kind.__module__ == "numpy"
