"""Which recorded values share memory eagerly: views (``x[0]``, ``x.view(...)``,
``x.t()``) and calls that return their input itself (``x.contiguous()``).

Batched values never share memory across handles, so changing one in place cannot
reach the others as it would eagerly. ``h += g`` (``ResultHandle.__iadd__``, and the
in-place calls of ``batchgraph.on_copy``) makes ``h`` stand for the new value, which
is exact for ``h``; the values sharing memory with it eagerly (its views, what it is
a view of: ``alias_group``) keep the old one. They are noted as changed
(``Graph.changed``), and a compute that reads one afterwards, or hands one out, is
refused (``check_changed``): ``y[0] = y[0] + v`` and ``y += y[0]`` work, as the
view is read before the change, while ``row = y[0]; y += 1; row * 2`` is refused.
Changing a view itself (``row += 1``, and so ``y[0] += v``) is refused where it is
recorded: eagerly it changes the value it views, which lives on.

Asked only at such a change, so whether a call makes a view is worked out then, by
running it once on fake tensors, and kept on its key.

A view of a value already handed out (``y = bg.compute(h)``, then ``h[0]``) is taken
eagerly of ``y`` itself (``view_of_handed``): eagerly it is a view of ``y``, and it
must follow ``y``'s later in-place changes, which happen outside recording. Views
that could not be taken so (recorded before the hand-out, or reading a handle not
computed yet) are settled at compute: ``batchgraph.handed_views``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import FunctionType
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
)
from torch.utils._pytree import tree_leaves, tree_map

if TYPE_CHECKING:
    from batchgraph.graph import Graph
    from batchgraph.keys import BatchKey

__all__ = [
    "NOT_VIEWED", "alias_group", "check_changed", "holds_handed", "known_view", "makes_view",
    "note_change", "unmerge_viewed", "view_of", "view_of_handed",
]

# Modules of the functions recorded in place of tensor operations (h.T, as_strided).
_OUR_TENSOR_OPERATIONS = frozenset({"batchgraph.attribute_reads", "batchgraph.strided"})

# What view_of_handed returns where it cannot take the view eagerly.
NOT_VIEWED: Any = object()


def view_of(graph: Graph, node: int) -> str | None:
    """The call that made ``node``'s value a view of (or the same tensor as) one of its
    inputs, named; None where it is no view.

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy() as policy:
        ...     h = bg.batched_value(torch.ones(2, 2)) * 1
        ...     row = h[0]
        >>> view_of(policy.graph, row.node), view_of(policy.graph, h.node)
        ('getitem', None)
    """
    key = graph.keys[graph.node_key[node]]
    return _label(key) if graph.node_inputs[node] and _aliases(key) else None


def alias_group(graph: Graph, node: int) -> set[int]:
    """The nodes whose values share memory eagerly with ``node``'s, ``node`` included
    (views of it, what it is a view of, and theirs in turn); empty where none do.

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy() as policy:
        ...     h = bg.batched_value(torch.ones(2, 2)) * 1
        ...     row, total = h[0], h.sum()
        >>> sorted(alias_group(policy.graph, row.node)) == sorted([h.node, row.node])
        True
    """
    keys, node_key, inputs = graph.keys, graph.node_key, graph.node_inputs
    group, stack = {node}, [node]
    while stack:  # what it views, and what that views: the inputs of view calls
        n = stack.pop()
        if inputs[n] and _aliases(keys[node_key[n]]):
            for src, _ in inputs[n]:
                if src not in group:
                    group.add(src)
                    stack.append(src)
    # Views of any of them, and views of those: recorded after what they view, so one
    # pass in recording order from the oldest finds them all (for a handle with no
    # views, a pass over the calls recorded after it).
    for n in range(min(group) + 1, len(node_key)):
        if (n not in group and inputs[n] and any(src in group for src, _ in inputs[n])
                and _aliases(keys[node_key[n]])):
            group.add(n)
    return group if len(group) > 1 else set()


def known_view(graph: Graph, node: int) -> bool:
    """Whether ``node``'s call is a view of (or returns) one of its inputs, as far as
    can be told without running the user's code: whether a call is a view is worked
    out by running it once (``_aliases``), which is done here only for torch's own
    operations; the user's functions and modules may have effects (a hook keeping its
    outputs), and are taken for no view unless known already.

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy() as policy:
        ...     h = bg.batched_value(torch.ones(2, 2)) * 1
        ...     row = h[0]
        >>> known_view(policy.graph, row.node), known_view(policy.graph, h.node)
        (True, False)
    """
    key = graph.keys[graph.node_key[node]]
    known: bool | None = getattr(key, "_known_view", None)
    if known is None:
        known = (getattr(key, "_aliases", None) is not None or _tensor_operation(key.fn)) and (
            _aliases(key))
        # Kept on the key: asked at every hand-out (callers check ``_known_view`` first).
        with contextlib.suppress(AttributeError):
            key._known_view = known  # type: ignore[attr-defined]
    return known


def unmerge_viewed(graph: Graph, node: int) -> None:
    """Note that ``node``'s value was handed out: where it is a view, identical calls
    recorded from now on no longer merge with the values it views.

    Eagerly such a call makes a tensor of its own, no view of which the caller holds;
    merged, it would share the handed-out view's alias group, and changing it in place
    would be refused for the view (``c = y.clone(); r = c.reshape(-1)``, ``r`` handed
    out, then ``z = y.clone(); z.add_(x)``: z merged into c's node).

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy():
        ...     y = bg.batched_value(torch.zeros(2, 2))
        ...     c = y.clone()
        ...     row = bg.compute(c[0])  # a view of c's value, handed out
        ...     z = y.clone()
        ...     _ = z.add_(1.0)
        ...     bg.compute(z).sum().item()
        4.0
    """
    node_key, inputs, table = graph.node_key, graph.node_inputs, graph.dedupe_table
    stack = [node]
    while stack:  # up through view calls, as alias_group's first half
        n = stack.pop()
        if inputs[n] and known_view(graph, n):
            for src, _ in inputs[n]:
                signature = (node_key[src], inputs[src])
                if inputs[src] and table.get(signature) == src:
                    del table[signature]
                stack.append(src)


def note_change(graph: Graph, group: set[int], changed: int, how: str) -> None:
    """Note that node ``changed`` was changed in place (by ``how``), and with it, from
    now on, the other nodes of its ``alias_group``: calls recorded afterwards must not
    read those, nor merge with calls made before that read any node of the group.

    ``changed`` itself is not noted: its handle now stands for the new value, and
    another handle of that node is an identical call merged with it (hash-consing),
    eagerly a tensor of its own, which did not change."""
    after = len(graph.node_key)
    for n in group:
        if n != changed:
            graph.changed.setdefault(n, (after, how))
    # An identical call recorded later would be merged with one recorded before the
    # change (and read the old value): such calls are not merged any more.
    table = graph.dedupe_table
    for signature in [sig for sig, n in table.items() if _reads_any(sig, group)]:
        del table[signature]


def _reads_any(signature: object, nodes: set[int]) -> bool:
    refs = signature[1] if isinstance(signature, tuple) and len(signature) == 2 else ()
    return isinstance(refs, tuple) and any(
        isinstance(r, tuple) and len(r) == 2 and r[0] in nodes for r in refs)


def check_changed(graph: Graph, roots: list[int]) -> None:
    """Refuse to compute ``roots`` where they are, or read after the change, a value
    changed in place through a value sharing its memory (see the module docstring).

    Raises:
        TypeError: naming the change and what to write instead.
    """
    changed = graph.changed
    inputs = graph.node_inputs
    seen: set[int] = set()
    stack = list(roots)
    for root in roots:
        if root in changed:
            _refuse(graph, root, None)
    while stack:
        n = stack.pop()
        if n in seen or graph.node_loc[n] >= 0:
            continue
        seen.add(n)
        for src, _ in inputs[n]:
            mark = changed.get(src)
            if mark is not None and n >= mark[0]:
                _refuse(graph, src, n)
            stack.append(src)


def _refuse(graph: Graph, node: int, reader: int | None) -> None:
    _, how = graph.changed[node]
    what = (f"a call recorded after that ({_label(graph.keys[graph.node_key[reader]])}) "
            "reads it" if reader is not None else "it is asked for")
    raise TypeError(
        f"a value (node {node}) shares memory eagerly with a value changed in place by "
        f"{how} after it was recorded, and {what}: eagerly it has changed too, which "
        "batched values cannot follow (they never share memory). Take the view after "
        "the change, or make a new value instead of changing one in place "
        "(h = h + other)."
    )


def makes_view(fn: Callable[..., Any], key: BatchKey) -> bool:
    """Whether ``fn``, a tensor operation (not a module or the user's own function,
    which are recorded as calls even where they return an input), makes a view of
    one of its inputs (or returns one of them) in ``key``'s calls.

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy() as policy:
        ...     h = bg.batched_value(torch.ones(2, 2)) * 1
        ...     row, total = h[0], h.sum()
        >>> key = lambda x: policy.graph.keys[policy.graph.node_key[x.node]]
        >>> makes_view(torch.Tensor.__getitem__, key(row)), makes_view(torch.sum, key(total))
        (True, False)
    """
    return _tensor_operation(fn) and _aliases(key)


def _tensor_operation(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is torch's (or stands for torch's): not a module, nor the user's
    own function."""
    if isinstance(fn, torch.nn.Module):
        return False
    return type(fn) is not FunctionType or (
        (fn.__module__ or "").startswith("torch") or fn.__module__ in _OUR_TENSOR_OPERATIONS)


def view_of_handed(site: Callable[..., Any], fn: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
    """Record ``fn(*args, **kwargs)`` through ``site``, a view of a handed-out value
    (``makes_view``), with the view taken eagerly too, of the values the handles stand
    for, as the value of its handles; where another handle has no value yet, recorded
    on the values as they are and noted for the next compute (``_record_pending_view``);
    ``NOT_VIEWED`` where the call fails eagerly.

    Eagerly the view shares memory with the value: an in-place change of the value
    (outside recording, where batchgraph does not see it) reaches the view. So the
    handles are as handed out (``ResultHandle.handed``): calls recorded on them read
    the recorded view (the value as it was then) until the value changes, and a copy
    of the view as it is now afterwards; computing one gives the view itself.

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy():
        ...     h = bg.batched_func(torch.tanh)(torch.zeros(2, 2))
        ...     y = bg.compute(h)
        ...     row = h[0]
        ...     y += 1
        ...     bg.compute(row * 2)
        tensor([2., 2.])
    """
    from batchgraph.handle import ResultHandle

    missing = False

    def value(a: Any) -> Any:
        nonlocal missing
        if type(a) is ResultHandle:
            out = a._out
            if out is None:
                missing = True
                return a
            return out[0]
        return a

    real_args, real_kwargs = tree_map(value, (args, kwargs))
    if missing:
        # Another handle has no value yet (h.expand_as(g), g pending): recorded as any
        # call, noted as a view of the handed-out values, checked at compute
        # (batchgraph.handed_views: computing it takes the view of y then).
        return _record_pending_view(site, args, kwargs)
    try:
        views = fn(*real_args, **real_kwargs)
    except Exception:
        # It fails eagerly (an index out of range): recorded as any call, it fails at
        # compute with the eager error (BatchedCallError), as calls do.
        return NOT_VIEWED
    plain_args, plain_kwargs = tree_map(_not_handed, (args, kwargs))
    recorded = _apart_from_early_views(site, args, plain_args, plain_kwargs)
    for handle, view in zip(tree_leaves(recorded), tree_leaves(views), strict=True):
        if type(handle) is ResultHandle and isinstance(view, torch.Tensor):
            handle.handed(view)
    return recorded


def _apart_from_early_views(site: Callable[..., Any], args: tuple[Any, ...],
                            plain_args: Any, plain_kwargs: Any) -> Any:
    """Record the view through ``site``, kept apart from an identical view recorded
    before its value was handed out (``last = h[0]``, ``y = bg.compute(h)``, ``h[0]``):
    merged, the calls on this one, read as eagerly, could not be told from those on
    the early one, which ``handed_views.check`` refuses where the value changed."""
    from batchgraph.handle import ResultHandle

    handles = [a for a in tree_leaves(args) if type(a) is ResultHandle]
    graph = handles[0]._graph if handles else None
    if graph is None or not graph.handed_views or not graph.dedupe or not any(
            (h.node, h.leaf) in graph.handed_views for h in handles):
        return site(*plain_args, **plain_kwargs)
    graph.dedupe = False
    try:
        return site(*plain_args, **plain_kwargs)
    finally:
        graph.dedupe = True


def holds_handed(args: tuple[Any, ...]) -> bool:
    """Whether a handle in ``args`` (in lists and tuples too) stands for a value
    handed out.

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy():
        ...     h = bg.batched_value(torch.ones(2)) * 1
        ...     before = holds_handed(([h],))
        ...     _ = bg.compute(h)
        >>> before, holds_handed(([h],))
        (False, True)
    """
    from batchgraph.handle import ResultHandle

    return any(type(a) is ResultHandle and a._out is not None for a in tree_leaves(args))


def _record_pending_view(site: Callable[..., Any], args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> Any:
    """Record a view of handed-out values that also reads a handle not computed yet,
    on those values as they are now (``_not_handed``), noting the values themselves
    (``handed_views.note_handed``): computing the view takes it of them then."""
    from batchgraph.handed_views import note_handed
    from batchgraph.handle import ResultHandle

    noted: list[tuple[ResultHandle, torch.Tensor]] = []

    def plain(a: Any) -> Any:
        out = _not_handed(a)
        if out is not a and isinstance(a._out[0], torch.Tensor):
            noted.append((out, a._out[0]))
        return out

    plain_args, plain_kwargs = tree_map(plain, (args, kwargs))
    for handle, value in noted:
        graph = handle._graph
        version = None if value.is_inference() else value._version
        note_handed(graph, handle.node, handle.leaf, value, version, len(graph.node_key) + 1)
    return site(*plain_args, **plain_kwargs)


def _not_handed(a: Any) -> Any:
    """A handle standing for the value ``a``'s value has now, recorded as not handed
    out: ``a``'s node where the value is as computed, else a copy of it now."""
    from batchgraph.functional import batched_value  # it imports the recording side
    from batchgraph.handle import ResultHandle, snapshot, unchanged

    if type(a) is not ResultHandle or a._out is None:
        return a
    if unchanged(a._out):
        return ResultHandle(a._graph, a.node, a.leaf, a.spec)
    copy = batched_value(snapshot(a))
    copy._out = None  # a copy no one else holds: it cannot change
    return copy


def _aliases(key: BatchKey) -> bool:
    """Whether an output of ``key``'s calls shares memory with one of their inputs."""
    known: bool | None = getattr(key, "_aliases", None)
    if known is None:
        known = _run_and_see(key)
        # A key class with __slots__ cannot keep it: asked again next time.
        with contextlib.suppress(AttributeError):
            key._aliases = known  # type: ignore[attr-defined]
    return known


def _run_and_see(key: BatchKey) -> bool:
    call = getattr(key, "call", None)
    if call is None or any(s is None for s in call.input_specs):
        return False  # inputs of unknown structure: cannot be run on fakes
    from batchgraph.inference import on_fake_tensors  # it imports much of the package
    from batchgraph.module_state import state_kept

    try:
        with state_kept(key.fn), on_fake_tensors():
            return _shares_input(call, key.fn, [torch.empty(s.shape, dtype=s.dtype, device=s.device)
                                       for s in call.input_specs])
    except (DataDependentOutputException, DynamicOutputShapeException):
        pass
    except Exception:  # not runnable on fakes: as before, not a view
        return False
    # Whether it is a view depends on values fakes lack (x[i], i a 0-d integer tensor,
    # is x.select(0, i), a view): run once on real zeros, one element each expanded to
    # its shape, so the inputs take no memory. Only torch's own deterministic
    # operations: the user's code may have effects (a counter, random draws).
    if not (_tensor_operation(key.fn) and key.deterministic):
        return False
    try:
        with torch.no_grad():
            return _shares_input(call, key.fn, [
                torch.zeros((), dtype=s.dtype, device=s.device).expand(s.shape)
                for s in call.input_specs])
    except Exception:  # fails on zeros: as before, not a view
        return False


def _shares_input(call: Any, fn: Callable[..., Any], inputs: list[torch.Tensor]) -> bool:
    """Whether ``call`` (a key's CallSignature) of ``fn`` on ``inputs`` returns a tensor
    sharing memory with one of them."""
    out = call.apply(fn, inputs)
    storages = {t.untyped_storage()._cdata for t in inputs}
    return any(isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in storages
               for t in tree_leaves(out))


def _label(key: BatchKey) -> str:
    fn = key.fn
    return getattr(fn, "__name__", None) or type(fn).__name__
