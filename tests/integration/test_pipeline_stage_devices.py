"""``Stage(..., device=)`` objects given as the pipeline's stages place them there, as
``devices=`` does; they were moved nowhere, silently. Contradictions are refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from batchgraph.pipeline import BackendRequest, Pipeline, PipelineConfigError, Stage
from batchgraph.pipeline import pipeline as pipeline_module
from tests.pipeline_models import assert_grads_equal, mlp, reference

_SEEN: list[BackendRequest] = []


def _noting(request: BackendRequest) -> Any:
    _SEEN.append(request)
    return pipeline_module._threads_backend(request)


@pytest.fixture(autouse=True)
def _noting_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    # Registered for these tests only: other tests list the registered backends.
    monkeypatch.setitem(pipeline_module._BACKENDS, "noting-threads", _noting)


def _stages(model: nn.Sequential, devices: list[str | None]) -> list[Stage]:
    parts = [model[:4], model[4:]]
    return [Stage(part, i, 2, device=d) for i, (part, d) in enumerate(zip(parts, devices, strict=True))]


def test_stages_run_on_the_devices_their_stage_objects_name() -> None:
    torch.manual_seed(0)
    model = mlp(layers=4)
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    want_loss, want = reference(model, x, y, nn.MSELoss())
    _SEEN.clear()
    with Pipeline(_stages(model, ["cpu", "cpu"]), microbatches=3, loss_fn=nn.MSELoss(),
                  backend="noting-threads", timeout=30) as pipe:
        loss = pipe.train_step(x, y)
    assert _SEEN[-1].devices == [torch.device("cpu"), torch.device("cpu")]
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, want)


def test_stages_naming_no_device_leave_the_devices_to_the_pipeline() -> None:
    _SEEN.clear()
    with Pipeline(_stages(mlp(layers=4), [None, None]), microbatches=2, loss_fn=nn.MSELoss(),
                  backend="noting-threads", timeout=30):
        pass
    assert _SEEN[-1].devices is None


@pytest.mark.parametrize(
    ("names", "devices", "message"),
    [
        (["cpu", None], None, r"pipeline devices \[1\] do not"),
        (["cpu", "meta"], ["cpu", "cpu"], r"devices\[1\] is cpu, but its Stages ask for meta"),
    ],
)
def test_contradicting_devices_are_refused(
    names: list[str | None], devices: list[str] | None, message: str,
) -> None:
    with pytest.raises(PipelineConfigError, match=message):
        Pipeline(_stages(mlp(layers=4), names), microbatches=2, loss_fn=nn.MSELoss(),
                 devices=devices, timeout=30)


def test_stages_of_one_device_naming_two_devices_are_refused() -> None:
    model = mlp(layers=4)
    parts = [model[:2], model[2:4], model[4:6], model[6:]]
    stages = [Stage(p, i, 4, device="meta" if i == 2 else "cpu") for i, p in enumerate(parts)]
    with pytest.raises(PipelineConfigError, match="another stage of pipeline device 0 asks for cpu"):
        Pipeline(stages, schedule="interleaved-1f1b", chunks=2, microbatches=2,
                 loss_fn=nn.MSELoss(), timeout=30)


def test_a_device_named_with_and_without_its_index_is_one_device() -> None:
    # "cuda" is the current CUDA device, maybe "cuda:0": not a contradiction ("meta"
    # stands in for a device type here: no CUDA is needed to build the check).
    _SEEN.clear()
    with Pipeline(_stages(mlp(layers=4), ["meta:0", "meta"]), microbatches=2,
                  loss_fn=nn.MSELoss(), devices=["meta", "meta:0"], backend="noting-threads",
                  timeout=30):
        pass
    assert _SEEN[-1].devices == [torch.device("meta"), torch.device("meta:0")]


def test_too_few_devices_beside_stages_naming_theirs_are_refused_by_count() -> None:
    with pytest.raises(PipelineConfigError, match="devices has 1 entries"):
        Pipeline(_stages(mlp(layers=4), ["cpu", "cpu"]), microbatches=2,
                 loss_fn=nn.MSELoss(), devices=["cpu"], timeout=30)
