"""Stage forwards reading back a tensor a forward kept from its inputs are refused.

One device runs the model once on the whole batch; a pipeline runs each stage once per
microbatch, so such a tensor is a microbatch's (see batchgraph.pipeline.kept_inputs).
Refused before any work, for several microbatches; one microbatch runs as one device.
Tensors kept without their inputs' values (a table per length, ones_like(x)), or kept
and never read back, run.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from torch import Tensor, nn

from batchgraph.pipeline import Pipeline, PipelineConfigError
from batchgraph.pipeline.kept_inputs import check_inputs_kept
from batchgraph.pipeline.microbatch import split_microbatches
from tests.pipeline_models import (
    SCHEDULES,
    assert_grads_equal,
    chunks_for,
    grid,
    reference,
    stacked,
)


class Centred(nn.Module):
    """Centres its inputs on the mean of the first batch it saw (kept, read back)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.ref: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.ref is None:
            self.ref = x.detach().mean(0)
        return torch.tanh(self.lin(x - self.ref))


def _finite(x: Tensor) -> None:
    # A value read in Python: such a forward cannot run on meta tensors, and the check
    # ended there, silently (ItemCentred: loss 1.6751 where one device's 1.6757).
    if not x.isfinite().all().item():
        raise ValueError("not finite")


class ItemCentred(Centred):
    """Centred, reading a value in Python first."""

    def forward(self, x: Tensor) -> Tensor:
        _finite(x)
        return super().forward(x)


class Tables(nn.Module):
    """Keeps a table per width and a mask shaped as its input: neither reads its values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.cos: Tensor | None = None
        self.mask: Tensor | None = None
        self.last: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.cos is None:
            self.cos = torch.cos(torch.arange(x.shape[-1], dtype=x.dtype))
        if self.mask is None:
            self.mask = torch.ones_like(x)
        out = torch.tanh(self.lin(x)) * self.cos * self.mask[:1]
        self.last = out.detach()  # kept for inspection, never read back
        return out


def _one_device_and_model(blocks: int, layer: type[nn.Module]) -> tuple[
        Tensor, Tensor, nn.Sequential, Tensor, list[Tensor | None], nn.Sequential]:
    """A batch, the model run on one device with its loss and gradients, and a fresh copy."""
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    one = stacked(blocks, layer)
    loss, grads = reference(one, x, y, nn.MSELoss())
    return x, y, one, loss, grads, stacked(blocks, layer)


@pytest.mark.parametrize("layer", [Centred, ItemCentred])
@settings(max_examples=16, deadline=None)
@given(**grid())
@example(stages=2, microbatches=2, schedule="1f1b")
def test_a_forward_reading_back_what_it_kept_from_its_inputs(
    layer: type[Centred], stages: int, microbatches: int, schedule: str
) -> None:
    chunks = chunks_for(schedule)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    one = stacked(stages * chunks, layer)
    loss, grads = reference(one, x, y, nn.MSELoss())
    model = stacked(stages * chunks, layer)
    with Pipeline(model, stages=stages, microbatches=microbatches, schedule=schedule,
                  loss_fn=nn.MSELoss(), chunks=chunks) as pipe:
        if microbatches == 1:  # as one device, kept state included
            torch.testing.assert_close(pipe.train_step(x, y), loss, rtol=1e-10, atol=1e-10)
            assert_grads_equal(model, grads)
            refs = [m.ref for m in model.modules() if isinstance(m, Centred)]
            expected = [m.ref for m in one.modules() if isinstance(m, Centred)]
            torch.testing.assert_close(refs, expected, rtol=1e-12, atol=1e-12)
            return
        with pytest.raises(PipelineConfigError,
                           match=rf"reads {layer.__name__}\.ref, .*next call"):
            pipe.train_step(x, y)
    # Refused before any work: nothing kept, no gradient.
    assert all(m.ref is None for m in model.modules() if isinstance(m, Centred))
    assert all(p.grad is None for p in model.parameters())


class Keeps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.cache: dict[str, Tensor] = {}

    def forward(self, x: Tensor) -> Tensor:
        self.cache["h"] = x.detach()
        return torch.tanh(self.lin(x))


class Reads(nn.Module):
    """Reads what another layer kept (a skip through an attribute, not an output)."""

    def __init__(self, source: Keeps) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.__dict__["source"] = source  # not a submodule: no parameters of its own

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) + self.source.cache["h"].mean(0)


class ItemReads(Reads):
    """Reads, reading a value in Python first."""

    def forward(self, x: Tensor) -> Tensor:
        _finite(x)
        return super().forward(x)


@pytest.mark.parametrize("reader", [Reads, ItemReads])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_stage_reading_what_another_stage_kept_is_refused(
    schedule: str, reader: type[Reads]
) -> None:
    keeps = Keeps()
    model = nn.Sequential(nn.Linear(4, 4, dtype=torch.float64), keeps,
                          nn.Linear(4, 4, dtype=torch.float64), reader(keeps))
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    with Pipeline(model, stages=2, microbatches=3, schedule=schedule,
                  loss_fn=nn.MSELoss()) as pipe:
        with pytest.raises(PipelineConfigError,
                           match=r"stage 1 .* reads Keeps\.cache, which stage 0's"):
            pipe.train_step(x, y)
        assert keeps.cache == {}
    with Pipeline(model, stages=2, microbatches=1, schedule=schedule,
                  loss_fn=nn.MSELoss()) as pipe:
        loss = pipe.train_step(x, y)
    torch.testing.assert_close(loss, nn.MSELoss()(model(x), y), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tables_and_masks_kept_run_and_a_tensor_kept_holds_the_last_microbatch(
    schedule: str
) -> None:
    chunks = chunks_for(schedule)
    x, y, one, loss, grads, model = _one_device_and_model(2 * chunks, Tables)
    with Pipeline(model, stages=2, microbatches=3, schedule=schedule,
                  loss_fn=nn.MSELoss(), chunks=chunks) as pipe:
        torch.testing.assert_close(pipe.train_step(x, y), loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, grads)
    last = split_microbatches(torch.arange(6), 3)[-1][0]
    for got, expected in zip(model.modules(), one.modules()):
        if isinstance(got, Tables) and isinstance(expected, Tables):
            assert expected.last is not None and got.last is not None
            torch.testing.assert_close(got.last, expected.last[last], rtol=1e-12, atol=1e-12)


def test_a_no_grad_forward_reading_back_what_it_kept_is_refused_too() -> None:
    model = stacked(2, Centred)
    x = torch.randn(6, 4, dtype=torch.float64)
    with Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss()) as pipe:
        with pytest.raises(PipelineConfigError, match=r"stage 0 .* reads Centred\.ref"):
            pipe.forward(x)
        assert all(m.ref is None for m in model.modules() if isinstance(m, Centred))
    with Pipeline(model, stages=2, microbatches=1, loss_fn=nn.MSELoss()) as pipe:
        out = pipe.forward(x)
    torch.testing.assert_close(out, stacked(2, Centred)(x), rtol=1e-12, atol=1e-12)


class Inspected(nn.Linear):
    """Keeps each call's output for inspection (replacing the last one), never reads it."""

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        self.last = out.detach()
        return torch.tanh(out) * 2


