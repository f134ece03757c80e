"""Mixed-precision loss scaling (``torch.amp.GradScaler``) for a pipeline step.

On one device a scaler is used as ``scaler.scale(loss).backward()``, then
``scaler.step(optimizer)`` (which unscales the gradients and skips the step if any is
inf or NaN) and ``scaler.update()``. A pipeline step runs the backwards itself and
returns the loss detached, so ``scaler.scale(loss).backward()`` cannot work, and
``scaler.step`` after an unscaled step would divide every gradient by the scale,
silently. ``pipe.train_step(x, y, grad_scaler=scaler)`` instead seeds each microbatch's
backward with the scale: the gradients are ``scaler.scale(loss).backward()``'s, and the
rest of the loop is unchanged::

    loss = pipe.train_step(x, y, grad_scaler=scaler)   # the loss itself, unscaled
    scaler.step(optimizer)
    scaler.update()

Across processes each rank has its own scaler and optimizer over its own stages, and
``scaler.step`` looks at that rank's gradients only: one rank would skip a step that the
others take. So the ranks agree after each step: where any rank's gradients overflowed,
every rank's get an inf too (:func:`spread_overflow`) and every scaler skips the step
and lowers its scale, as the one scaler of one device does. The ranks' scales must stay
equal (the last rank's seeds the backward, every rank unscales by its own): they are
compared before each step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from batchgraph.pipeline.errors import PipelineConfigError

__all__ = ["agree_on_scale", "grad_scale", "scaler_refused", "spread_overflow"]


def grad_scale(scaler: torch.amp.GradScaler, device: torch.device) -> float:
    """The factor ``scaler.scale(loss)`` multiplies a loss by on ``device`` (1.0 when the
    scaler is disabled); initialises the scaler's scale there as ``scale`` does.

    Example:
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        >>> grad_scale(scaler, torch.device("cpu"))
        1024.0
    """
    return float(scaler.scale(torch.ones((), device=device)).item())


def agree_on_scale(
    scaler: torch.amp.GradScaler,
    device: torch.device,
    group: Any,
    comm_device: torch.device,
    stepped: bool,
) -> float:
    """The scale of the ranks of ``group`` whose scalers step (``stepped``: this rank
    has parameters that train, so an optimizer and ``scaler.step``); raises on every rank
    if those differ. A rank without any (none, or all frozen) cannot step its scaler,
    whose scale then stays behind; it seeds the backward with the others' where it holds
    the last stage.
    Collective (over ``comm_device`` tensors).

    Raises:
        PipelineConfigError: naming the smallest and largest scale.

    Example (every rank, before a step)::

        scale = agree_on_scale(scaler, rank_device, control_group, comm_device, True)
    """
    scale = grad_scale(scaler, device)
    mine = [scale, -scale] if stepped else [-math.inf, -math.inf]
    both = torch.tensor(mine, dtype=torch.float64, device=comm_device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = both.tolist()
    if high != -low:
        raise PipelineConfigError(
            f"the ranks' GradScalers have different scales (from {-low} to {high}): the "
            "last rank's scales the gradients and each rank unscales by its own; give "
            "every rank a GradScaler made with the same arguments"
        )
    return float(high)


def spread_overflow(params: Sequence[nn.Parameter], group: Any, device: torch.device) -> bool:
    """Whether any rank of ``group`` has an inf or NaN gradient; if so and this rank
    has none, put an inf into one of its gradients, so that every rank's
    ``scaler.step`` skips the step. Collective.

    Example (every rank, after the step's gradients are complete)::

        if spread_overflow(pipe.parameters(), control_group, device):
            ...  # every rank's scaler.step(optimizer) will skip this step
    """
    grads = [p.grad for p in params if p.grad is not None]
    mine = any(not bool(torch.isfinite(g.to_dense() if g.is_sparse else g).all()) for g in grads)
    flag = torch.tensor([float(mine)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    anywhere = bool(flag.item())
    target = next((g for g in grads if g.numel() and not g.is_sparse), None)
    if anywhere and not mine and target is not None:
        with torch.no_grad():
            target[(0,) * target.dim()] = float("inf")
    return anywhere


def scaler_refused(backend: str) -> PipelineConfigError:
    """The error for ``grad_scaler=`` with a backend that does not take one."""
    return PipelineConfigError(
        f"backend {backend!r} does not take grad_scaler=: its processes' GradScalers "
        "would each see inf/NaN in their own stages' gradients only and skip different "
        "steps. Use backend='threads' or 'torch.distributed', or train under "
        "torch.autocast with dtype=torch.bfloat16, which needs no loss scaling"
    )
