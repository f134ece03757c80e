"""What the calls of equal keys must share besides their key: they run as one call.

A group of calls with equal ``BatchKey``s runs as one ``run`` of the first call's key,
so everything that ``run`` reads of a call comes from that one call's
``CallSignature``. The default ``identity()`` holds the whole signature; a custom one
may leave parts out, and those parts must still agree:

* the static arguments (``scale(x, 2.0)`` beside ``scale(x, 3.0)``): ``run`` applies
  ``self.call``'s to every example. Calls whose static arguments differ get key ids
  of their own (``statics_apart``), so they run apart, each with its own values, as
  eagerly, whatever ``identity()`` says;
* with ``combine = "stack"``, the per-example input specs: the inputs are gathered
  into one ``(B, *spec)`` tensor each. Calls that differ there are refused where
  recorded (``check_stackable``).
"""

from __future__ import annotations

from typing import Any

from batchgraph.errors import ShapeMismatchError
from batchgraph.keys import BatchKey
from batchgraph.specs import TensorSpec

__all__ = ["check_stackable", "statics_apart"]


class _Tensor:
    """Where a tensor argument stood in a signature (its spec masked)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "TENSOR"


_TENSOR = _Tensor()


def _masked(statics: Any) -> Any:
    if type(statics) is TensorSpec:
        return _TENSOR
    if type(statics) is tuple:
        return tuple(_masked(s) for s in statics)
    return statics


def statics_apart(key: BatchKey) -> Any:
    """What of ``key``'s call signature its ``identity()`` may leave out while its
    ``run`` still reads it: the static arguments, tensors' specs masked (lengths
    that a list rule leaves free stay free). None for keys whose identity holds the
    whole signature (the default ``BatchKey.identity``), which equal keys share.

    Example:
        >>> import torch, batchgraph as bg
        >>> from batchgraph.specs import CallSignature, InputSlot
        >>> spec = TensorSpec((3,), torch.float32, torch.device("cpu"))
        >>> class ByCallable(bg.StackKey):
        ...     def identity(self):
        ...         return id(self.fn)
        >>> call = CallSignature((InputSlot(0), 2.0), (), (spec,), (spec, (float, 2.0)))
        >>> statics_apart(ByCallable(torch.mul, call))
        (TENSOR, (<class 'float'>, 2.0))
        >>> statics_apart(bg.StackKey(torch.mul, call)) is None
        True
    """
    if type(key).identity is BatchKey.identity:
        return None
    return _masked(key.call.statics)


def check_stackable(first: BatchKey, other: BatchKey) -> None:
    """Refuse, where it is recorded, a call whose key equals ``first``'s (they would
    run as one call) though its per-example inputs differ: a rule with
    ``combine = "stack"`` gets each input as one tensor of shape ``(B, *spec)``, so
    equal keys need equal input specs. Only a custom ``identity()`` that leaves them
    out can do this (the default includes them); the gather would fail at compute
    with torch.cat's "Sizes of tensors must match" or, for dtypes, promote silently.
    """
    here, there = other.call.input_specs, first.call.input_specs
    if other.combine != "stack" or here == there:
        return
    if len(here) != len(there):
        what = f"it has {len(here)} tensor inputs and the earlier call {len(there)}"
    else:
        i = next(i for i, (a, b) in enumerate(zip(here, there)) if a != b)
        what = f"its input {i} is {_describe(here[i])} and the earlier call's {_describe(there[i])}"
    raise ShapeMismatchError(
        f"{other.label}: this call's key equals an earlier call's, so the two would run as "
        f"one stacked call, but {what}. With combine = \"stack\", "
        f"{type(other).__name__}.identity() must include the per-example input specs "
        "(BatchKey.identity() does: return (super().identity(), ...) to add to it), or "
        "set combine = \"list\" to receive each example's inputs as they are."
    )


def _describe(spec: TensorSpec | None) -> str:
    return "of unknown structure" if spec is None else spec.describe()
