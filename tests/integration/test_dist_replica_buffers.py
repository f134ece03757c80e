"""Replicas' buffers (BatchNorm running statistics) as DistributedDataParallel keeps them.

4 gloo ranks: a pipeline of 2 stages x 2 replicas, one microbatch per replica (so each
BatchNorm sees a replica's whole shard, as each DDP rank does), against DDP over the
unsplit model on 2 ranks with the same shards. Before the fix each replica kept the
running statistics of its own shards only, so replica 1's drifted from replica 0's
(DDP's default ``broadcast_buffers=True`` copies rank 0's before each forward) and the
replicas evaluated and saved different models, silently. And the replicas broadcast at
every step, ``forward`` (no grad) too, where DDP broadcasts at a forward only after one
with grad enabled: after a no-grad forward in train mode the states differed from DDP's.
Those mixed calls go through ``Pipeline(..., backend="torch.distributed",
broadcast_buffers=...)``, which could not turn the broadcast off.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.integration import dist_buffer_workers as BW
from tests.integration import dist_workers as W

pytestmark = W.MULTIPROCESS


@pytest.fixture(scope="module")
def run() -> W.Launch:
    return W.launch(BW.job_buffers, world=4, limit=120)


def _error(got: dict[str, Any], want: dict[str, Any]) -> tuple[float, str]:
    worst, where = 0.0, ""
    for k, v in got.items():
        diff = torch.tensor(v, dtype=torch.float64) - torch.tensor(want[k], dtype=torch.float64)
        err = diff.abs().max().item()
        if err >= worst:
            worst, where = err, k
    return worst, where


@pytest.mark.parametrize("calls", ["", "mixed_"])
@pytest.mark.parametrize("broadcast", [True, False])
def test_replicas_keep_buffers_and_weights_as_ddp(
    run: W.Launch, broadcast: bool, calls: str
) -> None:
    # mixed_: train_step and forward (no grad) in turn; DDP broadcasts at a forward's
    # start only after one with grad enabled (or at its first), so not at the second
    # forward in a row nor at the training step after a forward.
    for rank in range(4):
        replica = rank // 2
        ddp = run.ok(replica)[f"ddp_{calls}{broadcast}"]
        for step, got in enumerate(run.ok(rank)[f"pipe_{calls}{broadcast}"]):
            assert got, f"rank {rank} holds no state"
            err, key = _error(got, ddp[step])
            assert err < 1e-10, (
                f"broadcast_buffers={broadcast}: rank {rank} (replica {replica}) after {calls}step "
                f"{step}: {key} differs from DDP rank {replica}'s by {err}"
            )


def test_the_reference_tells_the_two_apart(run: W.Launch) -> None:
    # Replica 1's running statistics differ with and without the broadcast: the test
    # above could not pass for both by accident.
    on, off = run.ok(1)["ddp_True"][-1], run.ok(1)["ddp_False"][-1]
    assert _error(on, off)[0] > 1e-3
