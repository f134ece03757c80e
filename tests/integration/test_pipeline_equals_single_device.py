"""Seed 001's list: every schedule's outputs and gradients equal single-device execution."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from batchgraph.pipeline import SCHEDULE_NAMES, Loss, Pipeline
from tests.pipeline_models import assert_grads_equal, mlp, reference

# (stages p, microbatches m, batch size): single stage, m < p, m = p, m >> p, uneven last.
CASES = [(1, 1, 4), (1, 3, 7), (2, 1, 3), (2, 2, 4), (2, 5, 11), (4, 2, 6), (4, 4, 8), (4, 9, 21)]


def _chunks(schedule: str) -> int:
    return 2 if schedule == "interleaved-1f1b" else 1


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
@pytest.mark.parametrize(("p", "m", "n"), CASES)
def test_gradients_and_outputs_equal_single_device(schedule: str, p: int, m: int, n: int) -> None:
    model = mlp(layers=8)
    x = torch.randn(n, 5, dtype=torch.float64)
    y = torch.randn(n, 3, dtype=torch.float64)
    loss_fn = nn.MSELoss()
    want_loss, want_grads = reference(model, x, y, loss_fn)
    with Pipeline(
        model,
        stages=p,
        microbatches=m,
        schedule=schedule,
        loss_fn=loss_fn,
        chunks=_chunks(schedule),
        timeout=30,
    ) as pipe:
        assert pipe.schedule.stages == p * _chunks(schedule)
        loss = pipe.train_step(x, y)
        torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
        assert_grads_equal(model, want_grads)
        with torch.no_grad():
            torch.testing.assert_close(pipe.forward(x), model(x), rtol=1e-10, atol=1e-10)
        # The stages hold the original parameters, not copies.
        ids = {id(q) for mod in pipe.stage_modules for q in mod.parameters()}
        assert ids == {id(q) for q in model.parameters()}


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_sum_reduction_and_tuple_inputs(schedule: str) -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 4)

        def forward(self, x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.tanh(self.a(x)), z

    class Merge(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b = nn.Linear(4, 2)

        def forward(self, h: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
            return self.b(h) * z

    first, second = Two().double(), Merge().double()
    x = torch.randn(7, 3, dtype=torch.float64)
    z = torch.randn(7, 1, dtype=torch.float64)
    y = torch.randn(7, 2, dtype=torch.float64)
    loss_fn = nn.MSELoss(reduction="sum")
    whole = nn.ModuleList([first, second])
    whole.zero_grad()
    loss_fn(second(*first(x, z)), y).backward()
    want = [p.grad.clone() for p in whole.parameters()]  # type: ignore[union-attr]
    whole.zero_grad(set_to_none=True)
    with Pipeline(
        [first, second], microbatches=3, schedule=schedule, loss_fn=loss_fn, timeout=30
    ) as pipe:
        pipe.train_step((x, z), y)
    assert_grads_equal(whole, want)  # type: ignore[arg-type]


def test_graph_split_module_trains_exactly() -> None:
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, 6)
            self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
            self.out = nn.Linear(6, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.inp(x))
            skip = h
            for block in self.blocks:
                h = h + torch.tanh(block(h))
            return self.out(h + skip)

    model = Residual().double()
    x = torch.randn(9, 4, dtype=torch.float64)
    y = torch.randn(9, 2, dtype=torch.float64)
    want_loss, want = reference(model, x, y, nn.MSELoss())
    with Pipeline(
        model, stages=3, microbatches=4, schedule="zb-h1", loss_fn=nn.MSELoss(), timeout=30
    ) as pipe:
        loss = pipe.train_step(x, y)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, want)


def test_gradients_accumulate_across_steps_and_reset_works() -> None:
    model = mlp(layers=4)
    x = torch.randn(6, 5, dtype=torch.float64)
    y = torch.randn(6, 3, dtype=torch.float64)
    _, want = reference(model, x, y, nn.MSELoss())
    with Pipeline(
        model, stages=2, microbatches=3, schedule="1f1b", loss_fn=nn.MSELoss(), timeout=30
    ) as pipe:
        pipe.train_step(x, y)
        pipe.reset()
        assert pipe.timeline == [] and pipe.stats.makespan == 0.0
        pipe.train_step(x, y)
        assert_grads_equal(model, [None if g is None else 2 * g for g in want])
        model.zero_grad(set_to_none=True)
        pipe.train_step(x, y)
        assert_grads_equal(model, want)


@given(
    p=st.integers(1, 4),
    m=st.integers(1, 8),
    extra=st.integers(0, 6),
    schedule=st.sampled_from(SCHEDULE_NAMES),
    reduction=st.sampled_from(["mean", "sum"]),
)
def test_property_grid_equals_single_device(
    p: int, m: int, extra: int, schedule: str, reduction: str
) -> None:
    torch.manual_seed(p * 100 + m)
    n = m + extra
    model = mlp(layers=8, width=4)
    x = torch.randn(n, 5, dtype=torch.float64)
    y = torch.randn(n, 3, dtype=torch.float64)
    loss_fn = nn.MSELoss(reduction=reduction)
    want_loss, want = reference(model, x, y, loss_fn)
    with Pipeline(
        model,
        stages=p,
        microbatches=m,
        schedule=schedule,
        loss_fn=loss_fn,
        chunks=_chunks(schedule),
        cost="uniform",
        timeout=30,
    ) as pipe:
        loss = pipe.train_step(x, y)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, want)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved-1f1b"])
def test_weight_tied_across_stages(schedule: str) -> None:
    # The first and last stages share one weight; both threads add to its .grad.
    first = nn.Linear(4, 4)
    last = nn.Linear(4, 4)
    last.weight = first.weight
    model = nn.Sequential(first, nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), last).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    y = torch.randn(8, 4, dtype=torch.float64)
    want_loss, want = reference(model, x, y, nn.MSELoss())
    chunks = _chunks(schedule)
    with Pipeline(
        list(model) if chunks == 1 else [model[0], model[1:3], model[3], model[4]],
        microbatches=4,
        schedule=schedule,
        loss_fn=nn.MSELoss(),
        chunks=chunks,
        timeout=30,
    ) as pipe:
        loss = pipe.train_step(x, y)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, want)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_loss_that_computes_its_own_gradient(schedule: str) -> None:
    """A Loss overriding compute_gradient keeps the separate dL/d(outputs) pass on the last
    stage (the default one starts the stage's backward from the loss); both are exact."""
    calls: list[int] = []

    class OwnGradient(Loss):
        def compute_gradient(
            self, loss: torch.Tensor, output: Any, *, weight: float = 1.0
        ) -> tuple[torch.Tensor | None, ...]:
            calls.append(1)
            return super().compute_gradient(loss, output, weight=weight)

    model = mlp(layers=4)
    x = torch.randn(8, 5, dtype=torch.float64)
    y = torch.randn(8, 3, dtype=torch.float64)
    want_loss, want_grads = reference(model, x, y, nn.MSELoss())
    with Pipeline(
        model, stages=2, microbatches=4, schedule=schedule, loss_fn=OwnGradient(nn.MSELoss())
    ) as pipe:
        loss = pipe.train_step(x, y)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, want_grads)
    assert len(calls) == 4  # once per microbatch


