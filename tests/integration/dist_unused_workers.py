"""Workers for the tests of parameters that get no gradient across ranks (spawned processes).

Data-parallel replicas and tied weights sum gradients over ranks after each step; a
parameter that got none anywhere (frozen, or unused by the step) must keep ``.grad`` as
``None``, as on one device, or an optimizer that skips such parameters steps it.
Launched with :func:`tests.integration.dist_workers.launch` (4 ranks, gloo).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.integration import dist_workers as W


def _stages_with_idle_parameters() -> list[nn.Module]:
    """Two stages: stage 0's first weight frozen, stage 1 holding a parameter it never uses."""
    mods = [W.make_stage(s, 2) for s in range(2)]
    mods[0][0].weight.requires_grad_(False)
    mods[1].unused = nn.Parameter(torch.ones(2, dtype=torch.float64))
    return mods


def _tied_stages() -> list[nn.Module]:
    """Four stages; stages 0 and 3 share a Linear whose weight is frozen (its bias trains)."""
    gen = torch.Generator().manual_seed(5)
    shared = nn.Linear(W.DIM, W.DIM, dtype=torch.float64)
    with torch.no_grad():
        for p in shared.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    shared.weight.requires_grad_(False)
    mods = [W.make_stage(s, 4) for s in range(4)]
    mods[0] = nn.Sequential(shared, nn.Tanh())
    mods[3] = nn.Sequential(shared, nn.Tanh(), mods[3])
    return mods


def _compare(got: nn.Module, want: nn.Module) -> dict[str, Any]:
    """The names of the parameters whose gradient is None on one side only, and the
    largest difference of the gradients both have and of the parameters' values."""
    pairs = list(zip(got.named_parameters(), want.parameters()))
    grads = [(p.grad, q.grad) for (_, p), q in pairs]
    return {
        "presence": [name for (name, p), q in pairs if (p.grad is None) != (q.grad is None)],
        "grad_error": max(
            ((g - h).abs().max().item() for g, h in grads if g is not None and h is not None),
            default=0.0,
        ),
        "value_error": max((p - q).abs().max().item() for (_, p), q in pairs),
    }


def job_idle_parameters(rank: int, world: int) -> dict[str, Any]:
    """2 stages x 2 replicas and one AdamW step with weight decay; then 4 stages sharing a
    frozen weight between ranks 0 and 3. Each compared with one device."""
    from batchgraph.pipeline import Pipeline

    x, y = W.batch(12)
    out: dict[str, Any] = {}
    mods, twin = _stages_with_idle_parameters(), _stages_with_idle_parameters()
    a, b = ((0, 7), (7, 12))[rank // 2]  # uneven shards
    dev = rank % 2
    with Pipeline(mods, microbatches=2, schedule="zb-h1", loss_fn=nn.MSELoss(),
                  backend="torch.distributed", timeout=20) as pipe:  # fmt: skip
        pipe.train_step(x[a:b] if dev == 0 else None, y[a:b] if dev == 1 else None)
        nn.MSELoss()(nn.Sequential(*twin)(x), y).backward()
        out["replicas"] = _compare(mods[dev], twin[dev])
        # AdamW skips parameters without a gradient; weight decay moves the others.
        for params in (list(mods[dev].parameters()), [p for m in twin for p in m.parameters()]):
            torch.optim.AdamW(params, lr=0.1, weight_decay=0.5).step()
        out["replicas_stepped"] = _compare(mods[dev], twin[dev])
    mods, twin = _tied_stages(), _tied_stages()
    with Pipeline(mods, microbatches=3, schedule="1f1b", loss_fn=nn.MSELoss(),
                  backend="torch.distributed", timeout=20) as pipe:  # fmt: skip
        pipe.train_step(x if rank == 0 else None, y if rank == 3 else None)
        nn.MSELoss()(nn.Sequential(*twin)(x), y).backward()
        out["tied"] = _compare(mods[rank], twin[rank])
    return out
