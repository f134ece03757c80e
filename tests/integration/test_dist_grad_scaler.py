"""``train_step(..., grad_scaler=)`` on 2 gloo ranks trains as one device's GradScaler loop.

Each rank has its own scaler and optimizer over its own stage. Where the gradients of one
rank overflow, every rank skips the step and lowers its scale, as the one scaler of one
device does; ranks that disagree on passing a scaler, or on its scale, are refused on
every rank before the step, the pipeline staying usable.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.integration import dist_scaler_workers as SW
from tests.integration import dist_workers as W

pytestmark = W.MULTIPROCESS


@pytest.fixture(scope="module")
def run() -> W.Launch:
    return W.launch(SW.job_scaler, world=2, limit=90)


def _one_device() -> tuple[list[float], list[list[torch.Tensor]]]:
    model = nn.Sequential(*SW.stages())
    x, y = W.batch(12)
    x, y = x.float(), y.float()
    scaler = SW.scaler()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scales, params = [], []
    for _ in range(SW.STEPS):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.MSELoss()(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        params.append([p.detach().clone() for p in model.parameters()])
    return scales, params


def test_every_rank_skips_and_steps_as_one_device(run: W.Launch) -> None:
    scales, params = _one_device()
    assert scales[0] < SW.INIT_SCALE and len(set(scales)) > 1  # skipped steps, then growth
    for rank in range(2):
        got = run.ok(rank)
        assert got["scales"] == scales, f"rank {rank}"
        for step, (mine, want) in enumerate(zip(got["params"], params)):
            own = want[:2] if rank == 0 else want[2:]  # the rank's stage's parameters
            for p, q in zip(mine, own, strict=True):
                assert torch.equal(torch.tensor(p), q), f"rank {rank} after step {step}"


def test_ranks_that_disagree_are_refused_and_the_pipeline_goes_on(run: W.Launch) -> None:
    for rank in range(2):
        got = run.ok(rank)
        assert "rank 0 passed grad_scaler= but rank 1 did not" in got["one_rank"], got
        assert "GradScalers have different scales" in got["other_scale"], got
        assert got["usable"]


@pytest.mark.parametrize("frozen", [False, True])
def test_a_last_rank_without_trained_parameters_scales_by_the_stepping_ranks_scale(
    frozen: bool,
) -> None:
    # Frozen: its stale scale was compared with rank 0's, and the second step was refused
    # on both ranks ("GradScalers have different scales", 1048576 vs 524288).
    job = SW.job_rank_with_frozen_parameters if frozen else SW.job_rank_without_parameters
    launch = W.launch(job, world=2, limit=60)
    got = launch.ok(0)
    assert launch.ok(1)["params"] == []
    last = SW.frozen_last_stage() if frozen else nn.Tanh()
    model = nn.Sequential(SW.first_stage(), last)
    x, y = W.batch(12)
    scaler = SW.scaler()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scales = []
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.MSELoss()(model(x.float()), y.float())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    assert got["scales"] == scales
    for p, q in zip(got["params"], model[0].parameters(), strict=True):
        assert torch.equal(torch.tensor(p), q.detach())
