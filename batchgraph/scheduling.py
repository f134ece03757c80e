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
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from batchgraph.graph import LEAF_SHIFT, ROW_MASK, STORE_SHIFT, Graph
from batchgraph.keys import BatchKey, ConstantKey
from batchgraph.passes import LiveGraph

__all__ = [
    "GatherPlan",
    "Schedule",
    "ScheduleStats",
    "Step",
    "agenda_order",
    "build_schedule",
    "depth_order",
    "launch_lower_bound",
]

LEAF_MASK = (1 << (STORE_SHIFT - LEAF_SHIFT)) - 1

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
class ScheduleStats:
    """What one ``compute`` did.

    Attributes:
        nodes: calls computed (constants and merged duplicates not counted).
        launches: batched calls made; a call that cannot batch counts once per example.
        lower_bound: the launch lower bound (see ``launch_lower_bound``); computed on
            first access (it costs a pass per key), and before pickling.
        mean_batch_size: calls per batched launch.
        merged: identical calls merged by deduplication.
        unbatched_calls: calls that ran one at a time, and ``unbatched_callables`` names them.
        record_seconds: time from entering the policy (or the last compute) to this compute.
        schedule_seconds: passes plus scheduling; ``execute_seconds``: running the steps.
    """

    nodes: int
    launches: int
    mean_batch_size: float
    merged: int
    unbatched_calls: int
    unbatched_callables: tuple[str, ...]
    record_seconds: float
    schedule_seconds: float
    execute_seconds: float
    scheduler: str
    calls_recorded: int = field(default=0)
    # What the lazy lower bound needs: the graph and the live nodes (dropped once used).
    _bound_source: tuple[Graph, list[int]] | None = field(default=None, repr=False)
    _lower_bound: int | None = field(default=None, repr=False)

    @property
    def lower_bound(self) -> int:
        if self._lower_bound is None:
            assert self._bound_source is not None
            self._lower_bound = launch_lower_bound(*self._bound_source)
            self._bound_source = None
        return self._lower_bound

    def __getstate__(self) -> dict[str, Any]:
        _ = self.lower_bound  # resolve it: the graph does not travel
        return {k: v for k, v in self.__dict__.items() if k != "_bound_source"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._bound_source = None


@dataclass
class Schedule:
    """A whole run: its steps in order. ``stats`` is filled in once it has run."""

    steps: list[Step]
    base_store: int
    scheduler: str
    stats: ScheduleStats | None = None


def agenda_order(graph: Graph, live: LiveGraph) -> list[tuple[int, list[int]]]:
    """Order ``live`` nodes into steps by the agenda rule (see module docstring)."""
    node_key = graph.node_key
    node_depth = graph.node_depth
    keys = graph.keys
    pending = live.pending[:]  # consumed as steps are taken
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
            users = consumers[n]
            if users is None:
                continue
            for c in users:
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
    # Locations are planned on a copy: the graph only changes once execution succeeds.
    loc = graph.node_loc[:]
    keys = graph.keys
    inputs = graph.node_inputs
    # Rows per store (earlier computes' stores, then this schedule's steps); -1 for
    # stores of per-example lists, which may be ragged and are never taken whole.
    sizes = [-1 if not store or type(store[0]) is list else len(store[0]) for store in graph.stores]
    steps = []
    for i, (k, nodes) in enumerate(order):
        sid = base + i
        step = Step(k, nodes, sid)
        key = keys[k]
        sizes.append(len(nodes) if key.combine == "stack" else -1)
        if inputs[nodes[0]] and not isinstance(key, ConstantKey):
            _plan_inputs(graph, key, step, loc, sizes)
        code = sid << STORE_SHIFT
        for row, n in enumerate(nodes):
            loc[n] = code | row
        steps.append(step)
    return Schedule(steps, base, scheduler)


def _plan_inputs(
    graph: Graph, key: BatchKey, step: Step, loc: list[int], sizes: list[int]
) -> None:
    inputs = graph.node_inputs
    nodes = step.nodes
    num = len(inputs[nodes[0]])
    if key.combine != "stack":
        for p in range(num):
            column = [inputs[n][p] for n in nodes]
            step.refs.append(
                [(loc[s] >> STORE_SHIFT, leaf, loc[s] & ROW_MASK) for s, leaf in column]
            )
        return
    # One transposition (in C) gives each input position's column of (source, leaf).
    columns = list(zip(*map(inputs.__getitem__, nodes)))
    for positions in _position_groups(key, num):
        codes: list[int] = []
        for p in positions:
            codes.extend([loc[s] | (leaf << LEAF_SHIFT) for s, leaf in columns[p]])
        step.gathers.append(_plan_gather(positions, codes, sizes))


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


def _plan_gather(positions: list[int], codes: list[int], sizes: list[int]) -> GatherPlan:
    """Plan one gather from location codes (store, leaf, row packed in one int).

    Sorting the distinct codes groups them by (store, leaf) and orders rows within
    each group. Each group becomes one part: a slice when its rows are contiguous;
    the whole source (a free view; the permutation picks rows) when it uses at least
    half of it; else an ``index_select`` of its rows. A permutation restores the
    requested order unless it already holds.
    """
    distinct = sorted(set(codes))
    parts: list[Part] = []
    where: dict[int, int] = {}
    offset = 0
    start = 0
    total = len(distinct)
    exact = True  # parts hold exactly the distinct codes, in order
    while start < total:
        column = distinct[start] >> LEAF_SHIFT
        stop = bisect_left(distinct, (column + 1) << LEAF_SHIFT, start)
        first = distinct[start] & ROW_MASK
        last = distinct[stop - 1] & ROW_MASK
        store, leaf = column >> (STORE_SHIFT - LEAF_SHIFT), column & LEAF_MASK
        used = stop - start
        group = distinct[start:stop]
        if last - first + 1 == used:  # distinct and sorted: contiguous
            parts.append((store, leaf, range(first, last + 1)))
            where.update(zip(group, range(offset, offset + used)))
            offset += used
        elif sizes[store] > 0 and 2 * used >= sizes[store]:
            parts.append((store, leaf, range(0, sizes[store])))
            where.update(zip(group, [offset + (c & ROW_MASK) for c in group]))
            offset += sizes[store]
            exact = False
        else:
            parts.append((store, leaf, [c & ROW_MASK for c in group]))
            where.update(zip(group, range(offset, offset + used)))
            offset += used
        start = stop
    if exact and codes == distinct:
        return GatherPlan(positions, parts, None)
    return GatherPlan(positions, parts, list(map(where.__getitem__, codes)))


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
