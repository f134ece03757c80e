"""Workers for the tests of a loss module's own parameters across replicas (spawned).

Launched with :func:`tests.integration.dist_workers.launch` on 4 gloo ranks: a pipeline
of 2 stages x 2 replicas whose loss has a learned weight per output.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tests.integration import dist_workers as W

LR = 0.5
STEPS = 2
SHARDS = ((0, 7), (7, 12))  # replica j's samples (uneven)


class LearnedWeight(nn.Module):
    """A mean squared error with a learned weight per output, drawn from the global RNG."""

    def __init__(self, size: int = W.OUT) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(size, dtype=torch.float64) + 0.5)

    def forward(self, output: Tensor, target: Tensor) -> Tensor:
        return (((output - target) ** 2) * self.weight).mean()


def seeded_loss(rank: int) -> LearnedWeight:
    """Rank ``rank``'s loss, seeded apart (nanoGPT's ``seed + rank``)."""
    torch.manual_seed(1000 + rank)
    return LearnedWeight()


def _grad(p: nn.Parameter) -> list[float] | None:
    return None if p.grad is None else p.grad.tolist()


def job_loss_parameters(rank: int, world: int) -> dict[str, Any]:
    """The loss weight's gradient and value after each step; whether a step failing after
    microbatch 0's backward (through the loss) left every ``.grad`` as before it; and a
    loss of another shape on one replica."""
    from batchgraph.pipeline import DistributedPipeline, PipelineConfigError

    x, y = W.batch(12)
    a, b = SHARDS[rank // 2]
    dev = rank % 2
    loss = seeded_loss(rank)
    out: dict[str, Any] = {"grads": [], "weights": []}
    with DistributedPipeline(W.factories(2), stages=2, replicas=2, microbatches=2,
                             loss_fn=loss, timeout=20) as pipe:  # fmt: skip
        # On the last rank the optimizer takes the loss's parameters too, as on one device.
        opt = torch.optim.SGD(pipe.parameters() + list(loss.parameters()) * dev, lr=LR)

        def step() -> None:
            pipe.train_step(x[a:b] if dev == 0 else None, y[a:b] if dev == 1 else None)

        for _ in range(STEPS):
            step()
            out["grads"].append(_grad(loss.weight))
            opt.step()
            opt.zero_grad()
            out["weights"].append(loss.weight.tolist())
        step()  # accumulated into by the failing step below
        params = [*pipe.parameters(), loss.weight]
        before = [_grad(p) for p in params]
        if dev == 1:
            calls = [0]

            def fault(module: nn.Module, args: Any) -> None:
                calls[0] += 1
                if calls[0] == 2:  # microbatch 1: microbatch 0's backward has run
                    raise ValueError("injected failure")

            pipe.stages[1].module.register_forward_pre_hook(fault)
        try:
            step()
            out["failed"] = "no error"
        except Exception as exc:
            out["failed"] = type(exc).__name__
        out["before"], out["after"] = before, [_grad(p) for p in params]
    other = LearnedWeight(W.OUT + 1) if rank == 3 else loss
    try:
        with DistributedPipeline(W.factories(2), stages=2, replicas=2, microbatches=2,
                                 loss_fn=other, timeout=20):  # fmt: skip
            out["other_shape"] = "no error"
    except PipelineConfigError as exc:
        out["other_shape"] = str(exc)
    return out
