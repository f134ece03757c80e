"""What batchgraph's own runs of a forward leave in its modules' attributes.

batchgraph runs a call on fake tensors to learn its output (a new signature's shape
inference, the vmap probe, the grad and aliasing checks). A forward that keeps a
tensor it makes (``if self.mask is None: self.mask = torch.ones_like(x)``, a rotary
embedding's ``self.cos`` cached per length, ``self.cache[n] = table``) kept the
*fake* tensor of that run: the batched compute and every eager call after it read
it and failed ("aten.allclose: DataDependentOutputException") or returned fake
tensors. ``state_kept`` puts such a module's attributes back as they were before
the run, all those the run changed (a ``cached_len`` with its ``cos``, so they stay
consistent), and notes them as state the forward keeps itself
(``attributes.note_own_names``), as a run that changed them would have been.
Changes holding no tensor are put back too: a call counter (``self.n += 1``) counted
each of batchgraph's runs, and its calls computed with another count than eagerly.

A forward whose run changes the state again each time (a counter, ``self.n += 1`` or
``self.step = self.step + 1``, not made from its input) gives each call another value
than the one before it: ``carries_state`` runs such a call a second time and tells
(its calls run one at a time in recorded order), where a cache filled once (a table
per length) is left alone by the second run, and its calls still batch. A count
that changes but that no operation reads (``self.calls += 1``) gives a third run the
same operations as the second: its calls batch too. The first run is made once more,
traced, and the operations computing its output (the modules' state a leaf) are
compared with the second's: a first-call flag (``x * (2 if self.seen else 1)``) or a
count read until it stops changing (``min(self.step, 2)``) computes the second
otherwise, where a cache filled by the first is only read by both. A buffer changed
in place (skipped on fake tensors) and read by the output (``self.step.add_(1); return
x + self.step``, ``spectral_norm``'s power iteration in training) carries state too,
and so does a number set anew at each call and read by control flow alone (``if
self.n > 2:``) or set from the input's shape (``number_reads``).

Looked into (``python_state.SavedAttributes``, which the pipeline's probe and rerun
save and put back too): the modules' attributes, the lists, deques, dicts, sets and
tuples in them, plain objects of the user's in them (a ``SimpleNamespace``, a dataclass
instance: ``plain_objects``), 3 deep, and the modules' buffers (one registered in
forward).

It also tells whether a tensor kept was one of vmap's batched tensors
(``Kept.batched``): under ``torch.func.vmap`` such a forward keeps the whole batch
(``self.last_out = out``, a mask made from the batched input), a tensor that escaped
vmap and fails every later use, and where the forward reads it back in a later call
(``if self.ref is None: self.ref = x``) every example read its own value where
eagerly later calls read the first one's: other values, silently. The vmap probe
(``vmap_probe.probe_vmap``) runs such a call one example at a time instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from batchgraph.attributes import MODULE_OWN, note_own_names
from batchgraph.buffers import buffers_of_kept
from batchgraph.fake_mode import watching_changes
from batchgraph.number_reads import numbers_carried, sets_attributes
from batchgraph.python_state import PLAIN, SavedAttributes, tensors_in

__all__ = ["Kept", "carries_state", "changed_count", "kept_count", "output_ops", "state_kept"]

_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
# Runs that kept a tensor in a module (see kept_count).
_kept = [0]
# Of those, runs that changed a plain tensor attribute in place (see changed_count).
_changed = [0]


class Kept:
    """What a run inside ``state_kept`` kept (and was undone): ``names``, each as
    ``Class.attribute``, and whether one of them held a batched tensor of vmap's."""

    __slots__ = ("batched", "changed", "names", "saved")

    def __init__(self, saved: list[SavedAttributes]) -> None:
        self.names: list[str] = []
        self.batched = False
        self.saved = saved  # the modules' attributes before the run
        # the real tensors whose in-place changes the run skipped (watching_changes)
        self.changed: list[torch.Tensor] = []


