"""``BatchingPolicy``: the recording context, the key registry, and ``compute``.

Inside ``with BatchingPolicy():`` module calls of a ``BatchedModule``, functions
wrapped by ``batched_func`` and operations on handles are recorded instead of run.
``compute`` then deduplicates, prunes, schedules and executes what the requested
handles need, and returns tensors in the same nesting. A policy can compute several
times; later computes reuse everything computed before that a live handle still
stands for. After each compute the policy's ``StoreReleaser`` frees the stored values
nothing can read any more (``batchgraph.releasing``), so one policy kept open over a
whole training loop holds about one step's values, not every step's.
"""

from __future__ import annotations

import itertools
import operator
import time
import types
import weakref
from collections import Counter, deque
from collections.abc import Mapping
from typing import Any

import torch

from batchgraph import gcpause, handed_changes, handed_views
from batchgraph.aliasing import check_changed, unmerge_viewed
from batchgraph.eager_grad import eager_requires_grad, reads_grad
from batchgraph.errors import PolicyMismatchError
from batchgraph.executor import Executor
from batchgraph.graph import ROW_MASK, STORE_SHIFT, Graph
from batchgraph.handing_out import own_copy, private_rows
from batchgraph.handle import ResultHandle
from batchgraph.keys import ConstantKey, callable_name
from batchgraph.passes import prune
from batchgraph.pinning import unpin_stubs
from batchgraph.recording import _ACTIVE
from batchgraph.releasing import StoreReleaser
from batchgraph.rule_tokens import tokens_for
from batchgraph.rules import KeyFactory, rule_table
from batchgraph.scheduling import (
    SCHEDULERS,
    Schedule,
    ScheduleStats,
    build_schedule,
)
from batchgraph.specs import (
    TensorSpec,
    dataclass_fields,
    rebuild_dataclass,
    rebuild_mapping,
    rebuild_sequence,
)
from batchgraph.views_together import hand_out_together

__all__ = ["UNTRAVERSED", "BatchingPolicy", "refuse_hidden_handles"]

_policy_ids = itertools.count()


