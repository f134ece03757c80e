"""How long cached things live: what lives as long as the program, and the bounds on
what a call site keeps of the signatures it resolved.

A site's signature cache (``CallSite._bg_cache``) is keyed by the call's input specs and
static arguments. The sites of torch functions and operators live as long as the
program, so over a long run with varying static arguments (a temperature annealed per
step, ``logits / tau``; a NumPy mask; a new config object per batch) it grew by one
entry per distinct value, for good, and an object given by reference stayed alive in
it, with its tensors. It is bounded here: past ``SIGNATURES_KEPT`` entries the older
half is dropped (those signatures are resolved again if they come back, once each),
and a signature holding an object by reference is kept only among the last
``OBJECT_SIGNATURES_KEPT`` such ones, so a config object made per batch lives a few
batches at most, while a long-lived one given to every call stays cached. The
entries its runs on fake tensors add to torch's own dispatch cache are bounded too
(``trim_fake_cache``).
"""

from __future__ import annotations

import enum
from collections import deque
from itertools import islice
from types import (
    BuiltinFunctionType,
    ClassMethodDescriptorType,
    FunctionType,
    MethodDescriptorType,
    MethodType,
    MethodWrapperType,
    ModuleType,
    WrapperDescriptorType,
)
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from batchgraph.specs import TensorSpec

if TYPE_CHECKING:
    from batchgraph.entries import Entry
    from batchgraph.recording import CallSite

__all__ = [
    "FAKE_ENTRIES_KEPT", "OBJECT_SIGNATURES_KEPT", "SIGNATURES_KEPT", "bounded", "holds_objects",
    "keep_signature", "lives_forever", "trim_fake_cache",
]

K = TypeVar("K")
V = TypeVar("V")

# Enough for every shape and static argument a model uses over and over; past it the
# values vary without end, and resolving again costs one run on fake tensors. An entry
# takes about 6 KB (a float argument's, measured), so a site holds 12 MB at most.
SIGNATURES_KEPT = 2048
# Enough for the long-lived objects a model passes (a vocabulary, a config) to stay.
OBJECT_SIGNATURES_KEPT = 16
# Entries batchgraph's fake runs add to torch's dispatch cache of fake tensors (one
# dict for the whole process, never trimmed: about 1 KB an entry, three for a new
# float in ``h * s``), of which the newest are kept (see ``trim_fake_cache``).
FAKE_ENTRIES_KEPT = 8192
_FAKE_ENTRIES: deque[Any] = deque()

# C functions and descriptors: torch functions, operators, tensor methods.
_BUILTINS = (
    BuiltinFunctionType, MethodDescriptorType, WrapperDescriptorType, MethodWrapperType,
    ClassMethodDescriptorType,
)
# Static arguments that are values (compared by value, holding nothing else).
_VALUES = (
    str, bytes, int, float, complex, type(None), type, type(Ellipsis), torch.dtype,
    torch.device, torch.layout, torch.memory_format, TensorSpec, enum.Enum,
)


def lives_forever(fn: Any) -> bool:
    """Whether ``fn`` lives as long as the program: a function defined at module level,
    a class, or a C function bound to nothing, a module or a class (``torch.add``,
    ``operator.mul``, ``torch.Tensor.add``), but not one bound to an object
    (``w.mul``, a tensor's method), which would keep that object alive.

    Example:
        >>> lives_forever(torch.add), lives_forever(torch.ones(2).add)
        (True, False)
    """
    kind = type(fn)
    if kind is FunctionType:
        return "<" not in fn.__qualname__
    if isinstance(fn, type):
        return True
    if kind in _BUILTINS:
        owner = getattr(fn, "__self__", None)
        return owner is None or isinstance(owner, (ModuleType, type))
    return kind is MethodType and isinstance(fn.__self__, type)  # a classmethod


def holds_objects(sig: Any) -> bool:
    """Whether a call signature holds an argument by reference (an object of the
    user's, a local function) rather than values, specs, long-lived functions and
    modules (a model's layers, or their recording stubs, which pass for them) and
    their bound methods (``layer.forward``).

    A module passed to a recorded function (``block(layer, h)`` for each of a model's
    layers) is a part of the model, living as long as it: counted among the objects,
    a model of more layers than ``OBJECT_SIGNATURES_KEPT`` resolved every call anew,
    every batch (24 layers: 96 runs on fake tensors a batch, 1.3 s instead of 6 ms).

    Example:
        >>> holds_objects(((float, 0.5), "mean", torch.float32, torch.nn.Linear(2, 2)))
        False
        >>> holds_objects(((int, 1), object()))
        True
    """
    if isinstance(sig, tuple):
        return any(holds_objects(s) for s in sig)
    return not (isinstance(sig, _VALUES) or lives_forever(sig) or isinstance(
        sig.__self__ if type(sig) is MethodType else sig, torch.nn.Module))


def bounded(table: dict[K, V], key: K, value: V, limit: int | None = None) -> dict[K, V]:
    """``table`` with ``key`` set to ``value`` (as its newest entry): itself, or past
    ``limit`` entries (``SIGNATURES_KEPT`` when None) a new dict holding the newer half
    and the new entry (the caller replaces its reference: sites are shared by threads,
    and one reading the old table meanwhile still reads whole entries).

    Example:
        >>> table = {}
        >>> for i in range(10):
        ...     table = bounded(table, i, i, limit=4)
        >>> sorted(table)
        [6, 7, 8, 9]
    """
    if limit is None:
        limit = SIGNATURES_KEPT
    if key in table:
        del table[key]  # set anew: it moves to the newest end
    elif len(table) >= limit:
        table = dict(list(table.items())[len(table) // 2:])
    table[key] = value
    return table


def keep_signature(site: CallSite, sig: Any, entry: Entry) -> None:
    """Cache ``entry`` for ``sig`` on ``site``, within the bounds above: the signatures
    of a long run with varying static arguments do not pile up, nor the objects they
    hold by reference."""
    cache = site._bg_cache = bounded(site._bg_cache, sig, entry)
    if holds_objects(sig):
        held = site._bg_held = [s for s in site._bg_held if s in cache and s != sig]
        held.append(sig)
        if len(held) > OBJECT_SIGNATURES_KEPT:
            cache.pop(held.pop(0), None)


def trim_fake_cache(before: int) -> None:
    """After a run on fake tensors that began with torch's fake dispatch cache holding
    ``before`` entries: note the entries it added, and drop the oldest of those noted
    past ``FAKE_ENTRIES_KEPT``. The cache is torch's, for the whole process: each new
    signature's run added entries for good (a float argument is part of their keys),
    so a long run with varying static arguments or shapes grew it without end. Only
    entries batchgraph's runs added are dropped; others' (torch.compile's) stay.

    Example:
        >>> before = len(FakeTensorMode.cache)
        >>> with FakeTensorMode():
        ...     _ = torch.empty(2, 5).mul(0.25)
        >>> trim_fake_cache(before)
        >>> len(FakeTensorMode.cache) <= before + FAKE_ENTRIES_KEPT
        True
    """
    cache = FakeTensorMode.cache
    added = len(cache) - before
    if added <= 0:
        return
    try:
        # Insertion order: the newest entries are last (read from there, not copied).
        _FAKE_ENTRIES.extend(reversed(list(islice(reversed(cache), added))))
    except RuntimeError:  # another thread changed it meanwhile: not noted this time
        return
    while len(_FAKE_ENTRIES) > FAKE_ENTRIES_KEPT:
        cache.pop(_FAKE_ENTRIES.popleft(), None)
