"""Graph passes run before scheduling.

* Merging identical calls (same key and inputs, or the same small constant) happens
  as calls are recorded (hash-consing in ``CallSite.record`` and
  ``Graph.add_constant``): a repeated call returns the node that already exists, so
  the same token embedded twice — and everything built only from it — is computed
  once, and no later pass has to map aliases. Random calls (dropout) never merge.
  ``BatchingPolicy(dedupe=False)`` turns it off.
* ``prune`` keeps only the not-yet-computed nodes that the requested outputs need,
  and on the same walk counts each node's pending inputs and lists its consumers,
  which is what the schedulers need.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from batchgraph.graph import Graph

__all__ = ["LiveGraph", "prune"]


@dataclass
class LiveGraph:
    """The nodes to run, in recording order, with their dependency counts.

    ``pending[n]`` is how many of ``n``'s inputs are not computed yet (an input used
    twice counts twice); ``consumers[n]`` lists the live nodes using ``n`` (as often).
    """

    nodes: list[int]
    pending: dict[int, int]
    consumers: dict[int, list[int]]


def prune(graph: Graph, roots: Iterable[int]) -> LiveGraph:
    """The not-yet-computed nodes ``roots`` need, with their dependencies.

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy() as p:
        ...     used = bg.batched_value(torch.ones(2)) * 2
        ...     unused = bg.batched_value(torch.zeros(2)) + 1
        >>> len(prune(p.graph, [used.node]).nodes)   # the constant and the product
        2
    """
    store = graph.node_store
    inputs = graph.node_inputs
    seen = bytearray(len(store))
    stack = []
    for r in roots:
        if store[r] < 0 and not seen[r]:
            seen[r] = 1
            stack.append(r)
    pending: dict[int, int] = {}
    consumers: dict[int, list[int]] = {}
    while stack:
        n = stack.pop()
        waiting = 0
        for s, _ in inputs[n]:
            if store[s] < 0:
                waiting += 1
                users = consumers.get(s)
                if users is None:
                    consumers[s] = [n]
                else:
                    users.append(n)
                if not seen[s]:
                    seen[s] = 1
                    stack.append(s)
        pending[n] = waiting
    nodes = sorted(pending)
    return LiveGraph(nodes, pending, consumers)
