"""A pipeline runs one step at a time: calls from several threads wait their turn, and a
call made from inside a running step (its loss, a stage's forward) is refused.

Before, two threads' steps shared the stages' saved activations and the communicator's
messages: they failed with unrelated errors ("duplicate message", "computed no
gradient") or left wrong gradients; a loss function that called ``pipe.forward`` waited
for its own pipeline's threads forever, whatever ``timeout=`` said.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

from batchgraph.pipeline import Pipeline, PipelineReentrantError, StageError
from tests.pipeline_models import assert_grads_equal, mlp, reference

_SCHEDULES = ["gpipe", "1f1b", "zb-h1"]
LIMIT_S = 60  # a call that hangs fails the test instead of blocking the run


def _within(fn: Callable[[], None]) -> None:
    """Run ``fn`` on a daemon thread; fail if it is still running after LIMIT_S seconds,
    else re-raise what it raised."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(LIMIT_S)
    assert not thread.is_alive(), f"still running after {LIMIT_S} s: the call hangs"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("schedule", _SCHEDULES)
def test_steps_from_two_threads_accumulate_as_one_after_another(schedule: str) -> None:
    torch.manual_seed(0)
    model = mlp(layers=4)
    x = torch.randn(16, 5, dtype=torch.float64)
    y = torch.randn(16, 3, dtype=torch.float64)
    want_loss, want = reference(model, x, y, nn.MSELoss())
    steps, threads = 4, 2
    losses: list[torch.Tensor] = []
    errors: list[BaseException] = []
    with Pipeline(
        model, stages=2, microbatches=4, schedule=schedule, loss_fn=nn.MSELoss(), timeout=30
    ) as pipe:

        def train() -> None:
            try:
                for _ in range(steps):
                    loss = pipe.train_step(x, y)
                    assert loss is not None
                    losses.append(loss)
                    out = pipe.forward(x)
                    assert isinstance(out, torch.Tensor) and out.shape == (16, 3)
            except BaseException as exc:  # reported below, with the thread's traceback
                errors.append(exc)

        workers = [threading.Thread(target=train) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=LIMIT_S)
        assert not any(worker.is_alive() for worker in workers), "a step hung"
    assert errors == []
    for loss in losses:
        torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    # Every step added the batch's gradient once: 8 steps, 8 times one step's.
    assert_grads_equal(model, [None if g is None else g * (steps * threads) for g in want])


@pytest.mark.parametrize("schedule", _SCHEDULES)
@pytest.mark.parametrize("call", ["forward", "train_step", "reset"])
def test_a_call_from_inside_a_running_step_is_refused(schedule: str, call: str) -> None:
    model = mlp(layers=4)
    x = torch.randn(6, 5, dtype=torch.float64)
    y = torch.randn(6, 3, dtype=torch.float64)
    holder: dict[str, Pipeline] = {}

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        pipe = holder.pop("pipe", None)  # once: the first microbatch's loss
        if pipe is not None:
            if call == "forward":
                pipe.forward(x)
            elif call == "train_step":
                pipe.train_step(x, y)
            else:
                pipe.reset()
        return nn.functional.mse_loss(out, target)

    pipe = Pipeline(model, stages=2, microbatches=3, schedule=schedule, loss_fn=loss_fn, timeout=30)
    holder["pipe"] = pipe
    with pytest.raises(StageError, match=r"loss failed") as caught:
        _within(lambda: pipe.train_step(x, y) and None)
    cause = caught.value.__cause__
    assert isinstance(cause, PipelineReentrantError)
    assert f"pipe.{call}() was called from inside a running train_step" in str(cause)
    # The pipeline is still usable, and exact.
    model.zero_grad(set_to_none=True)
    want_loss, want = reference(model, x, y, nn.MSELoss())
    with pipe:
        loss = pipe.train_step(x, y)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, want)


def test_a_forward_from_inside_a_stage_is_refused() -> None:
    holder: dict[str, Pipeline] = {}

    class Peek(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            pipe = holder.pop("pipe", None)
            if pipe is not None:
                pipe.forward(torch.zeros(2, 5, dtype=torch.float64))
            return h

    model = mlp(layers=4)
    stages = [model[:3], nn.Sequential(Peek(), *model[3:])]
    # No meta-device probe: it would run Peek on the calling thread before the step.
    pipe = Pipeline(stages, microbatches=2, loss_fn=nn.MSELoss(), timeout=30, check_shapes=False)
    holder["pipe"] = pipe
    with pytest.raises(StageError, match=r"stage 1 failed in action 1F0") as caught:
        _within(lambda: pipe.forward(torch.randn(4, 5, dtype=torch.float64)) and None)
    assert isinstance(caught.value.__cause__, PipelineReentrantError)
    assert "inside a running forward" in str(caught.value.__cause__)
    pipe.close()
