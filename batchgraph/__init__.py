"""batchgraph: automatic batching of per-example PyTorch code, and pipeline schedules.

Write code for one example; run many together::

    import batchgraph as bg

    with bg.BatchingPolicy():
        handles = [model.encode(t) for t in trees]   # records, nothing runs
    results = bg.compute(handles)                      # batched, autograd intact
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__: list[str] = ["__version__"]
