"""The torch.distributed backend on 2 and 4 local processes (gloo on 127.0.0.1).

Each launch is bounded: a rank still alive after the limit is killed and the test fails,
so a hang can never stall the suite. Ranks report results through a queue; gradients are
compared with single-device training in float64.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

from tests.integration import dist_workers as W

pytestmark = W.MULTIPROCESS

TOL = 1e-10
SCHEDULES = ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"]


@pytest.fixture(scope="module")
def two_ranks() -> W.Launch:
    return W.launch(W.job_schedules, world=2, limit=90)


@pytest.fixture(scope="module")
def four_ranks() -> W.Launch:
    return W.launch(W.job_data_parallel, world=4, limit=90)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gradients_equal_single_device(two_ranks: W.Launch, schedule: str) -> None:
    results = [two_ranks.ok(r)[schedule] for r in range(2)]
    for r, res in enumerate(results):
        assert res["error"] < TOL, f"rank {r}: gradient differs by {res['error']}"
        assert res["error_new_shapes"] < TOL, f"rank {r}: after a batch-size change"
    assert results[0]["loss"] is None  # only the last rank gets the loss
    assert results[1]["loss"] == pytest.approx(results[1]["ref_loss"], abs=TOL)
    assert results[0]["devices"] == [0, 1]  # rank 0 gathered both ranks' timelines


def test_complex_outputs_get_their_gradient_under_zb_h1(two_ranks: W.Launch) -> None:
    # The last rank's loss leaves on complex outputs required no grad: no rank got any.
    for r in range(2):
        assert two_ranks.ok(r)["complex"] < TOL, f"rank {r}"


def test_one_element_tuples_reach_the_loss_as_tuples(two_ranks: W.Launch) -> None:
    # Targets (y,) and a last stage returning (h,) reached the loss as the bare tensors:
    # a loss indexing them trained on the first sample's row, silently.
    for r in range(2):
        res = two_ranks.ok(r)["one_element_tuples"]
        assert res["error"] < TOL, f"rank {r}: gradient differs by {res['error']}"
    last = two_ranks.ok(1)["one_element_tuples"]
    assert last["loss"] == pytest.approx(last["ref_loss"], abs=TOL)
    assert last["forward"] == "tuple"  # pipe.forward returns (h,) as the model does


@pytest.mark.parametrize("variant", ["fused", "own_gradient"])
def test_last_stage_loss_with_and_without_its_own_gradient_pass(
    two_ranks: W.Launch, variant: str
) -> None:
    """The default loss starts the last stage's backward itself; a Loss that overrides
    compute_gradient keeps the separate pass; both equal one device."""
    for r in range(2):
        res = two_ranks.ok(r)[variant]
        assert res["error"] < TOL, f"rank {r}: gradient differs by {res['error']}"
        assert res["fused"] is (variant == "fused")
    assert two_ranks.ok(1)[variant]["loss"] == pytest.approx(W.reference_loss(2), abs=TOL)


def test_a_mean_over_counted_targets_equals_single_device(two_ranks: W.Launch) -> None:
    # CrossEntropyLoss with ignore_index and class weights divides by a data-dependent
    # count; weighted by microbatch size it was wrong, and NaN for an all-ignored one.
    for r in range(2):
        res = two_ranks.ok(r)["counted"]
        assert res["error"] < TOL, f"rank {r}: gradient differs by {res['error']}"
    res = two_ranks.ok(1)["counted"]
    assert res["loss"] == pytest.approx(res["ref_loss"], abs=TOL)


def test_facade_backend_uses_only_own_stage(two_ranks: W.Launch) -> None:
    for r in range(2):
        res = two_ranks.ok(r)["facade"]
        assert res["error"] < TOL
        assert res["untouched"], f"rank {r} touched another rank's stage"
    assert two_ranks.ok(0)["facade"]["forward"] is None
    assert two_ranks.ok(1)["facade"]["forward"] == (12, W.OUT)


def test_mismatched_configuration_is_detected_at_start(two_ranks: W.Launch) -> None:
    for r in range(2):
        message = two_ranks.ok(r)["mismatch"]
        assert "built the pipeline differently" in message
        assert "rank 0: microbatches=3" in message and "rank 1: microbatches=4" in message


def test_pipeline_x_data_parallel_equals_single_device(four_ranks: W.Launch) -> None:
    for r in range(4):
        res = four_ranks.ok(r)["dp"]
        assert res["error"] < TOL, f"rank {r}: gradient differs by {res['error']}"
        assert res["meta_elsewhere"], f"rank {r} materialised a stage it does not run"
        if r % 2 == 1:  # last stage of each replica: the loss of the whole batch
            assert res["loss"] == pytest.approx(res["ref_loss"], abs=TOL)


def test_four_stage_pipeline_equals_single_device(four_ranks: W.Launch) -> None:
    for r in range(4):
        assert four_ranks.ok(r)["p4"]["error"] < TOL
    res = four_ranks.ok(3)["p4"]
    assert res["loss"] == pytest.approx(res["ref_loss"], abs=TOL)


def _fault(world: int, bad: int, mode: str, **kw: Any) -> W.Launch:
    # Every rank but a hung one must end by itself well within the limit.
    others = [r for r in range(world) if r != bad] if mode == "hang" else None
    job = partial(W.job_fault, bad_rank=bad, mode=mode, **kw)
    return W.launch(job, world=world, limit=45, wait_for=others)


def test_exception_on_one_rank_stops_every_rank_with_the_original_error() -> None:
    run = _fault(4, bad=2, mode="raise")
    assert all(code not in (None, 0) for code in run.exitcodes), run.exitcodes
    kind, message = run.error(2)
    assert kind == "RankStageError"
    assert "rank 2: stage 2 failed in action 2F1" in message and "injected failure" in message
    for r in (0, 1, 3):
        kind, message = run.error(r)
        assert kind == "PeerFailedError", message
        assert "rank 2 failed first (stage 2, action 2F1, microbatch 1)" in message
        assert "ValueError: injected failure" in message


def test_killed_rank_makes_the_others_fail_clearly() -> None:
    run = _fault(2, bad=1, mode="kill")
    assert run.exitcodes[1] == 9
    assert run.exitcodes[0] not in (None, 0)
    kind, message = run.error(0)
    assert kind in ("PeerLostError", "RankStageError"), message
    assert "rank 0 lost rank 1" in message and "died or closed its connection" in message


def test_hung_rank_makes_the_others_time_out() -> None:
    run = _fault(2, bad=1, mode="hang", timeout=3.0)
    assert run.exitcodes[0] not in (None, 0)
    kind, message = run.error(0)
    assert "PipelineTimeoutError" in kind + message, message
    assert "waited 3 s" in message and "rank 1" in message


def test_messages_survive_signature_changes_between_steps() -> None:
    """One-transfer (small) and header + tensor (large) messages, changing every step."""
    launch = W.launch(W.job_message_signatures, world=2, limit=60)
    assert launch.ok(0) == []
    assert launch.ok(1) == []


def test_a_send_buffer_is_reused_only_after_its_send_was_waited() -> None:
    """A key's one-transfer buffer, reused step after step, never overwritten in flight."""
    launch = W.launch(W.job_reused_send_buffer, world=2, limit=60)
    assert launch.ok(0) == []
    assert launch.ok(1) == []


def test_receives_posted_early_for_one_shape_take_another_and_errors_stay_clear() -> None:
    launch = W.launch(W.job_shape_change_after_early_posts, world=2, limit=60)
    one = launch.ok(1)
    assert one["early"] == [3, 3, 3], one  # every step: 1F1..1F3's receives, during the fill
    assert one["width"] == 8 and one["error"] == "RankStageError", one
    assert "rank 1: stage 1 failed in action 1F0" in one["message"], one["message"]
    # Microbatches of 3 rows: 8 columns arrived as sent, into buffers posted for 6.
    assert "shapes cannot be multiplied (3x8 and 6x3)" in one["message"], one["message"]
    zero = launch.ok(0)
    assert zero["width"] == 8 and zero["error"] == "PeerFailedError", zero
    assert "rank 1 failed first (stage 1, action 1F0, microbatch 0)" in zero["message"]
