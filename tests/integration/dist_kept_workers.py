"""Worker jobs for the torch.distributed tests of state kept by stage forwards (spawned:
importable by name, see dist_workers)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tests.integration.dist_workers import DIM, OUT, batch


class Centred(nn.Module):
    """Counts its calls and, with ``centre``, centres on the first batch's mean (kept,
    read back); with ``item``, reads a value in Python first (no meta run)."""

    def __init__(self, width: int, centre: bool, item: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width, dtype=torch.float64)
        self.centre = centre
        self.item = item
        self.calls = 0
        self.ref: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.item and not x.isfinite().all().item():
            raise ValueError("not finite")
        if self.centre:
            if self.ref is None:
                self.ref = x.detach().mean(0)
            x = x - self.ref
        return torch.tanh(self.lin(x))


def _model(centre: bool, item: bool) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM, dtype=torch.float64), Centred(DIM, centre, item),
                         nn.Linear(DIM, OUT, dtype=torch.float64), Centred(OUT, centre, item))


def job_kept_state(rank: int, world: int) -> dict[str, Any]:
    """A counter counts microbatches on its rank; a read-back of a kept mean is refused."""
    from batchgraph.pipeline import DistributedPipeline

    x, y = (t.double() for t in batch())
    out: dict[str, Any] = {}
    for item, centre in [(False, False), (False, True), (True, False), (True, True)]:
        model = _model(centre, item)
        key = f"{'item ' if item else ''}centre={centre}"
        try:
            with DistributedPipeline(model, stages=world, microbatches=3,
                          loss_fn=nn.MSELoss(), timeout=20) as pipe:
                pipe.train_step(x if rank == 0 else None, y if rank == world - 1 else None)
                own = [m for s in pipe.stages.values() for m in s.module.modules()
                       if isinstance(m, Centred)]
                out[key] = [m.calls for m in own]
        except Exception as exc:
            out[key] = (type(exc).__name__, str(exc))
    return out