def test_a_tensor_kept_and_replaced_at_each_call_is_not_taken_for_one_read_back() -> None:
    # Replaced in the second run, the first run's tensor was freed, and a tensor made
    # next could take its id: read, it was refused as the kept one (8 to 10 checks of
    # 10 raised, at random).
    torch.manual_seed(0)
    stages = [nn.Sequential(Inspected(8, 8), nn.ReLU(), Inspected(8, 8)),
              nn.Sequential(nn.Linear(8, 8), Inspected(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))]
    for _ in range(10):
        check_inputs_kept(stages, [torch.zeros(4, 8)])
    model = nn.Sequential(*stages).double()
    x, y = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
    loss, grads = reference(model, x, y, nn.MSELoss())
    for schedule in SCHEDULES:
        chunks = chunks_for(schedule)
        if chunks > 1:
            continue  # two blocks: one per stage
        with Pipeline(model, stages=2, microbatches=3, schedule=schedule,
                      loss_fn=nn.MSELoss()) as pipe:
            torch.testing.assert_close(pipe.train_step(x, y), loss, rtol=1e-10, atol=1e-10)
        assert_grads_equal(model, grads)
        model.zero_grad(set_to_none=True)


class RunningCentre(nn.Module):
    """Centres on a running mean of its inputs, a buffer it updates in place and reads."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.register_buffer("mean", torch.zeros(4, dtype=torch.float64))


    def forward(self, x: Tensor) -> Tensor:
        out = self.lin(x - self.mean)
        with torch.no_grad():
            self.mean.mul_(0.5).add_(0.5 * x.mean(0))
        return torch.tanh(out)


class PlainRunningCentre(RunningCentre):
    """The same with the mean a plain tensor attribute, not a buffer."""

    def __init__(self) -> None:
        super().__init__()
        del self.mean
        self.mean = torch.zeros(4, dtype=torch.float64)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("layer", [RunningCentre, PlainRunningCentre])
def test_a_buffer_updated_from_the_inputs_in_place_and_read_back_is_refused(
    schedule: str, layer: type[RunningCentre]
) -> None:
    # Microbatch 1 centred on the mean microbatch 0 left where one device centres on
    # zeros: loss 0.9185 where one device's is 0.9432, silently. (A plain attribute
    # failed on the meta inputs, which ended the check.)
    chunks = chunks_for(schedule)
    x, y, _, loss, grads, model = _one_device_and_model(2 * chunks, layer)
    with Pipeline(model, stages=2, microbatches=2, schedule=schedule, loss_fn=nn.MSELoss(),
                  chunks=chunks) as pipe, pytest.raises(
            PipelineConfigError, match=r"reads \w*RunningCentre\.mean, .*next call"):
        pipe.train_step(x, y)
    means = [m.mean for m in model.modules() if isinstance(m, RunningCentre)]
    assert all(t.device.type == "cpu" and not t.any() for t in means)  # as they were
    with Pipeline(model, stages=2, microbatches=1, schedule=schedule,
                  loss_fn=nn.MSELoss(), chunks=chunks) as pipe:
        torch.testing.assert_close(pipe.train_step(x, y), loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, grads)


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_batch_norm_updating_its_running_statistics_in_place_still_runs(schedule: str) -> None:
    # Written from the inputs, never read in training: no read back (documented as
    # updated once per microbatch).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4))
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    with Pipeline(model, stages=2, microbatches=2, schedule=schedule,
                  loss_fn=nn.MSELoss()) as pipe:
        pipe.train_step(x, y)
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    assert all(int(m.num_batches_tracked) == 2 for m in norms)


class Scaled(nn.Module):
    """Scales by a table made once, a plain tensor attribute (not a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.table = torch.linspace(0.5, 1.5, 4, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.lin(x)) * self.table


def test_a_plain_tensor_attribute_does_not_end_the_check() -> None:
    # x * self.table failed on meta inputs, which ended the check silently, so a
    # Centred beside it ran per microbatch (loss 0.91426 where one device's 0.91400).
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    torch.manual_seed(0)
    model = nn.Sequential(Scaled(), Centred(), Scaled(), Scaled())
    with Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss()) as pipe, \
            pytest.raises(PipelineConfigError, match=r"stage 0 .* reads Centred\.ref"):
        pipe.train_step(x, y)
    assert model[0].table.device.type == "cpu"
    torch.manual_seed(0)
    model = nn.Sequential(Scaled(), Scaled(), Scaled())
    loss, grads = reference(model, x, y, nn.MSELoss())
    with Pipeline(model, stages=2, microbatches=3, loss_fn=nn.MSELoss()) as pipe:
        torch.testing.assert_close(pipe.train_step(x, y), loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, grads)


