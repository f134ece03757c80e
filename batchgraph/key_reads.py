"""What a key's callable reads besides its arguments, and whether that changed.

A batched call reads its module's parameters, buffers and submodules' modes (for a
function, the tensors and modules it closes over: ``batchgraph.captured``) when it
computes, not when it was recorded. ``Graph.key_id`` notes them, as part of a key's
identity, at a key's first call after each compute and each optimizer step, so calls
recorded before and after a change never batch together; the executor asks, before
a compute runs, whether they changed since (``ParameterChangedError``,
``BufferChangedError``, ``ModuleModeChangedError``, and for modules' plain
attributes, ``batchgraph.attributes``, ``ModuleAttributeChangedError``). Kept apart from
``batchgraph.graph``, whose ``Graph`` takes these methods as a mixin.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

from batchgraph.attributes import Attributes, attribute_cache, changed_attributes
from batchgraph.buffers import Watch, epochs, watches_of
from batchgraph.captured import captured_parts
from batchgraph.hooks import Hooks, hooks_of
from batchgraph.keys import BatchKey

__all__ = ["NOT_READ", "KeyReads", "ModuleParts"]

# reads_now's ``attrs`` when the caller has not read them.
NOT_READ: Any = object()

Versions = tuple[int, ...]


class KeyReads:
    """What each key id's calls read, noted per key id (a mixin of ``Graph``, which
    makes the dictionaries).

    Example:
        >>> from batchgraph.graph import Graph
        >>> from batchgraph.keys import StackKey
        >>> from batchgraph.specs import CallSignature, InputSlot, TensorSpec
        >>> lin = torch.nn.Linear(2, 2)
        >>> spec = TensorSpec((2,), torch.float32, torch.device("cpu"))
        >>> graph = Graph()
        >>> kid = graph.key_id(StackKey(lin, CallSignature((InputSlot(0),), (), (spec,), None)))
        >>> graph.parameters_changed(kid)
        False
        >>> with torch.no_grad():
        ...     _ = lin.weight.mul_(2)
        >>> graph.parameters_changed(kid)
        True
    """

    keys: list[BatchKey]
    key_versions: dict[int, Versions]
    key_params: dict[int, tuple[torch.Tensor, ...]]
    key_layouts: dict[int, tuple[tuple[torch.dtype, torch.device], ...]]
    key_buffers: dict[int, Versions]
    key_buffer_parts: dict[int, ModuleParts]
    key_submodes: dict[int, tuple[bool, ...]]
    key_hooks: dict[int, Hooks]
    key_attrs: dict[int, Attributes]
    attrs_thread: int
    _module_parts: dict[int, ModuleParts]

    if TYPE_CHECKING:
        def new_stamp(self) -> None: ...  # Graph's: the next calls note anew

    def reads_now(self, fn: Any, attrs: Any = NOT_READ) -> tuple[
            Versions | None, tuple[bool, ...] | None, Versions | None, Hooks | None,
            Attributes | None]:
        """What calls of ``fn`` would read now, as part of their key's identity: its
        parameters' versions, its submodules' train/eval modes, its buffers' epochs
        (each None where it has none), for a module, its hooks (which its calls
        run when computed: ``batchgraph.hooks``), and the plain attributes of the
        modules it reads (``attributes_now``; ``attrs`` where the caller has them
        already, ``NOT_READ`` where not)."""
        versions = submodes = buffers = None
        parts = self._parts_of(fn)
        if (_replaced(parts.params, fn) or _replaced_buffers(parts, fn)) if isinstance(
                fn, torch.nn.Module) else (
                    _replaced_in_read_modules(parts) or _replaced_read_buffers(parts)):
            # A parameter or buffer replaced (load_state_dict(assign=True), `lin.weight =
            # nn.Parameter(...)`, `bn.running_mean = t`), or for a function, a parameter
            # or submodule of a module it reads: list the module's parts anew.
            self.forget_parts(fn)
            parts = self._parts_of(fn)
        if parts.params:
            versions = _versions(parts.params)
        if parts.submodules:
            submodes = tuple([m.training for m in parts.submodules])
        if parts.buffers:
            buffers = epochs(parts.buffers)
            if buffers is None:
                # A buffer was replaced (model.double() makes new buffer tensors,
                # where parameters stay): list the module's parts anew.
                self.forget_parts(fn)
                buffers = epochs(self._parts_of(fn).buffers)
            if buffers is not None:
                # And which tensors: calls recorded before and after a buffer was
                # replaced never share a key id (their parts, kept per key id, hold it).
                buffers = (*buffers, id(self._parts_of(fn).buffers))
        hooks = hooks_of(fn) if isinstance(fn, torch.nn.Module) else None
        if attrs is NOT_READ:
            attrs = parts.attributes.now() if parts.watched else None
        return versions, submodes, buffers, hooks, attrs

    def note_reads(self, kid: int, fn: Any, versions: Versions | None,
                   submodes: tuple[bool, ...] | None, buffers: Versions | None,
                   hooks: Hooks | None = None, attrs: Attributes | None = None) -> None:
        """Note for the new key id ``kid`` what ``reads_now`` gave, for the checks
        at compute."""
        if versions is not None:
            self.key_versions[kid] = versions
            self.key_params[kid] = self._parts_of(fn).params
            self.key_layouts[kid] = self.layout_of(fn)
            _watch_optimizer_steps(self)
        if submodes is not None:
            self.key_submodes[kid] = submodes
        if buffers is not None:
            self.key_buffers[kid] = buffers
            self.key_buffer_parts[kid] = self._parts_of(fn)
        if hooks is not None:
            self.key_hooks[kid] = hooks
        if attrs is not None:
            self.key_attrs[kid] = attrs
            self.attrs_thread = threading.get_ident()

    def _parts_of(self, module: Any) -> ModuleParts:
        found = self._module_parts.get(id(module))  # the key holds the module: id stays
        if found is None:
            found = self._module_parts[id(module)] = ModuleParts(module)
        return found

    def forget_parts(self, fn: Any) -> None:
        """List ``fn``'s parts anew at their next use (its buffers were replaced:
        ``model.double()`` makes new buffer tensors, where parameters stay)."""
        self._module_parts.pop(id(fn), None)

    def modes_of(self, fn: Any) -> tuple[bool, ...] | None:
        """The train/eval modes of a module and of its submodules, in order; for a
        function, of the modules it reads (None where it reads none). A call's output
        spec and key may depend on them (dropout drawing or not, batch or running
        statistics), so a call site's cached signatures are resolved per modes."""
        submodules = self._parts_of(fn).submodules
        if not isinstance(fn, torch.nn.Module):
            # A function: the modules it reads, if any.
            return tuple([m.training for m in submodules]) if submodules else None
        return (fn.training, *[m.training for m in submodules])

    def watched_modules(self, fn: Any) -> tuple[torch.nn.Module, ...]:
        """The modules whose plain attributes calls of ``fn`` read: it and its
        submodules, or the modules a function reads."""
        return self._parts_of(fn).watched

    def attributes_now(self, fn: Any) -> Attributes | None:
        """The plain attributes of the modules ``fn`` is or reads
        (``batchgraph.attributes``; None where it reads no module)."""
        parts = self._parts_of(fn)
        return parts.attributes.now() if parts.watched else None

    def changed_attributes(self, kid: int) -> list[str]:
        """The plain attributes of the modules key ``kid``'s callable is or reads
        changed since its calls were recorded, each as ``name: old -> new``.

        Exact where the change came between computes; one made between two calls
        recorded with no compute in between counts for both."""
        noted = self.key_attrs.get(kid)
        if noted is None:
            return []
        parts = self._parts_of(self.keys[kid].fn)
        now = parts.attributes.now()
        if now == noted:
            return []
        return changed_attributes(parts.watched, parts.watched_names, noted, now)

    def layout_of(self, fn: Any) -> tuple[tuple[torch.dtype, torch.device], ...]:
        """The dtype and device of each tensor ``fn`` reads besides its arguments: a
        module's parameters, a function's captured tensors (listed once per graph).

        A call's output spec may depend on them (an embedding's dtype is its
        weight's), so a call site's cached signatures hold only while they stay."""
        return tuple([(p.dtype, p.device) for p in self._parts_of(fn).params])

    def signature_layout(self, fn: Any) -> tuple[Any, ...]:
        """What a call site's cached signature of ``fn`` holds only while it stays:
        the dtype, device and shape of each tensor ``fn`` reads besides its arguments
        (``layout_of``), then the shape of each buffer it reads (None for one gone).

        An output spec may depend on them (an embedding's dtype is its weight's, a
        ``Linear``'s width its weight's rows): after ``lin.weight.data =
        torch.randn(6, 4)`` the next calls are resolved anew, as eagerly they compute
        with the new shape. Asked once per key and compute, not per call.

        Example:
            >>> from batchgraph.graph import Graph
            >>> lin = torch.nn.Linear(4, 3, bias=False)
            >>> Graph().signature_layout(lin)
            ((torch.float32, device(type='cpu'), torch.Size([3, 4])),)
        """
        parts = self._parts_of(fn)
        return (*[(p.dtype, p.device, _shape(p)) for p in parts.params],
                *[_shape(w.ref()) for w in parts.buffers])

    def switched_submodules(self, kid: int) -> list[str]:
        """The submodules of module key ``kid`` (for a function, the modules it reads,
        named ``Class.path``) switched between train and eval mode since its calls
        were recorded (named as in ``named_modules``).

        Exact where the switch came between computes; a switch between two calls
        recorded with no compute in between counts for both."""
        noted = self.key_submodes.get(kid)
        if noted is None:
            return []
        parts = self._module_parts[id(self.keys[kid].fn)]
        return [name for name, m, then in zip(parts.names, parts.submodules, noted)
                if m.training != then]

    def parameters_changed(self, kid: int) -> bool:
        """Whether the parameters of module key ``kid`` changed in place since its
        calls were recorded.

        Exact where the change came between computes or from an optimizer step (the
        calls after it get a new key id); a change made otherwise (``p.mul_(...)``)
        between two calls recorded with no compute in between counts for both."""
        noted = self.key_versions.get(kid)
        if noted is None:
            return False
        params, fn = self.key_params[kid], self.keys[kid].fn
        if isinstance(fn, torch.nn.Module):
            if _replaced(params, fn):
                return True
        else:
            # A parameter of a module it reads replaced (lin.bias = nn.Parameter(...)):
            # the batched calls would read the new one. Listed anew since, or now.
            now = self._parts_of(fn)
            if (len(now.params) != len(params) or any(a is not b for a, b in zip(now.params, params))
                    or _replaced_in_read_modules(now)):
                return True
        count = len(params)
        return (tuple([p._version for p in params]) != noted[:count]
                or _pointers(params) != noted[2 * count:3 * count])

    def unfrozen(self, kid: int) -> list[str]:
        """The parameters of key ``kid`` (named as in ``named_parameters``; for a
        function, ``tensor #i`` of those it reads) that did not require grad when its
        calls were recorded and do now (``requires_grad_(True)`` since).

        Eagerly those calls gave such a parameter no gradient; batched, they would.
        One frozen since is not counted: eagerly a backward after the freeze gives
        it no gradient either (autograd accumulates only into leaves that require
        grad then), as the batched calls do. Exact where the switch came between
        computes; one made between two calls with no compute in between counts for
        both."""
        noted = self.key_versions.get(kid)
        if noted is None:
            return []
        fn = self.keys[kid].fn
        params = self.key_params[kid]
        then = noted[len(params):2 * len(params)]
        names = ([name for name, _ in fn.named_parameters()] if isinstance(fn, torch.nn.Module)
                 else [f"tensor #{i}" for i in range(len(params))])
        return [name for name, p, was in zip(names, params, then) if p.requires_grad and not was]

    def watched_buffers(self, kid: int) -> tuple[Watch, ...]:
        """The watches of the buffers key ``kid``'s calls read (noted or not)."""
        return self._parts_of(self.keys[kid].fn).buffers

    def changed_buffers(self, kid: int) -> list[str]:
        """The buffers of key ``kid`` (named as in ``named_buffers``; for a function,
        ``Class.name``) changed in place by code other than batchgraph's since its
        calls were recorded: changes its computations made (a ``BatchNorm``'s
        running statistics in training mode) do not count.

        Exact where the change came between computes; one made between two calls
        recorded with no compute in between counts for both."""
        noted = self.key_buffers.get(kid)
        if noted is None:
            return []
        parts, fn = self.key_buffer_parts[kid], self.keys[kid].fn
        replaced = (_replaced_buffers(parts, fn) if isinstance(fn, torch.nn.Module)
                    else _replaced_read_buffers(parts))
        if replaced:  # `bn.running_mean = t`: the batched calls would read t
            return replaced
        now = epochs(parts.buffers)
        if now is None:
            # A function's, replaced since (model.double(): refused as a conversion).
            return []
        return [name for name, then, at in zip(parts.buffer_names, noted, now) if then != at]

    def adopt_replaced_buffers(self, kid: int) -> None:
        """Take the buffers of module key ``kid`` replaced since they were noted as
        its own (a compute's steps replaced them: ``watching_buffers``)."""
        fn, parts = self.keys[kid].fn, self.key_buffer_parts[kid]
        if _replaced_buffers(parts, fn) if isinstance(fn, torch.nn.Module) else (
                _replaced_read_buffers(parts)):
            self.forget_parts(fn)
            parts = self.key_buffer_parts[kid] = self._parts_of(fn)
            found = epochs(parts.buffers)
            if found is not None:
                self.key_buffers[kid] = (*found, id(parts.buffers))

    def parameters_converted(self, kid: int) -> bool:
        """Whether the parameters of key ``kid`` changed dtype or device (``.to()``,
        ``.double()``: not in place, so their versions stay) since its calls were
        recorded."""
        noted = self.key_layouts.get(kid)
        return noted is not None and self.layout_of(self.keys[kid].fn) != noted


