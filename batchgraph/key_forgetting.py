"""Forgetting the key ids that no call can use any more.

Parameter versions are part of a key's identity (``Graph.key_id``), so every
optimizer step gives each module a new key id, and with it about a dozen notes
(``key_versions``, ``key_params``, ``key_grad``, ...). A training loop kept inside one
``with BatchingPolicy():`` block made one set per module per step, never dropped:
about 3 KB a module a step, for as long as the policy lived.

A key id is forgotten when nothing can reach it again:

* no node of it is live (not computed yet, or its value still held: the releaser's
  survivors), so no compute checks it and no call merges into one of its nodes;
* no call went through ``key_id`` for it since the last time ids were forgotten, so
  no call site's memo (valid for one graph stamp, and the releaser runs after each
  compute's new stamp) still names it;
* it is not a constant's key id, which the graph keeps per spec.

A forgotten key's identity is dropped from ``key_ids`` too: the same identity seen
again gets a new id (ids are never reused), noted afresh. ``graph.keys`` keeps its
slot (one reference to a shared key), so code reading the key of an old node still
finds it.

Example:
    >>> import batchgraph as bg, torch
    >>> lin = bg.batched_func(torch.nn.Linear(2, 2))
    >>> policy = bg.BatchingPolicy()
    >>> for _ in range(3):
    ...     with policy:
    ...         out = policy.compute(lin(torch.ones(2)))
    ...     with torch.no_grad():
    ...         _ = lin._bg_fn.weight.add_(1)  # a new key id at the next call
    >>> graph = policy.graph
    >>> len(graph.key_versions)
    3
    >>> forget_keys(graph, live_nodes=[])
    >>> forget_keys(graph, live_nodes=[])  # the ids used since the last time go now
    >>> len(graph.key_versions), len(graph.keys)
    (0, 4)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from batchgraph.graph import Graph

__all__ = ["forget_keys"]


def forget_keys(graph: Graph, live_nodes: Iterable[int]) -> None:
    """Drop the notes of every key id that ``live_nodes`` (the computed nodes whose
    values are still held) and the uncomputed nodes do not use, that was not used
    since the last call, and that is not a constant's."""
    node_key = graph.node_key
    keep = set(graph.keys_used)
    graph.keys_used.clear()
    keep.update(node_key[n] for n in live_nodes)
    keep.update(node_key[graph.first_uncomputed:])
    keep.update(graph._constant_kids.values())
    keep.update(graph._scalar_kids.values())
    forget = [kid for kid in graph.key_ids.values() if kid not in keep]
    if not forget:
        return
    gone = set(forget)
    for ident in [ident for ident, kid in graph.key_ids.items() if kid in gone]:
        del graph.key_ids[ident]
    graph.in_order.difference_update(gone)
    notes: tuple[dict[int, Any], ...] = (
        graph.key_grad, graph.key_autocast, graph.key_training, graph.key_versions,
        graph.key_layouts, graph.key_params, graph.key_buffers, graph.key_buffer_parts,
        graph.key_submodes, graph.key_hooks, graph.key_attrs, graph.key_reads_grad,
    )
    for table in notes:
        if table:
            for kid in forget:
                table.pop(kid, None)
