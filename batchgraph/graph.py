"""The recorded computation graph, kept as flat arrays for speed.

Node ``n`` is a call (or a constant). Its arrays:

* ``node_key[n]``: index into ``keys`` (equal keys batch together);
* ``node_inputs[n]``: tuple of ``(source node, leaf)`` pairs, one per tensor input,
  where ``leaf`` numbers the tensors of the source's (flattened) output;
* ``node_depth[n]``: longest path from a constant (constants have depth 0);
* ``node_spec[n]``: output spec tree.

Node ids are assigned in recording order, which is a topological order: a node's
inputs always exist before it. Values live in ``stores``: one entry per executed step,
holding a batched tensor (or list of per-example tensors) per output leaf; node ``n``
is row ``loc & ROW_MASK`` of store ``loc >> STORE_SHIFT`` where ``loc = node_loc[n]``
(``-1`` until computed). One int per location keeps scheduling to integer sorting.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from batchgraph.attributes import Attributes
from batchgraph.autocasting import AutocastState
from batchgraph.eager_grad import eager_requires_grad
from batchgraph.equal_keys import check_stackable, statics_apart
from batchgraph.handing_out import own_copy, reading
from batchgraph.key_reads import NOT_READ, KeyReads, ModuleParts
from batchgraph.keys import BatchKey, ConstantKey
from batchgraph.placeholders import is_placeholder
from batchgraph.specs import OutSpec, TensorSpec, intern_spec

__all__ = ["INFERENCE", "Graph", "RecordedGrad", "Ref", "exact_number", "scalar_spec"]

Ref = tuple[int, int]  # (node, leaf)

# The grad mode a call is recorded in: grad on (True), off (False), or inference mode.
INFERENCE = "inference"
RecordedGrad = bool | str

_graph_uids = itertools.count()

# A location packs (store, leaf, row) into one int; a node's location has leaf 0.
STORE_SHIFT = 32
LEAF_SHIFT = 24
ROW_MASK = (1 << LEAF_SHIFT) - 1

_CPU = torch.device("cpu")
# Python scalars become 0-d constants of torch's type for that scalar (see scalar_spec).
_SCALAR_SPECS: dict[type, TensorSpec] = {
    kind: cast(TensorSpec, intern_spec(TensorSpec((), dtype, _CPU)))
    for kind, dtype in ((bool, torch.bool), (int, torch.int64))
}
_FLOAT_SPECS: dict[torch.dtype, TensorSpec] = {}


def scalar_spec(kind: type) -> TensorSpec:
    """The spec of a Python scalar's constant, as ``torch.tensor(value)`` makes it: a
    float takes the default dtype in force *now* (``torch.set_default_dtype`` may have
    changed it since import), a bool ``torch.bool`` and an int ``torch.int64``."""
    if kind is not float:
        return _SCALAR_SPECS[kind]
    dtype = torch.get_default_dtype()
    spec = _FLOAT_SPECS.get(dtype)
    if spec is None:
        spec = _FLOAT_SPECS[dtype] = cast(TensorSpec, intern_spec(TensorSpec((), dtype, _CPU)))
    return spec


class Graph(KeyReads):
    """Nodes recorded by one ``BatchingPolicy``; see the module docstring."""

    def __init__(self, name: str = "graph") -> None:
        self.name = name
        self.uid = next(_graph_uids)  # never reused, unlike id()
        # Changes with every compute (from the same counter, so no other graph has
        # it): CallSite memos keyed by it see each key again once after a compute.
        self.stamp = self.uid
        self.open = True
        # The BatchingPolicy recording into this graph, held weakly: policy -> graph ->
        # nothing back, so a batch's graph, handles and stores are freed by reference
        # counting as soon as the caller lets go of them (no cyclic GC pass over them).
        self._policy: Callable[[], Any] = _no_policy
        self.dedupe_table: dict[Any, int] = {}
        # Nodes whose values were changed in place through a value sharing their
        # memory: node -> (first node recorded after the change, how it was changed);
        # see batchgraph.aliasing.
        self.changed: dict[int, tuple[int, str]] = {}
        # Nodes whose values were handed out (by compute or an await): the caller may
        # hold them, so a change in place through a view of theirs is refused.
        self.handed_out: set[int] = set()
        # Values handed out while calls were pending, per output, and the most nodes
        # recorded before one of them: see batchgraph.handed_views.
        self.handed_views: dict[Ref, list[Any]] = {}
        self.handed_mark = 0
        self.handed_kept = 64  # the table's size after its last scan (or the least)
        # Such views computed since (their rows copies of the value as it was), with
        # what they view: calls reading them are checked as those on pending ones.
        self.early_views: dict[int, Any] = {}
        self.early_kept = 64
        self.keys: list[BatchKey] = []
        self.key_ids: dict[tuple[Any, ...], int] = {}
        self.keys_used: set[int] = set()  # since ids were last forgotten (key_forgetting)
        # Key ids whose calls run in the order recorded (batchgraph.ordering).
        self.in_order: set[int] = set()
        # Whether grad was enabled where a call was recorded, per key id: a call runs
        # in that mode, as it would have run eagerly (``with torch.no_grad():`` around
        # a recorded call then holds, whatever the mode at compute). A key recorded in
        # both modes has one id for each, so the two never batch together.
        self.key_grad: dict[int, RecordedGrad] = {}
        # Key ids recorded under autocast, and its state (see batchgraph.autocasting).
        self.key_autocast: dict[int, AutocastState] = {}
        # The default dtypes in force where its policy's `with` blocks began and ended.
        self.default_dtypes: set[torch.dtype] = set()
        # The train/eval mode a module's calls were recorded in, per key id: a call
        # must run in that mode, so a module switched in between is refused at compute.
        self.key_training: dict[int, bool] = {}
        # A module's parameters (a function's captured tensors, batchgraph.captured)
        # are read when its calls compute, so they must not change in place
        # (optimizer.step()) in between. Their versions are part of a key's identity,
        # so calls recorded before and after a change never batch or merge together; ``key_versions`` keeps them per key id, for the
        # check at compute. Noted when a call goes through ``key_id``: the first call
        # of a key after each compute and after each optimizer step.
        self.key_versions: dict[int, tuple[int, ...]] = {}
        # Per key id with versions: dtypes, devices and the tensors (converted, replaced).
        self.key_layouts: dict[int, tuple[tuple[torch.dtype, torch.device], ...]] = {}
        self.key_params: dict[int, tuple[torch.Tensor, ...]] = {}
        # A module's buffers (running statistics, a counter; for a function, those
        # of the modules it reads) are read when its calls compute too, but the
        # computation may change them itself: their epochs (batchgraph.buffers), which
        # only changes made outside batchgraph move, are noted with the parameters'
        # versions, as part of the key's identity, per key id.
        self.key_buffers: dict[int, tuple[int, ...]] = {}
        self.key_buffer_parts: dict[int, ModuleParts] = {}
        # Likewise the train/eval modes of a module's submodules (its own mode is
        # ``key_training``, noted per call): part of the key's identity, per key id.
        self.key_submodes: dict[int, tuple[bool, ...]] = {}
        # A module key's hooks (hooks.hooks_of), which its calls run when computed.
        self.key_hooks: dict[int, tuple[tuple[int, ...], ...]] = {}
        # And the plain attributes of the modules a key reads (batchgraph.attributes).
        self.key_attrs: dict[int, Attributes] = {}
        # The thread that noted them (the one recording, which runs the user's code).
        self.attrs_thread = 0
        self._module_parts: dict[int, ModuleParts] = {}
        self.node_key: list[int] = []
        self.node_inputs: list[tuple[Ref, ...]] = []
        self.node_depth: list[int] = []
        self.node_spec: list[OutSpec] = []
        # Constant values: tensors, or Python scalars (stacked with one torch.tensor call).
        self.constants: dict[int, Any] = {}
        # The version counter of each tensor constant when it was recorded: the tensor
        # is read when its step computes, and must not have changed by then.
        self.constant_versions: dict[int, int] = {}
        # Tensor constants that require grad: stacked with grad on, whatever the mode
        # at compute, so that their batched value keeps the way back to them.
        self.grad_constants: set[int] = set()
        # Tensor constants computed, whose values a coroutine run's releaser dropped
        # (batchgraph.releasing): a handle of one still stands for the very tensor
        # given to bg.batched_value, which an in-place change must not be recorded on.
        self.dropped_tensors: set[int] = set()
        self._constant_kids: dict[TensorSpec, int] = {}
        self._scalar_kids: dict[type | torch.dtype, int] = {}
        # Identical calls and constants are merged as they are recorded (hash-consing):
        # this table maps a call's (key, inputs) or a constant's value to its node.
        self.dedupe = True
        # Whether a call that may draw random numbers was recorded (noted at a key's
        # first call after each compute): lanes of run_all computing on threads at
        # once run such steps one after another, in a fixed order, so a fixed seed
        # gives the same draws run to run.
        self.draws_random = False
        # The recording policy's settings, for computing after it was freed.
        self.scheduler = "agenda"
        self.rules: dict[Any, Any] = {}
        self.merged_calls = 0  # calls merged so far
        self.merged_constants = 0  # and constants
        self.node_loc: list[int] = []
        self.stores: list[list[Any]] = []
        # Rows of the stores seen so far by scheduling (a cache; see build_schedule).
        self.store_sizes: list[int] = []
        # Every node below this id is computed (advanced after each execution).
        self.first_uncomputed = 0
        # Releasing dead values as a coroutine run goes (batchgraph.releasing): what
        # every new handle holds (a Generation; None when not releasing), the first
        # node of that generation, and where the older nodes its handles stand for
        # (merged calls and constants) live: their stores, or the nodes themselves
        # while not computed.
        self.generation: object | None = None
        self.generation_first = 0
        self.revived: list[int] = []
        self.revived_pending: list[int] = []
        # Whether calls merge with older computes' ones whose values require grad: in a
        # coroutine run (set by its lane), whose steps the driver runs with no backward
        # between them; not where the caller computes, and may backward, in between.
        self.merges_grad_steps = False
        # Values are handed out (handle.value, bg.value) as the caller's own tensors,
        # which it may change in place, as it may its own tensor in eager code. No
        # stored value, and so no other call or example, may see that change: values
        # are handed out from a copy of the stored ones, and where identical calls were
        # merged into one node (``shared``), each handle gets a copy of its own.
        self.shared: set[int] = set()
        # Whether a node's value would require grad eagerly, as far as worked out
        # (batchgraph.eager_grad): its rows are handed out detached where not.
        self.node_grad: dict[int, bool] = {}
        # Answers given while a compute runs, about nodes it has not located yet:
        # valid for that stamp only (see eager_requires_grad).
        self.node_grad_pending: tuple[int, dict[int, bool]] = (-1, {})
        self.key_reads_grad: dict[int, bool] = {}

    def __len__(self) -> int:
        return len(self.node_key)

    @property
    def policy(self) -> Any:
        """The policy recording into this graph, or None once it was freed."""
        return self._policy()

    @policy.setter
    def policy(self, policy: Any) -> None:
        self._policy = weakref.ref(policy)

    def key_id(
        self,
        key: BatchKey,
        grad: RecordedGrad | None = None,
        autocast: AutocastState | None = None,
        training: bool | None = None,
        attrs: Any = NOT_READ,
    ) -> int:
        """The id of ``key`` recorded with grad enabled or not, or in inference mode
        (``INFERENCE``; None: any), in the autocast state ``autocast`` (None: off)
        and, for a module's calls, with the module in training mode or not (None: not
        a module). Calls of one key recorded in different modes get different ids, so
        they never run as one call. ``attrs``: ``attributes_now(key.fn)``, where the
        caller read them already."""
        versions, submodes, buffers, hooks, attrs = self.reads_now(key.fn, attrs)
        # Static arguments a custom identity() leaves out still keep calls apart: a
        # batch runs with one call's (batchgraph.equal_keys).
        ident = (key, grad, autocast, training, versions, submodes, buffers, hooks, attrs,
                 statics_apart(key))
        kid = self.key_ids.get(ident)
        if kid is not None and self.keys[kid] is not key:
            check_stackable(self.keys[kid], key)
        if kid is None:
            kid = len(self.keys)
            self.keys.append(key)
            self.key_ids[ident] = kid
            if key.in_order:
                self.in_order.add(kid)
            if grad is not None:
                self.key_grad[kid] = grad
            if autocast is not None:
                self.key_autocast[kid] = autocast
            if training is not None:
                self.key_training[kid] = training
            self.note_reads(kid, key.fn, versions, submodes, buffers, hooks, attrs)
        self.keys_used.add(kid)
        return kid

    def new_stamp(self) -> None:
        """A compute ran (or an optimizer stepped): each key's next call goes through
        ``key_id`` again, which notes its module's parameters' versions anew."""
        self.stamp = next(_graph_uids)

    def add_node(self, kid: int, inputs: tuple[Ref, ...], depth: int, spec: OutSpec) -> int:
        # CallSite.__call__ inlines this for speed: keep the two in step.
        n = len(self.node_key)
        self.node_key.append(kid)
        self.node_inputs.append(inputs)
        self.node_depth.append(depth)
        self.node_spec.append(spec)
        self.node_loc.append(-1)
        return n

    def add_constant(
        self, value: torch.Tensor | bool | int | float, device: torch.device | None = None
    ) -> int:
        """Add a per-example constant: a tensor, or a Python scalar for ``device``."""
        if not isinstance(value, torch.Tensor) and device is None:
            return self.add_scalar(value)
        if isinstance(value, torch.Tensor):
            spec = TensorSpec.of(value)
        elif device is None:
            spec = scalar_spec(type(value))
        else:
            spec = scalar_spec(type(value))._replace(device=device)
        kid = self._constant_kids.get(spec)
        if kid is None:
            kid = self._constant_kids[spec] = self.key_id(ConstantKey(spec))
        spec = cast(ConstantKey, self.keys[kid]).spec  # one spec object per kind, kept per node
        if self.dedupe:
            signature = constant_signature(kid, value)
            if signature is not None:
                fresh = len(self.node_key)
                existing = self.dedupe_table.setdefault(signature, fresh)
                if existing != fresh:
                    existing = self.merge(existing, signature, fresh)
                    if existing != fresh:
                        self.merged_constants += 1
                        return existing
        n = self.add_node(kid, (), 0, spec)
        self.constants[n] = value
        if isinstance(value, torch.Tensor) and not value.is_inference():
            self.constant_versions[n] = value._version
            if value.requires_grad:
                self.grad_constants.add(n)
        return n

    def add_scalar(self, value: bool | int | float) -> int:
        """``add_constant`` for a Python scalar on the CPU: the per-token fast path."""
        kind = type(value)
        # A float's dtype is the default one now: its key id is looked up by dtype.
        kid = self._scalar_kids.get(kind if kind is not float else torch.get_default_dtype())
        if kid is None:
            spec = scalar_spec(kind)
            kid = self.key_id(ConstantKey(spec))
            self._scalar_kids[kind if kind is not float else spec.dtype] = kid
        n = len(self.node_key)
        if self.dedupe:
            signature = (kid, value) if value or kind is not float else (kid, exact_number(value))
            existing = self.dedupe_table.setdefault(signature, n)  # one hash
            if existing != n:
                if existing >= self.generation_first:
                    self.shared.add(existing)  # merge's usual case, inlined
                    self.merged_constants += 1
                    return existing
                existing = self.merge(existing, signature, n)
                if existing != n:
                    self.merged_constants += 1
                    return existing
        # add_node, inlined: this runs once per distinct token.
        self.node_key.append(kid)
        self.node_inputs.append(())
        self.node_depth.append(0)
        self.node_spec.append(cast(ConstantKey, self.keys[kid]).spec)
        self.node_loc.append(-1)
        self.constants[n] = value
        return n

    def merge(self, node: int, signature: Any, fresh: int) -> int:
        """What a call or constant identical to ``node``, about to be recorded as node
        ``fresh``, should use: ``node`` (merged), or ``fresh`` where ``node`` cannot be
        shared any more (``fresh`` then takes over ``signature``).
        """
        if node < self.generation_first:  # an older step's node (coroutine runs)
            node = self.revive(node, signature, fresh)
            if node == fresh:
                return fresh
        self.shared.add(node)
        return node

    def revive(self, node: int, signature: Any, fresh: int) -> int:
        """What a merge with ``node``, made by an older generation, should use.

        While a coroutine run releases dead values, its value may be gone: then the
        call or constant is recorded anew (``fresh``, which takes over ``signature``),
        as it is where its value requires grad outside coroutine runs
        (``merges_grad_steps``). Otherwise the current generation keeps it alive from
        now on.
        """
        loc = self.node_loc[node]
        if loc < 0:
            self.revived_pending.append(node)
            return node
        store = loc >> STORE_SHIFT
        if not self.stores[store] or (not self.merges_grad_steps
                                      and self.stored_requires_grad(node)):
            # Released; or its value requires grad, and a backward since may have freed
            # its graph (gradient accumulation over computes failed with "backward
            # through the graph a second time"): eagerly the call computes anew.
            self.dedupe_table[signature] = fresh
            return fresh
        self.revived.append(store)
        return node

    @property
    def merged(self) -> int:
        """Calls and constants merged so far."""
        return self.merged_calls + self.merged_constants

    @property
    def calls_recorded(self) -> int:
        """Calls recorded so far, merged ones included (constants excluded)."""
        return len(self.node_key) - len(self.constants) + self.merged_calls

    def is_constant(self, n: int) -> bool:
        return n in self.constants

    def computed(self, n: int) -> bool:
        return self.node_loc[n] >= 0

    def stored_requires_grad(self, n: int) -> bool:
        """Whether any output of computed node ``n`` as stored requires grad (True when
        that cannot be told: not computed, or released). Batched, it does when any
        example's does; see ``batchgraph.eager_grad``."""
        loc = self.node_loc[n]
        if loc < 0:
            return True
        store = self.stores[loc >> STORE_SHIFT]
        if not store:
            return True
        for column in store:
            if isinstance(column, torch.Tensor):
                if column.requires_grad:
                    return True
            elif any(isinstance(t, torch.Tensor) and t.requires_grad
                     for t in tree_leaves(column[loc & ROW_MASK])):
                return True  # per-example values ("list" keys)
        return False

    def leaf_value(self, n: int, leaf: int) -> torch.Tensor:
        """The per-example value of one output leaf of a computed node."""
        loc = self.node_loc[n]
        store = self.stores[loc >> STORE_SHIFT]
        if not store:
            raise RuntimeError(
                f"the value of node {n} of {self.name!r} was released: no handle to it "
                "was alive at a later step (a batchgraph bug; please report it)"
            )
        column = store[leaf]
        with reading(column):
            row = column[loc & ROW_MASK]
        # The caller's own copy: an in-place change must not reach the store, which
        # calls recorded before the change still read (eagerly they ran before it).
        if isinstance(row, torch.Tensor):
            if row.requires_grad and not eager_requires_grad(self, n):
                row = row.detach()  # another example's input made the batch require grad
            return own_copy(row)
        if not eager_requires_grad(self, n):
            row = tree_map_only(torch.Tensor, torch.Tensor.detach, row)
        value: torch.Tensor = tree_map_only(torch.Tensor, own_copy, row)
        return value


