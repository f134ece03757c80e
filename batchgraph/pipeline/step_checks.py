"""What a training step refuses or warns about, in the same words on every backend.

One device's ``loss.backward()`` raises when nothing requires grad, and a model that
reduces over the batch gives the loss one value per microbatch; the threads backend
(:class:`~batchgraph.pipeline.coordinator.Coordinator`) and the ``torch.distributed``
one (:class:`~batchgraph.pipeline.dist_pipeline.DistributedPipeline`) check the same
things and say the same words, made here.
"""

from __future__ import annotations

from batchgraph.pipeline.errors import PipelineConfigError

__all__ = [
    "check_timeout",
    "inference_mode_error",
    "no_gradient_error",
    "nothing_to_train_error",
    "scalar_output_warning",
    "targets_require_grad_error",
]


def check_timeout(timeout: object, *, optional: bool = True) -> None:
    """Refuse a ``timeout=`` that is not a positive number of seconds (or ``None`` where
    ``optional``), when the pipeline is built: else ``0`` or ``nan`` failed a step's first
    wait for a message and a string failed inside a stage, each named as a stage error.

    Example:
        >>> check_timeout(-1)
        Traceback (most recent call last):
        ...
        batchgraph.pipeline.errors.PipelineConfigError: timeout must be a number of seconds > 0 (or None: no limit), got -1
    """
    if timeout is None and optional:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        limit = " (or None: no limit)" if optional else ""
        raise PipelineConfigError(
            f"timeout must be a number of seconds > 0{limit}, got {timeout!r}"
        )


def targets_require_grad_error(where: str = "") -> PipelineConfigError:
    """``train_step``'s targets require grad: one device's ``loss.backward()`` would reach
    them (a teacher network's outputs), but a pipeline's loss gradient goes to the
    model's outputs only. Refused: a schedule whose backward starts from each
    microbatch's loss failed its second microbatch in the targets' graph, the others
    left the targets' gradients out without a word."""
    return PipelineConfigError(
        f"the targets require grad{where}, but the pipeline computes no gradient for "
        "them (the loss's gradient goes to the model's outputs only); pass "
        "targets.detach(), or move what computes them into the model"
    )


def nothing_to_train_error(where: str = "") -> PipelineConfigError:
    """Every parameter frozen and inputs without grad: refused before any work.

    Args:
        where: what was looked at, when more than this process (``" on any rank"``).

    Example:
        >>> str(nothing_to_train_error()).startswith("train_step has nothing to compute")
        True
    """
    return PipelineConfigError(
        "train_step has nothing to compute gradients for: no parameter of any "
        f"stage{where} requires grad (all frozen) and neither do the inputs. On one device, "
        "loss.backward() raises 'element 0 of tensors does not require grad and "
        "does not have a grad_fn'. Unfreeze parameters (p.requires_grad_(True)) or "
        "use pipe.forward"
    )


def inference_mode_error(where: str = "") -> PipelineConfigError:
    """``train_step`` under ``torch.inference_mode()`` (``where``: which rank, if known).

    Example:
        >>> print(inference_mode_error(" on rank 1"))  # doctest: +ELLIPSIS
        train_step was called under torch.inference_mode() on rank 1, where no gradient ...
    """
    return PipelineConfigError(
        f"train_step was called under torch.inference_mode(){where}, where no gradient can "
        "be recorded; call it outside inference mode (pipe.forward runs in it)"
    )


def no_gradient_error(stage: int, module: str) -> PipelineConfigError:
    """No microbatch's loss had a backward: the last stage (``stage``, a ``module``)
    returned outputs without an autograd graph, or the loss ignored them.

    Example:
        >>> "stage 1 (Argmax)" in str(no_gradient_error(1, "Argmax"))
        True
    """
    return PipelineConfigError(
        "train_step computed no gradient: the loss depends on nothing that requires "
        f"grad (the last stage, stage {stage} ({module}), "
        "returned outputs without an autograd graph, made by a non-differentiable "
        "op such as argmax, an integer op or .detach(); or loss_fn ignores its "
        "output). On one device, loss.backward() raises 'element 0 of tensors does "
        "not require grad and does not have a grad_fn'. Compute the loss from a "
        "differentiable output"
    )


def scalar_output_warning(stage: int, module: str, microbatches: int) -> str:
    """The warning for a last stage whose output is 0-d (no batch dimension).

    Example:
        >>> "(4 of them)" in scalar_output_warning(1, "Sum", 4)
        True
    """
    return (
        f"the last stage (stage {stage}, {module}) returned "
        "a 0-d tensor: it has no batch dimension, so loss_fn saw one value per "
        f"microbatch ({microbatches} of them), not one per sample, and the loss and gradients "
        "are not one device's unless loss_fn takes that value as the microbatch's "
        "own loss (weighted per reduction=). A model that reduces over the batch (a "
        "final .sum() or .mean()) should return per-sample outputs and leave the "
        "reduction to the loss (loss_fn=, with reduction='sum' for a sum)"
    )
