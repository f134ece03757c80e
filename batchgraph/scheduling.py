"""Scheduling: which nodes run together, in what order, and how inputs are gathered.

Two schedulers order the live nodes into *steps* (one batched call each):

* ``agenda`` (default): repeatedly run, among keys that have ready nodes, the key whose
  nodes have the smallest mean depth (computed once per key over the live nodes);
  keys that cannot batch go first. Running all ready nodes of the key that lies
  earliest on average leaves the deeper keys to accumulate more ready nodes.
* ``depth``: one step per (depth, key), in order of depth (for comparison).

A ``Schedule`` is plain data (ints and lists), so it pickles and can be built in
another process. Besides the order, each step carries its *gather plans*: for every
group of same-spec input positions, where each row comes from (a slice or rows of an
earlier step's output) and the permutation that puts them in node order. The executor
turns a plan into at most one ``index_select`` per source, one ``cat`` and one final
``index_select``.

``launch_lower_bound`` is the bound from DESIGN.md: for each batchable key, the most
nodes of that key on one dependency path, summed, plus one per unbatchable node.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from batchgraph.graph import Graph
from batchgraph.keys import BatchKey, ConstantKey
from batchgraph.passes import LiveGraph

__all__ = [
    "GatherPlan",
    "Schedule",
    "Step",
    "agenda_order",
    "build_schedule",
    "depth_order",
    "launch_lower_bound",
]

# rows: a range (a slice of the source) or an explicit list of rows.
Part = tuple[int, int, Any]  # (store id, leaf, rows)


@dataclass
class GatherPlan:
    """Gather the inputs at ``positions`` (same per-example spec) in one go.

    The gathered tensor holds ``len(positions) * B`` rows, position by position, each
    in node order: ``cat(part rows)[perm]`` (no ``perm`` when already in order).
    """

    positions: list[int]
    parts: list[Part]
    perm: list[int] | None


@dataclass
class Step:
    """One batched call: ``key`` run on ``nodes``; its outputs become store ``store``."""

    key: int
    nodes: list[int]
    store: int
    gathers: list[GatherPlan] = field(default_factory=list)
    # For "list" keys: per input position, the (store, leaf, row) of each node's input.
    refs: list[list[tuple[int, int, int]]] = field(default_factory=list)


@dataclass
class Schedule:
    """A whole run: steps in order, and where each requested value ends up."""

    steps: list[Step]
    base_store: int
    scheduler: str


def agenda_order(graph: Graph, live: LiveGraph) -> list[tuple[int, list[int]]]:
    """Order ``live`` nodes into steps by the agenda rule (see module docstring)."""
    node_key = graph.node_key
    node_depth = graph.node_depth
    keys = graph.keys
    pending = dict(live.pending)  # consumed as steps are taken
    consumers = live.consumers
    depth_sum: dict[int, float] = defaultdict(float)
    count: dict[int, int] = defaultdict(int)
    ready: dict[int, list[int]] = defaultdict(list)
    for n in live.nodes:
        k = node_key[n]
        depth_sum[k] += node_depth[n]
        count[k] += 1
        if not pending[n]:
            ready[k].append(n)
    # Unbatchable keys sort before everything (priority -1); the rest by mean depth.
    priority = {
        k: (depth_sum[k] / count[k] if keys[k].batchable else -1.0, k) for k in count
    }
    heap = [priority[k] for k in ready]
    heapq.heapify(heap)
    queued = set(ready)
    steps: list[tuple[int, list[int]]] = []
    while heap:
        _, k = heapq.heappop(heap)
        queued.discard(k)
        nodes = ready.pop(k)
        steps.append((k, nodes))
        for n in nodes:
            for c in consumers.get(n, ()):
                left = pending[c] - 1
                pending[c] = left
                if not left:
                    kc = node_key[c]
                    ready[kc].append(c)
                    if kc not in queued:
                        queued.add(kc)
                        heapq.heappush(heap, priority[kc])
    return steps


def depth_order(graph: Graph, live: LiveGraph) -> list[tuple[int, list[int]]]:
    """One step per (depth, key), by increasing depth; unbatchable keys first."""
    node_key = graph.node_key
    node_depth = graph.node_depth
    keys = graph.keys
    groups: dict[tuple[int, int, int], list[int]] = defaultdict(list)
    for n in live.nodes:
        k = node_key[n]
        groups[(node_depth[n], 0 if not keys[k].batchable else 1, k)].append(n)
    return [(k, groups[(d, b, k)]) for d, b, k in sorted(groups)]


SCHEDULERS = {"agenda": agenda_order, "depth": depth_order}


def build_schedule(graph: Graph, live: LiveGraph, scheduler: str = "agenda") -> Schedule:
    """Order ``live`` nodes with ``scheduler`` and plan every step's gathers.

    Raises:
        ValueError: for an unknown scheduler name.
    """
    order_fn = SCHEDULERS.get(scheduler)
    if order_fn is None:
        raise ValueError(f"unknown scheduler {scheduler!r}; choose one of {sorted(SCHEDULERS)}")
    order = order_fn(graph, live)
    base = len(graph.stores)
    # Locations are planned on copies: the graph only changes once execution succeeds.
    loc_store = graph.node_store[:]
    loc_row = graph.node_row[:]
    steps = []
    for i, (k, nodes) in enumerate(order):
        sid = base + i
        step = Step(k, nodes, sid)
        key = graph.keys[k]
        if not isinstance(key, ConstantKey) and graph.node_inputs[nodes[0]]:
            _plan_inputs(graph, key, step, loc_store, loc_row)
        for row, n in enumerate(nodes):
            loc_store[n] = sid
            loc_row[n] = row
        steps.append(step)
    return Schedule(steps, base, scheduler)


def _plan_inputs(
    graph: Graph, key: BatchKey, step: Step, loc_store: list[int], loc_row: list[int]
) -> None:
    inputs = graph.node_inputs
    nodes = step.nodes
    num = len(inputs[nodes[0]])
    if key.combine != "stack":
        for p in range(num):
            refs = [inputs[n][p] for n in nodes]
            step.refs.append([(loc_store[s], leaf, loc_row[s]) for s, leaf in refs])
        return
    for positions in _position_groups(key, num):
        sources: list[int] = []
        leaves: list[int] = []
        for p in positions:
            column = [inputs[n][p] for n in nodes]
            sources.extend([s for s, _ in column])
            leaves.extend([leaf for _, leaf in column])
        stores = [loc_store[c] for c in sources]
        rows = [loc_row[c] for c in sources]
        step.gathers.append(_plan_gather(positions, stores, leaves, rows))


def _position_groups(key: BatchKey, num: int) -> list[list[int]]:
    """Input positions grouped by per-example spec (cached on the key)."""
    groups: list[list[int]] | None = getattr(key, "_position_groups", None)
    if groups is None:
        by_spec: dict[Any, list[int]] = {}
        for p, spec in enumerate(key.call.input_specs[:num]):
            by_spec.setdefault(spec, []).append(p)
        groups = list(by_spec.values())
        key._position_groups = groups  # type: ignore[attr-defined]
    return groups


def _plan_gather(
    positions: list[int], stores: list[int], leaves: list[int], rows: list[int]
) -> GatherPlan:
    first = (stores[0], leaves[0])
    if all(s == first[0] for s in stores) and all(lf == first[1] for lf in leaves):
        lo = rows[0]
        if rows == list(range(lo, lo + len(rows))):
            return GatherPlan(positions, [(first[0], first[1], range(lo, lo + len(rows)))], None)
        return GatherPlan(positions, [(first[0], first[1], rows)], None)
    # Several sources: per source, its needed rows (sorted, unique); then one
    # permutation back to node order.
    by_source: dict[tuple[int, int], set[int]] = defaultdict(set)
    for s, lf, r in zip(stores, leaves, rows):
        by_source[(s, lf)].add(r)
    parts: list[Part] = []
    offset: dict[tuple[int, int, int], int] = {}
    total = 0
    for (s, lf), wanted in sorted(by_source.items()):
        ordered = sorted(wanted)
        lo = ordered[0]
        if ordered[-1] - lo + 1 == len(ordered):
            parts.append((s, lf, range(lo, lo + len(ordered))))
        else:
            parts.append((s, lf, ordered))
        for j, r in enumerate(ordered):
            offset[(s, lf, r)] = total + j
        total += len(ordered)
    perm = [offset[t] for t in zip(stores, leaves, rows)]
    if perm == list(range(len(perm))) and total == len(perm):
        return GatherPlan(positions, parts, None)
    return GatherPlan(positions, parts, perm)


def launch_lower_bound(graph: Graph, live: Sequence[int]) -> int:
    """Lower bound on launches for the ``live`` nodes (see the module docstring)."""
    node_key = graph.node_key
    inputs = graph.node_inputs
    keys = graph.keys
    unbatched = 0
    call_keys = set()
    for n in live:
        k = node_key[n]
        if isinstance(keys[k], ConstantKey):
            continue
        if keys[k].batchable:
            call_keys.add(k)
        else:
            unbatched += 1
    total = unbatched
    live_set = set(live)
    for k in call_keys:
        longest: dict[int, int] = {}
        best = 0
        for n in live:
            m = 0
            for s, _ in inputs[n]:
                if s in live_set:
                    v = longest[s]
                    if v > m:
                        m = v
            if node_key[n] == k:
                m += 1
            longest[n] = m
            if m > best:
                best = m
        total += best
    return total
