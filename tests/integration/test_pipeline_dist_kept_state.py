"""State kept by stage forwards on the torch.distributed backend (2 gloo ranks): a
counter counts its rank's microbatches; a forward reading back a mean it kept of its
inputs is refused at its first forward, naming the stage, on every rank, a forward that
reads a value in Python (no meta run) too."""

from __future__ import annotations

import pytest

from tests.integration import dist_workers as W
from tests.integration.dist_kept_workers import job_kept_state

pytestmark = W.MULTIPROCESS


@pytest.fixture(scope="module")
def two_ranks() -> W.Launch:
    return W.launch(job_kept_state, world=2, limit=90)


@pytest.mark.parametrize("item", ["", "item "])
def test_a_counter_counts_its_ranks_microbatches(two_ranks: W.Launch, item: str) -> None:
    # Each counting layer, on whichever rank holds it, counts the 3 microbatches (the
    # check's runs on real tensors, for a forward reading a value in Python, count none).
    key = f"{item}centre=False"
    assert two_ranks.ok(0)[key] + two_ranks.ok(1)[key] == [3, 3]


@pytest.mark.parametrize("item", ["", "item "])
def test_a_read_back_of_a_kept_mean_is_refused_on_every_rank(two_ranks: W.Launch,
                                                             item: str) -> None:
    # A forward reading a value in Python (.item()) cannot run on meta: it was not
    # refused before the check ran it on real tensors.
    key = f"{item}centre=True"
    for r in range(2):
        kind, text = two_ranks.ok(r)[key]
        assert kind.endswith("Error"), (kind, text)
    # Rank 1 holds both layers (split by parameter count): its stage 1 is named.
    _, own = two_ranks.ok(1)[key]
    assert "stage 1 (SequentialStage) reads Centred.ref" in own and "microbatches=1" in own
