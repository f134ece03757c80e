"""Coroutine examples calling a forward that keeps state of its own, in eager order.

Calls of such a forward (``batchgraph.ordering``: a total carried from call to call)
run in the order they were recorded. An eager loop over coroutine examples runs
each example to its end before the next; ``bg.run_all`` runs a step of each in turn,
so where example 0 records such a call after example 1 did, the recorded order is
not the eager one, and example 1's call read a state without example 0's later
call: other values, silently. ``ExampleOrder`` notes which example recorded which
nodes, and at each batched step refuses such an interleaving: the examples involved
get the error, at their await (those finished already, as their result).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchgraph.errors import BatchgraphError

if TYPE_CHECKING:
    from batchgraph.graph import Graph
    from batchgraph.stepping import Example

__all__ = ["ExampleOrder"]


class ExampleOrder:
    """Per lane of ``run_all``: the nodes each example step recorded since the last
    batched step, and the examples that recorded calls keeping state, in order.

    Example:
        >>> import batchgraph as bg
        >>> order = ExampleOrder()
        >>> order.check(bg.BatchingPolicy().graph) is None  # no such calls recorded
        True
    """

    __slots__ = ("involved", "ranges")

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int, Example]] = []
        self.involved: list[Example] = []  # in the order their calls were recorded

    def note(self, ex: Example, start: int, end: int) -> None:
        """``ex``'s step recorded nodes ``start`` to ``end`` (excluded)."""
        if end > start:
            self.ranges.append((start, end, ex))

    def check(self, graph: Graph) -> BatchgraphError | None:
        """The error for the steps noted since the last check, where an example
        recorded a call keeping state after a later example did; else None."""
        ranges, self.ranges = self.ranges, []
        if not graph.in_order:
            return None
        in_order, node_key = graph.in_order, graph.node_key
        for start, end, ex in ranges:
            if not any(node_key[n] in in_order for n in range(start, end)):
                continue
            last = self.involved[-1] if self.involved else None
            if last is not None and ex.index < last.index:
                kid = next(node_key[n] for n in range(start, end) if node_key[n] in in_order)
                return BatchgraphError(
                    f"example {ex.index} called {graph.keys[kid].label} after example "
                    f"{last.index} did, and its forward keeps state of its own across "
                    "calls (an attribute it sets and reads back: a tensor, a count): "
                    f"eagerly example {ex.index} runs to its end before example "
                    f"{last.index} starts, so "
                    "their calls would read another state than eagerly. Keep the state "
                    "out of the module (pass it in and return it), or run such examples "
                    "one at a time (bg.run_all([example]) each)."
                )
            if last is not ex:
                self.involved.append(ex)
        return None
