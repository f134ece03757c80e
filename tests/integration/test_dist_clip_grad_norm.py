"""Clipping by the global gradient norm across ranks equals one device's clipping.

4 gloo ranks: a pipeline of 2 stages x 2 replicas whose stages share a layer (tied across
ranks). ``torch.nn.utils.clip_grad_norm_`` over a rank's own parameters would clip by
that rank's norm only (each stage scaled differently); ``pipe.clip_grad_norm_`` gives the
unsplit model's total (the tied layer counted once) and scaling on every rank. The same
launch checks that a failed step leaves every rank's ``.grad`` as before it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from tests.integration import dist_clip_workers as CW
from tests.integration import dist_workers as W

pytestmark = W.MULTIPROCESS


@pytest.fixture(scope="module")
def run() -> W.Launch:
    return W.launch(CW.job_clip, world=4, limit=120)


def _one_device(norm_type: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The unsplit model's clipped gradients, named as the workers name them."""
    stages = CW.stages()
    x, y = W.batch(12)
    nn.MSELoss()(nn.Sequential(*stages)(x), y).backward()
    params = nn.Sequential(*stages).parameters()  # the shared layer once
    total = nn.utils.clip_grad_norm_(params, CW.MAX_NORM, norm_type)
    grads = {
        f"{s}.{name}": p.grad
        for s, stage in enumerate(stages)
        for name, p in stage.named_parameters(remove_duplicate=False)
        if p.grad is not None
    }
    return total, grads


@pytest.mark.parametrize("norm_type", CW.NORMS)
def test_every_rank_clips_as_one_device(run: W.Launch, norm_type: float) -> None:
    total, grads = _one_device(norm_type)
    assert total.item() > CW.MAX_NORM or norm_type == -float("inf")  # clipping happens
    for rank in range(4):
        got = run.ok(rank)[str(norm_type)]
        assert got["total"] == pytest.approx(total.item(), rel=1e-12), f"rank {rank}"
        assert got["dtype"] == str(total.dtype)
        assert got["grads"], f"rank {rank} holds no gradient"
        for name, g in got["grads"].items():
            err = (torch.tensor(g, dtype=torch.float64) - grads[name]).abs().max().item()
            assert err < 1e-12, f"norm {norm_type}: rank {rank}'s {name} off by {err}"


def test_clipping_each_rank_by_its_own_norm_differs(run: W.Launch) -> None:
    # What the method replaces: torch's function on one rank's parameters alone.
    stages = CW.stages()
    x, y = W.batch(12)
    nn.MSELoss()(nn.Sequential(*stages)(x), y).backward()
    alone = copy.deepcopy(stages[1])
    own = nn.utils.clip_grad_norm_(alone.parameters(), CW.MAX_NORM)
    assert abs(own.item() - run.ok(1)["2.0"]["total"]) > 1e-3


def test_a_nonfinite_norm_is_refused_on_every_rank(run: W.Launch) -> None:
    for rank in range(4):
        got: dict[str, Any] = run.ok(rank)
        assert got["nonfinite"].startswith("The total norm of order 2.0 for gradients"), rank
        assert "error_if_nonfinite=False" in got["nonfinite"]
        assert got["unscaled"], f"rank {rank} scaled its gradients before refusing"


def test_a_failed_step_keeps_every_ranks_earlier_gradients(run: W.Launch) -> None:
    for rank in range(4):
        got = run.ok(rank)
        assert got["failed"] in ("RankStageError", "PeerFailedError"), (rank, got["failed"])
        assert got["kept"], f"rank {rank}: the failed step changed .grad"