# Constants up to this many elements are merged by value; larger ones never.
_VALUE_DEDUPE_NUMEL = 16


def _no_policy() -> None:
    return None


def constant_signature(kid: int, value: Any) -> Any:
    """What identifies a constant for merging, or None if it is not merged."""
    if not isinstance(value, torch.Tensor):
        return (kid, exact_number(value))
    if value.requires_grad or value.numel() > _VALUE_DEDUPE_NUMEL:
        return None
    if is_placeholder(value):
        # A worker's weightless stand-in for a model tensor, or a view of one: its
        # values are not the live ones, which the binder reads in, so no value equals
        # it. Floating ones read NaN (never equal); integer ones read 0, as real zeros.
        return None
    if value.dim() == 0:  # the same signature as the equal Python scalar
        return (kid, exact_number(value.item()))
    return (kid, tuple(map(exact_number, value.reshape(-1).tolist())))


def exact_number(value: Any) -> Any:
    """A number as constants and calls are merged by: -0.0 and 0.0 are equal in Python
    but not in arithmetic (1 / -0.0 is -inf), so a float zero carries its sign; and a
    NaN, unequal even to itself (a signature holding one never matched another, so
    each call was resolved and keyed alone), is a tagged tuple of its sign."""
    if type(value) is float:
        if value == 0.0:
            return (value, math.copysign(1.0, value))
        if value != value:
            return ("nan", math.copysign(1.0, value))
    return value
