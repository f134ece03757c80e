"""batchgraph: automatic batching of per-example PyTorch code, and pipeline schedules.

Write code for one example; run many together::

    import batchgraph as bg

    with bg.BatchingPolicy():
        handles = [model.encode(t) for t in trees]   # records, nothing runs
    results = bg.compute(handles)                      # batched, autograd intact
"""

from __future__ import annotations

from batchgraph.errors import (
    BatchedCallError,
    BatchgraphError,
    NotATensorError,
    NotComputedError,
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
    StackKey,
    UnbatchedKey,
    VmapKey,
)
from batchgraph.module import BatchedModule
from batchgraph.policy import BatchingPolicy
from batchgraph.scheduling import Schedule, ScheduleStats
from batchgraph.sequence import PackedSequenceKey
from batchgraph.specs import TensorSpec

__version__ = "0.1.0"

__all__ = [
    "BatchKey",
    "BatchedCallError",
    "BatchedModule",
    "BatchgraphError",
    "BatchingPolicy",
    "DimArgKey",
    "ElementwiseKey",
    "Executor",
    "IndexKey",
    "NotATensorError",
    "NotComputedError",
    "PackedSequenceKey",
    "PolicyClosedError",
    "PolicyMismatchError",
    "ResultHandle",
    "Schedule",
    "ScheduleStats",
    "ShapeMismatchError",
    "StackKey",
    "TensorSpec",
    "UnbatchedKey",
    "VmapKey",
    "__version__",
    "batched_func",
    "batched_value",
    "compute",
]