def _versions(params: tuple[torch.Tensor, ...]) -> Versions:
    """The version counters of ``params``, then whether each requires grad, then where
    its data is, then the list's id: eagerly a call computes with the parameters as
    they are when it is made (its value requires grad or not), so calls recorded
    before a change of any, or before a parameter was replaced (a new list, kept by
    the key ids noted with it), are kept apart from those after it. ``p.data = t``
    moves no version counter, only the data."""
    return (*[p._version for p in params], *[p.requires_grad for p in params],
            *_pointers(params), id(params))


def _pointers(params: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
    try:
        return tuple([p.data_ptr() for p in params])
    except (RuntimeError, ValueError):
        # A sparse parameter has no one data pointer, an uninitialized one (a lazy
        # module's) none yet: not watched.
        return (0,) * len(params)


def _shape(tensor: torch.Tensor | None) -> torch.Size | str | None:
    if tensor is None:
        return None
    # A lazy module's parameter has no shape until its first call (reading it raises).
    return "uninitialized" if torch.nn.parameter.is_lazy(tensor) else tensor.shape


def _replaced_buffers(parts: ModuleParts, module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s buffers that are other tensors than ``parts`` lists
    (added or removed ones included)."""
    now = {name: b for name, b in module.named_buffers() if not b.is_inference()}
    then = {name: w.ref() for name, w in zip(parts.buffer_names, parts.buffers)}
    return [name for name in {**then, **now} if then.get(name) is not now.get(name)]


def _replaced_read_buffers(parts: ModuleParts) -> list[str]:
    """For a function's ``parts``: the buffers (``Class.name``) of the modules it reads
    that are not those listed (``bn.running_mean = t``).

    Example:
        >>> import torch
        >>> norm = torch.nn.BatchNorm1d(2)
        >>> parts = ModuleParts(lambda x: norm(x))
        >>> norm.running_mean = torch.ones(2)
        >>> _replaced_read_buffers(parts)
        ['BatchNorm1d.running_mean']
    """
    listed = {id(b) for w in parts.buffers if (b := w.ref()) is not None}
    listed.update(id(p) for p in parts.params)  # a buffer it reads itself
    return [f"{type(m).__name__}.{name}" for m in parts.submodules
            for name, b in m._buffers.items()
            if b is not None and not b.is_inference() and id(b) not in listed]


def _replaced_in_read_modules(parts: ModuleParts) -> bool:
    """For a function's ``parts``: whether a module it reads holds a parameter or a
    submodule now that was not listed (``lin.bias = nn.Parameter(...)``, ``m.l =
    nn.Linear(...)``).

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 2)
        >>> parts = ModuleParts(lambda x: lin(x))
        >>> before = _replaced_in_read_modules(parts)
        >>> lin.bias = torch.nn.Parameter(torch.zeros(2))
        >>> before, _replaced_in_read_modules(parts)
        (False, True)
    """
    if not parts.submodules:
        return False
    if parts.listed is None:  # once per listing: this runs once per key and compute
        parts.listed = ({id(p) for p in parts.params}, {id(m) for m in parts.submodules})
    params, modules = parts.listed
    return any(
        any(p is not None and id(p) not in params for p in m._parameters.values())
        or any(c is not None and id(c) not in modules for c in m._modules.values())
        for m in parts.submodules)


def _replaced(params: tuple[torch.Tensor, ...], module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters are other tensors than ``params`` now."""
    now = tuple(module.parameters())
    return len(now) != len(params) or any(a is not b for a, b in zip(now, params))


class ModuleParts:
    """A module's parameters, buffers (watched: batchgraph.buffers) and submodules
    (with their names), listed once; for a function, the tensors it reads besides its
    arguments, and the buffers and modules (submodules too) of the modules it reads
    (``captured_parts``)."""

    __slots__ = (
        "attributes", "buffer_names", "buffers", "listed", "names", "params", "submodules",
        "watched", "watched_names",
    )

    def __init__(self, module: Any) -> None:
        self.params: tuple[torch.Tensor, ...]
        if isinstance(module, torch.nn.Module):
            self.params = tuple(module.parameters())
            named = [(name, m) for name, m in module.named_modules() if m is not module]
            named_buffers: list[tuple[str, torch.Tensor]] = list(module.named_buffers())
        else:
            self.params, named_buffers, named = captured_parts(module)
        self.names = [name for name, _ in named]
        self.submodules = tuple(m for _, m in named)
        # The modules whose plain attributes calls read (batchgraph.attributes): a
        # module and its submodules, or the modules a function reads.
        self.watched: tuple[torch.nn.Module, ...] = self.submodules
        self.watched_names = self.names
        if isinstance(module, torch.nn.Module):
            self.watched = (module, *self.submodules)
            self.watched_names = ["", *self.names]
        self.attributes = attribute_cache(self.watched)
        self.buffer_names, self.buffers = watches_of(named_buffers)
        # The ids of params and submodules (``_replaced_in_read_modules``), once needed.
        self.listed: tuple[set[int], set[int]] | None = None


# Graphs that noted modules' parameters' versions: after an optimizer step, their
# next calls note them anew (a new stamp), so calls recorded after the step get key
# ids of their own, apart from those recorded before it.
_WATCHED: weakref.WeakSet[KeyReads] = weakref.WeakSet()
_hook_registered = False
# Graphs are added by the threads recording, and listed by the one stepping an
# optimizer (an actor-learner's learner beside its actors): listed while another
# thread added one, the step raised "Set changed size during iteration".
_watched_lock = threading.Lock()
# Per optimizer stepping now: its parameters that have a gradient (those a step
# updates), with their versions before the step.
_BEFORE: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[tuple[torch.Tensor, int]]] = (
    weakref.WeakKeyDictionary()
)


def _watch_optimizer_steps(graph: KeyReads) -> None:
    global _hook_registered
    with _watched_lock:
        _WATCHED.add(graph)
        registered, _hook_registered = _hook_registered, True
    if not registered:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        register_optimizer_step_pre_hook(_before_optimizer_step)
        register_optimizer_step_post_hook(_after_optimizer_step)


def _before_optimizer_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    if _WATCHED:
        _BEFORE[optimizer] = [(p, p._version) for group in optimizer.param_groups
                              for p in group["params"] if p.grad is not None]


def _after_optimizer_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    # A fused step (Adam(fused=True), ...) updates the parameters in one kernel that
    # leaves their version counters as they were: a call recorded before it would
    # have computed with the new weights, unrefused, and one recorded after it merged
    # with the old ones. Count the step as the change it is.
    unseen = [p for p, version in _BEFORE.pop(optimizer, ()) if p._version == version]
    if unseen:
        torch.autograd.graph.increment_version(unseen)
    with _watched_lock:
        graphs = list(_WATCHED)
    for graph in graphs:
        graph.new_stamp()
