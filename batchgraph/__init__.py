"""batchgraph: automatic batching of per-example PyTorch code, and pipeline schedules.

Write code for one example; run many together::

    import batchgraph as bg

    with bg.BatchingPolicy():
        handles = [model.encode(t) for t in trees]   # records, nothing runs
    results = bg.compute(handles)                      # batched, autograd intact
"""

from __future__ import annotations

from batchgraph.awaiting import CoroutineExampleError, DeadlockError, UnsupportedAwaitError
from batchgraph.binding import Binder, ScheduleMismatchError, bind
from batchgraph.bridge import AsyncBatcher
from batchgraph.bucketing import BucketBatchSampler
from batchgraph.coroutines import run_all, value
from batchgraph.epochs import EpochStream
from batchgraph.errors import (
    BatchedCallError,
    BatchgraphError,
    BufferChangedError,
    ConstantChangedError,
    DefaultDtypeChangedError,
    HooksChangedError,
    ModuleAttributeChangedError,
    ModuleModeChangedError,
    NotATensorError,
    NotComputedError,
    ParameterChangedError,
    PolicyClosedError,
    PolicyMismatchError,
    ShapeMismatchError,
)
from batchgraph.executor import Executor
from batchgraph.functional import batched_func, batched_value, compute
from batchgraph.handle import ResultHandle
from batchgraph.keys import (
    BatchKey,
    DimArgKey,
    ElementwiseKey,
    IndexKey,
    ReductionKey,
    StackKey,
    UnbatchedKey,
    VmapKey,
)
from batchgraph.module import BatchedModule
from batchgraph.policy import BatchingPolicy
from batchgraph.portable import PortableBatch, export
from batchgraph.rowwise import RowwiseKey
from batchgraph.rules import BatchedHooksWarning
from batchgraph.schedule_cache import ScheduleCache
from batchgraph.scheduling import Schedule, ScheduleStats
from batchgraph.sequence import PackedSequenceKey
from batchgraph.specs import TensorSpec
from batchgraph.workers import ExampleError, GraphCollate, GraphDataset, graph_loader

__version__ = "0.1.0"

__all__ = [
    "AsyncBatcher",
    "BatchKey",
    "BatchedCallError",
    "BatchedHooksWarning",
    "BatchedModule",
    "BatchgraphError",
    "BatchingPolicy",
    "Binder",
    "BucketBatchSampler",
    "BufferChangedError",
    "ConstantChangedError",
    "CoroutineExampleError",
    "DeadlockError",
    "DefaultDtypeChangedError",
    "DimArgKey",
    "ElementwiseKey",
    "EpochStream",
    "ExampleError",
    "Executor",
    "GraphCollate",
    "GraphDataset",
    "HooksChangedError",
    "IndexKey",
    "ModuleAttributeChangedError",
    "ModuleModeChangedError",
    "NotATensorError",
    "NotComputedError",
    "PackedSequenceKey",
    "ParameterChangedError",
    "PolicyClosedError",
    "PolicyMismatchError",
    "PortableBatch",
    "ReductionKey",
    "ResultHandle",
    "RowwiseKey",
    "Schedule",
    "ScheduleCache",
    "ScheduleMismatchError",
    "ScheduleStats",
    "ShapeMismatchError",
    "StackKey",
    "TensorSpec",
    "UnbatchedKey",
    "UnsupportedAwaitError",
    "VmapKey",
    "__version__",
    "batched_func",
    "batched_value",
    "bind",
    "compute",
    "export",
    "graph_loader",
    "run_all",
    "value",
]
