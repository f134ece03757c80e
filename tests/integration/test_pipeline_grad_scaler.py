"""``train_step(..., grad_scaler=scaler)``: float16 autocast with a ``torch.amp.GradScaler``
trains as ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` on one device
(threads here; test_dist_grad_scaler.py runs it on gloo ranks).

``train_step`` runs the backwards itself and returns the loss detached, so the one-device
loop could not be written; ``scaler.step`` after an unscaled step divided every gradient
by the scale (2**16 by default), silently.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from batchgraph.pipeline import BackendRequest, Pipeline, PipelineConfigError
from batchgraph.pipeline import pipeline as pipeline_module


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)
    )


def _scaler(init_scale: float) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2)


@settings(max_examples=8, deadline=None)
@given(schedule=st.sampled_from(["gpipe", "1f1b", "zb-h1"]), seed=st.integers(0, 2**16))
def test_one_microbatch_trains_as_one_device_with_its_skipped_steps(
    schedule: str, seed: int
) -> None:
    # A first scale of 2**20 overflows float16: the first steps are skipped and the scale
    # halved, on one device and in the pipeline alike, then training goes on.
    net, twin = _model(seed), _model(seed)
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 2, generator=gen)
    mine, theirs = _scaler(2.0**20), _scaler(2.0**20)
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, twin))
    scales = []
    with Pipeline(net, stages=2, microbatches=1, schedule=schedule, loss_fn=nn.MSELoss()) as pipe:
        for _ in range(6):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = pipe.train_step(x, y, grad_scaler=mine)
                want = nn.MSELoss()(twin(x), y)
            theirs.scale(want).backward()
            assert loss is not None and torch.equal(loss, want.detach())  # not scaled
            for p, q in zip(net.parameters(), twin.parameters()):
                assert torch.equal(p.grad.nan_to_num(7.0), q.grad.nan_to_num(7.0))  # type: ignore[union-attr]
            for scaler, optimizer in ((mine, opt), (theirs, twin_opt)):
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
            assert mine.get_scale() == theirs.get_scale()
            scales.append(mine.get_scale())
    assert scales[0] < 2.0**20 and len(set(scales)) > 1  # skipped steps, then growth
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), twin.parameters()))


def test_microbatches_give_the_unscaled_gradients_of_one_device() -> None:
    # Microbatched float16 rounds otherwise: within float16's precision.
    net, twin = _model(3), _model(3)
    x, y = torch.randn(12, 8), torch.randn(12, 2)
    mine, theirs = _scaler(2.0**8), _scaler(2.0**8)
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, twin))
    with (
        Pipeline(net, stages=2, microbatches=4, loss_fn=nn.MSELoss()) as pipe,
        torch.autocast("cpu", dtype=torch.float16),
    ):
        pipe.train_step(x, y, grad_scaler=mine)
        want = nn.MSELoss()(twin(x), y)
    theirs.scale(want).backward()
    mine.unscale_(opt)
    theirs.unscale_(twin_opt)
    for p, q in zip(net.parameters(), twin.parameters()):
        assert p.grad is not None and q.grad is not None
        assert torch.allclose(p.grad, q.grad, rtol=1e-2, atol=1e-3), (p.grad - q.grad).abs().max()


class _ElsewhereRuntime:
    """A backend's runtime whose train_step takes no grad_scaler (written before it)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def train_step(self, inputs: Any, targets: Any) -> Any:
        return self._inner.train_step(inputs, targets)


def test_a_backend_that_takes_no_scaler_refuses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    threads = pipeline_module._BACKENDS["threads"]

    def backend(request: BackendRequest) -> Any:
        return _ElsewhereRuntime(threads(request))

    monkeypatch.setitem(pipeline_module._BACKENDS, "test-elsewhere", backend)
    net = _model(0)
    grads_before = copy.deepcopy([p.grad for p in net.parameters()])
    refused = pytest.raises(
        PipelineConfigError, match=r"'test-elsewhere' does not take grad_scaler=.*bfloat16"
    )
    with Pipeline(net, stages=2, loss_fn=nn.MSELoss(), backend="test-elsewhere") as pipe, refused:
        pipe.train_step(torch.randn(4, 8), torch.randn(4, 2), grad_scaler=_scaler(2.0))
    assert [p.grad for p in net.parameters()] == grads_before  # nothing ran
