"""A failed rank that lives on (its caller catches the error) must not keep its peers
waiting: every rank fails within a few seconds, far below the 20 s timeout, with the
failed rank's error."""

from __future__ import annotations

from tests.integration import dist_failure_workers as F
from tests.integration import dist_workers as W

pytestmark = W.MULTIPROCESS

PROMPT = 5.0  # seconds (measured: 0.5); the ranks live on for F.LINGER = 8 s and time out after 20 s


def test_every_rank_fails_promptly_while_the_failed_rank_lives_on() -> None:
    # Destroying a gloo group did not close its connections while this rank's transfers
    # in flight (and their frames) held it: rank 0 waited until rank 1's process exited.
    launch = W.launch(F.job_fault_then_linger, world=4, limit=60)
    for r in range(4):
        res = launch.ok(r)
        assert res["seconds"] < PROMPT, (r, res)
        if r == 2:
            assert res["error"].startswith("RankStageError: rank 2: stage 2 failed"), res
        else:
            assert res["error"].startswith("PeerFailedError:"), res
            assert "rank 2 failed first (stage 2, action 2F0, microbatch 0)" in res["error"]


def test_a_rank_failing_after_its_last_message_is_named_by_the_others() -> None:
    # Rank 0 waited in the timeline gather for the whole timeout, then raised gloo's own
    # 'Timed out waiting 20000ms for recv operation to complete'.
    launch = W.launch(F.job_fail_after_last_message, world=2, limit=60)
    one, zero = launch.ok(1), launch.ok(0)
    assert one["error"].startswith("RuntimeWarning: the last stage (stage 1, Sequential)"), one
    assert zero["seconds"] < PROMPT, zero
    assert zero["error"].startswith(
        "PeerFailedError: rank 0 stopped in a collective with the other ranks: rank 1 failed "
        "first (outside a stage action): RuntimeWarning: the last stage"
    ), zero


def test_a_rank_leaving_its_with_block_on_an_error_is_named_by_the_others() -> None:
    # Rank 1's exit waited in close()'s barrier while rank 0 waited for its next step:
    # both for the whole timeout, rank 0 then raising gloo's 'Timed out waiting 20000ms'.
    launch = W.launch(F.job_leave_on_error, world=2, limit=90)
    for name in ("direct", "facade"):
        one, zero = launch.ok(1)[name], launch.ok(0)[name]
        assert one["error"] == 'KeyError: "the caller\'s own bug"', one
        assert zero["seconds"] < PROMPT and one["seconds"] < PROMPT, (name, zero, one)
        assert zero["error"].startswith("PeerFailedError: rank 0 stopped"), zero
        assert "rank 1 failed first (outside a stage action): KeyError" in zero["error"], zero
