"""The torch.distributed backend's batch semantics equal the threads backend's (2 gloo ranks).

How microbatches are weighted, which batches are refused, and parameters shared by
stages on different ranks: each compared with single-device training in float64.
Launches are bounded (see :func:`tests.integration.dist_workers.launch`).
"""

from __future__ import annotations

import pytest

from tests.integration import dist_batch_workers as BW
from tests.integration import dist_workers as W

pytestmark = W.MULTIPROCESS

TOL = 1e-10


def test_microbatch_weights_count_samples_not_output_rows() -> None:
    """Logits (B*T, V) of B sequences, mean cross-entropy: loss and gradients as one device."""
    run = W.launch(BW.job_output_not_batch, world=2, limit=60)
    for r in range(2):
        res = run.ok(r)
        assert res["error"] < TOL, f"rank {r}: gradient differs by {res['error']}"
    last = run.ok(1)
    assert last["loss"] == pytest.approx(last["ref_loss"], abs=TOL)


def test_a_mean_over_counted_targets_divides_by_every_replicas_count() -> None:
    # Each replica divided by the count of its own targets, so the replicas' summed
    # gradients (and loss) were the sum of their means, for CrossEntropyLoss with or
    # without ignored targets: about twice the right values with two replicas.
    run = W.launch(BW.job_counted_mean_over_replicas, world=2, limit=60)
    for r in range(2):
        for name, res in run.ok(r).items():
            assert res["error"] < TOL, f"rank {r}, {name}: gradient differs by {res['error']}"
            assert res["loss"] == pytest.approx(res["ref_loss"], abs=TOL), (r, name)


def test_inputs_computed_by_the_callers_graph_get_their_gradient() -> None:
    # Each microbatch's stage-0 backward ran on into the caller's graph: the second
    # failed the step ("Trying to backward through the graph a second time").
    run = W.launch(BW.job_inputs_from_the_callers_graph, world=2, limit=60)
    for r in range(2):
        assert run.ok(r)["error"] < TOL, f"rank {r}"


def test_inputs_and_targets_of_different_sizes_are_refused_on_every_rank() -> None:
    run = W.launch(BW.job_batch_mismatch, world=2, limit=60)
    for r in range(2):
        res = run.ok(r)
        assert "inputs have 8 samples but targets have 4" in res["refused"], res["refused"]
        assert "inputs on rank 0, targets on rank 1" in res["refused"]
        assert "rank 1 runs the last stage: pass the targets" in res["missing"], res["missing"]
        want = "the targets require grad" if r == 1 else "rank 1's targets are refused"
        assert want in res["grad_targets"], res["grad_targets"]
        # Refused before anything ran; the next good step equals one device.
        assert res["untouched"], f"rank {r}: a refused step left gradients"
        assert res["error"] < TOL, f"rank {r}: gradient differs by {res['error']}"


def test_parameter_tied_across_ranks_gets_the_whole_gradient() -> None:
    run = W.launch(BW.job_tied_across_ranks, world=2, limit=60)
    for r in range(2):
        res = run.ok(r)
        assert res["error"] < TOL, f"rank {r}: gradient differs by {res['error']}"
    # Built on meta and initialised on each rank apart: the copies start equal.
    assert run.ok(0)["meta_tied"] == run.ok(1)["meta_tied"]
