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
"""

from __future__ import annotations

import torch

from batchgraph.pipeline.errors import PipelineConfigError

__all__ = ["grad_scale"]


def grad_scale(scaler: torch.amp.GradScaler, device: torch.device | None) -> float:
    """The factor ``scaler.scale(loss)`` multiplies a loss by on ``device`` (1.0 when the
    scaler is disabled); initialises the scaler's scale there as ``scale`` does.

    Args:
        scaler: the caller's scaler.
        device: the last stage's device (where the loss is computed); ``None`` where
            this process does not run every stage (a process backend).

    Raises:
        PipelineConfigError: for a backend whose stages run in several processes: each
            process's scaler would find overflows in its own stages' gradients only,
            and the processes would skip different steps.

    Example:
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        >>> grad_scale(scaler, torch.device("cpu"))
        1024.0
    """
    if device is None:
        raise PipelineConfigError(
            "grad_scaler= needs every stage in this process (backend='threads'): across "
            "processes each rank's GradScaler would see inf/NaN in its own stages' "
            "gradients only and the ranks would skip different steps. Train under "
            "torch.autocast with dtype=torch.bfloat16, which needs no loss scaling"
        )
    return float(scaler.scale(torch.ones((), device=device)).item())