@pytest.mark.filterwarnings("ignore:reduction. 'mean' divides the total loss:UserWarning")
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("reduction", ["batchmean", "mean", "sum"])
def test_kl_divergence_loss_equals_single_device(schedule: str, reduction: str) -> None:
    # KLDivLoss(reduction="batchmean") splits exactly (sum over microbatches of each one's
    # sum / N) but was refused as an unknown reduction.
    y = torch.softmax(torch.randn(7, 3, dtype=torch.float64), dim=-1)
    log_probs_step_equals_single_device(y, nn.KLDivLoss(reduction=reduction), schedule, 3)


def log_probs_step_equals_single_device(
    y: torch.Tensor, loss_fn: nn.Module, schedule: str, microbatches: int
) -> None:
    """One training step of a 2-stage MLP ending in log-probabilities over 3 classes, 7
    samples, against one device."""
    model = nn.Sequential(mlp(layers=4), nn.LogSoftmax(dim=-1))
    x = torch.randn(7, 5, dtype=torch.float64)
    want_loss, want_grads = reference(model, x, y, loss_fn)
    assert torch.isfinite(want_loss)
    with Pipeline(
        model, stages=2, microbatches=microbatches, schedule=schedule, loss_fn=loss_fn,
        timeout=30,
    ) as pipe:  # fmt: skip
        loss = pipe.train_step(x, y)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, want_grads)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize(
    "loss_fn",
    [
        nn.CrossEntropyLoss(ignore_index=0),
        nn.CrossEntropyLoss(weight=torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64),
                            ignore_index=2, label_smoothing=0.1),
        nn.NLLLoss(weight=torch.tensor([3.0, 1.0, 0.25], dtype=torch.float64)),
    ],
    ids=["ignore_index", "weight-ignore-smoothing", "nll-weight"],
)
def test_a_mean_over_counted_targets_equals_single_device(
    schedule: str, loss_fn: nn.Module
) -> None:
    # CrossEntropyLoss/NLLLoss "mean" divides by the (weighted) count of targets not
    # ignored. Weighted by microbatch size, a microbatch of padding counted as much as
    # one of real targets (silently wrong loss and gradients), and one whose targets are
    # all ignored gave NaN. Microbatches here: [0, 0] (all ignored by the first loss),
    # [1, 2], [1, 1], [2].
    log_probs_step_equals_single_device(torch.tensor([0, 0, 1, 2, 1, 1, 2]), loss_fn, schedule, 4)


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_tuples_between_stages_carry_every_gradient_upstream(schedule: str) -> None:
    # Each middle stage takes and returns two tensors that both depend on the first
    # stage's parameters: the gradient of the second must reach upstream as the first
    # does. (test_sum_reduction_and_tuple_inputs passes its second tensor straight from
    # the inputs, which need no gradient: a backward that sent only the first input's
    # gradient upstream passed every pipeline test.)
    class Fork(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 4)
            self.b = nn.Linear(3, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.tanh(self.a(x)), torch.tanh(self.b(x))

    class Cross(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, h: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.tanh(self.lin(k)), h * k

    class Join(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.out = nn.Linear(8, 2)

        def forward(self, h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            return self.out(torch.cat([h, k], dim=-1))

    parts = [Fork(), Cross(), Cross(), Join()]
    whole = nn.ModuleList(parts).double()
    x = torch.randn(8, 3, dtype=torch.float64)
    y = torch.randn(8, 2, dtype=torch.float64)

    def single_device(x: torch.Tensor) -> torch.Tensor:
        h, k = parts[0](x)
        h, k = parts[1](h, k)
        h, k = parts[2](h, k)
        return parts[3](h, k)

    whole.zero_grad(set_to_none=True)
    want_loss = nn.MSELoss()(single_device(x), y)
    want_loss.backward()
    want = [p.grad.clone() for p in whole.parameters()]  # type: ignore[union-attr]
    whole.zero_grad(set_to_none=True)
    with Pipeline(
        parts, microbatches=4, schedule=schedule, loss_fn=nn.MSELoss(), chunks=_chunks(schedule),
        timeout=30,
    ) as pipe:  # fmt: skip
        loss = pipe.train_step(x, y)
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-10, atol=1e-10)
    assert_grads_equal(whole, want)  # type: ignore[arg-type]
