"""Plain numbers a forward keeps on its modules and sets again at every call: counted
only, or read.

A count the output's operations read (``self.n += 1; return x * self.n``) shows in the
operations of batchgraph's runs (``module_state.carries_state``), but one read only by
Python's control flow does not: ``self.n += 1; if self.n > 2: return lin(x) * 2``
makes the same operations at every call once its branch settles, so its calls batched
and the count counted batched calls, not examples (4 calls, 2 batches: ``n`` 2 where
eagerly 4), and a call after the branch moved read the wrong branch. Nor does a number
taken from the input's shape and read by the next call (``out = lin(x) * self.n;
self.n = x.shape[0]``): a run of one length sets it to the value it had, and the
calls of that length batched, ahead of a longer call recorded before them.

``numbers_carried`` runs the call once more with each plain number of the user's
modules (``int``, ``float``: not ``bool``, whose first-call flags the operations show)
replaced by an equal one that notes its reads (a comparison, ``bool``, ``int()``, an
index, a hash, a torch call taking it) and passes itself on through arithmetic, and
with the inputs' shapes made of such numbers too. A number the run sets anew where it
read the old one (a count read by anything but its own increment), or sets from the
input's shape, carries state from call to call: such calls run one at a time in the
order they were recorded. A count nothing reads (``self.calls += 1``), settings read
but never set, and a cache bound once (``if n > self.cached_len: self.cached_len =
n``, set by an earlier run already) are left to batch.

Looked into: the modules' own attributes and the items of the dicts and lists among
them (``self.state["n"]``; not deeper, nor objects they hold). The run costs as much as the one that learnt the call's output, so it is made
only where some module's class is the user's and sets attributes (or items) in a
method other than ``__init__`` (``sets_attributes``, its bytecode read once per class), or the
first run changed an attribute: torch's own modules keep no such state.
"""

from __future__ import annotations

import dis
import operator
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from batchgraph.attributes import MODULE_OWN
from batchgraph.python_state import SavedAttributes

__all__ = ["numbers_carried", "sets_attributes"]

# The tag of numbers taken from an input's shape.
_INPUT = "input"
Tag = Any  # (module index, attribute name), or _INPUT


class _Watched:
    """What the watching ``int`` and ``float`` share: the tags of the attributes (and
    inputs) the value was computed from, and where its reads are noted."""

    _plain: int | float
    _tags: frozenset[Tag]
    _noted: set[Tag]


def _watch(value: Any, tags: frozenset[Tag], noted: set[Tag]) -> Any:
    """``value`` as a number noting its reads in ``noted``, where it is an int or float."""
    kind = type(value)
    if kind is not int and kind is not float:
        return value  # a bool (a comparison's), a complex, a tensor
    out: Any = (_WatchedInt if kind is int else _WatchedFloat)(value)
    out._plain, out._tags, out._noted = value, tags, noted
    return out


def _plain(value: Any) -> Any:
    return value._plain if isinstance(value, _Watched) else value


def _tags(values: Iterable[Any]) -> frozenset[Tag]:
    return frozenset(t for v in values if isinstance(v, _Watched) for t in v._tags)


_NUMBERS = (int, float, bool)
_ARITHMETIC = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or",
               "xor", "lshift", "rshift")
_UNARY = ("neg", "pos", "abs", "invert")
_READS = ("bool", "index", "int", "float", "complex", "hash", "eq", "ne", "lt", "le", "gt",
          "ge", "format", "str", "repr", "round", "trunc", "floor", "ceil", "divmod",
          "rdivmod")


def _binary(fn: Callable[[Any, Any], Any], reflected: bool) -> Callable[[Any, Any], Any]:
    def op(self: _Watched, other: Any) -> Any:
        if not isinstance(other, _NUMBERS):
            return NotImplemented  # a tensor's own operator takes the watched number
        a, b = (_plain(other), self._plain) if reflected else (self._plain, _plain(other))
        return _watch(fn(a, b), self._tags | _tags((other,)), self._noted)
    return op


