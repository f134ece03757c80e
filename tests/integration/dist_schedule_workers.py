"""Workers for the tests of schedules given as data to the torch.distributed backend.

Launched with :func:`tests.integration.dist_workers.launch` (2 ranks, gloo).
"""

from __future__ import annotations

import time
from typing import Any

from torch import nn

from tests.integration import dist_workers as W


def _refusal(**kw: Any) -> dict[str, Any]:
    """Build a DistributedPipeline that must be refused: the error and how long it took."""
    from batchgraph.pipeline import DistributedPipeline

    start = time.monotonic()
    try:
        DistributedPipeline(W.factories(2), loss_fn=nn.MSELoss(), timeout=20, **kw).close()
        error = "no error"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": time.monotonic() - start}


def job_schedule_objects(rank: int, world: int) -> dict[str, Any]:
    """An invalid schedule and counts that contradict one are refused on every rank at
    once; then a valid hand-made schedule, and an interleaved one without chunks=,
    train as one device."""
    from batchgraph.pipeline import Action, DistributedPipeline, make_schedule

    out: dict[str, Any] = {}
    # Stage 0 never runs the backward of microbatch 1.
    broken = make_schedule("gpipe", stages=2, microbatches=2)
    broken.order[0].remove(Action.parse("0B1"))
    out["invalid"] = _refusal(stages=2, microbatches=2, schedule=broken)
    one_f = make_schedule("1f1b", stages=2, microbatches=2)
    out["counts"] = _refusal(stages=2, microbatches=4, schedule=one_f)
    x, y = W.batch()
    # Mixed backwards: microbatch 0 split into I and W on stage 1, the others whole.
    mixed = make_schedule("1f1b", stages=2, microbatches=3)
    mixed.name = "mixed"
    b0 = mixed.order[1].index(Action.parse("1B0"))
    mixed.order[1][b0 : b0 + 1] = [Action.parse("1I0")]
    mixed.order[1].append(Action.parse("1W0"))
    interleaved = make_schedule("interleaved-1f1b", stages=2, microbatches=4, chunks=2)
    for name, schedule in (("mixed", mixed), ("interleaved", interleaved)):
        total = schedule.stages
        with DistributedPipeline(W.factories(total), stages=2, microbatches=schedule.microbatches,
                                 schedule=schedule, loss_fn=nn.MSELoss(), timeout=20) as pipe:  # fmt: skip
            pipe.train_step(x if rank == 0 else None, y if rank == 1 else None)
            out[name] = W._grad_error(pipe.stages, W.reference_grads(total))
    return out
