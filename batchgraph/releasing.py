"""Releasing a policy's dead values as it computes again and again.

Every policy computes its graph as often as its user asks: a coroutine run
(``run_all``, ``AsyncBatcher``) once per step, thousands of times, and a training
loop kept in one ``with BatchingPolicy():`` block once per batch. Every compute adds
its batched outputs to the graph's stores. Kept to the end, a decoder's run would
hold every step's logits, and a training loop every batch's activations: memory
growing with steps, and on a GPU an out-of-memory error long before the run ends.
Each policy therefore owns a ``StoreReleaser`` (``policy.releaser``) and steps it at
the end of every compute.

A computed value can be needed later in two ways only:

* a live handle stands for it (its example may await it or record from it), or
* a recorded node that is not computed yet takes it as an input.

Handles are grouped in *generations*: every handle recorded between two computes
holds the same ``Generation`` object, which the graph itself references only weakly.
When all handles of a generation are gone (reference counting frees them as soon as
the examples rebind their variables), so is the ``Generation``, and its values are
needed only if an uncomputed node reads them. After each compute,
``StoreReleaser.step`` drops the stores that nothing needs; the autograd graph keeps
what a backward pass needs on its own.

Merged calls and constants: an identical call recorded in a later step is merged with
the earlier node (the same token embedded again costs nothing) while that node's
value is still held; the later generation then keeps it alive too (``revived``). A
merge with a value already released records the call anew instead.

Example:
    >>> import batchgraph as bg, torch
    >>> policy = bg.BatchingPolicy()
    >>> with policy:
    ...     h = bg.batched_func(torch.tanh)(torch.zeros(2))
    >>> _ = policy.compute(h)              # steps policy.releaser at its end
    >>> policy.graph.stores[0] != []       # h still stands for it
    True
    >>> del h; policy.releaser.step()
    >>> policy.graph.stores[0]
    []
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from batchgraph.eager_grad import eager_requires_grad
from batchgraph.graph import STORE_SHIFT, Graph
from batchgraph.key_forgetting import forget_keys

__all__ = ["Generation", "StoreReleaser"]

# What is noted for merging (table entries and shared nodes) may grow by this
# much (and double) before released nodes are forgotten: a scan over all of it, so
# not at every step. 0 forgets at every step (for tests).
FORGET_SLACK = 4096

# Every released store is this one empty list (a new one each took 56 bytes a store
# for as long as the policy lived). Stores are never changed in place, only replaced.
_RELEASED: list[Any] = []


class Generation:
    """Held by every handle recorded between two computes; see the module docstring."""

    __slots__ = ("__weakref__",)


class _Closed:
    """A generation that stopped recording: its nodes, the stores of the older nodes it
    revived (and those of them not computed yet), the first store its own nodes can
    be in and, once all are computed, every store it needs."""

    __slots__ = ("alive", "first", "first_store", "pending", "revived", "stop", "stores")

    def __init__(self, alive: weakref.ref[Generation], first: int, stop: int,
                 first_store: int, revived: set[int], pending: list[int]) -> None:
        self.alive = alive
        self.first = first
        self.stop = stop
        self.first_store = first_store
        self.revived = revived
        self.pending = pending
        self.stores: set[int] | None = None


class StoreReleaser:
    """Tracks the handle generations of ``graph`` and frees the stores nothing needs.

    ``BatchingPolicy`` makes one per graph and calls ``step()`` at the end of each
    compute (one releaser per graph: each opens the generations its handles hold).
    A step closes the generation recorded before that compute and releases the
    stores of the generations whose handles are all gone.

    Attributes:
        released: stores freed so far.
    """

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.released = 0
        self._closed: list[_Closed] = []
        self._held: set[int] = set()  # stores not released yet
        self._stores_seen = len(graph.stores)
        self._last_compute_from = -1  # the first store of the compute before step()
        self._leftovers: list[int] = []  # nodes no compute needed so far
        self._scanned = len(graph)  # nodes below this were checked for leftovers
        self._forget_from = FORGET_SLACK  # what _noted() reaches before _forget_released
        self._trimmed_to = 0  # computed nodes below this were trimmed or are survivors
        self._survivors: list[int] = []
        self._trim_at = FORGET_SLACK  # or len(graph) reaches this (see _forget_released)
        self._released_at: int | None = None  # a location in a released store
        self._open()

    def _open(self) -> None:
        graph = self.graph
        graph.generation = Generation()
        graph.generation_first = len(graph)
        graph.revived = []
        graph.revived_pending = []

    def step(self) -> None:
        """Close the recording generation, open a new one, release what nothing needs."""
        graph = self.graph
        gen = graph.generation
        if len(graph) > graph.generation_first or graph.revived or graph.revived_pending:
            assert isinstance(gen, Generation)
            self._closed.append(_Closed(weakref.ref(gen), graph.generation_first, len(graph),
                                        self._stores_seen, set(graph.revived),
                                        graph.revived_pending))
        self._open()
        self._drop_computed_constants()
        stores = graph.stores
        held = self._held
        held.update(range(self._stores_seen, len(stores)))
        self._last_compute_from = self._stores_seen
        self._stores_seen = len(stores)
        needed = self._needed()
        for s in held - needed:
            stores[s] = _RELEASED  # an empty store (reading a row of it fails)
            self.released += 1
        held &= needed
        if self._noted() >= self._forget_from or len(graph) >= self._trim_at:
            self._forget_released()

    def _noted(self) -> int:
        graph = self.graph
        return len(graph.dedupe_table) + len(graph.shared)

    def _forget_released(self) -> None:
        # A released node is never read again, nor merged with (a merge with it records
        # anew): what the graph keeps to merge it goes, and so do its inputs and the
        # ints of its depth and location, so that a long run's bookkeeping stays
        # bounded too (five list slots a node remain). Now and then, not every step:
        # the scan is over everything noted for merging.
        graph = self.graph
        loc, stores = graph.node_loc, graph.stores

        def released(n: int) -> bool:
            where = loc[n]
            return where >= 0 and not stores[where >> STORE_SHIFT]

        graph.shared.difference_update([n for n in graph.shared if released(n)])
        for noted in (graph.dropped_tensors, graph.handed_out):
            noted.difference_update([n for n in noted if released(n)])
        table = graph.dedupe_table
        for signature in [sig for sig, n in table.items() if released(n)]:
            del table[signature]
        # Computed nodes not looked at yet, and those whose values were still held.
        stop = graph.first_uncomputed
        candidates = self._survivors + list(range(min(self._trimmed_to, stop), stop))
        self._trimmed_to = max(self._trimmed_to, stop)
        self._survivors = [n for n in candidates if not released(n)]
        _keep_grad_answers(graph, self._survivors, released)
        inputs, depth = graph.node_inputs, graph.node_depth
        for n in candidates:
            if released(n):
                inputs[n] = ()
                depth[n] = 0
                # Any released store's location says "computed, released": one int
                # object for all of them, not one per store.
                if self._released_at is None:
                    self._released_at = loc[n] >> STORE_SHIFT << STORE_SHIFT
                loc[n] = self._released_at
        forget_keys(graph, self._survivors)
        self._forget_from = 2 * self._noted() + FORGET_SLACK if FORGET_SLACK else 0
        # Calls that are never merged (random ones, or dedupe off) note nothing, so
        # the nodes recorded since count too; the survivors are scanned every time.
        self._trim_at = len(graph) + max(FORGET_SLACK, 2 * len(self._survivors))

    def _needed(self) -> set[int]:
        graph = self.graph
        loc = graph.node_loc
        needed: set[int] = set()
        alive: list[_Closed] = []
        for gen in self._closed:
            if gen.alive() is None:
                continue
            alive.append(gen)
            if gen.stores is not None:
                needed |= gen.stores
                continue
            if gen.pending:  # revived before they were computed: where are they now?
                where = [loc[n] for n in gen.pending]
                gen.revived |= _stores(where)
                gen.pending = [n for n, w in zip(gen.pending, where) if w < 0]
            if graph.first_uncomputed >= gen.stop:
                # The usual case: every node up to its last is computed, and the compute
                # just made computed its own nodes, so they are in its stores (with at
                # most older leftovers).
                complete = True
                own = set(range(gen.first_store, len(graph.stores)))
                if gen.first_store != self._last_compute_from:  # computed since
                    own = _stores(loc[gen.first : gen.stop])
            else:
                own_locations = loc[gen.first : gen.stop]
                complete = -1 not in own_locations and not gen.pending
                own = _stores(own_locations) if complete else set(
                    range(gen.first_store, len(graph.stores)))
            own |= gen.revived
            if complete:  # they never move again: remember where they are
                gen.stores = own
            needed |= own
        self._closed = alive
        # The inputs of nodes that are not computed yet (nothing awaited them so far).
        if graph.first_uncomputed < len(loc):
            start = max(self._scanned, graph.first_uncomputed)
            self._leftovers = [n for n in self._leftovers if loc[n] < 0]
            self._leftovers += [n for n in range(start, len(loc)) if loc[n] < 0]
            inputs = graph.node_inputs
            for n in self._leftovers:
                needed.update(_stores([loc[s] for s, _ in inputs[n]]))
        else:
            self._leftovers = []
        self._scanned = len(loc)
        return needed

    def _drop_computed_constants(self) -> None:
        # A constant's value is read when its node computes, never after.
        constants = self.graph.constants
        if constants:
            loc = self.graph.node_loc
            versions = self.graph.constant_versions
            dropped = self.graph.dropped_tensors
            for n in [n for n in constants if loc[n] >= 0]:
                if isinstance(constants.pop(n), torch.Tensor):
                    dropped.add(n)  # bg.batched_value(t) += 1 is still refused
                versions.pop(n, None)


def _keep_grad_answers(graph: Graph, survivors: list[int],
                       released: Callable[[int], bool]) -> None:
    """Forget the gradient answers (``graph.node_grad``) of released nodes, but for
    those a computed node still held reads: with its inputs trimmed, a released node
    can no longer be walked, and a held value asked later (handed out again, or read
    by a new call) must still hear that it requires grad through it. Those answers are
    settled now, while their inputs are still there."""
    held = [n for n in range(graph.first_uncomputed, len(graph)) if graph.node_loc[n] >= 0]
    read = {s for n in (*survivors, *held) for s, _ in graph.node_inputs[n] if released(s)}
    for n in read:
        eager_requires_grad(graph, n)  # noted in graph.node_grad
    answers = graph.node_grad
    for n in [n for n in answers if n not in read and released(n)]:
        del answers[n]


_store_of = STORE_SHIFT.__rrshift__  # location -> store, as a C call


def _stores(locations: list[int]) -> set[int]:
    """The stores of these node locations (-1, not computed, is left out)."""
    found = set(map(_store_of, locations))
    found.discard(-1)  # -1 >> STORE_SHIFT
    return found
