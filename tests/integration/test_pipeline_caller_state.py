"""The threads backend runs stages in the caller's autocast and inference mode (both are
per thread, and stage work runs on device threads), as one device would."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchgraph.pipeline import Pipeline, PipelineConfigError

_BF16 = {"rtol": 3e-2, "atol": 2e-2}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_cpu_bf16_autocast_equals_single_device(schedule: str) -> None:
    model = _model()
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    loss_fn = nn.MSELoss()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_out = model(x)
        want_loss = loss_fn(model(x), y)
    want_loss.backward()
    want_grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    with (
        Pipeline(
            model, stages=2, microbatches=4, schedule=schedule, loss_fn=loss_fn, timeout=30
        ) as pipe,
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        out = pipe.forward(x)
        loss = pipe.train_step(x, y)
    assert isinstance(out, torch.Tensor)
    # Stages once ran in float32 here, whatever the caller's autocast.
    assert out.dtype == want_out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want_out, **_BF16)
    torch.testing.assert_close(loss, want_loss.detach(), **_BF16)
    for p, g in zip(model.parameters(), want_grads):
        assert p.grad is not None and p.grad.dtype == g.dtype == torch.float32
        torch.testing.assert_close(p.grad, g, **_BF16)
    # Outside the autocast block the same pipeline computes in float32 again.
    with Pipeline(model, stages=2, microbatches=4, schedule=schedule, timeout=30) as pipe:
        out = pipe.forward(x)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32


class _Modes(nn.Module):
    """Notes the autocast and inference mode each call runs in."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta":  # not the shape probe, which runs in the caller's thread
            self.seen.append((torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu")))
        return x


def test_forward_in_inference_mode_runs_stages_in_it() -> None:
    model = _model()
    probe = _Modes()
    x = torch.randn(6, 5)
    with Pipeline([model[:2], nn.Sequential(probe, model[2:])], microbatches=3, timeout=30) as pipe:
        with torch.inference_mode():
            out = pipe.forward(x)
            want = model(x)
        assert probe.seen == [(True, False)] * 3
        probe.seen.clear()
        pipe.forward(x)
        assert probe.seen == [(False, False)] * 3
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, want)


def test_train_step_in_inference_mode_is_refused() -> None:
    model = _model()
    x, y = torch.randn(6, 5), torch.randn(6, 3)
    with Pipeline(model, stages=2, microbatches=3, loss_fn=nn.MSELoss(), timeout=30) as pipe:
        with torch.inference_mode(), pytest.raises(PipelineConfigError, match="inference_mode"):
            pipe.train_step(x, y)
        # Not a half-done step: the pipeline still trains afterwards.
        pipe.train_step(x, y)
    assert all(p.grad is not None for p in model.parameters())