@contextlib.contextmanager
def state_kept(fn: Any) -> Iterator[Kept]:
    """Around a run of ``fn`` on fake tensors: buffers it replaced are put back
    (``buffers.buffers_kept``), and so are the attributes of a module where the run left a
    tensor in one (rebound, or put into a list or dict the module holds).

    Example:
        >>> from batchgraph.inference import on_fake_tensors
        >>> class Caching(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.mask = None
        ...     def forward(self, x):
        ...         if self.mask is None:
        ...             self.mask = torch.ones_like(x)
        ...         return x * self.mask
        >>> m = Caching()
        >>> with state_kept(m) as kept, on_fake_tensors():
        ...     _ = m(torch.empty(3))
        >>> m.mask is None, kept.names
        (True, ['Caching.mask'])
    """
    modules = _modules(fn)
    kept = Kept(_saved(modules))
    with watching_changes() as changed, buffers_of_kept(modules):
        start = len(changed)
        kept.changed = changed
        try:
            yield kept
        finally:
            skipped = {id(t) for t in changed[start:]}
            del changed[start:]
            for attrs in kept.saved:
                _put_back(attrs, kept)
                _note_changed_in_place(attrs.module, attrs.before, skipped, kept)


def kept_count() -> int:
    """How many times a run inside ``state_kept`` kept a tensor in a module (undone):
    a resolve that moved it found a forward keeping state of its own.

    Example:
        >>> before = kept_count()
        >>> with state_kept(torch.nn.Linear(2, 2)) as kept:
        ...     pass
        >>> kept_count() == before, kept.names
        (True, [])
    """
    return _kept[0]


def _modules(fn: Any) -> list[torch.nn.Module]:
    from batchgraph.captured import captured_parts  # captured imports nothing of ours

    if isinstance(fn, torch.nn.Module):
        return list(fn.modules())
    return [m for _, m in captured_parts(fn)[2]]


def _saved(modules: list[torch.nn.Module]) -> list[SavedAttributes]:
    return [SavedAttributes(m, MODULE_OWN) for m in modules]


def carries_state(kept: Kept, run: Callable[[], object]) -> bool:
    """Inside ``state_kept``: where the run so far changed the modules' attributes,
    whether ``run`` (the call once more) changes them again, with its output reading
    them: a step kept in a tensor (``self.step = self.step + 1; return x *
    self.step``: the output is computed from the step the first run left) does, and
    so does a count its operations read (``x * self.n`` after ``self.n += 1``: a third
    run's operations differ). A cache filled once is left alone by a second run; a
    count the output does not read (``self.count = self.count + 1``, ``self.calls +=
    1``) or a tensor made anew from others (a weight a pre-hook recomputes) gives an
    output made of none of it, and a third run the same operations. Such a call
    reads state each call before it changed (counted as in-place changes are:
    ``changed_count``), and is run one at a time in recorded order; the others batch,
    and change their state once per batched call.

    Example:
        >>> from batchgraph.inference import on_fake_tensors
        >>> class Counting(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.n = 0
        ...     def forward(self, x):
        ...         self.n += 1
        ...         return x * self.n
        >>> m = Counting()
        >>> with state_kept(m) as kept, on_fake_tensors():
        ...     _ = m(torch.empty(3))
        ...     again = carries_state(kept, lambda: m(torch.empty(3)))
        >>> again, m.n
        (True, 0)
    """
    modules = [attrs.module for attrs in kept.saved]
    if _reads_buffer_changed(kept, run, modules):
        return True
    # A number set anew at each call and read by control flow alone (if self.n > 2:)
    # makes the same operations, or one set from the input's shape (self.n =
    # x.shape[0], read by the next call) the same value, at a run of one length.
    if (any(attrs.changed() for attrs in kept.saved) or sets_attributes(modules)) and (
            carried := numbers_carried(run, modules)):
        kept.names.extend(name for name in carried if name not in kept.names)
        _kept[0] += 1
        _changed[0] += 1
        return True
    if not any(attrs.changed() for attrs in kept.saved):
        return False
    # The first run once more, traced, from the state before it: a first-call flag
    # (x * (2 if self.seen else 1); self.seen = True) or a count read until it stops
    # changing (min(self.step, 2)) leaves a second run that changes nothing, or a
    # third that repeats it, yet the second's output was computed otherwise.
    for attrs in kept.saved:
        attrs.put_back(attrs.changed())
    first = _Trace.of(run, [], modules)
    # The state the first run left: the second run's output made from it reads it.
    left = [t for attrs in kept.saved for name in attrs.changed()
            for t in tensors_in(vars(attrs.module).get(name))]
    then = _saved(modules)
    second = _Trace.of(run, left, modules)
    alike = second.to_output == first.to_output  # else the second computed otherwise
    if alike and not any(attrs.changed() for attrs in then):  # a cache filled once
        return False
    if alike and not second.made_of_state and _Trace.of(run, [], modules).ops == second.ops:
        return False
    _kept[0] += 1
    _changed[0] += 1
    return True


