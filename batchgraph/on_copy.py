"""In-place calls on a handle, recorded on a copy: ``nn.ReLU(inplace=True)(h)``,
``F.relu(h, inplace=True)``, ``h.relu_()``, ``h.mul_(2)``, ``torch.sigmoid_(h)``.

Eagerly such a call changes its input tensor and returns it, so every name bound to
that tensor sees the new value. A handle cannot be changed (it stands for a value that
calls recorded before it read, and identical calls share), so the call is recorded
out of place, on a copy of its input (``fn(x.clone(), ...)``, batched as any function
is), and the input handle is made to stand for the result, as ``h += g`` does
(``batchgraph.handle_operators``): the handle returned is the input handle itself, as
eagerly the call returns its input. Calls recorded on the handle before keep its old
value, as they read it eagerly.

As for ``h += g``, values sharing memory with the handle's (views) keep the old value
and a compute reading one afterwards is refused (``batchgraph.aliasing``); refused where
recorded: changing a view itself, the tensor given to ``bg.batched_value`` (eagerly the
handle is that tensor), and a value already handed out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from batchgraph.handle import ResultHandle
from batchgraph.handle_operators import _rebind, _refuse_shared
from batchgraph.signatures import changes_input_in_place

__all__ = ["changes_handle_in_place", "in_place_of", "on_copy", "rebind_to_copy"]


def changes_handle_in_place(fn: Callable[..., Any], args: tuple[Any, ...],
                            kwargs: dict[str, Any]) -> bool:
    """Whether ``fn(*args, **kwargs)`` changes its first argument in place and that is
    a handle (the calls this module records on a copy); ``out=`` calls are not."""
    return bool(args) and type(args[0]) is ResultHandle and changes_input_in_place(
        fn, args, kwargs)


def on_copy(fn: Callable[..., Any], name: str) -> Callable[..., torch.Tensor]:
    """``fn`` run on a copy of its first argument, which it returns.

    Example:
        >>> relu = on_copy(torch.nn.ReLU(inplace=True), "ReLU")
        >>> x = torch.tensor([-1.0, 2.0])
        >>> relu(x), x
        (tensor([0., 2.]), tensor([-1.,  2.]))
    """

    def run_on_copy(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        copy = x.clone()
        fn(copy, *args, **kwargs)
        return copy

    run_on_copy.__name__ = run_on_copy.__qualname__ = f"{name} (on a copy)"
    run_on_copy.in_place = fn  # type: ignore[attr-defined]  # see in_place_of
    return run_on_copy


def in_place_of(fn: Any) -> Any:
    """The in-place callable ``fn`` runs on a copy, or None where it is no such copy."""
    return getattr(fn, "in_place", None) if callable(fn) else None


def rebind_to_copy(handle: ResultHandle, result: ResultHandle, name: str) -> ResultHandle:
    """Make ``handle`` stand for ``result``, the in-place call ``name`` recorded on a
    copy of it, and return it (eagerly the call returns its changed input)."""
    shared = _refuse_shared(handle, name, f"give it a copy, {name}(h.clone())",
                            flag_only=name.endswith("requires_grad_"))
    return _rebind(handle, result, shared, name)
