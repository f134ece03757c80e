"""A :class:`PipelineSchedule` given to ``DistributedPipeline`` (2 gloo ranks).

It was used unchecked: counts that contradicted it were silently ignored, and an
invalid schedule (a backward missing) left every rank waiting the whole timeout for a
message never sent, then failed with a raw gloo error.
"""

from __future__ import annotations

import pytest

from tests.integration import dist_schedule_workers as SW
from tests.integration import dist_workers as W

pytestmark = W.MULTIPROCESS


@pytest.fixture(scope="module")
def run() -> W.Launch:
    return W.launch(SW.job_schedule_objects, world=2, limit=90)


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("invalid", "ScheduleError: invalid schedule 'gpipe': missing backward: neither 0B1"),
        ("counts", "microbatches=4 was passed with schedule '1f1b', which has microbatches=2"),
    ],
)
def test_a_schedule_object_is_checked_on_every_rank(run: W.Launch, case: str, words: str) -> None:
    for r in range(2):
        res = run.ok(r)[case]
        assert words in res["error"], f"rank {r}: {res['error']}"
        assert res["seconds"] < 10, f"rank {r} waited {res['seconds']:.1f} s to refuse"


@pytest.mark.parametrize("case", ["mixed", "interleaved"])
def test_a_valid_schedule_object_trains_as_one_device(run: W.Launch, case: str) -> None:
    for r in range(2):
        assert run.ok(r)[case] < 1e-10, f"rank {r}: gradient differs by {run.ok(r)[case]}"
