"""Stage forwards drawing from Python's ``random`` or NumPy's global generator (a
LayerDrop: ``if self.training and random.random() < p: return x``) through a
pipeline's checks before its first step.

The shape probe and the kept-inputs check run the stages' forwards on meta tensors
(and, for a forward reading ``.item()``, three times on real ones): such a forward drew
there too, and torch's generator was set back but not these. So the runs took other
branches from one run to the next and the stage was refused as "computes its output
otherwise at its second call" (several microbatches; no state is kept), or, reading
``.item()``, the runs' draws shifted the step's: its layers dropped otherwise than the
same step without the check, silently, and the user's draws after the step moved too.
So did a module's own ``torch.Generator`` (``self.gen``, drawn from with ``generator=``),
which the runs on real tensors moved and nothing set back.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from batchgraph.pipeline import Pipeline
from batchgraph.pipeline.kept_inputs import check_inputs_kept
from batchgraph.pipeline.microbatch import check_stages_fit
from tests.pipeline_models import (
    assert_grads_equal,
    chunks_for,
    grid,
    microbatch_reference,
    stacked,
)


class PyDrop(nn.Module):
    """Skipped at random by Python's generator (LayerDrop), scaled by NumPy's."""

    def forward(self, x: Tensor) -> Tensor:
        scale = 1 + float(np.random.rand())
        if self.training and random.random() < 0.5:
            return x
        return torch.tanh(x) * scale


class ItemPyDrop(PyDrop):
    """PyDrop reading a value in Python first (checked on real tensors)."""

    def forward(self, x: Tensor) -> Tensor:
        if not x.isfinite().all().item():  # cannot run on meta tensors
            raise ValueError("not finite")
        return super().forward(x)


def _states() -> tuple[object, ...]:
    numpy_state = np.random.get_state()
    return (random.getstate(), numpy_state[1].tobytes(), numpy_state[2])


def _after_draws(seed: int, draws: int) -> tuple[object, ...]:
    """The generators' states after ``draws`` draws of each from ``seed``."""
    random.seed(seed)
    np.random.seed(seed)
    for _ in range(draws):
        random.random()
        np.random.rand()
    return _states()


@pytest.mark.parametrize("layer", [PyDrop, ItemPyDrop])
@settings(max_examples=10, deadline=None)
@given(**grid(), seed=st.integers(0, 2**16))
@example(stages=2, microbatches=2, schedule="1f1b", seed=5)
def test_a_step_draws_once_per_layer_and_microbatch_and_is_not_refused(
    layer: type[nn.Module], stages: int, microbatches: int, schedule: str, seed: int
) -> None:
    blocks = stages * chunks_for(schedule)
    want = _after_draws(seed, blocks * microbatches)  # the step's forwards' draws only
    model = stacked(blocks, layer)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    random.seed(seed)
    np.random.seed(seed)
    with Pipeline(model, stages=stages, microbatches=microbatches, schedule=schedule,
                  loss_fn=nn.MSELoss(), chunks=chunks_for(schedule)) as pipe:
        loss = pipe.train_step(x, y)
    assert _states() == want
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("layer", [PyDrop, ItemPyDrop])
def test_the_checks_leave_pythons_and_numpys_generators(layer: type[nn.Module]) -> None:
    model = stacked(2, layer)
    x = torch.randn(3, 4, dtype=torch.float64)
    random.seed(3)
    np.random.seed(3)
    before = _states()
    check_stages_fit([model[:2], model[2:]], [x])
    check_inputs_kept([model[:2], model[2:]], [x], later=x * 2)
    assert _states() == before


class OwnNoise(nn.Module):
    """Adds noise from a generator of its own, reading a value in Python first (so
    checked on real tensors, whose runs drew from it and left it moved: 6685f77)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.gens = [torch.Generator().manual_seed(7)]  # in a container too

    def forward(self, x: Tensor) -> Tensor:
        if not x.isfinite().all().item():  # cannot run on meta tensors
            raise ValueError("not finite")
        noise = torch.rand(x.shape, generator=self.gens[0], dtype=x.dtype)
        return torch.tanh(self.lin(x)) + noise


@settings(max_examples=10, deadline=None)
@given(**grid())
@example(stages=2, microbatches=2, schedule="gpipe")
def test_a_modules_own_generator_draws_as_one_device_a_microbatch_at_a_time(
    stages: int, microbatches: int, schedule: str
) -> None:
    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[OwnNoise() for _ in range(stages * chunks_for(schedule))])

    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    # Each layer draws from its own generator once per microbatch, in microbatch order.
    reference = model()
    loss, grads = microbatch_reference(reference, x, y, microbatches)
    piped = model()
    with Pipeline(piped, stages=stages, microbatches=microbatches, schedule=schedule,
                  loss_fn=nn.MSELoss(), chunks=chunks_for(schedule)) as pipe:
        torch.testing.assert_close(pipe.train_step(x, y), loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(piped, grads)
    for a, b in zip(piped, reference, strict=True):
        assert torch.equal(a.gens[0].get_state(), b.gens[0].get_state())


class TorchDrawn(nn.Module):
    """Scales by a number drawn from torch's CPU generator and read in Python: a draw
    the runs on meta tensors make too."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x) * (1 + torch.rand(()).item())


def test_the_runs_on_meta_leave_torchs_generator() -> None:
    model = stacked(2, TorchDrawn)
    x = torch.randn(3, 4, dtype=torch.float64)
    before = torch.get_rng_state()
    check_stages_fit([model[:2], model[2:]], [x])
    check_inputs_kept([model[:2], model[2:]], [x], later=x * 2)
    assert torch.equal(torch.get_rng_state(), before)
