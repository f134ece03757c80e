"""Autograd engine calls for the pipeline's hot path, without the per-call wrapper cost.

``torch.autograd.backward`` and ``torch.autograd.grad`` normalise and check their
arguments in Python (tuples, ``__torch_function__`` dispatch, vmap, a shape and dtype
check per gradient) before they call the engine through
``torch.autograd.graph._engine_run_backward``. That costs about as much as the engine
itself on a small stage (tens of microseconds), and a pipeline makes several such calls
per microbatch and stage (B; or I, one per unit inside I, and W; and the loss).

:func:`backward` and :func:`grad` do the same thing. When every tensor is a plain
``torch.Tensor`` (or ``nn.Parameter``) and every gradient has its output's shape, dtype
and device, they call ``_engine_run_backward`` with the arguments the public functions
would pass it; otherwise, or if this torch has no ``_engine_run_backward``, they call
the public functions, which also produce the usual errors for bad arguments. Gradients
are the same either way: the same engine runs the same graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["alias", "backward", "grad"]

_run: Callable[..., tuple[Tensor | None, ...]] | None
try:  # torch >= 2.2: the one function both public entry points call
    from torch.autograd.graph import _engine_run_backward as _run
except ImportError:  # pragma: no cover - older torch
    _run = None

_PLAIN = (Tensor, nn.Parameter)


def _fast(outputs: Sequence[Tensor], grads: Sequence[Tensor | None]) -> bool:
    if _run is None or len(outputs) != len(grads):
        return False
    for o, g in zip(outputs, grads):
        if (
            g is None
            or type(o) not in _PLAIN
            or type(g) not in _PLAIN
            or g.shape != o.shape
            or g.dtype != o.dtype
            or g.device != o.device
        ):
            return False
    return True


def backward(
    outputs: Sequence[Tensor], grads: Sequence[Tensor], inputs: Sequence[Tensor] = ()
) -> None:
    """``torch.autograd.backward(outputs, grads, inputs=inputs or None)``: accumulate into ``.grad``."""
    if _fast(outputs, grads) and all(type(t) in _PLAIN for t in inputs):
        assert _run is not None
        _run(tuple(outputs), tuple(grads), False, False, tuple(inputs), True, accumulate_grad=True)
        return
    torch.autograd.backward(list(outputs), list(grads), inputs=list(inputs) or None)


def grad(
    outputs: Sequence[Tensor],
    grads: Sequence[Tensor | None],
    inputs: Sequence[Tensor],
    *,
    retain_graph: bool = False,
    allow_unused: bool = True,
) -> tuple[Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grads, retain_graph=..., allow_unused=...)``."""
    if _fast(outputs, grads) and all(type(t) in _PLAIN for t in inputs):
        assert _run is not None
        result: tuple[Any, ...] = _run(
            tuple(outputs),
            tuple(grads),
            retain_graph,
            False,
            tuple(inputs),
            allow_unused,
            accumulate_grad=False,
        )
        return result
    return tuple(
        torch.autograd.grad(
            list(outputs),
            list(inputs),
            list(grads),
            retain_graph=retain_graph,
            allow_unused=allow_unused,
        )
    )


class _Alias(torch.autograd.Function):
    """Identity whose output shares its input's storage but is neither a leaf nor a view."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        del ctx
        # detach(), not the input itself or a view: autograd would make either a view of
        # the input, and an in-place op on a view of a leaf that requires grad is refused.
        # A detached alias also shares the input's version counter, so an in-place op on
        # it still trips the checks of any graph that saved the tensor, as on one device.
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        del ctx
        return grad


def alias(leaf: Tensor) -> Tensor:
    """``leaf`` as a tensor an in-place op may change (``ReLU(inplace=True)``).

    A stage's input is a leaf that requires grad, which autograd forbids changing in
    place; its first op may well do so (cut before an in-place activation), as it may on
    one device where the same tensor is some layer's output. The module gets this
    alias, and ``leaf.grad`` (or ``grad(..., [leaf])``) is still dL/d(input): the gradient
    at the value received, before any in-place change. Costs one small autograd node.

    Example:
        >>> import torch
        >>> x = torch.tensor([-1.0, 2.0], requires_grad=True)
        >>> torch.relu_(alias(x)).sum().backward()
        >>> x.grad
        tensor([0., 1.])
    """
    result: Tensor = _Alias.apply(leaf)  # type: ignore[no-untyped-call]
    return result