def _unary(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def op(self: _Watched) -> Any:
        return _watch(fn(self._plain), self._tags, self._noted)
    return op


def _read(base: type, name: str) -> Callable[..., Any]:
    method = getattr(base, name)

    def op(self: _Watched, *args: Any) -> Any:
        self._noted.update(self._tags, _tags(args))
        return method(self._plain, *map(_plain, args))
    return op


def _read_property(member: types.GetSetDescriptorType) -> property:
    def get(self: _Watched) -> Any:
        self._noted.update(self._tags)
        return member.__get__(self._plain)
    return property(get)


def _methods(base: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _ARITHMETIC:
        fn = getattr(operator, f"{name}_" if name in ("and", "or") else name)
        out[f"__{name}__"] = _binary(fn, reflected=False)
        out[f"__r{name}__"] = _binary(fn, reflected=True)
    for name in _UNARY:
        out[f"__{name}__"] = _unary(getattr(operator, name))
    for name in _READS:
        if hasattr(base, f"__{name}__"):
            out[f"__{name}__"] = _read(base, f"__{name}__")
    # The number's own methods and properties read it too (if self.n.bit_length() > 2,
    # self.t.is_integer(), self.n.real): inherited, they read the plain value unnoted.
    for name, member in vars(base).items():
        if name.startswith("_") or not isinstance(
                member, (types.MethodDescriptorType, types.GetSetDescriptorType)):
            continue  # from_bytes, fromhex: made from others, not read from it
        out[name] = (_read_property(member) if isinstance(member, types.GetSetDescriptorType)
                     else _read(base, name))
    return out


_WatchedInt = type("_WatchedInt", (_Watched, int), _methods(int))
_WatchedFloat = type("_WatchedFloat", (_Watched, float), _methods(float))


class _Reads(TorchFunctionMode):
    """Notes the watched numbers a torch call takes, and hands out the inputs' shapes
    as watched numbers tagged ``_INPUT``."""

    def __init__(self, noted: set[Tag]) -> None:
        super().__init__()
        self.noted = noted

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self._note((args, tuple(kwargs.values())))
        out = func(*args, **kwargs)
        if func is torch.Tensor.size or getattr(func, "__self__", None) is torch.Tensor.shape:
            tags = frozenset({_INPUT})
            if isinstance(out, torch.Size):
                return torch.Size([_watch(d, tags, self.noted) for d in out])
            return _watch(out, tags, self.noted)
        return out

    def _note(self, value: Any) -> None:
        if isinstance(value, _Watched):
            self.noted.update(value._tags)
        elif isinstance(value, (list, tuple)):
            for v in value:
                self._note(v)
        elif isinstance(value, slice):
            self._note((value.start, value.stop, value.step))


# Per class of the user's: whether a method other than __init__ may set an attribute.
_SETS: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()
_SETTING = frozenset({"setattr", "__setattr__", "__dict__", "register_buffer"})


def sets_attributes(modules: Iterable[torch.nn.Module]) -> bool:
    """Whether one of ``modules`` is of a class of the user's (not torch's) with a
    method, other than ``__init__``, that sets an attribute or an item (``self.n =
    ...``, ``self.n += 1``, ``setattr``, ``self.state["n"] += 1``).

    Example:
        >>> class Counting(torch.nn.Linear):
        ...     def forward(self, x):
        ...         self.calls = getattr(self, "calls", 0) + 1
        ...         return super().forward(x)
        >>> sets_attributes([torch.nn.Linear(2, 2)]), sets_attributes([Counting(2, 2)])
        (False, True)
    """
    for m in modules:
        kind = type(m)
        if kind.__module__.startswith("torch."):
            continue
        found = _SETS.get(kind)
        if found is None:
            found = _SETS[kind] = any(
                _stores(fn.__code__) for c in kind.__mro__
                if not c.__module__.startswith("torch.") and c is not object
                for name, fn in vars(c).items()
                if name != "__init__" and isinstance(fn, types.FunctionType))
        if found:
            return True
    return False


def _stores(code: types.CodeType) -> bool:
    if _SETTING.intersection(code.co_names) or any(
            i.opname in ("STORE_ATTR", "DELETE_ATTR", "STORE_SUBSCR") for i in dis.get_instructions(code)):
        return True
    return any(_stores(c) for c in code.co_consts if isinstance(c, types.CodeType))


# Where a number is kept: its container (the module's __dict__, a dict or list in it)
# and key, the watching number put there, and its label (Class.attribute[key]).
_Slot = tuple[Any, Any, Any, str]


def _watch_numbers(module: torch.nn.Module, noted: set[Tag]) -> list[_Slot]:
    """Put watching numbers in place of ``module``'s plain numbers: its attributes,
    and the items of the dicts and lists among them (``self.state["n"]``)."""
    slots: list[_Slot] = []
    prefix = type(module).__name__
    attrs = vars(module)
    places: list[tuple[Any, Any, str]] = []
    for name, value in attrs.items():
        if name in MODULE_OWN:
            continue
        places.append((attrs, name, f"{prefix}.{name}"))
        if type(value) is dict:
            places += [(value, k, f"{prefix}.{name}[{k!r}]") for k in value]
        elif type(value) is list:
            places += [(value, i, f"{prefix}.{name}[{i}]") for i in range(len(value))]
    for holder, key, label in places:
        if type(holder[key]) in (int, float):
            holder[key] = _watch(holder[key], frozenset({label}), noted)
            slots.append((holder, key, holder[key], label))
    return slots


def _item(holder: Any, key: Any) -> Any:
    if isinstance(holder, dict):
        return holder.get(key)
    return holder[key] if key < len(holder) else None


def _from_input(value: Any) -> bool:
    return isinstance(value, _Watched) and _INPUT in value._tags


def numbers_carried(run: Callable[[], object], modules: list[torch.nn.Module]) -> list[str]:
    """The plain numbers of ``modules`` (of the user's) that ``run`` sets anew having
    read them, or sets from its inputs' shapes, as ``Class.attribute``; the modules'
    attributes are left as they were.

    Example:
        >>> class Branching(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.n, self.calls, self.width = 0, 0, 2
        ...     def forward(self, x):
        ...         self.n += 1
        ...         self.calls += 1
        ...         return x * 2 if self.n > self.width else x
        >>> m = Branching()
        >>> numbers_carried(lambda: m(torch.ones(2)), [m]), (m.n, m.calls)
        (['Branching.n'], (0, 0))
    """
    own = [m for m in modules if not type(m).__module__.startswith("torch.")]
    if not own:
        return []
    saved = [SavedAttributes(m, MODULE_OWN) for m in own]
    noted: set[Tag] = set()
    slots = [slot for m in own for slot in _watch_numbers(m, noted)]
    try:
        try:
            with _Reads(noted):
                run()
        except Exception:
            # A forward that cannot take the watching numbers (type(n) is int
            # checked, a C function wanting an exact int): as before, left to batch.
            return []
        found = {label for holder, key, was, label in slots
                 if (now := _item(holder, key)) is not was and (
                     label in noted or _from_input(now))}
        # attributes bound anew from the input's shape (self.n = x.shape[0], no n before)
        found.update(f"{type(m).__name__}.{name}" for m, attrs_before in zip(own, saved)
                     for name in attrs_before.rebound() - set(attrs_before.before)
                     if _from_input(vars(m).get(name)))
        return sorted(found)
    finally:
        for attrs_before in saved:
            attrs_before.put_back(attrs_before.changed())
