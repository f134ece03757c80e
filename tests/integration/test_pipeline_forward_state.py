"""Python state kept by stage forwards: what a pipeline step leaves versus one device.

A stage forward runs once per microbatch, so what a forward keeps (a counter, a list of
the shapes it saw) is what the unsplit model keeps when run on each microbatch in
order; the loss and gradients are one device's on the whole batch. No schedule runs a
forward more often than that: the two-stage backward ('zb-h1') runs a unit that changes
its input in place twice on its first call (torch refuses the change on a leaf), and its
Python state is put back in between. The stage shape probe (on meta tensors) leaves
nothing either, nested caches, deques and sets included.
"""

from __future__ import annotations

from collections import deque

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from batchgraph.pipeline import Pipeline, StageError
from batchgraph.pipeline.microbatch import check_stages_fit, split_microbatches
from tests.pipeline_models import SCHEDULES, assert_grads_equal, chunks_for, grid, reference


class ScaleInPlace(nn.Module):
    """A unit (parameters of its own) that counts its calls, notes the sizes it saw,
    and scales its input in place (timm's LayerScale(inplace=True))."""

    def __init__(self) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.float64))
        self.calls = 0
        self.seen: list[int] = []
        self.sizes: set[int] = set()

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        self.seen.append(x.shape[0])
        self.sizes.add(x.shape[0])
        return x.mul_(self.gamma)


