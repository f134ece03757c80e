"""A loss module's own parameters (a learned weight) trained as on one device, across
data-parallel replicas (4 gloo ranks: 2 stages x 2 replicas, uneven shards).

Before the fix each replica's last rank kept the gradient of its own shard only (no
all-reduce), each replica's loss started from its own random weight, and a failed step
left the microbatches' loss gradients in ``.grad``: the replicas trained different
losses, neither one device's, silently.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.integration import dist_loss_workers as LW
from tests.integration import dist_workers as W

pytestmark = W.MULTIPROCESS


@pytest.fixture(scope="module")
def run() -> W.Launch:
    return W.launch(LW.job_loss_parameters, world=4, limit=120)


def _one_device() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The loss weight's gradient and value after each step of the unsplit model on the
    whole batch, from the first replica's loss (rank 1's)."""
    net = nn.Sequential(W.make_stage(0, 2), W.make_stage(1, 2))
    loss = LW.seeded_loss(1)
    opt = torch.optim.SGD([*net.parameters(), *loss.parameters()], lr=LW.LR)
    x, y = W.batch(12)
    grads, weights = [], []
    for _ in range(LW.STEPS):
        loss(net(x), y).backward()
        assert loss.weight.grad is not None
        grads.append(loss.weight.grad.clone())
        opt.step()
        opt.zero_grad()
        weights.append(loss.weight.detach().clone())
    return grads, weights


def test_replicas_loss_parameters_train_as_on_one_device(run: W.Launch) -> None:
    grads, weights = _one_device()
    for rank in (1, 3):  # the last stage's ranks
        res = run.ok(rank)
        for step in range(LW.STEPS):
            for what, want in (("grads", grads[step]), ("weights", weights[step])):
                got = torch.tensor(res[what][step], dtype=torch.float64)
                err = (got - want).abs().max().item()
                assert err < 1e-12, f"rank {rank} step {step}: {what} off one device's by {err}"


def test_the_replicas_losses_started_apart(run: W.Launch) -> None:
    # Seeded apart, so the test above could not pass without the start broadcast.
    assert not torch.equal(LW.seeded_loss(1).weight, LW.seeded_loss(3).weight)


def test_a_failed_step_leaves_every_rank_s_gradients_as_before(run: W.Launch) -> None:
    for rank in range(4):
        res = run.ok(rank)
        assert res["failed"] != "no error", f"rank {rank}: the step did not fail"
        assert res["before"][-1] is not None or rank % 2 == 0
        assert res["after"] == res["before"], f"rank {rank}: the failed step changed .grad"


def test_a_loss_of_another_shape_on_one_replica_is_refused_on_every_rank(run: W.Launch) -> None:
    for rank in range(4):
        msg = run.ok(rank)["other_shape"]
        assert msg.startswith("the replicas' losses have different parameters"), msg