class _Trace(TorchFunctionMode):
    """The torch operations a run makes, each with its arguments' shapes and plain
    values (a count read by ``x * self.n`` shows as its value), whether its output
    was computed from the tensors ``state`` (followed through the operations), and
    the operations its output was computed by (``to_output``), from the modules'
    state as a leaf: a cache filled by the first run and read by the second gives
    both the same, a first-call flag read by the output does not."""

    def __init__(self, state: list[torch.Tensor]) -> None:
        super().__init__()
        self.ops: list[tuple[Any, ...]] = []
        self.flow: list[tuple[list[int], list[int]]] = []  # each op's inputs, outputs
        self.made: list[Any] = list(state)  # held: their ids stay theirs
        self.ids = {id(t) for t in state}
        self.made_of_state = False
        self.to_output: list[tuple[Any, ...]] = []
        self.reads: set[int] = set()  # the ids the output's operations read, to the inputs
        self.written: set[int] = set()  # the ids changed in place (add_, out=)
        self.out: object = None

    @classmethod
    def of(cls, run: Callable[[], object], state: list[torch.Tensor],
           modules: list[torch.nn.Module]) -> _Trace:
        trace = cls(state)
        held = _state_of(modules)
        with trace:
            out = run()
        held += _state_of(modules)
        trace.made_of_state = any(id(t) in trace.ids for t in tensors_in(out))
        trace.out = out
        outputs = [id(t) for t in tensors_in(out)]
        trace.to_output = trace._reaching(outputs, {id(t) for t in held})
        trace._reaching(outputs, set(), trace.reads)
        return trace

    def _reaching(self, wanted: list[int], leaves: set[int],
                  need: set[int] | None = None) -> list[tuple[Any, ...]]:
        """The operations ``wanted`` is computed by, back to ``leaves``; ``need`` gets
        the ids they read."""
        need = set() if need is None else need
        need.update(i for i in wanted if i not in leaves)
        ops = []
        for op, (read, made) in zip(reversed(self.ops), reversed(self.flow)):
            if need.intersection(made):
                ops.append(op)
                need.update(i for i in read if i not in leaves)
        return ops[::-1]

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        read: list[int] = []
        self.ops.append((func, _shown(args, read), _shown(tuple(kwargs.items()), read)))
        name = getattr(func, "__name__", "")
        if (name.endswith("_") and not name.endswith("__")) or name.startswith("__i"):
            self.written.update(read[:1])
        self.written.update(id(t) for t in tensors_in(kwargs.get("out")))
        out = func(*args, **kwargs)
        made = tensors_in(out)
        self.made += made
        self.flow.append((read, [id(t) for t in made]))
        if self.ids and any(i in self.ids for i in read):
            self.ids.update(id(t) for t in made)
        return out


