"""Checkpoints on the torch.distributed backend, 2 and 3 local processes (gloo, 127.0.0.1).

Each rank saves and loads its own stages' entries under the unsplit model's names; the
whole model's state gathers to one rank and loads strictly into the unsplit model; the
meta-built model's own ``state_dict()`` refuses instead of saving meta tensors. Trained
state is compared with single-device training in float64. Launches are bounded as in
test_dist_pipeline.py.
"""

from __future__ import annotations

import pytest

from tests.integration import dist_checkpoint_workers as C
from tests.integration import dist_workers as W

pytestmark = W.MULTIPROCESS

TOL = 1e-10


@pytest.fixture(scope="module", params=[2, 3])
def facade(request: pytest.FixtureRequest) -> tuple[int, W.Launch]:
    return request.param, W.launch(C.job_facade, world=request.param, limit=90)


@pytest.fixture(scope="module", params=[2, 3])
def stage_list(request: pytest.FixtureRequest) -> tuple[int, W.Launch]:
    return request.param, W.launch(C.job_stage_list, world=request.param, limit=90)


def test_each_rank_saves_its_own_stages_as_trained_under_the_models_names(
    facade: tuple[int, W.Launch],
) -> None:
    world, launch = facade
    keys: list[str] = []
    for r in range(world):
        res = launch.ok(r)
        assert res["loaded"] == ([], []), res["loaded"]  # a single-device checkpoint, strict
        assert res["part_error"] < TOL, f"rank {r}: differs from one device by {res['part_error']}"
        assert not res["part_meta"]
        assert res["part_keys"], f"rank {r} saved nothing"
        keys += res["part_keys"]
    want = launch.ok(0)["want_keys"]
    assert sorted(keys) == sorted(want)  # the ranks' parts: every key once


def test_gathered_state_dict_loads_into_the_unsplit_model(facade: tuple[int, W.Launch]) -> None:
    world, launch = facade
    zero = launch.ok(0)
    assert zero["whole_keys"] == zero["want_keys"]  # the unsplit model's names and order
    assert zero["whole_error"] < TOL
    assert zero["fresh_output_error"] < TOL
    for r in range(1, world):
        assert launch.ok(r)["whole_keys"] is None


def test_a_fresh_pipeline_resumes_from_each_ranks_own_part(facade: tuple[int, W.Launch]) -> None:
    world, launch = facade
    for r in range(world):
        assert launch.ok(r)["reloaded"] == ([], []), r  # other ranks' keys are not needed
    assert launch.ok(world - 1)["reloaded_output_error"] < TOL


def test_the_meta_built_models_own_state_dict_refuses(facade: tuple[int, W.Launch]) -> None:
    world, launch = facade
    for r in range(world):
        res = launch.ok(r)
        message = res["model_state_dict"]
        assert "meta tensors (never materialised)" in message, message
        stages = ", ".join(map(str, res["own_stages"]))
        assert f"this rank runs only stage(s) {stages}:" in message, message
        assert "pipe.state_dict()" in message and "pipe.gather_state_dict()" in message


def test_strict_loading_names_this_ranks_missing_and_unknown_keys(
    facade: tuple[int, W.Launch],
) -> None:
    world, launch = facade
    for r in range(world):
        res = launch.ok(r)
        assert "missing key(s): " + repr(res["missing_key"]) in res["missing"], res["missing"]
        assert "unexpected key(s), of no stage: 'head.bias'" in res["unexpected"]
        assert res["after_errors"] < TOL  # a refused load copies nothing


def test_a_list_of_stages_is_named_like_a_sequential_of_them(
    stage_list: tuple[int, W.Launch],
) -> None:
    world, launch = stage_list
    for r in range(world):
        res = launch.ok(r)
        assert res["part_keys"] and all(k.startswith(f"{r}.") for k in res["part_keys"])
        assert res["part_error"] == 0.0
        assert res["whole_keys"] == (res["want_keys"] if r == world - 1 else None)
        assert f"unexpected key(s), of no stage: '{r}.bogus'" in res["own_bogus"]
        assert res["other_bogus"] == "ok"  # another rank's stage: it checks its own
        assert f"unexpected key(s), of no stage: '{world}.x'" in res["no_stage"]
        assert res["own_module"] == "ok"
        assert "this rank runs only stage(s)" in res["other_module"]


def test_replicas_save_alike_and_the_whole_gathers_once() -> None:
    launch = W.launch(C.job_replicas, world=4, limit=90)
    for r in range(4):
        res = launch.ok(r)
        assert res["part_error"] < TOL, f"rank {r}: differs from one device by {res['part_error']}"
        assert res["whole_keys"] == (res["want_keys"] if r == 0 else None)
    assert launch.ok(0)["whole_error"] < TOL
