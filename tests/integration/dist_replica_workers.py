"""Workers for the tests of data-parallel replicas' starting state (spawned processes).

Launched with :func:`tests.integration.dist_workers.launch` (4 ranks, gloo: 2 stages x 2
replicas).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.integration import dist_workers as W

LR = 0.1


def model() -> nn.Sequential:
    """The float64 model every rank builds on ``meta`` (and the test on one device)."""
    return nn.Sequential(
        nn.Linear(W.DIM, W.DIM, dtype=torch.float64),
        nn.Tanh(),
        nn.Linear(W.DIM, W.OUT, dtype=torch.float64),
    )


def job_seeded_apart(rank: int, world: int) -> dict[str, Any]:
    """Each rank seeded apart (nanoGPT's ``seed + rank``), the model built on meta; this
    rank's state (the unsplit model's names, as lists: tensors would travel back as
    shared memory of an exited process) when built and after one SGD step."""
    from batchgraph.pipeline import Pipeline

    torch.manual_seed(1337 + rank)
    with torch.device("meta"):
        net = model()
    x, y = W.batch(12)
    a, b = ((0, 7), (7, 12))[rank // 2]  # uneven shards
    dev = rank % 2
    with Pipeline(net, stages=2, microbatches=2, schedule="1f1b", loss_fn=nn.MSELoss(),
                  backend="torch.distributed", timeout=20) as pipe:  # fmt: skip
        before = {k: v.tolist() for k, v in pipe.state_dict().items()}
        pipe.train_step(x[a:b] if dev == 0 else None, y[a:b] if dev == 1 else None)
        params = [p for m in pipe.stage_modules for p in m.parameters() if not p.is_meta]
        torch.optim.SGD(params, lr=LR).step()
        after = {k: v.tolist() for k, v in pipe.state_dict().items()}
    return {"before": before, "after": after}
