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

from batchgraph.buffers import buffers_kept
from batchgraph.handle import ResultHandle
from batchgraph.handle_operators import _rebind, _refuse_shared
from batchgraph.inference import on_fake_tensors
from batchgraph.module_state import state_kept
from batchgraph.signatures import changes_input_in_place
from batchgraph.specs import CallSignature, InputSlot
from batchgraph.torch_callables import torchs_own

__all__ = [
    "changes_handle_in_place", "changes_plain_tensor", "in_place_of", "on_copy", "rebind_to_copy",
    "records_on_copy", "returns_changed_input",
]


def changes_handle_in_place(fn: Callable[..., Any], args: tuple[Any, ...],
                            kwargs: dict[str, Any]) -> bool:
    """Whether ``fn(*args, **kwargs)`` changes its first argument in place and that is
    a handle (the calls this module records on a copy); ``out=`` calls are not."""
    return bool(args) and type(args[0]) is ResultHandle and changes_input_in_place(
        fn, args, kwargs)


def records_on_copy(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                    call: CallSignature) -> bool:
    """Whether the call ``fn(*args, **kwargs)`` (signature ``call``) records on a copy
    of its first argument, a handle: torch's own in-place calls, and a user's callable
    named or flagged so that does change that argument and return it."""
    if not changes_handle_in_place(fn, args, kwargs):
        return False
    if torchs_own(fn):
        return True
    from batchgraph.recording import not_recording  # it imports this module

    with not_recording(), buffers_kept(fn):
        return returns_changed_input(fn, call)


def returns_changed_input(fn: Callable[..., Any], call: CallSignature) -> bool:
    """Whether ``call`` changes its first argument in place and returns it, as torch's
    in-place calls do, run once on fake tensors: what a user's callable named so
    (``def clamp_(x): return x.clamp_(min=0)``) or flagged so (timm's
    ``LayerScale(inplace=True)``) does, or not (``self.inplace`` kept for an activation
    of an intermediate value; a ``masked_`` returning a new tensor). Where not, the
    call records as any other: its result is its own, and a change it makes to an
    input is refused (``inference._changes_its_input``).

    Example:
        >>> from batchgraph.specs import TensorSpec
        >>> spec = TensorSpec((2,), torch.float32, torch.device("cpu"))
        >>> call = CallSignature((InputSlot(0),), (), (spec,), (spec,))
        >>> def clamp_(x):
        ...     return x.clamp_(min=0)
        >>> def masked_(x):
        ...     return x.clamp(min=0)
        >>> returns_changed_input(clamp_, call), returns_changed_input(masked_, call)
        (True, False)
    """
    first = call.args[0] if call.args else None
    if type(first) is not InputSlot or any(s is None for s in call.input_specs):
        return False
    try:
        with state_kept(fn), on_fake_tensors():
            fakes = [torch.empty(s.shape, dtype=s.dtype, device=s.device)
                     for s in call.input_specs if s is not None]
            out = call.apply(fn, fakes)
    except Exception:  # its run for the output spec reports what fails
        return False
    x = fakes[first.slot]
    return out is x and not x.is_inference() and x._version > 0


def changes_plain_tensor(name: str) -> TypeError:
    """The error for a call of ``name``, found to change its first argument in place
    where it got a handle (``returns_changed_input``), given a tensor of the caller's.

    Example:
        >>> str(changes_plain_tensor("clamp_")).split(":")[0]
        'clamp_ changes its first argument in place'
    """
    return TypeError(
        f"{name} changes its first argument in place: eagerly the change reaches the "
        "tensor given and every name bound to it, which a recorded call cannot do. Give "
        "it a copy (t.clone()) and use what it returns, or give it a handle, which then "
        "stands for the changed value."
    )


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
