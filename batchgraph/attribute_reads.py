"""Attributes read on a handle that are computations, and so are recorded: tensor
properties (``h.T``, ``h.real``) and the fields of torch's named results read on a
result of unknown structure (``torch.linalg.lstsq(a, b).solution``). Each is one
importable function, so batches recorded in worker processes name it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["RESULT_FIELDS", "TENSOR_PROPERTIES", "property_call", "property_getter", "read_field"]


# Tensor properties that are computations (recorded); other non-callable tensor
# attributes (grad, requires_grad, ...) only exist on computed values.
TENSOR_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag"})


class _TensorProperty:
    """The recorded form of each such property: one importable function per property
    (``batchgraph.attribute_reads:_TensorProperty.T``), so batches recorded in worker
    processes name it, and one call-signature cache per property."""


def _define_getter(name: str) -> None:
    def getter(t: torch.Tensor) -> torch.Tensor:
        value: torch.Tensor = getattr(t, name)
        return value

    getter.__name__ = name
    getter.__qualname__ = f"_TensorProperty.{name}"
    setattr(_TensorProperty, name, staticmethod(getter))


for _name in sorted(TENSOR_PROPERTIES):
    _define_getter(_name)


# The field names of torch's named results (``torch.linalg.lstsq(a, b).solution``)
# that no tensor has: on a result whose structure is only known once it runs, reading
# one records the read, as ``h[0]`` does. (Names tensors have too, such as ``values``,
# stay the tensor's methods.)
RESULT_FIELDS = frozenset(
    field
    for kind in vars(torch.return_types).values()
    if isinstance(kind, type) and hasattr(kind, "n_fields")
    for field in getattr(kind, "__match_args__", ())
    if not hasattr(torch.Tensor, field)
)


def read_field(result: Any, name: str) -> Any:
    """``result.name``: what reading a field of a handle of unknown structure
    records (importable, so batches recorded in worker processes name it).

    Example:
        >>> read_field(torch.linalg.slogdet(torch.eye(2)), "logabsdet")
        tensor(0.)
    """
    return getattr(result, name)


def property_getter(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    getter: Callable[[torch.Tensor], torch.Tensor] = getattr(_TensorProperty, name)
    return getter


def property_call(name: str, tensor: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The torch call that reads property ``name`` of ``tensor`` (a handle: its
    ``dim()`` known from its spec), so it batches as torch's own view does: the
    property's getter, a function of batchgraph's, ran one example at a time
    (``q @ k.T``: one launch per example). The getter where no call says the same
    (``h.mT`` of a 1-D value: eagerly an error, raised by the getter).

    Example:
        >>> fn, args = property_call("mT", torch.ones(2, 3, 4))
        >>> fn(*args).shape
        torch.Size([2, 4, 3])
    """
    ndim = tensor.dim() if name in ("T", "mT", "H", "mH") else 0
    if name == "T" and ndim <= 2:
        return torch.Tensor.t, (tensor,)
    if name == "mT" and ndim >= 2:
        return torch.Tensor.transpose, (tensor, -2, -1)
    if (name == "mH" and ndim >= 2) or (name == "H" and ndim == 2):
        return torch.Tensor.adjoint, (tensor,)
    if name in ("real", "imag"):
        return getattr(torch, name), (tensor,)
    return property_getter(name), (tensor,)
