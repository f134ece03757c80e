"""Workers for the tests of clipping by the global gradient norm (spawned processes).

Launched with :func:`tests.integration.dist_workers.launch` on 4 gloo ranks: a pipeline
of 2 stages x 2 replicas whose stages share a layer (tied across ranks).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.integration import dist_workers as W

SHARDS = ((0, 7), (7, 12))  # replica j's samples (uneven)
NORMS = (2.0, 1.0, float("inf"), 0.5, 0.0, -float("inf"))
MAX_NORM = 0.05


def stages() -> list[nn.Sequential]:
    """Two float64 stages sharing ``shared`` (position 2 of stage 1); seeded."""
    torch.manual_seed(5)
    shared = nn.Linear(W.DIM, W.DIM, dtype=torch.float64)
    first = nn.Sequential(shared, nn.Tanh())
    second = nn.Sequential(
        nn.Linear(W.DIM, W.DIM, dtype=torch.float64), nn.Tanh(), shared,
        nn.Linear(W.DIM, W.OUT, dtype=torch.float64),
    )  # fmt: skip
    return [first, second]


def _grads(pipe: Any) -> dict[str, list[Any]]:
    # Named as the unsplit model names them; as lists (see dist_replica_workers).
    return {
        f"{s}.{name}": p.grad.tolist()
        for s, stage in pipe.stages.items()
        for name, p in stage.module.named_parameters()
        if p.grad is not None
    }


def _same(got: dict[str, list[Any]], want: dict[str, list[Any]]) -> bool:
    return got.keys() == want.keys() and all(
        torch.equal(torch.tensor(got[k]).nan_to_num(7.0), torch.tensor(want[k]).nan_to_num(7.0))
        for k in want
    )


def job_clip(rank: int, world: int) -> dict[str, Any]:
    """Per norm type: the total ``clip_grad_norm_`` returned and the clipped gradients;
    then a non-finite norm refused on every rank, and a failing step's gradients."""
    from batchgraph.pipeline import DistributedPipeline

    x, y = W.batch(12)
    a, b = SHARDS[rank // 2]
    dev = rank % 2
    out: dict[str, Any] = {}

    def step(pipe: DistributedPipeline) -> None:
        pipe.train_step(x[a:b] if dev == 0 else None, y[a:b] if dev == 1 else None)

    with DistributedPipeline(stages(), stages=2, replicas=2, microbatches=2,
                             loss_fn=nn.MSELoss(), timeout=20) as pipe:  # fmt: skip
        for norm_type in NORMS:
            for p in pipe.parameters():
                p.grad = None
            step(pipe)
            total = pipe.clip_grad_norm_(MAX_NORM, norm_type)
            out[str(norm_type)] = {"total": total.item(), "dtype": str(total.dtype),
                                   "grads": _grads(pipe)}  # fmt: skip
        # A NaN in device 1's gradients (each replica's: they hold equal gradients): every
        # rank refuses alike, its gradients unscaled, and the pipeline stays usable.
        if dev == 1:
            p = pipe.parameters()[0]
            assert p.grad is not None
            p.grad.view(-1)[0] = float("nan")
        before = _grads(pipe)
        try:
            pipe.clip_grad_norm_(MAX_NORM, error_if_nonfinite=True)
            out["nonfinite"] = "no error"
        except RuntimeError as exc:
            out["nonfinite"] = str(exc)
        out["unscaled"] = _same(_grads(pipe), before)
        step(pipe)  # the pipeline goes on
        # A step failing on rank 1 (forward of microbatch 1): every rank's .grad as before it.
        before = _grads(pipe)
        if rank == 1:
            calls = [0]

            def fault(module: nn.Module, args: Any) -> None:
                calls[0] += 1
                if calls[0] == 2:
                    raise ValueError("injected failure")

            pipe.stages[1].module.register_forward_pre_hook(fault)
        try:
            step(pipe)
            out["failed"] = "no error"
        except Exception as exc:
            out["failed"] = type(exc).__name__
        out["kept"] = _same(_grads(pipe), before)
    return out
