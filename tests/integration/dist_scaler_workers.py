"""Workers for the tests of ``train_step(..., grad_scaler=)`` on gloo ranks (spawned).

Launched with :func:`tests.integration.dist_workers.launch` on 2 ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.integration import dist_workers as W

STEPS = 6
INIT_SCALE = 2.0**20  # float16 gradients overflow at first: steps are skipped


def stages() -> list[nn.Sequential]:
    """Two float32 stages (autocast runs them in float16); seeded."""
    torch.manual_seed(11)
    return [
        nn.Sequential(nn.Linear(W.DIM, 16), nn.Tanh()),
        nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, W.OUT)),
    ]


def scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)


def job_scaler(rank: int, world: int) -> dict[str, Any]:
    """Each step's scale and this rank's parameters after it; then a step where only
    rank 0 passes a scaler, and one where the scalers' scales differ."""
    from batchgraph.pipeline import DistributedPipeline, PipelineConfigError

    x, y = W.batch(12)
    x, y = x.float(), y.float()
    out: dict[str, Any] = {"scales": [], "params": []}
    mine = scaler()
    with DistributedPipeline(stages(), stages=2, microbatches=1, loss_fn=nn.MSELoss(),
                             timeout=20) as pipe:  # fmt: skip
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)

        def step(grad_scaler: torch.amp.GradScaler | None) -> Any:
            with torch.autocast("cpu", dtype=torch.float16):
                return pipe.train_step(
                    x if rank == 0 else None, y if rank == 1 else None, grad_scaler=grad_scaler
                )

        for _ in range(STEPS):
            step(mine)
            mine.step(opt)
            mine.update()
            opt.zero_grad()
            out["scales"].append(mine.get_scale())
            out["params"].append([p.tolist() for p in pipe.parameters()])
        for case, given in (("one_rank", mine if rank == 0 else None),
                            ("other_scale", mine if rank == 0 else scaler())):  # fmt: skip
            try:
                step(given)
                out[case] = "no error"
            except PipelineConfigError as exc:
                out[case] = str(exc)
        step(mine)  # still usable
        out["usable"] = True
    return out


def first_stage() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(W.DIM, 16), nn.Tanh(), nn.Linear(16, W.OUT))


def frozen_last_stage() -> nn.Linear:
    """A last stage whose parameters are all frozen (fine-tuning the first stage only)."""
    torch.manual_seed(5)
    return nn.Linear(W.OUT, W.OUT).requires_grad_(False)


def job_rank_without_parameters(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's stage (the last) has no parameters, so no optimizer, and its scaler never
    steps; rank 0 steps with its scaler. Every rank joins the overflow check, and the last
    rank seeds the backward with rank 0's scale, not its own stale one."""
    return _only_rank_0_trains(rank, nn.Tanh())


def job_rank_with_frozen_parameters(rank: int, world: int) -> dict[str, Any]:
    """As ``job_rank_without_parameters``, rank 1's parameters all frozen: nothing for an
    optimizer there either (torch.optim refuses an empty list), so its scaler never steps."""
    return _only_rank_0_trains(rank, frozen_last_stage())


def _only_rank_0_trains(rank: int, last: nn.Module) -> dict[str, Any]:
    from batchgraph.pipeline import DistributedPipeline

    x, y = W.batch(12)
    mine = scaler()
    scales = []
    with DistributedPipeline([first_stage(), last], stages=2, microbatches=1,
                             loss_fn=nn.MSELoss(), timeout=10) as pipe:  # fmt: skip
        trained = [p for p in pipe.parameters() if p.requires_grad]
        opt = torch.optim.SGD(trained, lr=0.1) if trained else None
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                pipe.train_step(x.float() if rank == 0 else None,
                                y.float() if rank == 1 else None, grad_scaler=mine)  # fmt: skip
            if opt is not None:
                mine.step(opt)
                mine.update()
                opt.zero_grad()
            scales.append(mine.get_scale())
        params = [p.tolist() for p in trained]
    return {"scales": scales, "params": params}
