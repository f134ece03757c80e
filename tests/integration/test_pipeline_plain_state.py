"""State a stage forward keeps on plain objects and in buffers it registers, in a pipeline.

The pipeline's own runs of a stage (the shape probe and the check for kept inputs on
meta tensors, the two-stage backward's second run of a unit changing its input in
place) save and put back the modules' attributes as batchgraph's fake runs do
(``python_state.SavedAttributes``): a ``SimpleNamespace`` or dataclass the module
holds, and a buffer registered in forward, are looked into as a list or dict is.
Before, a probe's meta tensor stayed on such an object or as such a buffer (the first
real forward failed), a 'zb-h1' rerun counted a call twice there, and a mean of the
inputs kept on an object was not seen.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given, settings
from torch import Tensor, nn

from batchgraph.pipeline import Pipeline, PipelineConfigError
from batchgraph.pipeline.microbatch import check_stages_fit
from tests.pipeline_models import grid, step_per_microbatch


@dataclasses.dataclass
class Seen:
    calls: int = 0
    sizes: list[int] = dataclasses.field(default_factory=list)


class BoxedCache(nn.Module):
    """Keeps a table per width on a SimpleNamespace and its calls and sizes on a
    dataclass; scales its input in place (a 'zb-h1' unit runs it twice at first)."""

    def __init__(self) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.float64))
        self.box = SimpleNamespace(cos=None)
        self.seen = Seen()

    def forward(self, x: Tensor) -> Tensor:
        self.seen.calls += 1
        self.seen.sizes.append(x.shape[0])
        if self.box.cos is None:
            self.box.cos = torch.cos(torch.arange(x.shape[-1], dtype=x.dtype, device=x.device))
        return x.mul_(self.gamma * self.box.cos)


class Registering(nn.Module):
    """Registers a buffer at its first call, and counts its calls on a dataclass."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = Seen()

    def forward(self, x: Tensor) -> Tensor:
        self.seen.calls += 1
        self.seen.sizes.append(x.shape[0])
        if "shift" not in self._buffers:
            self.register_buffer("shift", torch.full((x.shape[-1],), 0.25, dtype=x.dtype,
                                                     device=x.device))
        return torch.tanh(x + self.shift)


def _model(blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(blocks):
        mods += [nn.Linear(4, 4, dtype=torch.float64), BoxedCache(), Registering()]
    return nn.Sequential(*mods)


def _state(model: nn.Module) -> list[tuple[int, list[int], str]]:
    return [(m.seen.calls, m.seen.sizes, (m.box.cos if isinstance(m, BoxedCache)
                                          else m.shift).device.type)
            for m in model.modules() if isinstance(m, (BoxedCache, Registering))]


def test_the_stage_probe_leaves_no_meta_tensor_on_an_object_or_as_a_buffer() -> None:
    boxed, registering = BoxedCache(), Registering()
    check_stages_fit([nn.Linear(4, 4, dtype=torch.float64), boxed, registering],
                     [torch.zeros(2, 4, dtype=torch.float64)])
    assert boxed.box.cos is None and "shift" not in registering._buffers
    assert boxed.seen == Seen() and registering.seen == Seen()
    # The real forwards, on real tensors (a meta tensor left failed them).
    registering(boxed(torch.ones(3, 4, dtype=torch.float64)))
    assert _state(nn.Sequential(boxed, registering)) == [(1, [3], "cpu"), (1, [3], "cpu")]


@settings(max_examples=16, deadline=None)
@given(**grid())
@example(stages=2, microbatches=3, schedule="zb-h1")
def test_state_on_objects_and_registered_buffers_is_one_devices_per_microbatch(
    stages: int, microbatches: int, schedule: str
) -> None:
    step_per_microbatch(_model, _state, stages, microbatches, schedule)


class BoxedRef(nn.Module):
    """Centres its inputs on the mean of the first batch it saw, kept on an object."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.box = SimpleNamespace(ref=None)

    def forward(self, x: Tensor) -> Tensor:
        if self.box.ref is None:
            self.box.ref = x.detach().mean(0)
        return torch.tanh(self.lin(x - self.box.ref))


def test_a_mean_of_the_inputs_kept_on_an_object_and_read_back_is_refused() -> None:
    # Run per microbatch, microbatches 1 on would centre on microbatch 0's mean.
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    model = nn.Sequential(nn.Linear(4, 4, dtype=torch.float64), BoxedRef())
    with Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss()) as pipe, \
            pytest.raises(PipelineConfigError, match=r"stage 1 .*reads BoxedRef\.box"):
        pipe.train_step(x, y)
    assert model[1].box.ref is None  # the check left nothing
