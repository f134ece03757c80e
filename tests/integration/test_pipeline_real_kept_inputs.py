"""The kept-inputs check for stage forwards that cannot run on meta tensors (the
refusals of tensors kept from the inputs: test_pipeline_kept_inputs's Item* layers).

A forward reading a value in Python (``.item()``, ``.tolist()``) or making a shape from
values (``torch.nonzero``, ``x[x > 0]``) cannot run on meta tensors, and the check
(batchgraph.pipeline.kept_inputs) ended there, silently: such a stage keeping a mean
of microbatch 0 and centring later microbatches on it trained otherwise than one
device (loss 1.6751 where one device's 1.6757). It now runs those stages on a real
microbatch, a later one, and the later one again on the state as it was, and undoes
what the runs changed (real_runs): a stage of that kind that keeps nothing trains as
one device, its buffers and generator state untouched by the check.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from torch import Tensor, nn

from batchgraph.pipeline import Pipeline, PipelineConfigError
from batchgraph.pipeline.kept_inputs import check_inputs_kept
from tests.integration.test_pipeline_kept_inputs import _finite
from tests.pipeline_models import grid, refused_or_one_device, stacked, step_per_microbatch


class ItemScaled(nn.Module):
    """Reads values in Python and makes a shape from values, keeping nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        _finite(x)
        out = torch.tanh(self.lin(x))
        rows, cols = torch.nonzero(out > 0).unbind(1)  # a data-dependent shape
        return out.index_put((rows, cols), out[rows, cols] * 2)


class ItemFloat(ItemScaled):
    """Keeps a Python float of microbatch 0 (``.item()``) and reads it back."""

    scale: float | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.scale is None:
            self.scale = float(x.abs().mean().item())
        return super().forward(x) * self.scale


class ItemFlag(ItemScaled):
    """Computes otherwise at its second call (a first-call flag)."""

    seen = False

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x) * (2 if self.seen else 1)
        self.seen = True
        return out


class ItemTotals(ItemScaled):
    """Totals of its inputs kept in a buffer and in a plain tensor, updated in place and
    never read: the check's runs must not count in either."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(4, dtype=torch.float64))
        self.total = torch.zeros(4, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        self.seen.add_(x.detach().sum(0))
        self.total += x.detach().abs().sum(0)
        return super().forward(x)


@pytest.mark.parametrize("layer", [ItemFloat, ItemFlag])
@settings(max_examples=8, deadline=None)
@given(**grid())
@example(stages=2, microbatches=3, schedule="1f1b")
def test_a_forward_off_meta_computing_otherwise_later_is_refused(
    layer: type[nn.Module], stages: int, microbatches: int, schedule: str
) -> None:
    refused_or_one_device(layer, stages, microbatches, schedule,
                          r"stage 0 \(\w+\) computes its output otherwise at its second call")


@settings(max_examples=12, deadline=None)
@given(**grid())
@example(stages=2, microbatches=3, schedule="zb-h1")
def test_a_forward_off_meta_keeping_nothing_trains_as_one_device(
    stages: int, microbatches: int, schedule: str
) -> None:
    step_per_microbatch(lambda blocks: stacked(blocks, ItemScaled), lambda m: None,
                        stages, microbatches, schedule)


@settings(max_examples=8, deadline=None)
@given(**grid())
@example(stages=2, microbatches=2, schedule="gpipe")
def test_the_check_leaves_buffers_and_plain_tensors_as_they_were(
    stages: int, microbatches: int, schedule: str
) -> None:
    def state(model: nn.Module) -> list[object]:
        return [(m.seen.tolist(), m.total.tolist()) for m in model.modules()
                if isinstance(m, ItemTotals)]

    step_per_microbatch(lambda blocks: stacked(blocks, ItemTotals), state, stages,
                        microbatches, schedule)


class Draws(ItemScaled):
    """Reads a random draw in Python: a draw of its own, not state it kept."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * (1 + torch.rand(()).item())


def test_the_check_draws_alike_in_its_runs_and_leaves_the_generator() -> None:
    model = stacked(2, Draws)
    x, later = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    before = torch.get_rng_state()
    check_inputs_kept([model[:2], model[2:]], [x], later=later)
    assert torch.equal(torch.get_rng_state(), before)


_CALLS: list[int] = []  # rows of each call of Counted's forward, the check's too


class Counted(ItemScaled):
    """Notes its calls outside the module (nothing the check puts back)."""

    def forward(self, x: Tensor) -> Tensor:
        _CALLS.append(x.shape[0])
        return super().forward(x)


def test_the_runs_on_real_tensors_are_made_for_one_input_signature() -> None:
    # Three forwards per stage and signature would cost a step's worth of forwards for
    # every new length; the check ran on real tensors once covers the pipeline.
    model = stacked(1, Counted)
    _CALLS.clear()
    with Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss()) as pipe:
        for rows in (6, 8, 6):
            x, y = torch.randn(rows, 4, dtype=torch.float64), torch.randn(rows, 4,
                                                                          dtype=torch.float64)
            pipe.train_step(x, y)
    # 6 rows: the shape probe's and the meta check's tries (3, 3: no value on meta),
    # the real runs (3, then 4, one row longer, twice), the step (3, 3); 8 rows: the
    # tries and the step, no real runs; 6 rows again: checked, the step.
    assert _CALLS == [3, 3, 3, 4, 4, 3, 3, 4, 4, 4, 4, 3, 3]


def test_one_microbatch_is_enough_to_see_a_float_kept() -> None:
    # What a torch.distributed rank checks at its first forward: no later microbatch.
    # The later runs take it one row longer, so microbatch 0's float is another.
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(PipelineConfigError, match=r"computes its output otherwise"):
        check_inputs_kept([stacked(1, ItemFloat)], [x])
    assert check_inputs_kept([stacked(1, ItemScaled)], [x])  # ran on real tensors
