"""Workers for the tests of replicas' buffers (BatchNorm running statistics).

Launched with :func:`tests.integration.dist_workers.launch` on 4 gloo ranks: a pipeline
of 2 stages x 2 replicas, then ``DistributedDataParallel`` over the whole model on ranks
0 and 1 (its reference: rank ``j`` has replica ``j``'s shard).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.integration import dist_workers as W

LR = 0.1
STEPS = 3
TRAIN = ("train",) * STEPS
# In train mode throughout: a no-grad forward updates BatchNorm's statistics too, each
# replica its own, so when the buffers are broadcast shows in every state.
MIXED = ("train", "forward", "forward", "train", "forward")
SHARDS = ((0, 7), (7, 12))  # replica j's samples (uneven)


def stage(index: int) -> nn.Sequential:
    """Stage ``index`` of a float64 model with a BatchNorm in each stage; seeded."""
    torch.manual_seed(100 + index)
    layers: list[nn.Module] = [
        nn.Linear(W.DIM, W.DIM, dtype=torch.float64),
        nn.BatchNorm1d(W.DIM, dtype=torch.float64),
        nn.Tanh(),
    ]
    if index == 1:
        layers.append(nn.Linear(W.DIM, W.OUT, dtype=torch.float64))
    return nn.Sequential(*layers)


def _state(module: Any) -> dict[str, list[Any]]:
    # As lists: tensors would travel back as shared memory of an exited process.
    return {k: v.tolist() for k, v in module.state_dict().items()}


def _pipeline_states(
    rank: int, broadcast: bool, calls: tuple[str, ...] = TRAIN, facade: bool = False
) -> list[dict[str, list[Any]]]:
    """This rank's state after each call, built directly or through ``Pipeline``."""
    from batchgraph.pipeline import DistributedPipeline, Pipeline

    x, y = W.batch(12)
    a, b = SHARDS[rank // 2]
    dev = rank % 2
    states = []
    if facade:
        pipe: Any = Pipeline([stage(0), stage(1)], microbatches=1, loss_fn=nn.MSELoss(),
                             backend="torch.distributed", timeout=20,
                             broadcast_buffers=broadcast)  # fmt: skip
    else:
        pipe = DistributedPipeline([stage(0), stage(1)], stages=2, replicas=2, microbatches=1,
                                   loss_fn=nn.MSELoss(), timeout=20,
                                   broadcast_buffers=broadcast)  # fmt: skip
    with pipe:
        own = [p for m in pipe.own_modules.values() for p in m.parameters()]
        opt = torch.optim.SGD(own, lr=LR)
        for call in calls:
            if call == "forward":
                pipe.forward(x[a:b] if dev == 0 else None)
            else:
                pipe.train_step(x[a:b] if dev == 0 else None, y[a:b] if dev == 1 else None)
                opt.step()
                opt.zero_grad()
            states.append(_state(pipe))
    return states


def _ddp_states(
    rank: int, group: Any, broadcast: bool, calls: tuple[str, ...] = TRAIN
) -> list[dict[str, list[Any]]]:
    """DDP over the unsplit model on ranks 0 and 1 (rank j: shard j); named as the model."""
    from torch.nn.parallel import DistributedDataParallel

    x, y = W.batch(12)
    a, b = SHARDS[rank]
    model = nn.Sequential(stage(0), stage(1))
    with warnings.catch_warnings():  # torch 2.13 renames it forward_sync_buffers
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DistributedDataParallel(model, process_group=group, broadcast_buffers=broadcast)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    states = []
    for call in calls:
        if call == "forward":
            with torch.no_grad():
                ddp(x[a:b])
        else:
            # DDP averages over its 2 ranks: each rank's share of the full batch's mean, x 2.
            loss = nn.MSELoss()(ddp(x[a:b]), y[a:b]) * (b - a) * 2 / 12
            loss.backward()
            opt.step()
            opt.zero_grad()
        states.append(_state(model))
    return states


def job_buffers(rank: int, world: int) -> dict[str, Any]:
    """Each rank's state after each step, with and without broadcast buffers, and DDP's;
    over training steps (``pipe_*``) and training steps mixed with forwards (``mixed_*``)."""
    out: dict[str, Any] = {}
    for broadcast in (True, False):
        out[f"pipe_{broadcast}"] = _pipeline_states(rank, broadcast)
        # Through the façade: Pipeline(..., broadcast_buffers=) reaches the replicas.
        out[f"pipe_mixed_{broadcast}"] = _pipeline_states(rank, broadcast, MIXED, facade=True)
    group = dist.new_group([0, 1])  # collective: every rank creates it
    for broadcast in (True, False):
        if rank in (0, 1):
            out[f"ddp_{broadcast}"] = _ddp_states(rank, group, broadcast)
            out[f"ddp_mixed_{broadcast}"] = _ddp_states(rank, group, broadcast, MIXED)
    return out
