"""Graph passes run before scheduling: deduplication and pruning.

* ``deduplicate`` merges identical calls: same key and the same (deduplicated) inputs,
  or the same small constant. The same token embedded twice is computed once, and so
  is everything built only from it. Random calls (dropout) are never merged.
* ``prune`` keeps only the not-yet-computed nodes that the requested outputs need.

Both work on the flat arrays of ``Graph`` and keep state across calls, so a graph
that grows between ``compute`` calls (coroutines) is only processed incrementally.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from batchgraph.graph import Graph

__all__ = ["deduplicate", "prune"]

# Constants up to this many elements are merged by value; larger ones by identity.
_VALUE_DEDUPE_NUMEL = 16


def _constant_signature(kid: int, value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return (kid, value)
    if value.numel() <= _VALUE_DEDUPE_NUMEL and not value.requires_grad:
        return (kid, tuple(value.reshape(-1).tolist()))
    return (kid, "id", id(value))


def deduplicate(graph: Graph) -> int:
    """Merge identical calls recorded since the last run; returns how many merged.

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy() as p:
        ...     a = bg.batched_value(torch.tensor(3))
        ...     b = bg.batched_value(torch.tensor(3))
        >>> deduplicate(p.graph)
        1
    """
    canon = graph.canon
    inputs = graph.node_inputs
    node_key = graph.node_key
    keys = graph.keys
    table = graph.dedupe_table
    constants = graph.constants
    merged = 0
    deterministic = [k.deterministic for k in keys]
    for n in range(graph.deduped_upto, len(node_key)):
        kid = node_key[n]
        if not deterministic[kid]:
            continue
        value = constants.get(n)
        if value is not None:
            sig: Any = _constant_signature(kid, value)
        else:
            sig = (kid, tuple([(canon[s], leaf) for s, leaf in inputs[n]]))
        try:
            first = table.setdefault(sig, n)
        except TypeError:  # unhashable constant contents: keep the node as it is
            continue
        if first != n:
            canon[n] = first
            merged += 1
    graph.deduped_upto = len(node_key)
    return merged


def prune(graph: Graph, roots: Iterable[int]) -> list[int]:
    """The canonical, not-yet-computed nodes that ``roots`` need, in recording order."""
    canon = graph.canon
    store = graph.node_store
    inputs = graph.node_inputs
    seen = bytearray(len(canon))
    stack = []
    for r in roots:
        c = canon[r]
        if store[c] < 0 and not seen[c]:
            seen[c] = 1
            stack.append(c)
    live = []
    while stack:
        n = stack.pop()
        live.append(n)
        for s, _ in inputs[n]:
            c = canon[s]
            if not seen[c] and store[c] < 0:
                seen[c] = 1
                stack.append(c)
    live.sort()
    return live
