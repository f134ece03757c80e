"""Faults: a failing task names stage, action and microbatch; no thread is left blocked."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from batchgraph.pipeline import (
    Pipeline,
    PipelineClosedError,
    PipelineConfigError,
    StageError,
    StageMismatchError,
    available_backends,
)
from tests.pipeline_models import assert_grads_equal, mlp, reference


def _pipeline_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("batchgraph-pipeline")]


class RaiseOnMicrobatch(nn.Module):
    """A layer that raises on its ``bad``-th real forward call while ``armed``.

    Calls on meta tensors (the pipeline's shape probe) are not counted.
    """

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.bad = bad
        self.calls = 0
        self.armed = True

    def forward(self, x: Tensor) -> Tensor:
        if x.is_meta:
            return self.lin(x)
        call, self.calls = self.calls, self.calls + 1
        if self.armed and call == self.bad:
            raise ValueError("boom on purpose")
        return self.lin(x)


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        raise RuntimeError("backward exploded")


class FailInBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()

    def forward(self, x: Tensor) -> Tensor:
        return _FailBackward.apply(self.lin(x))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_exception_in_stage_names_stage_action_microbatch(schedule: str) -> None:
    bad = RaiseOnMicrobatch(bad=2)
    model = nn.Sequential(nn.Linear(4, 4).double(), bad, nn.Linear(4, 4).double())
    x = torch.randn(8, 4, dtype=torch.float64)
    y = torch.randn(8, 4, dtype=torch.float64)
    pipe = Pipeline(
        list(model), microbatches=4, schedule=schedule, loss_fn=nn.MSELoss(), timeout=30
    )
    with pytest.raises(
        StageError, match=r"stage 1 failed in action 1F2 \(forward of microbatch 2\)"
    ) as info:
        pipe.train_step(x, y)
    assert (info.value.stage, info.value.action, info.value.microbatch) == (1, "1F2", 2)
    assert isinstance(info.value.__cause__, ValueError)
    # Nothing is blocked: the device threads are idle and the pipeline runs again.
    bad.armed = False
    pipe.reset()
    model.zero_grad(set_to_none=True)
    _, want = reference(model, x, y, nn.MSELoss())
    pipe.train_step(x, y)
    assert_grads_equal(model, want)
    assert _pipeline_threads()
    pipe.close()
    assert _pipeline_threads() == []
    with pytest.raises(PipelineClosedError):
        pipe.train_step(x, y)


@pytest.mark.parametrize(("schedule", "action"), [("1f1b", r"1B\d"), ("zb-h1", r"1I\d")])
def test_exception_in_backward_is_reported(schedule: str, action: str) -> None:
    model = [nn.Linear(4, 4).double(), FailInBackward(), nn.Linear(4, 4).double()]
    x = torch.randn(6, 4, dtype=torch.float64)
    with (
        Pipeline(
            model, microbatches=3, schedule=schedule, loss_fn=nn.MSELoss(), timeout=30
        ) as pipe,
        pytest.raises(StageError, match=rf"stage 1 failed in action {action} .*backward exploded"),
    ):
        pipe.train_step(x, x)
    assert _pipeline_threads() == []


def test_exception_in_loss_is_reported_and_threads_end() -> None:
    def bad_loss(out: Tensor, tgt: Tensor) -> Tensor:
        raise KeyError("no such target")

    with Pipeline(mlp(4), stages=2, microbatches=2, loss_fn=bad_loss, timeout=30) as pipe:
        x = torch.randn(4, 5, dtype=torch.float64)
        with pytest.raises(StageError, match="loss failed on microbatch 0"):
            pipe.train_step(x, torch.zeros(4, 3, dtype=torch.float64))
    assert _pipeline_threads() == []


def test_shape_mismatch_across_cut_found_before_training() -> None:
    first = RaiseOnMicrobatch(bad=-1)  # counts forward calls
    model = [first, nn.Linear(4, 8).double(), nn.Linear(3, 2).double()]
    pipe = Pipeline(model, microbatches=2, loss_fn=nn.MSELoss(), timeout=30)
    with (
        pipe,
        pytest.raises(
            StageMismatchError,
            match=r"stage 1 \(Linear\) produces \(\(2, 8\) torch.float64\) but stage 2 \(Linear\) cannot take it",
        ),
    ):
        pipe.train_step(
            torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
        )
    assert first.calls == 0  # nothing ran for real
    assert all(p.grad is None for m in model for p in m.parameters())


def test_first_stage_input_mismatch() -> None:
    # Says to fix the inputs: "fix the split" pointed at a cut that is not there.
    pipe = Pipeline([nn.Linear(3, 2), nn.Linear(2, 1)], microbatches=1, loss_fn=nn.MSELoss())
    with (
        pipe,
        pytest.raises(
            StageMismatchError,
            match=r"stage 0 \(Linear\) cannot take the microbatch inputs .*; give inputs that "
            r"stage takes \(check their shape and dtype\) or fix it$",
        ),
    ):
        pipe.forward(torch.randn(2, 5))


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_targets_that_require_grad_are_refused(schedule: str) -> None:
    # Targets from a trainable teacher: gpipe failed its second microbatch in their
    # graph ("backward through the graph a second time"), zb-h1 left out their gradient.
    model = mlp(4)
    teacher = nn.Linear(5, 3, dtype=torch.float64)
    x = torch.randn(6, 5, dtype=torch.float64)
    with (
        Pipeline(model, stages=2, microbatches=3, schedule=schedule, loss_fn=nn.MSELoss()) as pipe,
        pytest.raises(PipelineConfigError, match=r"the targets require grad.*targets\.detach\(\)"),
    ):
        pipe.train_step(x, teacher(x))
    assert all(p.grad is None for p in [*model.parameters(), *teacher.parameters()])


def test_an_empty_batch_is_named() -> None:
    # Was "microbatches=1 does not fit a batch of 0 samples: use 1 <= microbatches <= 0".
    with (
        Pipeline(mlp(4), stages=2, microbatches=2, loss_fn=nn.MSELoss()) as pipe,
        pytest.raises(PipelineConfigError, match=r"^the batch is empty \(0 samples"),
    ):
        pipe.train_step(torch.zeros(0, 5, dtype=torch.float64), torch.zeros(0, 3))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stages": 2, "microbatches": 0}, "microbatches must be an int >= 1"),
        ({"stages": 2, "microbatches": 2, "chunks": 2}, "use 'interleaved-1f1b'"),
        ({"stages": 2, "microbatches": 2, "schedule": "2f2b"}, "choose one of gpipe, 1f1b"),
        ({"stages": 9, "microbatches": 2}, r"cannot split 7 layers into 9 stages"),
        (
            {"stages": 2, "microbatches": 2, "backend": "mpi"},
            r"backend 'mpi' is not registered; registered backends: threads, torch\.distributed",
        ),
        ({"microbatches": 2}, "pass stages="),
        # One copy of the model: no replica could keep buffers of its own.
        (
            {"stages": 2, "microbatches": 2, "broadcast_buffers": False},
            r"^broadcast_buffers=False lets data-parallel replicas .* backend='threads' trains one",
        ),
        ({"stages": 2, "microbatches": 2, "broadcast_buffers": 0}, r"True or False, got 0$"),
        # Failed inside the first step as a stage error, or (negative) was not refused.
        ({"stages": 2, "microbatches": 2, "timeout": 0}, r"timeout must be .* > 0 .*got 0$"),
        ({"stages": 2, "microbatches": 2, "timeout": -1}, r"timeout must be .* > 0 .*got -1$"),
        ({"stages": 2, "microbatches": 2, "timeout": "30"}, r"got '30'$"),
    ],
)
def test_invalid_configuration(kwargs: dict[str, Any], match: str) -> None:
    assert "threads" in available_backends()
    with pytest.raises(PipelineConfigError, match=match):
        Pipeline(mlp(4), loss_fn=nn.MSELoss(), **kwargs)


def test_distributed_backend_outside_a_process_group() -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="start the script with torchrun"):
        Pipeline(
            mlp(4), stages=2, microbatches=2, loss_fn=nn.MSELoss(), backend="torch.distributed"
        )


def test_more_microbatches_than_samples() -> None:
    pipe = Pipeline(mlp(4), stages=2, microbatches=5, loss_fn=nn.MSELoss())
    with (
        pipe,
        pytest.raises(
            PipelineConfigError, match=r"microbatches=5 does not fit a batch of 3 samples"
        ),
    ):
        pipe.train_step(
            torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
        )
