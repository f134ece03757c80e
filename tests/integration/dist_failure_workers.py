"""Worker jobs for tests/integration/test_dist_failures_prompt.py (spawned gloo ranks).

Each rank catches its step's error and lives on (as a caller that logs or saves a
checkpoint does), and reports the error and how long its step took to fail.
"""

from __future__ import annotations

import time
import warnings
from functools import partial
from typing import Any

import torch
from torch import nn

from tests.integration import dist_workers as W
from tests.integration.dist_check_workers import Total, _last_with

LINGER = 8.0  # seconds each rank lives on after its step failed


def _warm() -> None:
    """Pay, before any timing, the one-off cost of each rank's first check of its stage
    on meta tensors (kept_inputs, at a stage's first forward with several
    microbatches): importing torch's meta kernels, 1-6 s per process on a loaded
    2-core machine. The tests time how fast a failure reaches the ranks, not that."""
    from batchgraph.pipeline.kept_inputs import check_inputs_kept

    check_inputs_kept([nn.Linear(2, 2)], [torch.zeros(1, 2)])


def _timed_step(pipe: Any, x: torch.Tensor | None, y: torch.Tensor | None) -> dict[str, Any]:
    _warm()
    start = time.monotonic()
    try:
        pipe.train_step(x, y)
        out: dict[str, Any] = {"error": None}
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"}
    out["seconds"] = time.monotonic() - start
    time.sleep(LINGER)
    return out


def job_fault_then_linger(rank: int, world: int) -> dict[str, Any]:
    """Rank 2's forward raises; every rank catches the error and lives on."""
    from batchgraph.pipeline import DistributedPipeline

    x, y = W.batch()
    with DistributedPipeline(W.factories(world), stages=world, microbatches=4, schedule="1f1b",
                             loss_fn=nn.MSELoss(), timeout=20) as pipe:  # fmt: skip
        if rank == 2:

            def fault(module: nn.Module, args: Any) -> None:
                raise ValueError("injected failure")

            pipe.stages[rank].module.register_forward_pre_hook(fault)
        return _timed_step(pipe, x if rank == 0 else None, y if rank == world - 1 else None)


def job_fail_after_last_message(rank: int, world: int) -> dict[str, Any]:
    """The last rank fails after its step's last message (its 0-d output warning, turned
    into an error there), while rank 0 waits in the timeline gather."""
    from batchgraph.pipeline import DistributedPipeline

    x, y = W.batch()
    stages = [partial(W.make_stage, 0, 2), partial(_last_with, Total)]
    pipe = DistributedPipeline(stages, stages=2, microbatches=4, loss_fn=lambda o, t: o,
                               timeout=20)  # fmt: skip
    with pipe, warnings.catch_warnings():
        if rank == 1:
            warnings.simplefilter("error")
        return _timed_step(pipe, x if rank == 0 else None, y if rank == 1 else None)


def job_leave_on_error(rank: int, world: int) -> dict[str, Any]:
    """After a good step, rank 1's own code raises and leaves the pipeline's ``with``
    block while rank 0 goes on to the next step; once with DistributedPipeline, once
    with the Pipeline façade."""
    from batchgraph.pipeline import DistributedPipeline, Pipeline

    x, y = W.batch()
    out: dict[str, Any] = {}
    builds = {
        "direct": lambda: DistributedPipeline(W.factories(world), stages=world, microbatches=4,
                                              loss_fn=nn.MSELoss(), timeout=20),
        "facade": lambda: Pipeline([W.make_stage(s, world) for s in range(world)],
                                   microbatches=4, loss_fn=nn.MSELoss(),
                                   backend="torch.distributed", timeout=20),
    }  # fmt: skip
    _warm()
    for name, build in builds.items():
        start = time.monotonic()
        try:
            with build() as pipe:
                pipe.train_step(x if rank == 0 else None, y if rank == 1 else None)
                if rank == 1:
                    raise KeyError("the caller's own bug")
                pipe.train_step(x, None)
            out[name] = {"error": None}
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        out[name]["seconds"] = time.monotonic() - start
    return out