class TotalInPlace(ScaleInPlace):
    """Also carries a total of its inputs in a plain tensor, changed in place."""

    def __init__(self) -> None:
        super().__init__()
        self.total = torch.zeros((), dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        self.total += x.detach().sum()
        return super().forward(x)


def _model(blocks: int, layer: type[ScaleInPlace] = ScaleInPlace) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(blocks):
        mods += [nn.Linear(4, 4, dtype=torch.float64), layer(), nn.Tanh()]
    return nn.Sequential(*mods)


def _state(model: nn.Module) -> list[tuple[int, list[int], set[int]]]:
    return [(m.calls, m.seen, m.sizes) for m in model.modules() if isinstance(m, ScaleInPlace)]


@settings(max_examples=20, deadline=None)
@given(**grid(), samples=st.integers(4, 7))
@example(stages=2, microbatches=2, schedule="zb-h1", samples=4)
def test_forward_state_is_one_devices_per_microbatch(
    stages: int, microbatches: int, schedule: str, samples: int
) -> None:
    chunks = chunks_for(schedule)
    x = torch.randn(samples, 4, dtype=torch.float64)
    y = torch.randn(samples, 4, dtype=torch.float64)
    one = _model(stages * chunks)
    loss, grads = reference(one, x, y, nn.MSELoss())
    # What the forwards keep: the unsplit model's forwards on each microbatch, in order.
    kept = _model(stages * chunks)
    with torch.no_grad():
        for (part,) in split_microbatches(x, microbatches):
            kept(part.clone())
    model = _model(stages * chunks)
    with Pipeline(model, stages=stages, microbatches=microbatches, schedule=schedule,
                  loss_fn=nn.MSELoss(), chunks=chunks) as pipe:
        got = pipe.train_step(x, y)
        torch.testing.assert_close(got, loss, rtol=1e-10, atol=1e-10)
        assert_grads_equal(model, grads)
        assert _state(model) == _state(kept)
        # A second step keeps it once per microbatch again (the unit now runs once).
        model.zero_grad(set_to_none=True)
        pipe.train_step(x, y)
        assert_grads_equal(model, grads)
    with torch.no_grad():
        for (part,) in split_microbatches(x, microbatches):
            kept(part.clone())
    assert _state(model) == _state(kept)


def test_a_total_changed_in_place_before_an_input_changed_in_place_is_refused() -> None:
    # Run again, the call would add its input to the total twice: refused, naming the
    # stage and the attribute, before any total is off.
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    model = _model(2, TotalInPlace)
    with Pipeline(model, stages=2, microbatches=3, schedule="zb-h1",
                  loss_fn=nn.MSELoss()) as pipe, pytest.raises(StageError) as info:
        pipe.train_step(x, y)
    text = str(info.value)
    assert "stage 1" in text and "TotalInPlace.total" in text and "1f1b" in text


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_total_changed_in_place_sums_the_microbatches(schedule: str) -> None:
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    one = _model(2, TotalInPlace)
    one(x.clone())
    model = _model(2, TotalInPlace)
    with Pipeline(model, stages=2, microbatches=3, schedule=schedule,
                  loss_fn=nn.MSELoss()) as pipe:
        pipe.train_step(x, y)
    totals = [m.total for m in model.modules() if isinstance(m, TotalInPlace)]
    expected = [m.total for m in one.modules() if isinstance(m, TotalInPlace)]
    torch.testing.assert_close(totals, expected, rtol=1e-12, atol=1e-12)


class Checkpointed(nn.Module):
    """A stateful layer run under torch.utils.checkpoint (non-reentrant): one device runs
    its forward twice per call, once more to recompute in the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = ScaleOut()

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = checkpoint(self.inner, x, use_reentrant=False)
        return out


class ScaleOut(ScaleInPlace):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.clone())


def _checkpointed(blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(blocks):
        mods += [nn.Linear(4, 4, dtype=torch.float64), Checkpointed(), nn.Tanh()]
    return nn.Sequential(*mods)


@settings(max_examples=12, deadline=None)
@given(**grid())
@example(stages=2, microbatches=2, schedule="zb-h1")
def test_a_checkpointed_forward_is_recomputed_once_per_microbatch(
    stages: int, microbatches: int, schedule: str
) -> None:
    # Under 'zb-h1' the region's units recorded local graphs whose saved tensors the
    # checkpoint recomputed in each autograd pass: in I's chain, in the junction's and in
    # W (4 runs per microbatch where one device runs 2).
    chunks = chunks_for(schedule)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    loss, grads = reference(_checkpointed(stages * chunks), x, y, nn.MSELoss())
    kept = _checkpointed(stages * chunks)
    for (part,) in split_microbatches(x, microbatches):
        kept(part).sum().backward()
    model = _checkpointed(stages * chunks)
    with Pipeline(model, stages=stages, microbatches=microbatches, schedule=schedule,
                  loss_fn=nn.MSELoss(), chunks=chunks) as pipe:
        torch.testing.assert_close(pipe.train_step(x, y), loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, grads)
    # The recomputations run at each microbatch's backward, in the schedule's order.
    assert [(n, sorted(seen), sizes) for n, seen, sizes in _state(model)] == [
        (n, sorted(seen), sizes) for n, seen, sizes in _state(kept)]


class Keeping(nn.Module):
    """Keeps tensors in nested dicts, a deque and a set, and counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: dict[str, dict[str, Tensor]] = {"layer": {}}
        self.recent: deque[Tensor] = deque(maxlen=2)
        self.shapes: set[tuple[int, ...]] = set()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        self.shapes.add(tuple(x.shape))
        if "cos" not in self.cache["layer"]:
            self.cache["layer"]["cos"] = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        out = x * self.cache["layer"]["cos"]
        self.recent.append(out)
        return out


def test_the_stage_probe_leaves_nested_containers_deques_and_sets() -> None:
    # The probe runs the stages on meta tensors: a meta tensor left in a nested cache
    # failed the first real forward, and the deque and set kept the probe's call.
    layer = Keeping()
    check_stages_fit([nn.Linear(4, 4), layer], [torch.zeros(2, 4)])
    assert layer.calls == 0 and layer.cache == {"layer": {}}
    assert len(layer.recent) == 0 and layer.shapes == set()
    layer(torch.ones(3, 4))  # the real forward computes on real tensors
    assert layer.cache["layer"]["cos"].device.type == "cpu" and layer.shapes == {(3, 4)}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_no_grad_forward_keeps_state_per_microbatch_too(schedule: str) -> None:
    chunks = chunks_for(schedule)
    x = torch.randn(7, 4, dtype=torch.float64)
    kept = _model(2 * chunks)
    with torch.no_grad():
        expected = torch.cat([kept(part.clone()) for (part,) in split_microbatches(x, 3)])
    model = _model(2 * chunks)
    with Pipeline(model, stages=2, microbatches=3, schedule=schedule,
                  loss_fn=nn.MSELoss(), chunks=chunks) as pipe:
        out = pipe.forward(x)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert _state(model) == _state(kept)
