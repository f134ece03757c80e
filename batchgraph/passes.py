"""Graph passes run before scheduling.

* Merging identical calls (same key and inputs, or the same small constant) happens
  as calls are recorded (hash-consing in ``CallSite.__call__`` and
  ``Graph.add_constant``): a repeated call returns the node that already exists, so
  the same token embedded twice — and everything built only from it — is computed
  once, and no later pass has to map aliases. Random calls (dropout) never merge.
  ``BatchingPolicy(dedupe=False)`` turns it off.
* ``prune`` keeps only the not-yet-computed nodes that the requested outputs need,
  and on the same walk counts each node's pending inputs and lists its consumers,
  which is what the schedulers need. Calls of a forward keeping state of its own
  wait for the one recorded before them (``batchgraph.ordering``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from batchgraph import ordering
from batchgraph.graph import Graph

__all__ = ["LiveGraph", "prune"]


@dataclass
class LiveGraph:
    """The nodes to run, in recording order, with their dependency counts.

    Indexed by node id less ``base`` (every live node is at least ``base``: the
    graph's first uncomputed node): ``pending[n - base]`` is how many of ``n``'s inputs
    are not computed yet (an input used twice counts twice); ``consumers[n - base]``
    lists the live nodes that use ``n`` (as often), or is None. The window keeps a
    coroutine run's steps from paying for every node recorded before them.
    """

    nodes: list[int]
    pending: list[int]
    consumers: list[list[int] | None]
    base: int = 0


def prune(graph: Graph, roots: Iterable[int]) -> LiveGraph:
    """The not-yet-computed nodes ``roots`` need, with their dependencies.

    Node ids are a topological order, so one sweep from the highest root down marks
    everything needed and, on the way, counts each needed node's pending inputs and
    lists its consumers: one linear pass over flat arrays, no per-node objects.

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy() as p:
        ...     used = bg.batched_value(torch.ones(2)) * 2
        ...     unused = bg.batched_value(torch.zeros(2)) + 1
        >>> prune(p.graph, [used.node]).nodes   # the constant and the product
        [0, 1]
    """
    roots = list(roots)
    if graph.in_order:  # calls keeping state of their own: see ordering
        roots += ordering.earlier_calls(graph, roots)
        live = _prune(graph, roots)
        ordering.chain(graph, live)
        return live
    return _prune(graph, roots)


def _prune(graph: Graph, roots: list[int]) -> LiveGraph:
    if not graph.stores:
        everything = _everything_needed(graph, roots)
        if everything is not None:
            return everything
    loc = graph.node_loc
    inputs = graph.node_inputs
    # Nodes below the graph's first uncomputed one are all computed: the arrays cover
    # only the nodes from there on (indexed by node - floor).
    floor = graph.first_uncomputed
    top = -1
    for r in roots:
        if loc[r] < 0 and r > top:
            top = r
    size = max(0, top + 1 - floor)
    needed = bytearray(size)
    for r in roots:
        if loc[r] < 0:
            needed[r - floor] = 1
    pending = [0] * size
    consumers: list[list[int] | None] = [None] * size
    for i in range(size - 1, -1, -1):
        if needed[i]:
            n = i + floor
            waiting = 0
            for s, _ in inputs[n]:
                if loc[s] < 0:  # uncomputed, so at least floor
                    waiting += 1
                    j = s - floor
                    needed[j] = 1
                    users = consumers[j]
                    if users is None:
                        consumers[j] = [n]
                    else:
                        users.append(n)
            pending[i] = waiting
    if needed.count(1) == size:  # the usual case: everything recorded is needed
        nodes = list(range(floor, top + 1))
    else:
        nodes = [i + floor for i in range(size) if needed[i]]
    return LiveGraph(nodes, pending, consumers, floor)


def _everything_needed(graph: Graph, roots: list[int]) -> LiveGraph | None:
    """The first compute's usual case: nothing computed yet and every node needed.

    Then each node waits for all of its inputs, and one forward sweep lists the
    consumers, with no reachability marks. Following consumers from any node ends
    at a node without consumers (a sink), so every node is needed exactly when every
    sink is requested; otherwise (None) ``prune`` walks from the roots.
    """
    inputs = graph.node_inputs
    size = len(inputs)
    consumers: list[list[int] | None] = [None] * size
    for n, sources in enumerate(inputs):
        for s, _ in sources:
            users = consumers[s]
            if users is None:
                consumers[s] = [n]
            else:
                users.append(n)
    requested_sinks = sum(1 for r in set(roots) if consumers[r] is None)
    if consumers.count(None) != requested_sinks:
        return None
    return LiveGraph(list(range(size)), list(map(len, inputs)), consumers)
