"""Calls of a forward keeping state of its own run in the order they were recorded.

A forward that keeps a tensor made from its input and reads it back in a later call
(a total carried from call to call, ``self.total = self.total + x.sum(0)``; a
reference taken from the first call, ``if self.ref is None: self.ref = x``) gives
each call a value that depends on the calls before it. Such calls cannot run batched
(``vmap_probe``: they run one at a time), and they must also run in the order eager
code runs them: the scheduler ran the calls of one signature (a length) before those
of another recorded earlier, and a call's total missed the earlier calls', silently.

Their keys are marked ``in_order`` where they are resolved (``recording``), and a
compute then (only where a graph holds such keys):

* computes, with the values asked for, every such call recorded before them (eagerly
  they have run by then: a later compute would run them after the later calls), and
* makes each such call wait for the one recorded before it, so the agenda scheduler
  runs them one after another in recorded order (``chain``); the ``depth``
  scheduler, which orders by depth alone, is refused where it would reorder them
  (``check``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from batchgraph.errors import BatchgraphError

if TYPE_CHECKING:
    from batchgraph.graph import Graph
    from batchgraph.passes import LiveGraph

__all__ = ["chain", "check", "earlier_calls"]


def earlier_calls(graph: Graph, roots: Sequence[int]) -> list[int]:
    """The uncomputed calls of ``in_order`` keys recorded before the last of
    ``roots``: computed with them, as eagerly they ran before."""
    if not roots:
        return []
    in_order, node_key, loc = graph.in_order, graph.node_key, graph.node_loc
    return [n for n in range(graph.first_uncomputed, max(roots))
            if node_key[n] in in_order and loc[n] < 0]


def chain(graph: Graph, live: LiveGraph) -> None:
    """Make each live call of an ``in_order`` key wait for the one recorded before
    it (node ids are the recorded order, and a topological one: no cycle)."""
    in_order, node_key, base = graph.in_order, graph.node_key, live.base
    last = -1
    for n in live.nodes:
        if node_key[n] in in_order:
            if last >= 0:
                users = live.consumers[last - base]
                if users is None:
                    live.consumers[last - base] = [n]
                else:
                    users.append(n)
                live.pending[n - base] += 1
            last = n


def check(graph: Graph, steps: Sequence[tuple[int, list[int]]]) -> None:
    """Refuse an order of ``steps`` running calls of ``in_order`` keys out of the
    order they were recorded in."""
    last = -1
    for k, nodes in steps:
        if k in graph.in_order:
            for n in nodes:
                if n < last:
                    raise BatchgraphError(
                        f"calls of {graph.keys[k].label} keep state of their own across "
                        "calls (an attribute the forward sets and reads back: a tensor, a "
                        "count), so they must run in the order they were recorded, and this "
                        "scheduler orders them by depth. Compute with the default "
                        "scheduler (BatchingPolicy(scheduler='agenda'))."
                    )
                last = n