def _reads_buffer_changed(kept: Kept, run: Callable[[], object],
                          modules: list[torch.nn.Module]) -> bool:
    """Whether the run changed a buffer in place (skipped on fake tensors) that its
    output is computed from (``self.step.add_(1); return x + self.step``, a
    ``spectral_norm`` pre-hook's power iteration in training): eagerly each call reads
    the step the one before left, where a batched call reads one step for all. A
    buffer only updated (BatchNorm's running statistics, a count of calls) is no read.
    Such calls are noted as changing state in place (``changed_count``)."""
    buffers = {id(b) for m in modules for b in m._buffers.values() if b is not None}
    skipped = buffers.intersection(id(t) for t in kept.changed)
    # (a run changing none of the state needs no trace: a pre-hook's out= into a
    # buffer is not skipped but sets the weight anew)
    if not skipped and not any(attrs.changed() for attrs in kept.saved):
        return False
    trace = _Trace.of(run, [], modules)
    if not buffers.intersection(trace.reads, trace.written | skipped):
        return False
    _kept[0] += 1
    _changed[0] += 1
    return True


def output_ops(run: Callable[[], object], modules: list[torch.nn.Module]
               ) -> tuple[object, list[tuple[Any, ...]]]:
    """``run``'s output, and the torch operations computing it (their arguments' shapes
    and plain values), from ``modules``' state as a leaf: two calls of a forward that
    differ read state an earlier call changed (a first-call flag, a count).

    Example:
        >>> lin, x = torch.nn.Linear(2, 2), torch.ones(2)
        >>> out, ops = output_ops(lambda: lin(x) * 3, [lin])
        >>> [op[0].__name__ for op in ops], ops[-1][1][1]
        (['linear', 'mul'], 3)
    """
    trace = _Trace.of(run, [], modules)
    return trace.out, trace.to_output


def _state_of(modules: list[torch.nn.Module]) -> list[torch.Tensor]:
    return [t for m in modules for v in vars(m).values() for t in tensors_in(v)]


def _shown(value: Any, read: list[int]) -> Any:
    if isinstance(value, torch.Tensor):
        read.append(id(value))
        return (tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_shown(v, read) for v in value)
    return value if type(value) in PLAIN else type(value)


def _put_back(attrs: SavedAttributes, kept: Kept) -> None:
    changed = attrs.changed()
    if not changed:
        return
    now = vars(attrs.module)
    tensors = [t for name in changed for t in tensors_in(now.get(name))]
    if tensors:  # a counter alone is put back, and taken for no kept tensor
        _kept[0] += 1
        kept.batched = kept.batched or any(_wrapped(t) for t in tensors)
    kept.names.extend(f"{type(attrs.module).__name__}.{name}" for name in sorted(changed))
    attrs.put_back(changed)
    note_own_names(attrs.module, changed)


def _note_changed_in_place(module: torch.nn.Module, before: dict[str, Any],
                           skipped: set[int], kept: Kept) -> None:
    """Note the plain tensor attributes of ``module`` the run changed in place (a total
    carried across calls, ``self.total += x.sum(0)``; ``skipped``: the ids of the real
    tensors whose in-place changes the run skipped, so there is nothing to put back),
    as kept: the calls read state of their own, and run in recorded order."""
    if not skipped:
        return
    names = [name for name, t in before.items() if isinstance(t, torch.Tensor)
             and name not in MODULE_OWN and id(t) in skipped]
    if names:
        _kept[0] += 1
        _changed[0] += 1
        kept.names.extend(f"{type(module).__name__}.{name}" for name in sorted(names))


def changed_count() -> int:
    """How many times a run inside ``state_kept`` changed a module's plain tensor
    attribute in place (skipped): a resolve that moved it found a forward carrying a
    total across calls, which no batched run can give each call of.

    Example:
        >>> before = changed_count()
        >>> with state_kept(torch.nn.Linear(2, 2)):
        ...     pass
        >>> changed_count() == before
        True
    """
    return _changed[0]
