"""Scheduling: which nodes run together, in what order, and how inputs are gathered.

Two schedulers order the live nodes into *steps* (one batched call each):

* ``agenda`` (default): repeatedly run, among keys that have ready nodes, the key whose
  nodes have the smallest mean depth (computed once per key over the live nodes);
  keys that cannot batch go first. Running all ready nodes of the key that lies
  earliest on average leaves the deeper keys to accumulate more ready nodes.
* ``depth``: one step per (depth, key), in order of depth (for comparison).

A ``Schedule`` is plain data (ints and lists), so it pickles and can be built in
another process. Besides the order, each step carries its *gather plans*
(``batchgraph.gathering``): for every group of same-spec input positions, which
sources to concatenate and the one ``index_select`` that puts their rows in node
order, with the rows later steps still need carried along in a per-spec pool.

``launch_lower_bound`` is the bound from DESIGN.md: for each batchable key, the most
nodes of that key on one dependency path, summed, plus one per unbatchable node.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, cast

from batchgraph import ordering
from batchgraph.gathering import GatherPlan, GatherPlanner, record_uses
from batchgraph.graph import LEAF_SHIFT, ROW_MASK, STORE_SHIFT, Graph
from batchgraph.keys import BatchKey, ConstantKey
from batchgraph.passes import LiveGraph
from batchgraph.specs import OutSpec, TensorSpec, spec_leaves

__all__ = [
    "GatherPlan",
    "Schedule",
    "ScheduleStats",
    "Step",
    "agenda_order",
    "build_schedule",
    "depth_order",
    "launch_lower_bound",
    "leaf_specs",
]


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
    # Every node's location once the steps have run, as planned: (graph uid, list).
    # The executor adopts the list instead of setting each location again; it stays
    # in this process (not pickled) and is used once.
    planned_loc: tuple[int, list[int]] | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "planned_loc"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.planned_loc = None


def agenda_order(graph: Graph, live: LiveGraph) -> list[tuple[int, list[int]]]:
    """Order ``live`` nodes into steps by the agenda rule (see module docstring)."""
    node_key = graph.node_key
    node_depth = graph.node_depth
    keys = graph.keys
    pending = live.pending[:]  # consumed as steps are taken
    consumers = live.consumers
    base = live.base  # both are indexed by node - base
    # Per key id (small ints): lists beat dicts here, this runs once per node.
    depth_sum = [0] * len(keys)
    count = [0] * len(keys)
    # ready[k]: the ready nodes of key k, or None when k is not on the heap.
    ready: list[list[int] | None] = [None] * len(keys)
    for n in live.nodes:
        k = node_key[n]
        depth_sum[k] += node_depth[n]
        count[k] += 1
        if not pending[n - base]:
            waiting = ready[k]
            if waiting is None:
                ready[k] = [n]
            else:
                waiting.append(n)
    # Unbatchable keys sort before everything (priority -1); the rest by mean depth.
    priority = [
        (depth_sum[k] / c if keys[k].batchable else -1.0, k) if c else (0.0, k)
        for k, c in enumerate(count)
    ]
    heap = [priority[k] for k, waiting in enumerate(ready) if waiting is not None]
    heapq.heapify(heap)
    steps: list[tuple[int, list[int]]] = []
    while heap:
        _, k = heapq.heappop(heap)
        nodes = cast(list[int], ready[k])
        ready[k] = None
        steps.append((k, nodes))
        for n in nodes:
            users = consumers[n - base]
            if users is None:
                continue
            for c in users:
                j = c - base
                left = pending[j] - 1
                pending[j] = left
                if not left:
                    kc = node_key[c]
                    waiting = ready[kc]
                    if waiting is None:
                        ready[kc] = [c]
                        heapq.heappush(heap, priority[kc])
                    else:
                        waiting.append(c)
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
    if graph.in_order:
        ordering.check(graph, order)
    # Locations are planned first, all of them: the planner needs each value's last
    # use. The graph's own locations only change once execution succeeds, so:
    if graph.first_uncomputed == 0:
        # the first compute plans on a copy, which the executor then adopts (every
        # node is new, so copying costs about what setting each location would);
        loc = graph.node_loc[:]
        in_place = False
    else:
        # later ones (a coroutine run's steps) plan in place and set the live nodes
        # back afterwards: a copy would cost every node recorded before them.
        loc = graph.node_loc
        in_place = True
    setloc = loc.__setitem__
    try:
        return _plan(graph, order, loc, scheduler, in_place)
    finally:
        if in_place:
            for _, nodes in order:
                deque(map(setloc, nodes, repeat(-1)), maxlen=0)


def _plan(
    graph: Graph, order: list[tuple[int, list[int]]], loc: list[int], scheduler: str,
    in_place: bool,
) -> Schedule:
    """The steps of ``order`` with their gather plans (``loc``: the locations to plan on)."""
    base = len(graph.stores)
    keys = graph.keys
    inputs = graph.node_inputs
    # Rows per store (earlier computes' stores, then this schedule's steps).
    sizes = _store_sizes(graph)
    setloc = loc.__setitem__
    for i, (k, nodes) in enumerate(order):
        sizes.append(len(nodes) if keys[k].combine == "stack" else -1)
        code = (base + i) << STORE_SHIFT
        deque(map(setloc, nodes, range(code, code + len(nodes))), maxlen=0)  # loc[n] = code | row
    steps: list[Step] = []
    requests: list[list[tuple[list[int], list[int], Any]]] = []
    last_use: dict[int, int] = {}
    pools: dict[TensorSpec, int] = {}
    for i, (k, nodes) in enumerate(order):
        step = Step(k, nodes, base + i)
        steps.append(step)
        key = keys[k]
        wanted: list[tuple[list[int], list[int], Any]] = []
        if inputs[nodes[0]] and not isinstance(key, ConstantKey):
            if key.combine == "stack":
                wanted = _requests(graph, key, nodes, loc)
                for _, codes, spec in wanted:
                    record_uses(last_use, codes, i)
                    pools.setdefault(spec, len(pools))
            else:
                step.refs = _refs(graph, nodes, loc)
        requests.append(wanted)
    planner = GatherPlanner(sizes, last_use, pools)
    for i, step in enumerate(steps):
        for positions, codes, spec in requests[i]:
            step.gathers.append(planner.gather(i, positions, codes, spec))
        key = keys[step.key]
        if key.combine == "stack":
            planner.produced(step.store, leaf_specs(key, graph.node_spec[step.nodes[0]]))
    del sizes[base:]  # this schedule's: the next compute reads them off its stores
    return Schedule(steps, base, scheduler,
                    planned_loc=None if in_place else (graph.uid, loc))


def _store_sizes(graph: Graph) -> list[int]:
    """Rows of each of ``graph``'s stores (-1 for per-example lists): the graph's own list.

    Stores of per-example lists may be ragged and are never taken whole. A coroutine
    run computes the same graph once per step, so the sizes of the stores already seen
    are kept on the graph: each compute looks only at the stores added since.
    """
    stores = graph.stores
    known = graph.store_sizes
    del known[len(stores) :]  # stores of a failed run are dropped again
    for store in stores[len(known) :]:
        known.append(-1 if not store or type(store[0]) is list else len(store[0]))
    # Not a copy: a long-lived policy has made many stores, and copying them all at
    # every compute cost time growing with the run. _plan appends this schedule's
    # sizes and takes them off again.
    return known


def _requests(
    graph: Graph, key: BatchKey, nodes: list[int], loc: list[int]
) -> list[tuple[list[int], list[int], Any]]:
    """Per group of same-spec input positions: the positions, the value codes, the spec."""
    num = len(graph.node_inputs[nodes[0]])
    # One transposition (in C) gives each input position's column of (source, leaf).
    columns = list(zip(*map(graph.node_inputs.__getitem__, nodes)))
    specs = key.call.input_specs
    out = []
    for positions in _position_groups(key, num):
        codes: list[int] = []
        for p in positions:
            codes.extend([loc[s] | (leaf << LEAF_SHIFT) for s, leaf in columns[p]])
        out.append((positions, codes, specs[positions[0]]))
    return out


def _refs(graph: Graph, nodes: list[int], loc: list[int]) -> list[list[tuple[int, int, int]]]:
    """For "list" keys: per input position, the (store, leaf, row) of each node's input."""
    inputs = graph.node_inputs
    refs = []
    for p in range(len(inputs[nodes[0]])):
        column = [inputs[n][p] for n in nodes]
        refs.append([(loc[s] >> STORE_SHIFT, leaf, loc[s] & ROW_MASK) for s, leaf in column])
    return refs


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


def leaf_specs(key: BatchKey, spec: OutSpec) -> list[OutSpec]:
    """The spec of each output leaf of ``key``'s calls (cached on the key): ``spec``,
    the output spec of any of them, flattened."""
    leaves: list[OutSpec] | None = getattr(key, "_leaf_specs", None)
    if leaves is None:
        leaves = spec_leaves(spec)
        key._leaf_specs = leaves  # type: ignore[attr-defined]
    return leaves


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
