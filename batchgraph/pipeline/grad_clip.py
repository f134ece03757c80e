"""Gradient clipping by the global norm over every stage of a pipeline, as on one device.

``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` scales every gradient by
``min(max_norm / (total + 1e-6), 1)``, ``total`` being the norm over *all* of the model's
gradients. Across processes each rank holds only its own stages' parameters, and clipping
them by their own norm would scale each stage differently, silently. So each rank
computes the norm of its own gradients, the ranks of a pipeline gather those norms, and
every rank combines them alike into the model's total (the p-norm of the per-rank p-norms
is the p-norm over all gradients)::

    rank 0: ‖g₀‖ ─┐                                    ┌─ grads₀ *= min(max / (‖g‖ + 1e-6), 1)
                  ├─ all_gather ─► ‖g‖ = ‖(‖g₀‖, ‖g₁‖)‖ ┤
    rank 1: ‖g₁‖ ─┘                                    └─ grads₁ *= the same

A parameter tied across ranks (its copies hold the same summed gradient) is counted on
the lowest of them only, as one device counts a shared parameter once. Replicas hold
equal gradients after a step, so each pipeline's total is the same.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from batchgraph.pipeline.errors import PipelineConfigError

if TYPE_CHECKING:
    from batchgraph.pipeline.dist_comm import DistCommunicator
    from batchgraph.pipeline.dist_tied import TiedGradients
    from batchgraph.pipeline.dist_topology import ProcessGroups

__all__ = ["RankClipping", "combine_norms", "every_stage_parameters", "nonfinite_norm_error"]

# The real dtypes a total norm can have; gathered as an index so every rank gives the
# total the dtype one device gives (its gradients' promoted dtype).
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def nonfinite_norm_error(norm_type: float) -> RuntimeError:
    """The error ``torch.nn.utils.clip_grad_norm_(..., error_if_nonfinite=True)`` raises."""
    return RuntimeError(
        f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
        "non-finite, so it cannot be clipped. To disable this error and scale the "
        "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
    )


def combine_norms(norms: Tensor, norm_type: float) -> Tensor:
    """The norm of all gradients from the norms of disjoint parts of them.

    For ``p != 0`` the p-norm of the parts' p-norms (also ``inf``: the largest, ``-inf``:
    the smallest); for ``p == 0`` (how many tensors have a nonzero gradient) their sum.

    Example:
        >>> a, b = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
        >>> parts = torch.stack([a.norm(), b.norm()])
        >>> combine_norms(parts, 2.0).item(), torch.cat([a, b]).norm().item()
        (5.0, 5.0)
    """
    if norm_type == 0:
        return norms.sum()
    total: Tensor = torch.linalg.vector_norm(norms, norm_type)
    return total


def every_stage_parameters(
    own: dict[int, nn.Module], stages: int, backend: str
) -> list[nn.Parameter]:
    """The parameters of every stage (each once), for a runtime without a clip of its own.

    Raises:
        PipelineConfigError: if this process holds only some of the ``stages``: clipping
            them by their own norm would not be the model's clipping.

    Example:
        >>> shared = nn.Linear(2, 2)
        >>> len(every_stage_parameters({0: shared, 1: nn.Sequential(shared)}, 2, "threads"))
        2
    """
    if len(own) != stages:
        raise PipelineConfigError(
            f"this process holds {len(own)} of the {stages} stages and backend {backend!r} "
            "has no clip_grad_norm_: clipping these by their own norm would not be the "
            "model's; give the runtime a clip_grad_norm_ that computes the norm over "
            "every process"
        )
    return list(dict.fromkeys(p for s in sorted(own) for p in own[s].parameters()))


class RankClipping:
    """``clip_grad_norm_`` of ``DistributedPipeline`` (a base class)."""

    if TYPE_CHECKING:
        groups: ProcessGroups
        comm: DistCommunicator
        tied: TiedGradients
        device: torch.device

        def parameters(self) -> list[nn.Parameter]: ...

        def _check_open(self) -> None: ...

        def _fail(self, exc: BaseException, keep_frames: bool = False) -> BaseException: ...

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> Tensor:
        """Clip this rank's gradients by the norm over the whole model's, on every rank.

        What ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` does to the
        unsplit model on one device: the same total norm (over every stage on every rank
        of the pipeline, a tied parameter once), returned on every rank, and each rank's
        gradients scaled by the same ``min(max_norm / (total + 1e-6), 1)``. Collective:
        call it on every rank, after ``train_step`` (and before ``optimizer.step()``).

        Args:
            max_norm: the largest norm the gradients may have.
            norm_type: the p of the p-norm; ``float("inf")`` for the largest magnitude.
            error_if_nonfinite: raise if the total norm is NaN or infinite (on every
                rank alike, the gradients left unscaled and the pipeline usable).
            foreach: as for ``torch.nn.utils.clip_grad_norm_``.

        Returns:
            The total norm of the whole model's gradients (before clipping).

        Raises:
            RuntimeError: for a non-finite total with ``error_if_nonfinite=True``
                (torch's message).

        Example (every rank of ``torchrun --nproc-per-node 2 train.py``)::

            loss = pipe.train_step(x if rank == 0 else None, y if rank == 1 else None)
            total = pipe.clip_grad_norm_(1.0)   # the same total on every rank
            optimizer.step()
        """
        self._check_open()
        norm_type = float(norm_type)
        params = self.parameters()
        skip = {id(p) for p in self.tied.copies}  # counted on another rank
        grads = [p.grad for p in params if p.grad is not None and id(p) not in skip]
        try:
            total = self._total_norm(grads, norm_type, foreach)
        except BaseException as exc:  # a peer is gone or stuck: the pipeline cannot go on
            raise self._fail(exc) from exc
        if error_if_nonfinite and not math.isfinite(total.item()):
            raise nonfinite_norm_error(norm_type)
        clip_grads_with_norm_(params, max_norm, total, foreach)
        return total

    def _total_norm(self, grads: list[Tensor], norm_type: float, foreach: bool | None) -> Tensor:
        # Each rank's (norm, whether it has gradients, dtype), gathered over its pipeline:
        # a rank without gradients adds nothing (its 0 would be the minimum of -inf).
        device = self.comm.device
        mine = torch.zeros(3, dtype=torch.float64, device=device)
        if grads:
            local = get_total_norm(grads, norm_type, False, foreach)
            mine[0] = local.to(device, torch.float64)
            mine[1], mine[2] = 1, _DTYPES.index(local.dtype)
        group = self.groups.pipeline
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
        rows = torch.stack(every)
        rows = rows[rows[:, 1] == 1]
        if not len(rows):
            return torch.tensor(0.0)  # no gradient anywhere: as one device
        dtype: torch.dtype | None = None
        for index in rows[:, 2].tolist():
            got = _DTYPES[int(index)]
            dtype = got if dtype is None else torch.promote_types(dtype, got)
        return combine_norms(rows[:, 0], norm_type).to(self.device, dtype)
