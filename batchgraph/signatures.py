"""How a recorded call's arguments become its signature (and what may not be one).

A call's *signature* is what its cache entry and its ``BatchKey`` are keyed by: the
per-example specs of its tensor arguments, in order, and every other argument as a
hashable static value. ``encode_argument`` builds an argument's entry while
recording (the hot path) and collects the graph inputs; ``template_argument`` builds
the call's template, with ``InputSlot`` placeholders where the tensors go.

Refused as arguments: handles of another policy, or of one whose ``with`` block has
ended (``foreign_handle``), and calls that would modify their input in place
(``in_place_error``): a handle stands for a value other calls share.

Example:
    >>> static_value(2) == static_value(2.0)    # equal in Python, not as arguments
    False
    >>> static_value([1, 2])                    # hashable, so the call is cached
    (<class 'list'>, ((<class 'int'>, 1), (<class 'int'>, 2)))
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, cast

import torch

from batchgraph.errors import PolicyClosedError, PolicyMismatchError
from batchgraph.graph import ROW_MASK, STORE_SHIFT, exact_number
from batchgraph.handle import ResultHandle, snapshot, unchanged
from batchgraph.specs import InputSlot, TensorSpec, intern_spec, make_map, make_seq
from batchgraph.torch_callables import torchs_own

if TYPE_CHECKING:
    from batchgraph.graph import Graph, Ref

__all__ = [
    "changes_input_in_place",
    "computed_spec",
    "encode_argument",
    "encode_handle_tuple",
    "foreign_handle",
    "identity_signature",
    "in_place_error",
    "static_value",
    "template_argument",
]


# Dicts taken apart when they hold tensors or handles (at any depth), rebuilt with
# the same keys in the same order; other dicts are held by reference, as any object
# (and so is a subclass with other constructor arguments, ``defaultdict``).
_MAPS: tuple[type, ...] = (dict, OrderedDict)
# What a list or tuple argument is looked into for.
_NESTED: tuple[type, ...] = (torch.Tensor, list, tuple, *_MAPS)
# Mutable statics a cached call keeps copies of (see ``_owned``).
_COPIED = frozenset({list, tuple, dict, OrderedDict})


def _holds_tensors(a: Any) -> bool:
    if type(a) is ResultHandle or isinstance(a, torch.Tensor):
        return True
    if type(a) is list or type(a) is tuple:
        return any(_holds_tensors(x) for x in a)
    if type(a) in _MAPS:
        return any(_holds_tensors(x) for x in a.values())
    return False


def encode_handle_tuple(
    a: tuple[Any, ...], graph: Graph, inputs: list[Ref], depth: list[int]
) -> Any:
    """``encode_argument`` of a tuple of plain handles of ``graph`` (an LSTM state
    ``(h, c)``), without its recursion; None for any other tuple, unchanged ``inputs``.

    Same entry as ``encode_argument`` gives, so both share the call-signature cache.
    """
    specs = []
    for x in a:
        if (type(x) is not ResultHandle or x._graph is not graph
                or type(spec := x.spec) is not TensorSpec
                or (x._out is not None and not unchanged(x._out))):
            return None
        specs.append(spec)
    if not specs:
        return None
    node_depth = graph.node_depth
    deepest = depth[0]
    for x in a:
        inputs.append((x.node, x.leaf))
        d = node_depth[x.node]
        if d > deepest:
            deepest = d
    depth[0] = deepest
    return (tuple, tuple(specs))


def encode_argument(a: Any, graph: Graph, inputs: list[Ref], depth: list[int]) -> Any:
    """The signature entry for one argument; appends its tensor inputs to ``inputs``."""
    if type(a) is ResultHandle:
        if a._graph is not graph:
            foreign_handle(a, graph)
        if a._out is not None and not unchanged(a._out):
            # Its value was changed in place after it was handed out: the eager call
            # would read it as it is now (and not see later changes).
            return encode_argument(snapshot(a), graph, inputs, depth)
        spec = a.spec
        d = graph.node_depth[a.node]
        if d > depth[0]:
            depth[0] = d
        if type(spec) is TensorSpec:
            inputs.append((a.node, a.leaf))
            return spec
        if spec is None:  # structure unknown until it ran
            spec = computed_spec(graph, a)
            if spec is None:  # still unknown: pass the whole result
                inputs.append((a.node, -1))
                return None
            inputs.append((a.node, 0))
            return spec
        return ("handle-tuple", tuple(encode_argument(h, graph, inputs, depth) for h in a))
    if isinstance(a, torch.Tensor):
        node = graph.add_constant(a)
        inputs.append((node, 0))
        return graph.node_spec[node]
    if type(a) is list or type(a) is tuple:
        if any(type(x) is ResultHandle or isinstance(x, _NESTED) for x in a):
            return (type(a), tuple(encode_argument(x, graph, inputs, depth) for x in a))
    elif type(a) in _MAPS and _holds_tensors(a):
        # Taken apart like a list: the call gets a dict of the per-example (or
        # batched) tensors. Held by reference, it would reach the call with handles.
        return (type(a), tuple((static_value(k), encode_argument(v, graph, inputs, depth))
                               for k, v in a.items()))
    return static_value(a)


def computed_spec(graph: Graph, handle: ResultHandle) -> TensorSpec | None:
    """The spec of ``handle``'s result, whose structure was unknown when it was
    recorded, once it has run and turned out one tensor; None until then (or when it
    is another structure, or was released).

    The handle (and its node) then take that spec: calls recorded on it later know
    their inputs and batch with one another, where a call of unknown input runs one
    at a time (``batchgraph.rules.choose_key``). Its value is the store's column 0
    row, the very tensor the whole result is.

    Example:
        >>> import batchgraph as bg, torch
        >>> f = bg.batched_func(lambda x: x * float(x.sum()))  # a host read: unknown
        >>> with bg.BatchingPolicy() as p:
        ...     h = f(torch.ones(2))
        >>> h.spec is None, computed_spec(p.graph, h)
        (True, None)
        >>> _ = bg.compute(h)
        >>> computed_spec(p.graph, h).shape, h.spec is not None
        ((2,), True)
    """
    loc = graph.node_loc[handle.node]
    if loc < 0 or handle.leaf != 0:
        return None
    store = graph.stores[loc >> STORE_SHIFT]
    if len(store) < 2:  # released, or results holding no tensor
        return None
    row = loc & ROW_MASK
    whole, column = store[-1], store[0]
    if type(whole) is not list or type(column) is not list or not isinstance(
        whole[row], torch.Tensor
    ) or column[row] is not whole[row]:
        return None
    spec = cast(TensorSpec, intern_spec(TensorSpec.of(whole[row])))
    graph.node_spec[handle.node] = handle.spec = spec
    return spec


def in_place_error(
    fn: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> TypeError | RuntimeError | None:
    """The error for a call that would modify its input in place, or None.

    In place: a tensor method or function named with a trailing underscore (``add_``,
    ``torch.relu_``), ``inplace=True`` by keyword or position, a module built with it,
    or an ``out=`` tensor. A handle stands for a value other calls share, and batched calls run later in
    another order, so none of these can be recorded.
    """
    method = getattr(fn, "__name__", "")
    # A user's callable named or flagged so may mean anything by it: what it changes
    # is seen where it runs on fake tensors (inference._changes_its_input).
    own = torchs_own(fn)
    if method == "__setitem__" and args and isinstance(args[0], torch.Tensor):
        # `t[h] = v` or `t[i] = h` on a tensor: recorded, it returned None, which nothing
        # computed, so `t` stayed as it was (silently, where eagerly it changes).
        return RuntimeError(
            "t[index] = value with a recorded index or value would change the tensor t in "
            "place, but the recorded value is not known until computed: t, and every name "
            "bound to it, cannot be changed. Make a new value instead, e.g. "
            "t = t.index_put((index,), value) (out of place), or compute the handle first "
            "(in a coroutine example: await bg.value(h))."
        )
    if own and isinstance(method, str) and method.endswith("_") and not method.startswith("_"):
        if args and isinstance(args[0], torch.Tensor):
            # A tensor changed in place with a recorded value: `t.add_(h)`, and `t += h`
            # (Tensor.__iadd__ calls add_). Not a TypeError: __iadd__ turns that into
            # NotImplemented, and Python then quietly rebinds `t` to `t + h`, leaving
            # ``t`` and every other name bound to it unchanged, as they are not eagerly.
            return RuntimeError(
                f"{method} (or an augmented assignment such as `t += h`) would change "
                "a tensor in place with a recorded value, whose value is not known until "
                "computed: the tensor, and every name bound to it, cannot be changed. "
                f"Make a new value instead: {_out_of_place(method)}."
            )
        return TypeError(
            f"{method} modifies its tensor in place, which cannot be recorded: a handle "
            "stands for a value that other calls (and identical calls, which are merged) "
            "share, and batched calls run later in another order. Use the out-of-place "
            f"form and rebind the name: h = h.{method[:-1]}(...) or "
            f"torch.{method[:-1]}(h, ...)."
        )
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor) or (
        isinstance(out, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in out)
    ):
        short = method if isinstance(method, str) and method else name
        return TypeError(
            f"{short}(..., out=...) writes its result into a tensor given by the caller, "
            "which cannot be recorded: the call runs later, batched, and that tensor would "
            "never be written (eager code finds it filled). Use the returned value "
            f"instead: h = {short}(...) without out=."
        )
    if own and _inplace_flag(fn, args, kwargs):
        return TypeError(
            f"{name} modifies its input in place, which cannot be recorded: the input "
            "handle stands for a value that other calls share, and batched calls run "
            "later in another order. Use inplace=False (a batched call's input is a "
            "gathered batch, so in place saves nothing there)."
        )
    return None


def changes_input_in_place(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """Whether ``fn`` changes its first argument in place by its name or flag (a method
    or function named with a trailing underscore, ``inplace=True``, a module built with
    it), writing no ``out=`` tensor. For a callable not torch's own only a claim, which
    ``on_copy.returns_changed_input`` checks."""
    method = getattr(fn, "__name__", "")
    if "out" in kwargs or method == "__setitem__":
        return False
    if isinstance(method, str) and method.endswith("_") and not method.startswith("_"):
        return True
    return _inplace_flag(fn, args, kwargs)


def _inplace_flag(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if getattr(fn, "inplace", False) is True or kwargs.get("inplace") is True:
        return True
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):  # no signature (a builtin), or it does not bind
        return False
    return bound.arguments.get("inplace") is True


def static_value(a: Any) -> Any:
    """A static argument as it enters a call signature (and so the call's BatchKey).

    Numbers carry their type: ``2``, ``2.0`` and ``True`` are equal and hash alike, but
    ``h * 2`` and ``h * 2.0`` give different dtypes, so they must not share a cached
    signature, a key or a merged node (and a float zero its sign: ``exact_number``).
    Lists and tuples become tagged tuples of the same (a list is otherwise
    unhashable, and its call could not be cached), a slice a tagged tuple of its
    bounds (unhashable before Python 3.12); a NumPy array its dtype, shape and bytes,
    and a NumPy scalar its type, as a number does.
    """
    kind = type(a)
    if kind is float or kind is int or kind is bool or kind is complex:
        return (kind, exact_number(a))
    if kind is list or kind is tuple:
        return (kind, tuple(map(static_value, a)))
    if kind in _MAPS:  # by value, as a list (template_argument keeps a copy)
        return (kind, tuple((static_value(k), static_value(v)) for k, v in a.items()))
    if kind is slice:  # unhashable before Python 3.12: each call would key on its own
        return (slice, static_value(a.start), static_value(a.stop), static_value(a.step))
    if kind.__module__ == "numpy":
        if kind.__name__ == "ndarray":  # by value: held by reference, a change would reach it
            return ("ndarray", a.dtype.str, a.shape, a.tobytes())
        if getattr(a, "ndim", None) == 0:  # a NumPy scalar: np.float64(1.0) == np.int64(1)
            return (kind, exact_number(a.item()))
    return a


def _is_ndarray(a: Any) -> bool:
    kind = type(a)
    return kind.__name__ == "ndarray" and kind.__module__ == "numpy"


def template_argument(a: Any, specs: list[TensorSpec | None]) -> Any:
    """The argument with tensors replaced by InputSlots (same order as ``encode_argument``)."""
    if type(a) is ResultHandle:
        if type(a.spec) is TensorSpec or a.spec is None:
            specs.append(a.spec if type(a.spec) is TensorSpec else None)
            return InputSlot(len(specs) - 1)
        return make_seq(tuple, tuple(template_argument(h, specs) for h in a))
    if isinstance(a, torch.Tensor):
        specs.append(TensorSpec.of(a))
        return InputSlot(len(specs) - 1)
    if type(a) is list or type(a) is tuple:
        if any(type(x) is ResultHandle or isinstance(x, _NESTED) for x in a):
            return make_seq(type(a), tuple(template_argument(x, specs) for x in a))
    elif type(a) in _MAPS and _holds_tensors(a):
        return make_map(type(a), tuple(a), tuple(template_argument(v, specs) for v in a.values()))
    return _owned(a)


def _owned(a: Any) -> Any:
    """A static argument as the cached call keeps it: lists, dicts and arrays (also
    inside tuples) copied. The signature took them by value, and later calls with
    equal ones reuse this template: held by reference, a change the caller makes
    afterwards would reach every one of them."""
    kind = type(a)
    if kind is list:
        return [_owned(x) for x in a]
    if kind is tuple:
        return tuple(_owned(x) for x in a) if any(type(x) in _COPIED for x in a) else a
    if kind in _MAPS:
        return kind((k, _owned(v)) for k, v in a.items())
    if _is_ndarray(a):
        return a.copy()
    return a


def without_nan(sig: Any) -> Any:
    """``sig`` with each float NaN as ``exact_number`` gives it, or ``sig`` itself when
    it holds none. The recording fast path puts floats in a signature as they are, and
    a NaN (``float("nan")``, a new object each time) is unequal to itself: each call's
    signature missed the cache, was resolved on fake tensors and got a key of its own,
    so such calls never batched. Asked only on a cache miss."""
    if type(sig) is float:
        return exact_number(sig) if sig != sig else sig
    if type(sig) is tuple:
        parts = tuple([without_nan(s) for s in sig])
        return sig if all(a is b for a, b in zip(parts, sig)) else parts
    return sig


def identity_signature(sig: Any) -> Any:
    """``sig`` with unhashable parts replaced by their identity (such a call is not cached)."""
    if isinstance(sig, tuple):
        return tuple(identity_signature(s) for s in sig)
    try:
        hash(sig)
    except TypeError:
        return ("unhashable", id(sig))
    return sig


def foreign_handle(handle: ResultHandle, graph: Graph) -> NoReturn:
    """Raise the error for ``handle`` used in a call recorded into ``graph``."""
    if not handle._graph.open:
        raise PolicyClosedError(
            f"{handle!r} belongs to a BatchingPolicy whose `with` block has ended, so no new "
            "call can use it. Compute it first (bg.compute) and pass the tensor, or record "
            "everything inside one policy."
        )
    raise PolicyMismatchError(
        f"{handle!r} was recorded by policy {handle._graph.name!r} but is used in a call "
        f"recorded by policy {graph.name!r}; handles of two policies cannot be mixed. Record "
        "the whole computation under one BatchingPolicy."
    )


def _out_of_place(method: str) -> str:
    """The out-of-place form of ``t.method(h)``, to advise where the change of a
    tensor by a recorded value is refused (torch has no ``torch.copy``, say).

    Example:
        >>> _out_of_place("copy_")
        't = h.expand_as(t).to(t.dtype) (what t.copy_(h) makes)'
    """
    if method == "copy_":
        return "t = h.expand_as(t).to(t.dtype) (what t.copy_(h) makes)"
    name = method[:-1]
    if hasattr(torch, name):
        return f"t = t + h, or t = torch.{name}(t, ...)"
    return "t = t + h"
