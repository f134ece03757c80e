"""What a training step refuses or warns about, on the torch.distributed backend as on
the threads one: refused on every rank before any work (the pipeline stays usable), or,
when only the last rank can tell, failing every rank with the last rank's words."""

from __future__ import annotations

import pytest

from tests.integration import dist_check_workers as C
from tests.integration import dist_workers as W

pytestmark = W.MULTIPROCESS

TOL = 1e-10
# Three samples for microbatches=4, refused by train_step and forward alike.
TOO_SMALL = (
    "PipelineConfigError: microbatches=4 does not fit a batch of 3 samples: use 1 <= "
    "microbatches <= 3 (every microbatch needs at least one sample)"
)


@pytest.fixture(scope="module")
def refusals() -> W.Launch:
    return W.launch(C.job_refusals, world=2, limit=60)


def test_train_step_under_inference_mode_is_refused_on_every_rank(refusals: W.Launch) -> None:
    # It silently recorded nothing: every .grad stayed untouched.
    for r in range(2):
        res = refusals.ok(r)
        assert res["inference"].startswith("PipelineConfigError: train_step was called under "
                                           "torch.inference_mode() on ranks 0, 1"), res  # fmt: skip
        assert res["inference_then"] < TOL


def test_a_frozen_model_is_refused_on_every_rank(refusals: W.Launch) -> None:
    for r in range(2):
        res = refusals.ok(r)
        assert res["frozen"].startswith("PipelineConfigError: train_step has nothing to "
                                        "compute gradients for"), res  # fmt: skip
        assert "on any rank" in res["frozen"]
        assert res["frozen_then"] < TOL


def test_more_microbatches_than_samples_leaves_the_pipeline_usable(refusals: W.Launch) -> None:
    # It failed inside the step, which tore the process groups down for good.
    for r in range(2):
        res = refusals.ok(r)
        assert res["small"] == TOO_SMALL
        assert res["small_then"] < TOL


def test_forward_refuses_bad_inputs_on_every_rank_and_stays_usable(refusals: W.Launch) -> None:
    # A batch smaller than microbatches failed rank 0 inside the step, which tore the
    # process groups down for good (every later call: PipelineClosedError).
    for r in range(2):
        res = refusals.ok(r)
        assert res["forward_small"] == TOO_SMALL
        assert res["forward_missing"] == "PipelineConfigError: rank 0 runs stage 0: pass the inputs"
        assert res["forward_then_train"] < TOL
    assert refusals.ok(1)["forward_then"] < TOL


def test_ranks_making_different_calls_are_refused_on_every_rank(refusals: W.Launch) -> None:
    # Each ran its own plan: both waited the whole timeout, rank 0 with a raw gloo error.
    for r in range(2):
        res = refusals.ok(r)
        assert res["mixed_calls"] == (
            "PipelineConfigError: rank 1 called train_step but rank 0 called forward; every "
            "rank must make the same call each step"
        ), res["mixed_calls"]
        assert res["mixed_then"] < TOL


def test_a_0d_output_warns_in_train_step_and_forward_refuses_it_on_the_last_rank() -> None:
    launch = W.launch(C.job_scalar_output, world=2, limit=60)
    zero, one = launch.ok(0), launch.ok(1)
    assert zero["warnings"] == []
    assert len(one["warnings"]) == 1 and "returned a 0-d tensor" in one["warnings"][0]
    # Rank 0 got a raw gloo 'Connection closed by peer' from the timeline gather.
    assert zero["forward"] == "ok"
    assert one["forward"].startswith("PipelineConfigError: the last stage (stage 1, Sequential) "
                                     "returned a 0-d tensor"), one  # fmt: skip
    assert zero["then"] == one["then"] == "ok"


def test_a_step_without_gradient_fails_every_rank_naming_the_last_stage() -> None:
    # It silently left every .grad untouched.
    launch = W.launch(C.job_no_gradient, world=2, limit=60)
    one, zero = launch.ok(1)["step"], launch.ok(0)["step"]
    assert one.startswith("RankStageError: rank 1: train_step computed no gradient"), one
    assert "stage 1 (Sequential)" in one
    assert zero.startswith("PeerFailedError:"), zero
    assert "rank 1 failed first (stage 1, action loss, microbatch 3)" in zero
    assert "train_step computed no gradient" in zero


def test_hooks_on_a_sequential_given_whole_warn_that_they_will_not_run(refusals: W.Launch) -> None:
    # The façade warned; DistributedPipeline splits the Sequential itself and did not.
    for r in range(2):
        (message, filename), *more = refusals.ok(r)["hooks"]
        assert not more
        assert "Sequential being split has forward hooks registered on it" in message
        assert filename.endswith("dist_check_workers.py")  # the caller's line
