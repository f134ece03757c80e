"""Reusing schedules: a structure seen before is not scheduled again.

A schedule depends only on the graph's *structure*: which key each node has (the
callable, its static arguments and per-example shapes), how nodes are wired (each
input's source node and output leaf), which nodes are requested, and the scheduler.
It does not depend on the constants' values (token ids), so two batches of different
sentences with the same shapes and wiring share one schedule, node ids, store ids and
gather plans included.

The signature is that structure itself (tuples of the graph's flat arrays), so a hit
is exact, never a hash collision. Building it costs one pass over the node arrays,
much less than scheduling (agenda ordering plus gather planning).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from batchgraph.graph import Graph
from batchgraph.scheduling import Schedule

__all__ = ["ScheduleCache"]


class ScheduleCache:
    """A bounded LRU map from graph structure to ``Schedule``.

    Args:
        max_entries: how many structures to keep (least recently used go first).

    Attributes:
        hits, misses: lookups that found / did not find a schedule.

    Example:
        >>> cache = ScheduleCache(max_entries=64)
        >>> cache.hits, cache.misses, cache.hit_rate
        (0, 0, 0.0)
    """

    def __init__(self, max_entries: int = 256) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        # A plain dict in use order (a hit is popped and re-inserted): comparing a
        # signature costs a pass over the graph, so each hit compares once.
        self._entries: dict[Hashable, Schedule] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def hit_rate(self) -> float:
        """Hits over lookups (0.0 before the first lookup)."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @staticmethod
    def signature(graph: Graph, roots: Sequence[int], scheduler: str) -> Hashable:
        """The structure a schedule of ``roots`` in ``graph`` depends on.

        Keys compare by callable and signature (``BatchKey.__eq__``); key ids follow
        first use, so equal structures number their keys alike.

        Raises:
            ValueError: if the graph has computed nodes (their locations would matter).
        """
        if graph.stores:
            raise ValueError("schedules are cached for graphs with nothing computed yet")
        node_key, root_ids = tuple(graph.node_key), tuple(roots)
        parts = (scheduler, tuple(graph.keys), node_key, tuple(graph.node_inputs), root_ids)
        return _Signature(parts, hash((scheduler, node_key, root_ids)))

    def lookup(self, signature: Hashable) -> Schedule | None:
        """The schedule stored for ``signature``, counting a hit or a miss."""
        schedule = self._entries.pop(signature, None)
        if schedule is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries[signature] = schedule  # now the most recently used
        return schedule

    def store(self, signature: Hashable, schedule: Schedule) -> None:
        """Remember ``schedule`` for ``signature`` (evicting the oldest if full)."""
        self._entries.pop(signature, None)
        self._entries[signature] = schedule
        while len(self._entries) > self.max_entries:
            del self._entries[next(iter(self._entries))]  # the least recently used


class _Signature:
    """A graph's structure, hashed once and cheaply.

    ``signature`` hashes the scheduler, the key id of every node and the roots (ints:
    a C loop), not the per-node input tuples, whose hashing would cost about a
    millisecond per batch, a miss included (a tuple's hash is not cached). Equality
    compares every part, so a collision only costs a comparison.
    """

    __slots__ = ("_hash", "parts")

    def __init__(self, parts: tuple[Any, ...], hashed: int) -> None:
        self.parts = parts
        self._hash = hashed

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is _Signature and other._hash == self._hash and other.parts == self.parts
        )
