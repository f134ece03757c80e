"""Views recorded before the value they view was handed out.

``last = h[0:2]``, then ``y = bg.compute(h)``: eagerly ``last`` is a view of ``y``, so
an in-place change of ``y`` (``y += 1``, outside recording) reaches it. Batched,
``last`` is a pending call reading ``h``'s stored row, which ``y`` is a copy of.
(A view recorded *after* the hand-out is taken of ``y`` itself: ``view_of_handed``.)

Recording does not watch handed-out tensors (a check per recorded call would cost
every call), so this is settled once per compute, over the nodes it computes:

* such a view computed itself (``bg.compute(last)``) is handed out as the view of
  ``y`` taken now, as the eager ``last`` is (``rederive``);
* a call recorded before the hand-out that reads the view reads the value as it was,
  as eagerly (it ran before any change of ``y``);
* a call recorded after the hand-out that reads the view, where ``y``'s contents
  changed since: eagerly it read ``y`` before or after the change, which cannot be told
  apart here, so the compute is refused (``check``), naming what to write instead.

A hand-out is noted (``note_handed``) only while calls are pending (none can be such
a view otherwise), holding the value weakly: one dropped can no longer change.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_leaves

from batchgraph.aliasing import makes_view
from batchgraph.graph import INFERENCE, ROW_MASK, STORE_SHIFT
from batchgraph.handed_changes import keep_only
from batchgraph.handing_out import reading

if TYPE_CHECKING:
    from batchgraph.graph import Graph, Ref
    from batchgraph.handle import ResultHandle
    from batchgraph.passes import LiveGraph
    from batchgraph.specs import TensorSpec

__all__ = ["Handout", "check", "hand_out_views", "note_handed", "note_views_computed_with",
           "reads_changed_view", "rederive"]

# A value handed out for a node's output while calls were pending: the value (weakly),
# its version then (None: an inference tensor, which keeps none) and the number of
# nodes recorded then (the calls recorded before it). A tuple: one is made per value
# handed out while calls are pending (a coroutine step hands out one per example).
Handout = tuple[weakref.ref[torch.Tensor], int | None, int]

# A tracked view: the hand-outs of the value it views and that value's output.
_Tracked = tuple[tuple[Handout, ...], "Ref"]


def note_handed(graph: Graph, node: int, leaf: int, value: Any, version: Any,
                mark: int | None = None) -> None:
    """Note ``value``, handed out for output ``leaf`` of ``node``, where a pending call
    may be a view of it (the callers check that some call is pending); ``mark``: the
    calls recorded before this number read it as it is (all recorded so far unless
    given).

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy() as policy:
        ...     h = bg.batched_value(torch.ones(2)) * 1
        ...     last = h[0:1]
        ...     y = bg.compute(h)                  # last is still pending
        >>> [handout[0]() is y for handout in policy.graph.handed_views[(h.node, 0)]]
        [True]
    """
    if not isinstance(value, torch.Tensor):
        return
    mark = graph.handed_mark = len(graph.node_key) if mark is None else mark
    graph.handed_views.setdefault((node, leaf), []).append(
        (weakref.ref(value), version if type(version) is int else None, mark))


def reads_changed_view(graph: Graph, refs: tuple[Ref, ...], node: int) -> bool:
    """Whether a call reading ``refs``, identical to ``node`` (recorded before a
    hand-out), reads a pending view recorded before that hand-out of a value changed in
    place since: merged with ``node``, it would read the value as it was, where eagerly
    it reads the change (``s = h[:, 1]; s2 = s * 2``, ``y = bg.compute(h)``,
    ``y.add_(1)``, ``s * 2``); kept apart, ``check`` refuses it as it does where
    identical calls are not merged.

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy() as policy:
        ...     h = bg.batched_value(torch.ones(2, 2)) * 1
        ...     s = h[:, 1]
        ...     s2 = s * 2
        ...     y = bg.compute(h)
        ...     before = s * 2
        ...     _ = y.add_(1)
        ...     after = s * 2
        >>> before.node == s2.node, after.node == s2.node
        (True, False)
    """
    if not (graph.handed_views or graph.early_views):
        return False
    return any(_early_view_changed(graph, ref[0], node) for ref in refs)


def _early_view_changed(graph: Graph, n: int, node: int) -> bool:
    """Whether node ``n`` is a view (or a view of a view) of a value handed out after
    ``n`` and ``node`` were recorded, and that value changed in place since
    (``_changed``)."""
    table, loc, keys, node_key = graph.handed_views, graph.node_loc, graph.keys, graph.node_key
    todo, seen = [n], set()
    while todo:
        n = todo.pop()
        if (early := graph.early_views.get(n)) is not None:  # computed already
            if any(node < o[2] and _changed(graph, o, early[1]) for o in early[0]):
                return True
            continue
        if n in seen or n >= graph.handed_mark or loc[n] >= 0 or n in graph.constants:
            continue
        seen.add(n)
        key = keys[node_key[n]]
        if not makes_view(key.fn, key):
            continue
        for ref in graph.node_inputs[n]:
            if (loc[ref[0]] >= 0 or ref[0] in graph.constants) and any(
                    node < o[2] and _changed(graph, o, ref) for o in table.get(ref, ())):
                return True
            todo.append(ref[0])  # a view of a view
    return False


def check(graph: Graph, nodes: list[int]) -> dict[int, _Tracked]:
    """Of ``nodes`` (about to be computed, ascending), the views recorded before the
    value they view was handed out, with what they view (for ``rederive``).

    Raises:
        TypeError: where a call recorded after the hand-out reads such a view and the
            value was changed in place since (see the module docstring).
    """
    table, early = graph.handed_views, graph.early_views
    if not table and not early:
        return {}
    _forget_settled(graph)
    if not nodes or (not early and (not table or nodes[0] >= graph.handed_mark)):
        return {}
    loc, inputs, node_key, keys = graph.node_loc, graph.node_inputs, graph.node_key, graph.keys
    mark = graph.handed_mark
    tracked: dict[int, _Tracked] = {}
    for n in nodes:
        if n >= mark and not tracked and not early:
            break
        for ref in inputs[n]:
            src = ref[0]
            # One computed already (by an earlier compute) reads as a pending one.
            viewed = tracked.get(src) or early.get(src)
            if viewed is None:
                # A value as computed, or as it was when a view reading a handle not
                # computed yet was recorded (a constant: aliasing._record_pending_view).
                if n < mark and (loc[src] >= 0 or src in graph.constants) and (
                        outs := table.get(ref)):
                    before = tuple(o for o in outs if n < o[2])  # recorded before it
                    key = keys[node_key[n]]
                    if before and makes_view(key.fn, key) and _views_as_laid_out(
                            graph, n, tracked, (before, ref)):
                        tracked[n] = (before, ref)
                continue
            key = keys[node_key[n]]
            # A view of the view is a view of the value too; an operation that copies
            # the view as it is laid out (reshape of a transpose) reads it.
            if makes_view(key.fn, key) and _views_as_laid_out(
                    graph, n, {**early, **tracked} if early else tracked, viewed):
                tracked[n] = viewed
                continue
            handouts, base = viewed
            for handout in handouts:
                if n >= handout[2] and _changed(graph, handout, base):
                    _refuse(graph, n, src)
    return tracked


def rederive(graph: Graph, node: int, tracked: dict[int, _Tracked]) -> Any:
    """The value of ``node``, a view in ``tracked`` (``check``), taken as eagerly of the
    value handed out (every node it reads computed); None where that value is gone, or
    more than one handle of the node was handed out (identical calls merged) and none
    of their values changed (so the value as computed is each one's).

    Raises:
        TypeError: where several were handed out and one changed: which one the view
            is of is not kept.
    """
    handouts, base = tracked[node]
    alive = [value for h in handouts if (value := h[0]()) is not None]
    if len(alive) > 1 and any(_changed(graph, h, base) for h in handouts):
        raise TypeError(
            f"a view ({_label(graph, node)}, node {node}) of a value computed for several "
            "handles (identical calls, merged) and handed out to each, one of which was "
            "changed in place since: eagerly the view follows the one it was taken of, "
            "which is not kept. Take the view of the tensor handed out (y[0:2]), or keep "
            "identical calls apart (BatchingPolicy(dedupe=False))."
        )
    if len(alive) != 1:
        return None
    with reading(alive[0]):
        return _view(graph, node, tracked, base, alive[0])


def _view(graph: Graph, node: int, tracked: dict[int, _Tracked], base: Ref,
          value: torch.Tensor) -> Any:
    key = graph.keys[graph.node_key[node]]
    specs = key.call.input_specs
    args: list[Any] = []
    for i, ref in enumerate(graph.node_inputs[node]):
        if ref == base:
            args.append(value)
        elif ref[0] in tracked:
            args.append(_leaf(_view(graph, ref[0], tracked, base, value), ref[1]))
        else:
            args.append(_stored(graph, ref, specs[i] if i < len(specs) else None))
    if graph.key_grad.get(graph.node_key[node]) in (False, INFERENCE):
        # Taken, as recorded, under no_grad (or in inference mode, which the executor
        # runs without grad too): a view of a value that requires grad then requires
        # grad but has no history. Taken under the handing-out's grad mode, it had
        # some, and a gradient reached the value through it (x[i] with i a handle).
        with torch.no_grad():
            return key.call.apply(key.fn, args)
    return key.call.apply(key.fn, args)


def _views_as_laid_out(graph: Graph, node: int, tracked: dict[int, _Tracked],
                       viewed: _Tracked) -> bool:
    """Whether ``node``, a call that ``makes_view`` names (it runs it on contiguous
    fakes) on a value handed out or a tracked view of one, makes a view as its input
    is laid out: ``reshape``, ``flatten`` or ``contiguous`` of a transpose copy it,
    eagerly at the time of the call. Run once on the value handed out (a call whose
    other inputs are not computed yet gets zeros of their shape: the layout is what
    counts) where that value changed since; a view otherwise, which reads the same
    (``rederive`` copies as eagerly, of the value as it was)."""
    handouts, base = viewed
    if not any(_changed(graph, h, base) for h in handouts):
        return True
    value = next((v for h in handouts if (v := h[0]()) is not None), None)
    if value is None:
        return True
    try:
        with torch.no_grad():
            out = _view(graph, node, tracked, base, value)
    except Exception:  # not runnable so (the value reshaped in place): as recorded
        return True
    storage = value.untyped_storage()._cdata
    return any(isinstance(t, torch.Tensor) and t.untyped_storage()._cdata == storage
               for t in tree_leaves(out))


def _stored(graph: Graph, ref: Ref, spec: TensorSpec | None) -> Any:
    """The per-example value of ``ref``, computed (or a constant); zeros of ``spec``
    (its input spec) where it is not computed yet, for ``_views_as_laid_out``, where
    only the layout counts."""
    loc = graph.node_loc[ref[0]]
    if loc < 0:
        if ref[0] not in graph.constants and spec is not None:
            return torch.zeros((), dtype=spec.dtype, device=spec.device).expand(spec.shape)
        return graph.constants[ref[0]]
    return graph.stores[loc >> STORE_SHIFT][ref[1]][loc & ROW_MASK]


def _leaf(out: Any, leaf: int) -> Any:
    return out if isinstance(out, torch.Tensor) else tree_leaves(out)[leaf]


def hand_out_views(graph: Graph, handles: list[ResultHandle], tracked: dict[int, _Tracked]) -> None:
    """Hand the ``handles`` of ``tracked`` views (and of such views computed before,
    ``graph.early_views``) their eager values (``rederive``): views of the value handed
    out, following its later in-place changes as eagerly. The ``tracked`` ones, computed
    now, join ``graph.early_views``: a call recorded on one later reads its row, the
    value as it was."""
    if graph.early_views:
        tracked = {**graph.early_views, **tracked}
    _keep_computed(graph, tracked)
    values: dict[int, Any] = {}
    for h in handles:
        if h.node in tracked and h._out is None:
            if h.node not in values:
                values[h.node] = rederive(graph, h.node, tracked)
            if values[h.node] is not None:
                h.handed(_leaf(values[h.node], h.leaf))


def note_views_computed_with(graph: Graph, handles: list[ResultHandle], live: LiveGraph,
                             before: list[ResultHandle]) -> None:
    """Keep in ``graph.early_views`` the computed views (and views of those) of a value
    that ``handles`` were handed out now, not handed out themselves: views computed now
    (``live``'s consumers of the handles' nodes), and for the ``before`` ones (computed
    by an earlier compute), any computed since. Their rows are copies of the value as
    it was (``s = h[:, 1]`` computed for ``s * 2``, then
    ``y, _ = bg.compute([h, s * 2])``, ``y.add_(1)``): a call on one recorded after a
    change of the value is refused, and computing one gives the view of the value, as
    for views still pending at the hand-out.

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy() as policy:
        ...     h = bg.batched_value(torch.ones(2, 2)) * 1
        ...     s = h[:, 1]
        ...     y, _ = bg.compute([h, s * 2])
        ...     _ = y.add_(1)
        ...     bg.compute(s)
        tensor([2., 2.])
    """
    base, consumers, loc = live.base, live.consumers, graph.node_loc
    outs: dict[Ref, _Tracked] = {}
    readers: list[int] = []
    mark = len(graph.node_key)
    size, earlier = len(consumers), {id(h) for h in before}
    for h in handles:
        i = h.node - base
        users = consumers[i] if 0 <= i < size else None
        if users is None and (not earlier or id(h) not in earlier):
            continue  # no call computed now reads it (the usual case)
        out = h._out
        if out is not None and isinstance(out[0], torch.Tensor):
            version = out[1] if type(out[1]) is int else None
            outs[(h.node, h.leaf)] = (((weakref.ref(out[0]), version, mark),), (h.node, h.leaf))
            readers += users or [n for n in range(h.node + 1, mark) if loc[n] >= 0]
    if not outs:
        return
    handed = {h.node for h in handles}  # handed out themselves: copies (see README)
    inputs, node_key, keys = graph.node_inputs, graph.node_key, graph.keys
    found: dict[int, _Tracked] = {}
    todo = sorted(set(readers), reverse=True)
    while todo:
        n = todo.pop()  # lowest first: a view's inputs are settled before it
        if n in found or n in handed:
            continue
        key = keys[node_key[n]]
        if not makes_view(key.fn, key):
            continue
        viewed = next((v for ref in inputs[n]
                       if (v := outs.get(ref) or found.get(ref[0])) is not None), None)
        if viewed is not None:
            found[n] = viewed
            i = n - base
            more = consumers[i] if 0 <= i < len(consumers) else None
            todo = sorted(set(todo) | set(more or [m for m in range(n + 1, mark)
                                                   if loc[m] >= 0]), reverse=True)
    if found:
        _keep_computed(graph, found)


def _keep_computed(graph: Graph, tracked: dict[int, _Tracked]) -> None:
    """Keep ``tracked`` in ``graph.early_views``, less the views whose values handed out
    are all gone (they can no longer change), scanned once the table has doubled."""
    early = graph.early_views
    early.update(tracked)
    if len(early) >= 2 * graph.early_kept:
        loc, stores = graph.node_loc, graph.stores
        for n in [n for n, (outs, _) in early.items()
                  if all(o[0]() is None for o in outs)  # can change no more
                  or loc[n] < 0 or not stores[loc[n] >> STORE_SHIFT]]:  # released
            del early[n]
        graph.early_kept = max(len(early), 64)


def _changed(graph: Graph, handout: Handout, base: Ref) -> bool:
    """Whether the value handed out differs from the stored one it is a copy of (a
    version count alone would also count ``y += 0``); one dropped is taken as is."""
    ref, version, _ = handout
    value = ref()
    if value is None or (version is not None and value._version == version):
        return False
    loc = graph.node_loc[base[0]]
    if base[0] not in graph.constants and (loc < 0 or not graph.stores[loc >> STORE_SHIFT]):
        return True  # the stored one released: a new version is all there is to tell
    return not torch.equal(value, _stored(graph, base, None))


def _forget_settled(graph: Graph) -> None:
    """Drop the hand-outs no pending call can view any more: the value dropped, or every
    call recorded before it computed. All of them where every call is computed, else
    a scan once the table has doubled (not at every compute of a coroutine run whose
    examples left calls pending)."""
    table, first = graph.handed_views, graph.first_uncomputed
    if first >= graph.handed_mark:
        table.clear()
    elif len(table) >= 2 * graph.handed_kept:
        graph.handed_kept = keep_only(table, lambda o: o[2] > first and o[0]() is not None)


def _label(graph: Graph, node: int) -> str:
    fn = graph.keys[graph.node_key[node]].fn
    return getattr(fn, "__name__", None) or type(fn).__name__


def _refuse(graph: Graph, reader: int, view: int) -> None:
    raise TypeError(
        f"a call ({_label(graph, reader)}, node {reader}) reads a view "
        f"({_label(graph, view)}, node {view}) "
        "of a value handed out (by compute or an await) that was not taken of that "
        "value itself (recorded before the hand-out, or reading a handle not computed "
        "then), and the value was changed in place since: eagerly the view shares the "
        "value's memory, and the call read it before or after the change, which "
        "batchgraph cannot tell (it does not watch the tensors it handed out while "
        "recording). Take the view after the value is handed out and what else it "
        "reads is computed (last = h[0:2] after y = bg.compute(h), or y[0:2]), or "
        "compute the call before changing the value."
    )
