"""The last rank's loss over one training step of a :class:`DistributedPipeline`.

The last stage's send of its output for microbatch ``i`` is handed to
:meth:`StepLoss.take` (no mailbox): the loss and its gradient are computed right there,
so the gradient is waiting when the stage's backward asks for it::

    last stage: F(i) ──send(output)──► StepLoss.take ──► loss_i, weight_i
                B(i) ◄──────────────── gradient (or the loss itself, fused)

It checks what the threads backend's coordinator checks (with the same words, from
:mod:`batchgraph.pipeline.step_checks`): a step whose loss has no backward on any
microbatch fails at the last microbatch's loss (so every rank stops, naming it), and a
0-d output (no batch dimension) is noted for a warning after the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from batchgraph.pipeline.comm import COORDINATOR, Communicator, MessageKey, MessageKind, Payload
from batchgraph.pipeline.errors import PipelineConfigError, StageError
from batchgraph.pipeline.loss import Loss, output_leaves
from batchgraph.pipeline.stage import Stage
from batchgraph.pipeline.step_checks import no_gradient_error

__all__ = ["StepLoss", "count_over_replicas", "start_loss_replicas"]


def start_loss_replicas(
    params: Sequence[nn.Parameter] | None, control: Any, replica: Any, src: int
) -> None:
    """Make every replica's loss parameters (a learned weight) the first replica's.

    Every rank calls it (collective over ``control``); ``params`` is the loss's
    parameters on the ranks of the last stage and ``None`` elsewhere, ``replica`` this
    rank's replica group, ``src`` the first replica's rank in it. As the stages' (see
    :func:`~batchgraph.pipeline.dist_build.sync_replicas`): each rank built its loss with
    its own random state, and replicas that start apart stay apart however exactly
    their gradients are summed. Their layouts are compared first, so a loss built
    differently on some replica is refused on every rank rather than hung on.

    Example (every rank of a 2 stages x 2 replicas job)::

        start_loss_replicas(loss.parameters() if last else None, control, replica, src)
    """
    mine = None if params is None else [(tuple(p.shape), str(p.dtype)) for p in params]
    every: list[Any] = [None] * dist.get_world_size(control)
    dist.all_gather_object(every, mine, group=control)
    layouts = {repr(x) for x in every if x is not None}
    if len(layouts) > 1:
        raise PipelineConfigError(
            "the replicas' losses have different parameters (shape, dtype per parameter: "
            f"{'; '.join(sorted(layouts))}): give every rank of the last stage the same loss"
        )
    for p in params or ():
        dist.broadcast(p.data, src=src, group=replica)


def count_over_replicas(loss: Loss, group: Any, device: torch.device) -> None:
    """Make ``loss`` divide by the count of the targets of every replica (collective over
    ``group``: the last stage's ranks of all replicas, after ``begin_step``).

    A mean over counted targets (``CrossEntropyLoss``, ``NLLLoss``) divides by a count
    of the whole batch; each replica counted only its own share, so the replicas' losses
    and gradients, summed, were the sum of their means. Every replica takes part, counted
    or not, so a disagreement is found rather than waited on.
    """
    count = loss.count
    mine = [0.0, 0.0] if count is None else [1.0, count]
    both = torch.tensor(mine, dtype=torch.float64, device=device)
    dist.all_reduce(both, group=group)
    counted, total = both.tolist()
    if counted == dist.get_world_size(group):
        loss.set_count(total)
    elif counted:
        raise PipelineConfigError(
            "the replicas' losses disagree on whether they mean over counted targets "
            "(class-index targets on some replicas, class probabilities on others?): give "
            "every replica targets of the same kind"
        )


class StepLoss:
    """Microbatch losses of one step, computed as the last stage's outputs arrive.

    Args:
        loss: the pipeline's loss (``begin_step`` already called with the targets).
        last: the last stage (on this rank).
        comm: where the gradient that starts the last stage's backward is sent.
        targets: the targets, one tuple of tensors per microbatch.
        total_n: the global batch size (over replicas) the loss weights divide by.
        fused: start the last stage's backward from the loss itself (see :meth:`take`).
        one_target: whether the targets were given as one tensor (else as a tuple).
        grad_scale: the gradients are those of ``grad_scale`` x the loss (not the values).

    Example (what :class:`DistributedPipeline` does on the last rank)::

        collected = StepLoss(loss, stages[last], comm, split_microbatches(y, m), n, True)
        comm.set_handler(COORDINATOR, collected.take)
        ...  # run the step's actions
        batch_loss = collected.total()
    """

    def __init__(
        self,
        loss: Loss,
        last: Stage,
        comm: Communicator,
        targets: list[tuple[Tensor, ...]],
        total_n: int,
        fused: bool,
        one_target: bool = True,
        grad_scale: float = 1.0,
    ) -> None:
        self.loss = loss
        # Targets given as one tensor reach the loss as that tensor; given as a tuple
        # (of one, too) as the tuple, as on one device (a loss may index targets[0]).
        self.one_target = one_target
        self.last = last
        self.comm = comm
        self.targets = targets
        self.total_n = total_n
        self.fused = fused
        self.grad_scale = grad_scale  # a GradScaler's (see grad_scaling): seeds only
        self.values: list[Tensor] = []
        self.weights: list[float] = []
        self.graphs: list[bool] = []  # per microbatch: whether its loss has a backward
        #: Whether an output was 0-d (no batch dimension) with more than one microbatch.
        self.scalar = False

    def take(self, key: MessageKey, payload: Payload) -> None:
        """The last stage's output for ``key.microbatch``: its loss, weight and gradient."""
        outs = tuple(t for t in payload if t is not None)
        mb = key.microbatch
        if len(self.targets) > 1 and any(o.dim() == 0 for o in outs):
            self.scalar = True
        value, weight, graph = self._loss(key.src, mb, outs)
        self.values.append(value)
        self.weights.append(weight)
        self.graphs.append(graph)
        if len(self.graphs) == len(self.targets) and not any(self.graphs):
            # The step can compute no gradient: stop every rank now, as one device's
            # loss.backward() would raise, rather than leave every .grad untouched.
            error = no_gradient_error(self.last.index, type(self.last.module).__name__)
            raise StageError(str(error), stage=key.src, action="loss", microbatch=mb) from error

    def total(self) -> Tensor:
        """The batch loss: the microbatches' losses weighted (off the critical path)."""
        return torch.stack([v * w for v, w in zip(self.values, self.weights)]).sum()

    def _loss(self, stage: int, mb: int, outs: tuple[Tensor, ...]) -> tuple[Tensor, float, bool]:
        """Microbatch ``mb``'s loss (detached), weight and whether it has a backward;
        sends the gradient that starts the backward of ``stage`` (the last) for it.

        With the default :meth:`Loss.compute_gradient` and a one-pass backward on the
        last stage (see :meth:`Stage.attached_outputs`), the loss is computed on the
        stage's own outputs and the stage's B starts from it, seeded with the weight:
        the same gradients as computing dL/d(outputs) on detached copies and
        backpropagating those, with one autograd pass fewer per microbatch on the
        pipeline's busiest rank (1F1B's critical path). Otherwise (a split backward, or
        a ``Loss`` that overrides ``compute_gradient``) it sends dL/d(outputs).
        """
        last, tgs = self.last, self.targets
        attached = last.attached_outputs(mb) if self.fused else None
        try:
            tgt = tgs[mb][0] if self.one_target else tgs[mb]
            # The microbatch's samples, as the threads backend counts them (its inputs'
            # dim 0; the targets split alike): the output's dim 0 need not be the batch,
            # e.g. (B*T, V) logits of B sequences.
            weight = self.loss.weight(tgs[mb][0].shape[0], self.total_n)
            if attached is not None:
                with torch.enable_grad():
                    value = self.loss.compute_loss(
                        attached[0] if last.bare else attached, tgt
                    )
                graph = value.requires_grad
                last.start_backward_at(mb, (value,))
                seed = weight * self.grad_scale
                grads: tuple[Tensor | None, ...] = (torch.full_like(value, seed),)
            else:
                graph = last.has_graph(mb)
                leaves = output_leaves(outs)
                # As the module returned them: (h,) stays a tuple (Stage.bare).
                out = leaves[0] if last.bare else leaves
                with torch.enable_grad():
                    value = self.loss.compute_loss(out, tgt)
                    grads = self.loss.compute_gradient(
                        value, out, weight=weight * self.grad_scale
                    )
        except Exception as exc:
            raise StageError(
                f"the loss failed on microbatch {mb} (after stage {stage}): "
                f"{type(exc).__name__}: {exc}",
                stage=stage, action="loss", microbatch=mb,
            ) from exc  # fmt: skip
        self.comm.send(MessageKey(MessageKind.GRADIENT, COORDINATOR, stage, mb), grads)
        return value.detach(), weight, graph
