"""Data-parallel replicas start equal (4 gloo ranks: 2 stages x 2 replicas).

Each rank initialised its stages with its own random state; seeded apart (``seed +
rank``, for different dropout masks per rank) the replicas started apart and, their
gradients summed, trained as different models, neither one device's, silently.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.integration import dist_replica_workers as RW
from tests.integration import dist_workers as W

pytestmark = W.MULTIPROCESS


@pytest.fixture(scope="module")
def run() -> W.Launch:
    return W.launch(RW.job_seeded_apart, world=4, limit=90)


def test_replicas_start_as_the_first_one(run: W.Launch) -> None:
    for r in (2, 3):
        got, want = run.ok(r)["before"], run.ok(r - 2)["before"]
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == want[k], f"rank {r}'s {k} differs from rank {r - 2}'s"


def test_replicas_train_as_one_device_from_the_first_replicas_state(run: W.Launch) -> None:
    twin = RW.model()
    first = {**run.ok(0)["before"], **run.ok(1)["before"]}
    twin.load_state_dict({k: torch.tensor(v, dtype=torch.float64) for k, v in first.items()})
    x, y = W.batch(12)
    nn.MSELoss()(twin(x), y).backward()
    torch.optim.SGD(twin.parameters(), lr=RW.LR).step()
    want = twin.state_dict()
    for r in range(4):
        for k, v in run.ok(r)["after"].items():
            err = (torch.tensor(v, dtype=torch.float64) - want[k]).abs().max().item()
            assert err < 1e-10, f"rank {r}: {k} differs from one device's by {err}"
