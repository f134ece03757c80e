"""Recording calls: the hot path that turns a call into a graph node and a handle.

A ``CallSite`` stands for one callable (a module or a function). Calling it while a
policy records adds a node; the first time a given *signature* is seen (per-example
input specs plus static arguments), the site works out, once, the call's output spec
(by running the per-example call on fake tensors, which also catches shape errors at
record time) and its ``BatchKey``; later calls with that signature only build a
tuple and look it up. That keeps recording at a few microseconds per call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from types import FunctionType
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.utils.hooks import RemovableHandle as _HANDLES

from batchgraph.aliasing import NOT_VIEWED, holds_handed, makes_view, view_of_handed
from batchgraph.attributes import note_own_state, spec_attributes
from batchgraph.autocasting import (
    AutocastState,
    autocast_enabled,
    autocast_state,
)
from batchgraph.buffers import buffers_kept
from batchgraph.entries import Entry
from batchgraph.graph import INFERENCE, RecordedGrad
from batchgraph.handed_views import reads_changed_view
from batchgraph.handle import ResultHandle, unchanged
from batchgraph.hooks import hooks_of
from batchgraph.inference import infer_spec
from batchgraph.keys import UnbatchedKey, callable_name
from batchgraph.lazy_modules import guard_lazy_reads, materialize_lazy
from batchgraph.lifetimes import keep_signature
from batchgraph.module_state import changed_count, kept_count
from batchgraph.on_copy import changes_plain_tensor, on_copy, rebind_to_copy, records_on_copy
from batchgraph.pinning import unpin_stubs
from batchgraph.python_random import drawn_count
from batchgraph.result_kinds import ResultKind, rebuild_result
from batchgraph.rules import choose_key
from batchgraph.signatures import (
    encode_argument,
    encode_handle_tuple,
    identity_signature,
    in_place_error,
    template_argument,
    without_nan,
)
from batchgraph.specs import (
    NO_TENSOR,
    CallSignature,
    OutSpec,
    TensorSpec,
    count_leaves,
    intern_spec,
)
from batchgraph.stale_entries import STALE, recheck
from batchgraph.vmap_probe import probe_vmap

if TYPE_CHECKING:
    from batchgraph.graph import Graph, Ref
    from batchgraph.policy import BatchingPolicy

__all__ = [
    "CallSite",
    "active_policy",
    "handles_for",
]

_new_handle = object.__new__  # see the end of CallSite.__call__
_grad_enabled = torch.is_grad_enabled
_inference_enabled = torch.is_inference_mode_enabled
_autocast_enabled = autocast_enabled

_ACTIVE: ContextVar[BatchingPolicy | None] = ContextVar("batchgraph_policy", default=None)

def active_policy() -> BatchingPolicy | None:
    """The policy recording in this context, or None (then code runs eagerly)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def not_recording() -> Iterator[None]:
    """Around code that runs the recorded callables themselves (shape inference on
    fake tensors, the vmap probe, a batched step): no policy records, and no stub is
    pinned, so a function reading a ``BatchedModule``'s submodule (``model.cell``)
    gets the module and calls it, as eagerly, instead of recording a call of it
    into the policy (which left the function unbatched, or returned a handle from a
    batched step) or handing a stub to code that wants a module
    (``torch.func.functional_call``).
    """
    token = _ACTIVE.set(None)
    unpin_stubs()
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class CallSite:
    """Records calls of one callable into the active policy's graph.

    Calling the site records into the active policy, or calls the callable directly
    when no policy is active (so the same per-example code runs eagerly).

    Example:
        >>> site = CallSite(torch.tanh)     # what batched_func(torch.tanh) returns
        >>> site(torch.zeros(2))            # no policy: runs eagerly
        tensor([0., 0.])
    """

    # Prefixed: a ModuleStub forwards every other attribute to its module, and a
    # module's own `self.name`, `self.fn` or `self.cache` read or set through the stub
    # in per-example code got the site's slot instead, silently.
    __slots__ = (
        "__weakref__", "_bg_autocast", "_bg_by_modes", "_bg_cache", "_bg_copying", "_bg_fn",
        "_bg_held", "_bg_last", "_bg_last1", "_bg_mode_module", "_bg_name", "_bg_shadows",
    )

    def __init__(self, fn: Callable[..., Any], autocast: AutocastState | None = None) -> None:
        self._bg_fn = fn
        self._bg_name = callable_name(fn)
        # A module's calls note its train/eval mode: they must run in it (dropout on or
        # off, batch or running statistics), as they would have run eagerly.
        self._bg_mode_module = fn if isinstance(fn, torch.nn.Module) else None
        self._bg_cache: dict[Any, Entry] = {}
        # The cached signatures holding an object by reference, oldest first (see
        # batchgraph.lifetimes: the cache keeps those objects alive).
        self._bg_held: list[Any] = []
        # Its in-place calls on handles run as this (batchgraph.on_copy), made once so
        # that their keys compare equal.
        self._bg_copying: Callable[..., Any] | None = None
        # Entries resolved in other train/eval modes than the cached ones, by
        # (signature, modes): switching back and forth resolves each signature once.
        self._bg_by_modes: dict[tuple[Any, tuple[bool, ...]], Entry] = {}
        # Calls made under autocast record through a shadow site per autocast state,
        # with its own caches: their specs (and keys) are that state's.
        self._bg_autocast = autocast
        self._bg_shadows: dict[AutocastState, CallSite] = {}
        # The last signature of handle and number arguments and its entry: one tuple,
        # so it is replaced atomically (sites are shared by threads).
        self._bg_last: tuple[list[Any] | None, Any] = (None, None)
        # The same for calls of one handle: its spec and the entry.
        self._bg_last1: tuple[TensorSpec | None, Any] = (None, None)

    @property
    def fn(self) -> Callable[..., Any]:
        """The callable this site records (``bg.batched_func(f).fn is f``); a
        ``ModuleStub`` forwards ``fn`` to its module instead, as any attribute."""
        return self._bg_fn

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {self._bg_name}>"

    # What functools.wraps gives a decorated function, so that inspect.signature,
    # help() and tools that name functions see the callable the site records
    # (``@bg.batched_func def step(x, h)`` is still "step", with its parameters).
    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self._bg_fn

    @property
    def __name__(self) -> str:  # type: ignore[override]
        name: str = self._bg_fn.__name__  # none for a module, as on the module
        return name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        # ``@bg.batched_func`` above a method's def: read through an instance, the site
        # stands for the method bound to it, as the function's own __get__ would bind
        # it (eagerly obj.helper(x) calls helper(obj, x)). Without this, self was not
        # passed: "helper() missing 1 required positional argument".
        if obj is None or type(self._bg_fn) is not FunctionType:
            return self
        from batchgraph.sites import method_site  # sites imports this module

        return method_site(self._bg_fn, obj)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Record the call into the active policy's graph (and return its handle), or
        run it eagerly when no policy is active.

        This is the hot path, one Python frame per recorded call.
        """
        policy = _ACTIVE.get()
        if policy is None:
            return self._bg_fn(*args, **kwargs)
        if _autocast_enabled() and self._bg_autocast is None:
            return self._bg_shadow()(*args, **kwargs)
        graph = policy.graph
        if (
            len(args) == 1
            and not kwargs
            and type(a := args[0]) is ResultHandle
            and a._graph is graph
            and type(spec := a.spec) is TensorSpec
            and ((given := a._out) is None or unchanged(given))
        ):
            # The commonest call, one handle for one tensor of this graph (an embedding,
            # a linear layer, an activation), without the general path's lists. A handle
            # whose handed-out value changed in place takes the general path, which
            # passes a copy of that value instead (signatures.encode_argument).
            last1 = self._bg_last1
            entry = last1[1]
            if last1[0] is not spec or entry.rules_token != policy.rules_token:
                entry = self._bg_entry(policy, args, kwargs, (spec,))
                _set_last1(self, (spec, entry))  # self._bg_last1 = ..., see _set_last1
            source = a.node
            refs: tuple[Ref, ...] = ((source, a.leaf),)
            deepest = graph.node_depth[source]
            handed = given is not None
        else:
            node_depth = graph.node_depth
            inputs: list[Ref] = []
            deepest = 0
            sig: list[Any] = []
            simple = True  # only handles and numbers: the last-signature check applies
            handed = False  # a handle's value was handed out (see view_of_handed)
            nested = False  # handles in a list or tuple argument
            for a in args:
                if (
                    type(a) is ResultHandle and a._graph is graph and type(spec := a.spec) is TensorSpec
                    and ((given := a._out) is None or unchanged(given))
                ):
                    # The common case, inlined: a handle for one tensor of this graph.
                    if given is not None:
                        handed = True
                    source = a.node
                    inputs.append((source, a.leaf))
                    sig.append(spec)
                    d = node_depth[source]
                    if d > deepest:
                        deepest = d
                else:
                    kind = type(a)
                    if kind is ResultHandle and a._out is not None:
                        handed = True
                    if kind is int or kind is bool or (kind is float and a):  # h * 2.0
                        sig.append((kind, a))  # as static_value, inlined
                        continue
                    box = [deepest]
                    if kind is tuple:  # cell(x, (h, c)): the signature check still applies
                        entry_ = encode_handle_tuple(a, graph, inputs, box)
                        if entry_ is not None:
                            sig.append(entry_)
                            deepest = box[0]
                            nested = True
                            continue
                    elif kind is list:
                        nested = True
                    simple = False
                    sig.append(encode_argument(a, graph, inputs, box))
                    deepest = box[0]
            if kwargs:
                handed = handed or any(
                    type(v) is ResultHandle and v._out is not None for v in kwargs.values())
                box = [deepest]
                key_sig: Any = (tuple(sig), tuple((k, encode_argument(v, graph, inputs, box)) for k, v in kwargs.items()))
                deepest = box[0]
                entry = self._bg_entry(policy, args, kwargs, key_sig)
            else:
                # A site is mostly called with one signature over and over: compare with the
                # last one (specs are interned, so this is identity checks, and numbers are
                # tagged with their type) before hashing.
                last = self._bg_last
                if simple and last[0] == sig and last[1].rules_token == policy.rules_token:
                    entry = last[1]
                else:
                    entry = self._bg_entry(policy, args, kwargs, tuple(sig))
                    if simple:
                        _set_last(self, (sig, entry))
            if entry.on_copy and type(args[0]) is not ResultHandle:
                # Resolved for a handle changed in place (h.add_(g)); a tensor of the
                # same spec (t.add_(g)) has its signature, but it may not change so.
                raise (in_place_error(self._bg_fn, self._bg_name, args, kwargs)
                       or changes_plain_tensor(self._bg_name))
            refs = tuple(inputs)
            if nested and not handed and (
                    entry.view if entry.view is not None else self._bg_note_view(entry)):
                # A view of handles in a list (torch.meshgrid([h, g])): looked into only
                # for calls that make views, so a cell's (h, c) costs no scan.
                handed = holds_handed(args)
        if handed and (entry.view if entry.view is not None else self._bg_note_view(entry)):
            # A view of a value handed out: eagerly it shares the value's memory, and
            # follows its in-place changes, made outside recording (aliasing module).
            viewed = view_of_handed(self, self._bg_fn, args, kwargs)
            if viewed is not NOT_VIEWED:
                return viewed
        memo = entry.memo
        # Inference mode first: inside it even torch.enable_grad() builds no autograd
        # graph (eager calls give inference tensors that do not require grad).
        grad: RecordedGrad = INFERENCE if _inference_enabled() else _grad_enabled()
        module = self._bg_mode_module
        if module is None:
            training = hooked = None
        else:
            training = module.training
            # Hook handles are numbered by one counter: after any registration, a
            # module's next call notes its hooks in key_id (see Graph.key_hooks).
            hooked = _HANDLES.next_id
        # The stamp changes with every compute and optimizer step: a module's first
        # call after one goes through key_id, which notes its parameters' versions
        # (see Graph.key_versions).
        if memo[0] == graph.stamp and memo[2] is grad and memo[3] is training and memo[4] == hooked:
            kid = memo[1]
        else:
            attrs = recheck(self, policy, entry, args, kwargs)
            if attrs is STALE:  # resolved anew
                return self(*args, **kwargs)
            kid = graph.key_id(entry.key, grad, self._bg_autocast, training, attrs)
            entry.memo = (graph.stamp, kid, grad, training, hooked)
            if not entry.dedupe:  # never merged: it may draw random numbers
                graph.draws_random = True
        spec = entry.spec
        fresh = node = len(graph.node_key)
        if entry.dedupe and graph.dedupe:
            # Hash-consing: an identical call (same key, same inputs) is the same node.
            # One setdefault hashes the signature once (a tuple's hash is not cached).
            node = graph.dedupe_table.setdefault((kid, refs), fresh)
            if node != fresh:
                if node >= graph.generation_first:
                    graph.shared.add(node)  # Graph.merge's usual case, inlined
                else:
                    node = graph.merge(node, (kid, refs), fresh)
                if node != fresh and (graph.handed_views or graph.early_views) and (
                        reads_changed_view(graph, refs, node)):
                    node = graph.dedupe_table[(kid, refs)] = fresh
        if node != fresh:
            graph.merged_calls += 1
        else:
            # Graph.add_node, inlined: this runs once per recorded call.
            graph.node_key.append(kid)
            graph.node_inputs.append(refs)
            graph.node_depth.append(deepest + 1)
            graph.node_spec.append(spec)
            graph.node_loc.append(-1)
        # Handles are built field by field: calling the class (and its __init__) costs
        # a third more, and this runs once or twice per recorded call.
        if entry.single:
            h = _new_handle(ResultHandle)
            h._graph = graph
            h._gen = graph.generation
            h.node = node
            h.leaf = 0
            h.spec = spec
            h._out = None
            if entry.on_copy:  # `nn.ReLU(inplace=True)(h)`: h stands for the result
                return rebind_to_copy(args[0], h, self._bg_name)
            return h
        children = entry.children
        if children is None:
            out = handles_for(graph, node, 0, spec)
            return out if entry.kind is None else rebuild_result(entry.kind, out)
        if len(children) == 2:  # (h, c) and friends, without a comprehension frame
            h = _new_handle(ResultHandle)
            h._graph = graph
            h._gen = graph.generation
            h.node = node
            h.leaf = 0
            h.spec = children[0][1]
            h._out = None
            c = _new_handle(ResultHandle)
            c._graph = graph
            c._gen = graph.generation
            c.node = node
            c.leaf = 1
            c.spec = children[1][1]
            c._out = None
            return (h, c)
        return tuple([ResultHandle(graph, node, i, s) for i, s in children])

    def _bg_note_view(self, entry: Entry) -> bool:
        """Work out, once per entry, whether its calls make a view of an input."""
        view = entry.view = not entry.on_copy and makes_view(self._bg_fn, entry.key)
        return view

    def _bg_forget(self) -> None:
        """Drop every cached signature (each is replaced whole: sites are shared by
        threads, and one reading the old cache meanwhile still gets a whole entry)."""
        self._bg_cache = {}
        self._bg_held = []
        self._bg_by_modes = {}
        self._bg_last = (None, None)
        self._bg_last1 = (None, None)

    def _bg_shadow(self) -> CallSite:
        """The site recording this callable's calls in the current autocast state."""
        state = autocast_state()
        assert state is not None
        shadow = self._bg_shadows.get(state)
        if shadow is None:
            shadow = self._bg_shadows[state] = CallSite(self._bg_fn, autocast=state)
        return shadow

    def _bg_entry(
        self, policy: BatchingPolicy, args: tuple[Any, ...], kwargs: dict[str, Any], key_sig: Any
    ) -> Entry:
        """The cached entry for ``key_sig``, resolved (and cached) when new."""
        try:
            entry = self._bg_cache.get(key_sig)
            if entry is None and (canonical := without_nan(key_sig)) is not key_sig:
                key_sig = canonical
                entry = self._bg_cache.get(key_sig)
            cacheable = True
        except TypeError:
            # An unhashable static argument: key on its identity, and do not cache
            # (the cache would keep the object alive forever).
            key_sig = identity_signature(key_sig)
            entry = None
            cacheable = False
        if entry is None or entry.rules_token != policy.rules_token:
            entry = self._bg_resolve(policy, args, kwargs, key_sig)
            if cacheable:
                entry.sig = key_sig
                keep_signature(self, key_sig, entry)
        return entry

    def _bg_resolve(
        self, policy: BatchingPolicy, args: tuple[Any, ...], kwargs: dict[str, Any], key_sig: Any
    ) -> Entry:
        # Slow path, once per signature: build the template, infer the output spec
        # on fake tensors, choose the key, and check that vmap can run it.
        policy.follow_default_dtype()  # the entry's token is of the default it is resolved in
        fn = self._bg_fn
        specs: list[TensorSpec | None] = []
        template_args = tuple(template_argument(a, specs) for a in args)
        template_kwargs = tuple((k, template_argument(v, specs)) for k, v in kwargs.items())
        call = CallSignature(template_args, template_kwargs, tuple(specs), key_sig)
        if records_on_copy(fn, args, kwargs, call):
            # Recorded on a copy, which the input handle then stands for.
            if self._bg_copying is None:
                self._bg_copying = on_copy(fn, self._bg_name)
            fn = self._bg_copying
        elif (error := in_place_error(fn, self._bg_name, args, kwargs)) is not None:
            raise error
        if isinstance(fn, torch.nn.Module):
            with not_recording():
                materialize_lazy(fn, call)
        graph = policy.graph
        before, kept, changed = graph.attributes_now(fn), kept_count(), changed_count()
        drew = drawn_count()
        with not_recording(), guard_lazy_reads(fn), buffers_kept(fn):
            spec, draws_random, kind = infer_spec(fn, callable_name(fn), call)
        # Drawing from Python's random or NumPy's: each call its own (python_random).
        draws_random = draws_random or drawn_count() != drew
        key = choose_key(fn, call, policy.rules)
        if key.batchable and spec is not None:
            with not_recording(), buffers_kept(fn):
                batches = probe_vmap(key, spec)
            if not batches or changed_count() != changed or drawn_count() != drew:
                # A total carried across calls in place (self.total += x): each call
                # reads the one before it's, which no batched run gives.
                key = UnbatchedKey(fn, call)
        # What they changed is no setting (a counter).
        note_own_state(graph.watched_modules(fn), before, graph.attributes_now(fn))
        if spec is None and key.batchable:
            key = UnbatchedKey(fn, call)
        if not key.batchable and kept_count() != kept:
            key.in_order = True  # state of its own read across calls: see ordering
        entry = Entry(key, intern_spec(spec), policy.rules_token, draws_random, kind)
        # Of the site's own callable, as CallSite.__call__ compares them.
        entry.layout = graph.signature_layout(self._bg_fn)
        entry.modes = graph.modes_of(self._bg_fn)
        # As CallSite.__call__ compares them (stale_entries), holding no tensor.
        entry.attrs = spec_attributes(graph.attributes_now(key.fn))
        if isinstance(self._bg_fn, torch.nn.Module):
            entry.hooks = hooks_of(self._bg_fn)
        entry.on_copy = fn is not self._bg_fn
        return entry

    def _bg_infer_spec(self, call: CallSignature) -> tuple[OutSpec, bool, ResultKind]:
        """See ``batchgraph.inference.infer_spec``."""
        return infer_spec(self._bg_fn, self._bg_name, call)


# The hot path writes these slots through their descriptors: a ModuleStub (a module's
# site) forwards other attribute writes to its module (``self.layer.p = 0.2`` in
# per-example code), and its __setattr__ in Python would cost five times as much.
_set_last1: Callable[[CallSite, Any], None] = vars(CallSite)["_bg_last1"].__set__
_set_last: Callable[[CallSite, Any], None] = vars(CallSite)["_bg_last"].__set__


def handles_for(graph: Graph, node: int, leaf: int, spec: OutSpec) -> Any:
    """What a recorded call returns: a handle per tensor, in the result's nesting.

    A single tensor (or a result whose structure is unknown until it runs) gets one
    handle; a tuple result gets a tuple of handles, nested like the eager result, with
    ``None`` where the result holds ``None``.
    """
    if type(spec) is not tuple:
        return None if spec is NO_TENSOR else ResultHandle(graph, node, leaf, spec)
    out = []
    for child in cast(tuple[OutSpec, ...], spec):
        out.append(handles_for(graph, node, leaf, child))
        leaf += count_leaves(child)
    return tuple(out)
