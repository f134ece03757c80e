"""State kept by stage forwards on the torch.distributed backend (2 gloo ranks): a
counter counts its rank's microbatches; a forward reading back a mean it kept of its
inputs is refused at its first forward, naming the stage, on every rank."""

from __future__ import annotations

import pytest

from tests.integration import dist_workers as W
from tests.integration.dist_kept_workers import job_kept_state

pytestmark = W.MULTIPROCESS


@pytest.fixture(scope="module")
def two_ranks() -> W.Launch:
    return W.launch(job_kept_state, world=2, limit=90)


def test_a_counter_counts_its_ranks_microbatches(two_ranks: W.Launch) -> None:
    # Each counting layer, on whichever rank holds it, counts the 3 microbatches.
    assert two_ranks.ok(0)["centre=False"] + two_ranks.ok(1)["centre=False"] == [3, 3]


def test_a_read_back_of_a_kept_mean_is_refused_on_every_rank(two_ranks: W.Launch) -> None:
    for r in range(2):
        kind, text = two_ranks.ok(r)["centre=True"]
        assert kind.endswith("Error"), (kind, text)
    # Rank 1 holds both layers (split by parameter count): its stage 1 is named.
    _, own = two_ranks.ok(1)["centre=True"]
    assert "stage 1 (SequentialStage) reads Centred.ref" in own and "microbatches=1" in own