class BatchingPolicy:
    """Records per-example calls and runs them batched.

    Args:
        scheduler: ``"agenda"`` (default) or ``"depth"``.
        dedupe: merge identical calls (same callable, same inputs) before running.
        rules: extra batching rules: ``{module, ModuleType or function: BatchKey
            subclass}``. A rule keyed by a module instance applies to that module
            alone and comes before its class's rule (a forward hook on one layer:
            ``{layer: bg.UnbatchedKey}``); a module's own ``batch_key`` attribute
            comes before both. A ``batched_func`` wrapper stands for what it wraps.
        name: shown in error messages.

    Example:
        >>> import batchgraph as bg, torch
        >>> lin = torch.nn.Linear(3, 2)
        >>> f = bg.batched_func(lin)
        >>> with bg.BatchingPolicy() as policy:
        ...     hs = [f(torch.ones(3)) for _ in range(4)]
        >>> out = policy.compute(hs)
        >>> policy.stats.launches
        1
    """

    def __init__(
        self,
        *,
        scheduler: str = "agenda",
        dedupe: bool = True,
        rules: Mapping[Any, KeyFactory] | None = None,
        name: str | None = None,
    ) -> None:
        if scheduler not in SCHEDULERS:
            raise ValueError(
                f"unknown scheduler {scheduler!r}; choose one of {sorted(SCHEDULERS)}"
            )
        # Checked here: dedupe="no" would merge (a non-empty string is true) and a
        # name that is not a string fails only inside an error message later.
        if not isinstance(dedupe, bool):
            raise TypeError(f"dedupe must be True or False, got {dedupe!r}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a string (shown in error messages), got {name!r}")
        self.scheduler = scheduler
        self.dedupe = dedupe
        self.rules: dict[Any, KeyFactory] = rule_table(rules)
        # Signature caches are shared across policies with the same rules (none, or
        # the same table written anew per batch); each default dtype has its own
        # token (see __enter__ and batchgraph.rule_tokens).
        self._tokens = tokens_for(self.rules)
        self.rules_token = self._tokens.base
        # The default dtype the signatures resolve under (see follow_default_dtype).
        self.default_dtype = torch.get_default_dtype()
        self.name = name or f"policy-{next(_policy_ids)}"
        self.graph = Graph(self.name)
        self.graph.policy = self
        self.graph.open = False
        self.graph.dedupe = dedupe
        self.graph.scheduler = scheduler
        self.graph.rules = self.rules
        self._merged_before = 0
        self.stats: ScheduleStats | None = None
        # Only the last schedule is kept: a coroutine run computes thousands of times.
        self.last_schedule: Schedule | None = None
        self.computes = 0
        # Frees, after each compute, the values no live handle or pending call needs:
        # without it every compute's batched outputs stay in the graph for the
        # policy's life (a training loop in one `with` block grew without bound).
        self.releaser = StoreReleaser(self.graph)
        self._token: Any = None
        self._quiet = False
        self._mark = time.perf_counter()

    @property
    def calls_recorded(self) -> int:
        """Calls recorded by this policy so far (merged duplicates included)."""
        return self.graph.calls_recorded

    # -- recording context -----------------------------------------------------------
    def __enter__(self) -> BatchingPolicy:
        if self._token is not None:
            raise RuntimeError(f"{self.name} is already active; policies are not reentrant")
        self._token = _ACTIVE.set(self)
        self.graph.open = True
        # A cached signature's spec and key hold for the default dtype it was resolved
        # in (`int_h * 2.5` is float64 under a float64 default): another default reads
        # other caches. Read once per block: changed inside it, compute refuses.
        default = self.default_dtype = torch.get_default_dtype()
        self.graph.default_dtypes.add(default)
        self.rules_token = self._tokens.of(default)
        if not self._quiet:
            # Fewer GC passes until the graph is freed (computing and the backward pass
            # come after the `with` block): its many small objects are not rescanned.
            gcpause.enter()
            weakref.finalize(self.graph, gcpause.leave)
            self._quiet = True
        self._mark = time.perf_counter()
        return self

    def follow_default_dtype(self) -> bool:
        """Whether the default dtype changed since the block began or this was last
        asked (``torch.set_default_dtype`` inside it). If so, it is noted, so that
        compute refuses (``DefaultDtypeChangedError``), and signatures resolve under
        it from now on: a spec resolved under one default is not cached as the
        block's, where a later block under that default would take it (its
        ``int_h * 2.5`` float64 under float32, failing as a batching rule's error).
        Asked where a signature is resolved and at a key's first call after each
        compute, not per call: a default changed and changed back between two calls
        of one signature with no compute in between is not seen.

        Example:
            >>> policy = BatchingPolicy()
            >>> with policy:
            ...     torch.set_default_dtype(torch.float64)
            ...     changed = policy.follow_default_dtype()
            ...     torch.set_default_dtype(torch.float32)
            >>> changed, sorted(str(d) for d in policy.graph.default_dtypes)
            (True, ['torch.float32', 'torch.float64'])
        """
        default = torch.get_default_dtype()
        if default is self.default_dtype:
            return False
        self.default_dtype = default
        self.graph.default_dtypes.add(default)
        self.rules_token = self._tokens.of(default)
        return True

    def __exit__(self, *exc: object) -> None:
        # One default, unless torch.set_default_dtype was called inside the block
        # (compute_checks.check_default_dtype refuses then).
        self.graph.default_dtypes.add(torch.get_default_dtype())
        _ACTIVE.reset(self._token)
        self._token = None
        self.graph.open = False
        unpin_stubs()

    @property
    def recording(self) -> bool:
        """True inside the policy's ``with`` block."""
        return self.graph.open

    # -- computing -----------------------------------------------------------------
    def compute(self, obj: Any) -> Any:
        """Compute every handle in ``obj`` (lists, tuples, dicts and dataclasses of handles).

        Returns:
            The same nesting with each handle replaced by its per-example tensor (or
            tuple of tensors); other leaves are returned unchanged.

        Raises:
            PolicyMismatchError: if ``obj`` holds handles of another policy.
            BatchedCallError: if a batched call raises.
        """
        with gcpause.fewer_collections():
            return self._compute(obj)

    def _compute_example(self, obj: Any, example: int) -> Any:
        """``compute`` for the values of one example, numbered ``example`` by its
        caller (a coroutine driver retrying its examples one at a time): errors name
        that number, where ``compute`` names each handle's position in ``obj``."""
        with gcpause.fewer_collections():
            return self._compute(obj, example)

    def _compute(self, obj: Any, example: int | None = None) -> Any:
        start = time.perf_counter()
        record_seconds = start - self._mark
        handles: list[ResultHandle] = []
        _collect(obj, handles)
        for h in handles:
            if h._graph is not self.graph:
                raise PolicyMismatchError(
                    f"{h!r} belongs to policy {h._graph.name!r}, not {self.name!r}; compute "
                    "each policy's handles with that policy"
                )
        graph = self.graph
        merged = graph.merged - self._merged_before
        self._merged_before = graph.merged
        if graph.changed:  # values changed in place through a view: see aliasing
            check_changed(graph, [h.node for h in handles])
        live = prune(graph, [h.node for h in handles])
        # Views recorded before the value they view was handed out: see handed_views.
        stale = handed_views.check(graph, live.nodes)
        handed_changes.check(graph, live)  # handed out, then changed through .data
        schedule = build_schedule(graph, live, self.scheduler)
        scheduled = time.perf_counter()
        example_of = (
            _ExampleIndex(graph, handles) if example is None else lambda _node: example
        )
        # Handed out now: their views computed with them (or before) copy them as they
        # were (see handed_views.note_views_computed_with).
        fresh = [h for h in handles if h._out is None]
        before = [h for h in fresh if graph.node_loc[h.node] >= 0]
        executor = Executor(graph, example_of=example_of)
        try:
            executor.run(schedule)
        except BaseException:
            # Refused (a parameter replaced since its calls were recorded) or failed:
            # calls recorded next go through key_id again, which notes what they read
            # now under a key id of their own, not their site's memo of the refused one.
            graph.new_stamp()
            raise
        executed = time.perf_counter()
        if stale or graph.early_views:
            handed_views.hand_out_views(graph, handles, stale)
        self.last_schedule = schedule
        self.computes += 1
        self.stats = self._stats(schedule, live.nodes, merged, record_seconds, start, scheduled, executed)
        schedule.stats = self.stats
        # The caller gets its own copies (graph.private_rows); rows of values with
        # history keep it, even when read under no_grad or in inference mode (a call
        # recorded with grad has it, as eagerly): see graph.reading.
        # A view computed with the value it views is handed out as a view of it.
        hand_out_together(graph, fresh)
        result = _rebuild(obj, _row_views(graph, handles))
        handed_views.note_views_computed_with(graph, fresh, live, before)
        # The caller still holds the handles in `obj` (and `result` holds its rows):
        # what this compute made for them stays until they are dropped.
        self.releaser.step()
        self._mark = time.perf_counter()
        return result

    def _stats(
        self,
        schedule: Schedule,
        live: list[int],
        merged: int,
        record_seconds: float,
        start: float,
        scheduled: float,
        executed: float,
    ) -> ScheduleStats:
        keys = self.graph.keys
        launches = 0
        nodes = 0
        unbatched = 0
        names: set[str] = set()
        for step in schedule.steps:
            key = keys[step.key]
            if isinstance(key, ConstantKey):
                continue
            nodes += len(step.nodes)
            if key.batchable and not getattr(key, "runs_alone", False):  # VmapKey's
                launches += 1
            else:
                launches += len(step.nodes)
                unbatched += len(step.nodes)
                names.add(callable_name(key.fn))
        return ScheduleStats(
            nodes=nodes,
            launches=launches,
            mean_batch_size=nodes / launches if launches else 0.0,
            merged=merged,
            unbatched_calls=unbatched,
            unbatched_callables=tuple(sorted(names)),
            record_seconds=record_seconds,
            schedule_seconds=scheduled - start,
            execute_seconds=executed - scheduled,
            scheduler=self.scheduler,
            calls_recorded=self.graph.calls_recorded,
            _bound_source=(self.graph, live),
        )


