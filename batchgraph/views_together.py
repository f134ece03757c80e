"""Views handed out by the same compute as the value they view.

``y, s = bg.compute((h, h[:, 1]))``: eagerly ``s`` is a view of ``y``, so changing
``y`` in place (``y.add_(1)``, outside recording) changes ``s`` too, and the other way
round. Computed, both are rows of stored batches, and each would be handed out as a
copy of its own, sharing no memory: ``s`` would miss the change, silently. So such a
view is handed out as the view of ``y`` taken now, by running its recorded view calls
on ``y`` (``handed_views.rederive``), as for views recorded before a hand-out.

Only torch's own view operations are followed (what ``aliasing`` can tell without
running the user's code), from a value with one handle: where identical calls were
merged into its node (``Graph.shared``), which of them the view was taken of is not
kept, and each handle keeps a copy of its own (see the README).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch.utils._pytree import tree_leaves

from batchgraph.aliasing import known_view
from batchgraph.handed_views import Handout, rederive
from batchgraph.specs import TensorSpec

if TYPE_CHECKING:
    from batchgraph.graph import Graph, Ref
    from batchgraph.handle import ResultHandle

__all__ = ["hand_out_together"]


def hand_out_together(graph: Graph, fresh: list[ResultHandle]) -> None:
    """Hand each of ``fresh`` (handles this compute hands out, none handed out before)
    that is a view of another one's value the view of that value's hand-out.

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy():
        ...     h = bg.batched_value(torch.zeros(2, 2)) * 1
        ...     y, s = bg.compute((h, h[:, 1]))
        >>> _ = y.add_(1)
        >>> s
        tensor([1., 1.])
    """
    if len(fresh) < 2:
        return
    # Most values handed out are no views (a module's output): one check per key.
    node_key, inputs = graph.node_key, graph.node_inputs
    view_kids: dict[int, bool] = {}
    views = []
    for h in fresh:
        kid = node_key[h.node]
        is_view = view_kids.get(kid)
        if is_view is None:
            is_view = view_kids[kid] = bool(inputs[h.node]) and known_view(graph, h.node)
        if is_view:
            views.append(h)
    if not views:
        return
    bases: dict[Ref, ResultHandle | None] = {}
    for h in fresh:
        if type(h.spec) is TensorSpec:
            ref = (h.node, h.leaf)
            # Two handles of one value: identical calls merged (which one a view was
            # taken of is not kept).
            bases[ref] = h if bases.get(ref, h) is h else None
    for h in sorted(views, key=lambda h: h.node):  # a view after what it views
        if h._out is not None or type(h.spec) is not TensorSpec:  # (listed twice)
            continue
        found = _viewed_handle(graph, h.node, h.leaf, bases)
        if found is None:
            continue
        base, chain = found
        value = base.value
        if not isinstance(value, torch.Tensor):
            continue
        handout: tuple[Handout, ...] = ((
            weakref.ref(value), None if value.is_inference() else value._version,
            len(graph.node_key)),)
        tracked = {n: (handout, (base.node, base.leaf)) for n in chain}
        view = rederive(graph, h.node, tracked)
        if view is None:
            continue
        view = view if isinstance(view, torch.Tensor) else tree_leaves(view)[h.leaf]
        # A view of another input (a guess of which input an output views that missed)
        # is a view of that input's stored row: handed out, a change of it would reach
        # the store, which later calls read. It stays a copy of its own.
        if view.untyped_storage()._cdata == value.untyped_storage()._cdata:
            h.handed(view)


def _viewed_handle(graph: Graph, node: int, leaf: int,
                   bases: dict[Ref, ResultHandle | None],
                   ) -> tuple[ResultHandle, list[int]] | None:
    """The handle whose value output ``leaf`` of ``node`` is a view of (through torch's
    view calls), and the view calls from it; None where there is none, or its value has
    several handles. A call of several inputs and outputs views input ``leaf`` with
    output ``leaf`` (``torch.broadcast_tensors(a, h)[1]`` views ``h``; the caller checks
    that guess), else its first input (``h.unbind()[2]`` views ``h``)."""
    inputs, chain = graph.node_inputs, []
    n = node
    while inputs[n] and known_view(graph, n):
        chain.append(n)
        ref = inputs[n][leaf if leaf < len(inputs[n]) else 0]
        if ref in bases:
            base = bases[ref]
            if base is None or ref[0] in graph.shared:
                return None
            return base, chain
        n, leaf = ref
    return None
