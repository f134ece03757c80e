"""What a backend of :class:`~batchgraph.pipeline.pipeline.Pipeline` is given
(:class:`BackendRequest`) and what it builds (:class:`PipelineRuntime`).

Backends are registered by name with :func:`~batchgraph.pipeline.pipeline.register_backend`
(the registry stays in that module): ``"threads"`` there, ``"torch.distributed"`` by
:mod:`batchgraph.pipeline.dist_backend`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from batchgraph.pipeline.actions import PipelineSchedule
from batchgraph.pipeline.loss import Loss
from batchgraph.pipeline.microbatch import Batch
from batchgraph.pipeline.stats import PipelineStats
from batchgraph.pipeline.trace import TimelineEvent

__all__ = ["BackendFactory", "BackendRequest", "PipelineRuntime"]


class PipelineRuntime(Protocol):
    """What a backend builds: the object a :class:`Pipeline` delegates to."""

    @property
    def stats(self) -> PipelineStats: ...

    @property
    def timeline(self) -> list[TimelineEvent]: ...

    # A process backend gives each rank only its part: inputs on the first rank, targets
    # and the loss on the last, None elsewhere.
    def train_step(self, inputs: Batch, targets: Batch) -> Tensor | None: ...

    def forward(self, inputs: Batch) -> Tensor | tuple[Tensor, ...] | None: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...

    # The modules of the stages this process runs, by stage index (a process backend's
    # rank: its own only), and every process's part of a state_dict merged on rank
    # ``dst`` (None elsewhere; a one-process runtime returns ``part``).
    @property
    def own_modules(self) -> dict[int, nn.Module]: ...

    def gather_state(self, part: dict[str, Any], dst: int = 0) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class BackendRequest:
    """Everything a backend needs to build a runtime.

    ``modules`` has one module per schedule stage; ``devices`` (when given) has one
    device per pipeline device, and stage ``s`` belongs on ``devices[schedule.device_of(s)]``.
    ``broadcast_buffers`` is for data-parallel replicas (see :class:`Pipeline`): a backend
    without them refuses ``False`` rather than ignore it.
    """

    modules: list[nn.Module]
    schedule: PipelineSchedule
    loss: Loss | None
    devices: list[torch.device] | None
    timeout: float | None
    check_shapes: bool
    broadcast_buffers: bool = True


BackendFactory = Callable[[BackendRequest], PipelineRuntime]