class _ExampleIndex:
    """Maps a node to the index of the first requested output that needs it.

    Built lazily: it is only needed to name examples in error messages.
    """

    def __init__(self, graph: Graph, handles: list[ResultHandle]) -> None:
        self.graph = graph
        self.handles = handles
        self._owner: dict[int, int] | None = None

    def __call__(self, node: int) -> int | None:
        if self._owner is None:
            self._owner = {}
            inputs = self.graph.node_inputs
            for i, h in enumerate(self.handles):
                stack = [h.node]
                while stack:
                    n = stack.pop()
                    if n in self._owner:
                        continue
                    self._owner[n] = i
                    stack.extend(s for s, _ in inputs[n])
        return self._owner.get(node)


def _collect(obj: Any, out: list[ResultHandle]) -> None:
    if type(obj) is ResultHandle:
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _collect(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _collect(x, out)
    elif (names := dataclass_fields(obj)) is not None:
        for name in names:
            _collect(getattr(obj, name), out)
    elif isinstance(obj, UNTRAVERSED):
        refuse_hidden_handles(obj)


# Containers compute and bg.value do not take apart (a set has no order to rebuild
# it in): one that holds a handle would come back with the handle not computed.
# Iterators that are used up by looking into them (bg.compute(h for h in hs)) are
# refused whatever they hold.
_ONE_SHOT = (types.GeneratorType, map, filter, zip)
UNTRAVERSED = (set, frozenset, deque, *_ONE_SHOT)


def refuse_hidden_handles(obj: Any) -> None:
    """Raise if ``obj``, a set, frozenset or deque, holds a handle, at any depth; or
    if it is a generator (or map, filter, zip object), which cannot be looked into
    without using it up.

    Raises:
        TypeError: naming the container and the handle, and what to use instead.

    Example:
        >>> refuse_hidden_handles({1, 2})   # no handle: nothing to say
    """
    if isinstance(obj, _ONE_SHOT):
        kind = type(obj).__name__
        raise TypeError(
            f"got a {kind} object: compute, bg.value and export cannot look into it "
            "without using it up, and would hand it back with any handles in it not "
            f"computed; make it a list first (bg.compute(list(...)))"
        )
    found: list[ResultHandle] = []
    for x in obj:
        _collect(x, found)
    if found:
        kind = type(obj).__name__
        raise TypeError(
            f"a {kind} holds {found[0]!r}: compute, bg.value and export take handles "
            f"out of lists, tuples, dicts and dataclasses only, and would hand this {kind} "
            "back with its handles not computed; put the handles in a list or tuple instead"
        )


# The rows of a copy of a stored column, the copy's version, and whether each row is
# to be checked against eager for requiring grad.
_View = tuple[tuple[torch.Tensor, ...], int | None, bool]

# From this many requested rows of one batched output on, their per-example values
# are taken by one unbind (and, in backward, one stack) instead of a select each.
_UNBIND_FROM = 8


def _row_views(graph: Graph, handles: list[ResultHandle]) -> dict[tuple[int, int], _View]:
    """Per (store, leaf) from which many handles are requested: the rows of a copy of
    it, that copy's version (which its rows share; None for inference tensors), and
    whether its rows, which require grad, may not eagerly (``batchgraph.eager_grad``)."""
    loc = graph.node_loc
    counts = Counter(
        (loc[h.node] >> STORE_SHIFT, h.leaf)
        for h in handles if type(h.spec) is TensorSpec and h._out is None
    )
    views: dict[tuple[int, int], _View] = {}
    for (store, leaf), count in counts.items():
        column = graph.stores[store][leaf]
        if count >= _UNBIND_FROM and isinstance(column, torch.Tensor):
            rows = private_rows(column)
            first = rows[0]
            check = first.requires_grad
            if check:
                # A step's nodes share one key: where it was recorded with grad and its
                # callable reads a parameter that requires grad, every row does
                # eagerly (no walk per row).
                node = next(h.node for h in handles if loc[h.node] >> STORE_SHIFT == store)
                kid = graph.node_key[node]
                check = not (graph.key_grad.get(kid) is True and reads_grad(graph, kid))
            views[(store, leaf)] = (rows, None if first.is_inference() else first._version, check)
            handed_changes.note_rows(graph, store, leaf, rows, views[(store, leaf)][1])
    return views


def _rebuild(obj: Any, views: dict[tuple[int, int], _View]) -> Any:
    if type(obj) is ResultHandle:
        if views and obj._out is None and type(obj.spec) is TensorSpec:
            graph = obj._graph
            where = graph.node_loc[obj.node]
            found = views.get((where >> STORE_SHIFT, obj.leaf))
            if found is not None:
                rows, version, check = found
                row = rows[where & ROW_MASK]
                if check and not eager_requires_grad(graph, obj.node):
                    # Another example's input made the batch require grad; the detached
                    # row shares the copy's version counter, so ``version`` holds.
                    row = row.detach()
                if obj.node in graph.shared:  # another handle reads this row too
                    return obj.handed(own_copy(row))
                obj._out = (row, version)  # ResultHandle.handed, inlined
                graph.handed_out.add(obj.node)
                if row._base is None:  # rows with grad are no views: noted one by one
                    handed_changes.note(graph, obj.node, obj.leaf, row, version)
                if graph.node_inputs[obj.node] and graph.dedupe and getattr(
                        graph.keys[graph.node_key[obj.node]], "_known_view", True):
                    unmerge_viewed(graph, obj.node)
                if graph.first_uncomputed < len(graph.node_key):  # calls still pending
                    handed_views.note_handed(graph, obj.node, obj.leaf, row, version)
                return row
        return obj.value
    if isinstance(obj, list):
        return [_rebuild(x, views) for x in obj]
    if isinstance(obj, tuple):
        values = [_rebuild(x, views) for x in obj]
        if all(map(operator.is_, values, obj)):
            # No handle in it: kept as it is. Rebuilt, a tuple subclass that is neither
            # a namedtuple nor a structseq (a torch.Size) would become a plain tuple.
            return obj
        return rebuild_sequence(type(obj), values)
    if isinstance(obj, dict):
        return rebuild_mapping(obj, ((k, _rebuild(v, views)) for k, v in obj.items()))
    if (names := dataclass_fields(obj)) is not None:
        return rebuild_dataclass(obj, names, lambda v: _rebuild(v, views))
    return obj


def policy_of(graph: Graph) -> BatchingPolicy:
    """The policy of ``graph``; a stand-in with its settings if that one was freed.

    ``with bg.BatchingPolicy():`` without ``as`` leaves nothing holding the policy, so
    ``bg.compute(handles)`` may find only its graph.
    """
    policy = graph.policy
    if policy is None:
        policy = BatchingPolicy(
            scheduler=graph.scheduler, dedupe=graph.dedupe, rules=graph.rules, name=graph.name
        )
        policy.graph = graph
        graph.policy = policy
    assert isinstance(policy, BatchingPolicy)
    return policy


def current_policy() -> BatchingPolicy | None:
    """The policy recording in this context, if any."""
    return _ACTIVE.get()
