"""torch functions about a tensor's metadata, answered for handles from their specs.

``torch.numel(h)``, ``torch.is_floating_point(h)``, ``torch.is_complex(h)`` and
``torch.result_type(h, 2.0)`` return Python values, which a recorded call cannot give
(it was refused with "a recorded call must return a tensor"); but they read only a
tensor's shape and dtype, which a handle knows while recording, as ``h.numel()`` and
``h.is_floating_point()`` already answer. So they are answered at once, on meta
tensors of the handles' specs (``torch.result_type`` tells 0-d tensors from others).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["answer_from_specs"]


def _meta(value: Any) -> Any:
    """A handle's stand-in: an empty meta tensor of its spec (anything else as it is)."""
    spec_of = getattr(value, "_tensor_spec", None)
    if spec_of is None or isinstance(value, torch.Tensor):
        return value
    spec = spec_of("metadata")
    return torch.empty(spec.shape, dtype=spec.dtype, device="meta")


def _on_specs(fn: Callable[..., Any]) -> Callable[..., Any]:
    def answer(*args: Any, **kwargs: Any) -> Any:
        return fn(*tree_map(_meta, args), **tree_map(_meta, kwargs))

    return answer


_ANSWERED: dict[Any, Callable[..., Any]] = {
    fn: _on_specs(fn)
    for fn in (torch.numel, torch.is_floating_point, torch.is_complex, torch.result_type)
}


def answer_from_specs(func: Any) -> Callable[..., Any] | None:
    """How ``func`` called on handles is answered from their specs, or None where it is
    recorded as a call.

    Example:
        >>> import batchgraph as bg
        >>> with bg.BatchingPolicy():
        ...     h = bg.batched_value(torch.ones(2, 3)) * 2
        ...     torch.numel(h), torch.result_type(h, 2.0), torch.is_complex(h)
        (6, torch.float32, False)
    """
    try:
        return _ANSWERED.get(func)
    except TypeError:  # an unhashable callable
        return None
