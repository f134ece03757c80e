"""Per-example tensor specs and the shape of a call's arguments.

A recorded call is described without tensors: each tensor input becomes a
``TensorSpec`` (per-example shape, dtype, device) and a slot number; everything else
is a static value. ``CallSignature`` keeps that description and rebuilds the real
arguments from a list of (batched or per-example) tensors when the call runs.

Output specs are trees: a ``TensorSpec`` for one tensor, a tuple of trees for a tuple
result (``nn.LSTM`` returns ``(out, (h, c))``), or ``None`` when the structure cannot
be known before running the call.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Union, cast

import torch

__all__ = [
    "NO_TENSOR",
    "CallSignature",
    "InputSlot",
    "OutSpec",
    "TensorSpec",
    "count_leaves",
    "dataclass_fields",
    "intern_spec",
    "rebuild_dataclass",
    "rebuild_mapping",
    "rebuild_sequence",
    "sequence_kind",
    "spec_leaves",
    "spec_of",
]


class TensorSpec(NamedTuple):
    """What must match for two per-example tensors to batch: shape, dtype, device."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype, tensor.device)

    def describe(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return f"{tuple(self.shape)} {dtype} on {self.device}"


class _NoTensor:
    """The spec of a ``None`` inside a result (``attention(q, k, v, need_weights=False)``
    returns ``(out, None)``): no tensor, no leaf; its handle is ``None``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NO_TENSOR"

    def __reduce__(self) -> str:
        return "NO_TENSOR"  # unpickles as the one instance


NO_TENSOR = _NoTensor()

# None: a structure unknown until the call runs.
OutSpec = Union[TensorSpec, tuple["OutSpec", ...], _NoTensor, None]

# One object per distinct TensorSpec that call results carry, so the recording hot
# path can compare signatures by identity (equal specs are the same object).
_INTERNED: dict[TensorSpec, TensorSpec] = {}


def intern_spec(spec: OutSpec) -> OutSpec:
    """``spec`` with each ``TensorSpec`` replaced by the one interned equal to it.

    Example:
        >>> a = TensorSpec((3,), torch.float32, torch.device("cpu"))
        >>> b = TensorSpec((3,), torch.float32, torch.device("cpu"))
        >>> intern_spec(a) is intern_spec(b)
        True
    """
    if type(spec) is TensorSpec:
        return _INTERNED.setdefault(spec, spec)
    if type(spec) is tuple:
        return tuple(intern_spec(s) for s in cast(tuple[OutSpec, ...], spec))
    return spec


def count_leaves(spec: OutSpec) -> int:
    """Number of tensors in an output spec tree (1 for an unknown structure)."""
    if spec is None or isinstance(spec, TensorSpec):
        return 1
    if spec is NO_TENSOR:
        return 0
    return sum(count_leaves(s) for s in cast(tuple[OutSpec, ...], spec))


def spec_leaves(spec: OutSpec) -> list[OutSpec]:
    """The leaves of an output spec tree, in the order ``flatten_output`` gives
    tensors (``None`` for a structure unknown until the call runs)."""
    leaves: list[OutSpec] = []
    _flatten_spec(spec, leaves)
    return leaves


def _flatten_spec(spec: OutSpec, out: list[OutSpec]) -> None:
    if type(spec) is tuple:
        for child in cast(tuple[OutSpec, ...], spec):
            _flatten_spec(child, out)
    elif spec is not NO_TENSOR:
        out.append(spec)


def spec_of(value: Any) -> OutSpec:
    """The spec tree of a call's result: tensors, and tuples/lists of them.

    Raises:
        TypeError: if ``value`` holds anything but tensors (the caller turns this into
            a ``NotATensorError`` naming the call).
    """
    if isinstance(value, torch.Tensor):
        return TensorSpec.of(value)
    if isinstance(value, (tuple, list)):
        return tuple(NO_TENSOR if v is None else spec_of(v) for v in value)
    raise TypeError(f"expected a tensor or a tuple of tensors, got {type(value).__name__}")


def sequence_kind(value: Any) -> type | None:
    """The type of a list, namedtuple or ``torch.return_types`` result (None for a
    plain tuple or anything else), so that handles come back in the eager result's
    kind: ``h.max(-1).values`` and ``torch.split(h, 1)`` work as on tensors.

    Example:
        >>> sequence_kind(torch.zeros(2, 3).max(-1)).__name__
        'max'
        >>> sequence_kind((torch.zeros(1),)) is None
        True
    """
    kind = type(value)
    if kind is tuple or not isinstance(value, (tuple, list)):
        return None
    return kind


def rebuild_sequence(kind: type, values: list[Any]) -> Any:
    """``values`` as a sequence of type ``kind``: a list, a tuple, a namedtuple, or a
    structseq such as ``torch.return_types.max`` (built from one sequence, where a
    namedtuple takes its fields as arguments).

    Example:
        >>> rebuild_sequence(type(torch.zeros(2, 3).max(-1)), [1, 2]).indices
        2
    """
    if kind is tuple:
        return tuple(values)
    if kind is list:
        return values
    if hasattr(kind, "_fields"):
        return kind(*values)
    if hasattr(kind, "n_fields") or issubclass(kind, list):
        return kind(values)
    return tuple(values)


def dataclass_fields(obj: Any) -> tuple[str, ...] | None:
    """The field names of a dataclass instance, or None for anything else: results
    and awaited values may hold handles in dataclass fields, as in lists and dicts.

    Example:
        >>> import dataclasses
        >>> @dataclasses.dataclass
        ... class Out:
        ...     logits: Any
        ...     length: int
        >>> dataclass_fields(Out(None, 3)), dataclass_fields((1, 2))
        (('logits', 'length'), None)
    """
    kind = type(obj)
    names = _DATACLASS_FIELDS.get(kind)
    if names is None:
        if not hasattr(kind, "__dataclass_fields__"):
            return None
        names = _DATACLASS_FIELDS[kind] = tuple(f.name for f in dataclasses.fields(obj))
    return names


_DATACLASS_FIELDS: dict[type, tuple[str, ...]] = {}


def rebuild_dataclass(obj: Any, names: tuple[str, ...], rebuild: Callable[[Any], Any]) -> Any:
    """Dataclass instance ``obj`` with ``rebuild`` applied to its fields ``names``
    (``dataclass_fields(obj)``): ``obj`` itself where no field changes, else a copy.

    Copied and set rather than constructed: a frozen dataclass, fields outside
    ``__init__`` and a ``__post_init__`` that would run again all stay as they are.

    Example:
        >>> import dataclasses
        >>> @dataclasses.dataclass(frozen=True)
        ... class Out:
        ...     x: int
        >>> rebuild_dataclass(Out(1), ("x",), lambda v: v + 1)
        Out(x=2)
    """
    values = {name: rebuild(getattr(obj, name)) for name in names}
    if all(v is getattr(obj, name) for name, v in values.items()):
        return obj
    new = copy.copy(obj)
    for name, value in values.items():
        object.__setattr__(new, name, value)
    return new


def rebuild_mapping(obj: dict[Any, Any], items: Iterable[tuple[Any, Any]]) -> dict[Any, Any]:
    """A mapping of ``obj``'s kind holding ``items`` (its keys, with new values).

    A dict subclass is copied, then given the new values, rather than called with
    the items: ``defaultdict(items)`` would take them for its ``default_factory``
    ("first argument must be callable or None"), and a subclass's own ``__init__``
    may take other arguments. The copy keeps what the mapping holds besides its
    items (a default_factory, attributes).

    Example:
        >>> from collections import defaultdict
        >>> d = rebuild_mapping(defaultdict(list, a=1), [("a", 2)])
        >>> d["a"], d["b"]
        (2, [])
    """
    if type(obj) is dict:
        return dict(items)
    out = copy.copy(obj)
    for key, value in items:
        out[key] = value
    return out


def flatten_output(value: Any, out: list[torch.Tensor]) -> None:
    """Append the tensors of a (nested) result to ``out`` in spec-tree order."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            if v is not None:  # NO_TENSOR: no leaf
                flatten_output(v, out)
    else:
        raise TypeError(f"expected a tensor or a tuple of tensors, got {type(value).__name__}")


class InputSlot(NamedTuple):
    """Placeholder in an argument template: the ``slot``-th tensor input."""

    slot: int


@dataclass(frozen=True)
class _Seq:
    """A list or tuple argument that contains tensor inputs (``torch.cat([a, b])``)."""

    kind: type
    items: tuple[Any, ...]


@dataclass(frozen=True)
class _Map:
    """A dict argument that contains tensor inputs (``f({"a": h, "b": g})``): its keys,
    in order, and their values' templates. Each call gets a dict of its own."""

    kind: type
    keys: tuple[Any, ...]
    values: tuple[Any, ...]


def _fill(template: Any, inputs: Sequence[Any]) -> Any:
    if type(template) is InputSlot:
        return inputs[template.slot]
    if type(template) is _Seq:
        return template.kind(_fill(t, inputs) for t in template.items)
    if type(template) is _Map:
        return template.kind(zip(template.keys, [_fill(t, inputs) for t in template.values]))
    return template


# PyTorch's argument parser takes NumPy's names for some parameters of its native
# functions (``torch.cat(xs, axis=0)``, ``x.sum(axis=1)``, as eagerly): a rule that
# reads or rewrites ``dim`` must find it under its alias too.
_ALIASES: dict[str, tuple[str, ...]] = {"dim": ("dim", "axis")}


def _names(name: str) -> tuple[str, ...]:
    return _ALIASES.get(name, (name,))


@dataclass(frozen=True)
class CallSignature:
    """A call with its tensor inputs taken out.

    ``args``/``kwargs`` hold ``InputSlot`` placeholders where tensors were;
    ``input_specs[i]`` is the per-example spec of input ``i`` (``None`` if unknown);
    ``statics`` is the hashable summary of everything else.

    Example:
        >>> sig = CallSignature((InputSlot(0), 2), (), (TensorSpec((3,), torch.float32,
        ...     torch.device("cpu")),), ("s", 2))
        >>> sig.apply(torch.mul, [torch.ones(3)])
        tensor([2., 2., 2.])
    """

    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    input_specs: tuple[TensorSpec | None, ...]
    statics: Any

    @property
    def num_inputs(self) -> int:
        return len(self.input_specs)

    def apply(self, fn: Callable[..., Any], inputs: Sequence[Any]) -> Any:
        """Call ``fn`` with the template filled from ``inputs``."""
        args = [_fill(a, inputs) for a in self.args]
        if self.kwargs:
            return fn(*args, **{k: _fill(v, inputs) for k, v in self.kwargs})
        return fn(*args)

    def static_arg(self, position: int, name: str, default: Any) -> Any:
        """The static value passed at ``position`` or as ``name`` (or its NumPy alias:
        ``axis`` for ``dim``), else ``default``."""
        names = _names(name)
        for key, value in self.kwargs:
            if key in names:
                return value
        if position < len(self.args):
            return self.args[position]
        return default

    def with_arg(self, position: int, name: str, value: Any) -> CallSignature:
        """A copy with the static argument at ``position``/``name`` replaced (passed
        by keyword when the call left it to its default). A value passed under the
        alias (``axis=``) is replaced there: adding ``dim=`` beside it would pass the
        argument twice."""
        names = _names(name)
        by_keyword = any(k in names for k, _ in self.kwargs)
        kwargs = tuple((k, value if k in names else v) for k, v in self.kwargs)
        args = self.args
        if not by_keyword:
            if position < len(args):
                args = (*args[:position], value, *args[position + 1 :])
            else:
                kwargs = (*kwargs, (name, value))
        return CallSignature(args, kwargs, self.input_specs, self.statics)


def make_seq(kind: type, items: tuple[Any, ...]) -> _Seq:
    return _Seq(kind, items)


def make_map(kind: type, keys: tuple[Any, ...], values: tuple[Any, ...]) -> _Map:
    return _Map(kind, keys, values)


def tuple_parts(template: Any) -> tuple[Any, ...]:
    """The parts of a tuple argument in a template (a static tuple, or one that holds
    tensor inputs); any other argument is its own one part (``h[i]`` vs ``h[i, j]``)."""
    if type(template) is tuple:
        return template
    if type(template) is _Seq and template.kind is tuple:
        return template.items
    return (template,)
