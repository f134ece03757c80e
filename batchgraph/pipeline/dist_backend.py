"""``Pipeline(..., backend="torch.distributed")``: the façade's process backend.

Registered with :func:`~batchgraph.pipeline.pipeline.register_backend` on import of
:mod:`batchgraph.pipeline`. It runs inside a process group that ``torchrun`` (or
``torch.distributed.init_process_group``) started: the pipeline has ``stages`` ranks, and
a world of ``stages x replicas`` ranks trains ``replicas`` data-parallel pipelines. Build
the model under ``torch.device("meta")`` so each rank materialises only its own stages.

Example (``torchrun --nproc-per-node 2 train.py``)::

    dist.init_process_group("gloo")
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    with Pipeline(net, stages=2, microbatches=4, loss_fn=nn.MSELoss(),
                  backend="torch.distributed") as pipe:
        first, last = dist.get_rank() == 0, dist.get_rank() == 1
        loss = pipe.train_step(x if first else None, y if last else None)  # None but on last
"""

from __future__ import annotations

import torch.distributed as dist

from batchgraph.pipeline.backends import BackendRequest, PipelineRuntime
from batchgraph.pipeline.dist_pipeline import DistributedPipeline
from batchgraph.pipeline.errors import PipelineConfigError
from batchgraph.pipeline.pipeline import register_backend

__all__ = ["BACKEND_NAME", "torch_distributed_backend"]

BACKEND_NAME = "torch.distributed"


def torch_distributed_backend(request: BackendRequest) -> PipelineRuntime:
    """Build this rank's :class:`DistributedPipeline` from the façade's request.

    The number of replicas is ``world size / pipeline devices``. ``devices`` (one per
    pipeline device) picks this rank's device; ``check_shapes`` does not apply (no rank
    holds every stage to probe).

    Raises:
        RuntimeError: without an initialised process group.
        PipelineConfigError: if the world size is not a multiple of the pipeline's devices.

    Example (each process of ``torchrun --nproc-per-node 2 train.py``; the façade
    calls this backend for ``backend="torch.distributed"``):
        >>> import torch.distributed as dist                      # doctest: +SKIP
        >>> from batchgraph.pipeline import Pipeline              # doctest: +SKIP
        >>> dist.init_process_group("gloo")                       # doctest: +SKIP
        >>> pipe = Pipeline(model, stages=2, microbatches=8, schedule="1f1b",
        ...                 loss_fn=loss_fn, backend="torch.distributed")  # doctest: +SKIP
        >>> loss = pipe.train_step(inputs, targets)               # doctest: +SKIP
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "backend='torch.distributed' runs inside a process group: start the script with "
            "torchrun, or call torch.distributed.init_process_group first"
        )
    p, world = request.schedule.devices, dist.get_world_size()
    if world % p:
        raise PipelineConfigError(
            f"world size {world} is not a multiple of the pipeline's {p} devices; start "
            "stages x replicas processes"
        )
    device = None
    if request.devices is not None:
        device = request.devices[dist.get_rank() % p]
    return DistributedPipeline(
        request.modules,
        stages=p,
        microbatches=request.schedule.microbatches,
        schedule=request.schedule,
        loss_fn=request.loss,
        chunks=request.schedule.chunks,
        replicas=world // p,
        device=device,
        timeout=request.timeout if request.timeout is not None else 60.0,
        broadcast_buffers=request.broadcast_buffers,
    )


register_backend(BACKEND_NAME, torch_distributed_backend, replace=True)
