"""Pipeline-parallel training: schedules as data, a validator, a simulator and runtimes."""

from __future__ import annotations

# Schedules as data (IR, generators, grid printer, validator, simulator, timelines) and
# the runtime (stages, communicator, coordinator, two-stage backprop, partitioning, façade).
from batchgraph.pipeline.actions import Action, ActionKind, PipelineSchedule
from batchgraph.pipeline.backward import BackwardTape, TwoStageBackward, find_units
from batchgraph.pipeline.comm import (
    COORDINATOR,
    Communicator,
    MessageKey,
    MessageKind,
    RecvWork,
    ThreadCommunicator,
    Work,
)
from batchgraph.pipeline.coordinator import Coordinator

# The torch.distributed backend (one process per rank, under torchrun); importing
# dist_backend registers Pipeline(..., backend="torch.distributed").
from batchgraph.pipeline.dist_backend import torch_distributed_backend
from batchgraph.pipeline.dist_comm import DistCommunicator
from batchgraph.pipeline.dist_errors import PeerFailedError, PeerLostError, RankStageError
from batchgraph.pipeline.dist_pipeline import DistributedPipeline
from batchgraph.pipeline.dist_topology import Topology
from batchgraph.pipeline.errors import (
    PipelineAbortedError,
    PipelineClosedError,
    PipelineConfigError,
    PipelineReentrantError,
    PipelineTimeoutError,
    StageError,
    StageMismatchError,
)
from batchgraph.pipeline.grid import format_schedule
from batchgraph.pipeline.loss import Loss
from batchgraph.pipeline.microbatch import check_stages_fit, merge_microbatches, split_microbatches
from batchgraph.pipeline.partition import (
    balanced_partition,
    layer_costs,
    partition_graph,
    partition_sequential,
)
from batchgraph.pipeline.pipeline import (
    BackendRequest,
    Pipeline,
    available_backends,
    register_backend,
)
from batchgraph.pipeline.schedules import (
    SCHEDULE_NAMES,
    gpipe_schedule,
    interleaved_1f1b_schedule,
    make_schedule,
    one_f_one_b_schedule,
    sync_schedule,
    zb_h1_schedule,
)
from batchgraph.pipeline.simulate import ActionCosts, SimulationResult, simulate
from batchgraph.pipeline.stage import Stage
from batchgraph.pipeline.stats import DeviceStats, PipelineStats
from batchgraph.pipeline.trace import (
    TimelineEvent,
    draw_timeline,
    to_chrome_trace,
    write_chrome_trace,
)
from batchgraph.pipeline.validate import ScheduleError, validate_schedule

__all__: list[str] = [
    # schedules as data and the runtime
    "COORDINATOR",
    "SCHEDULE_NAMES",
    "Action",
    "ActionCosts",
    "ActionKind",
    "BackendRequest",
    "BackwardTape",
    "Communicator",
    "Coordinator",
    "DeviceStats",
    "DistCommunicator",
    "DistributedPipeline",
    "Loss",
    "MessageKey",
    "MessageKind",
    "PeerFailedError",
    "PeerLostError",
    "Pipeline",
    "PipelineAbortedError",
    "PipelineClosedError",
    "PipelineConfigError",
    "PipelineReentrantError",
    "PipelineSchedule",
    "PipelineStats",
    "PipelineTimeoutError",
    "RankStageError",
    "RecvWork",
    "ScheduleError",
    "SimulationResult",
    "Stage",
    "StageError",
    "StageMismatchError",
    "ThreadCommunicator",
    "TimelineEvent",
    "Topology",
    "TwoStageBackward",
    "Work",
    "available_backends",
    "balanced_partition",
    "check_stages_fit",
    "draw_timeline",
    "find_units",
    "format_schedule",
    "gpipe_schedule",
    "interleaved_1f1b_schedule",
    "layer_costs",
    "make_schedule",
    "merge_microbatches",
    "one_f_one_b_schedule",
    "partition_graph",
    "partition_sequential",
    "register_backend",
    "simulate",
    "split_microbatches",
    "sync_schedule",
    "to_chrome_trace",
    "torch_distributed_backend",
    "validate_schedule",
    "write_chrome_trace",
    "zb_h1_schedule",
]