class Overwritten(nn.Module):
    """Overwrites a buffer whole from its inputs, then reads it: its own call's value."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.register_buffer("last", torch.zeros(4, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            self.last.copy_(x.mean(0))
        return torch.tanh(self.lin(x)) + self.last


def test_a_buffer_overwritten_before_it_is_read_is_no_read_back() -> None:
    x, y, _, loss, grads, model = _one_device_and_model(2, Overwritten)
    with Pipeline(model, stages=2, microbatches=1, loss_fn=nn.MSELoss()) as pipe:
        torch.testing.assert_close(pipe.train_step(x, y), loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, grads)
    check_inputs_kept([model[:2], model[2:]], [x[:3]])  # several microbatches: runs


class ReadsItsScale(nn.Module):
    """Reads a plain tensor attribute's value in Python (no meta tensor can give one)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.scale = torch.tensor([0.5], dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.lin(x)) * float(self.scale)


def test_a_forward_reading_a_plain_tensors_value_still_gets_the_check() -> None:
    # On meta, float(self.scale) fails: the check runs again with it as it is.
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    torch.manual_seed(0)
    model = nn.Sequential(ReadsItsScale(), Centred(), ReadsItsScale())
    with Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss()) as pipe, \
            pytest.raises(PipelineConfigError, match=r"stage \d .* reads Centred\.ref"):
        pipe.train_step(x, y)
    assert model[0].scale.device.type == "cpu"
