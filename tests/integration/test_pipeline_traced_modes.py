"""Graph-split stages follow ``model.train()`` / ``model.eval()``.

torch.fx tracing turns a read of ``self.training`` in the traced Python into a constant;
the stages kept the mode the model was built in: after ``model.eval()``,
``pipe.forward`` still applied ``F.dropout(x, p, self.training)``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from batchgraph.pipeline import Pipeline, PipelineConfigError
from batchgraph.pipeline.traced_modes import ModeParts
from tests.pipeline_models import assert_grads_equal, reference


class _FunctionalDropout(nn.Module):
    """Reads its mode in its own forward (traced through), and has a dropout layer
    (a leaf: reads its mode at every call)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.c = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = F.dropout(torch.tanh(self.a(x)), 0.5, self.training)
        h = self.drop(torch.tanh(self.b(h)))
        out: Tensor = self.c(h)
        return out


class _Noisy(nn.Module):
    """A block whose traced operations depend on its mode."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h: Tensor = self.lin(x)
        if self.training:
            h = h * 0.5
        return h


class _Branching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.block = _Noisy()
        self.last = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.last(torch.tanh(self.block(torch.tanh(self.first(x)))))
        return out


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_functional_dropout_follows_eval_and_train(schedule: str) -> None:
    torch.manual_seed(0)
    model = _FunctionalDropout().double()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    loss_fn = nn.MSELoss()
    with Pipeline(
        model, stages=2, microbatches=4, schedule=schedule, loss_fn=loss_fn, timeout=30
    ) as pipe:
        assert all(isinstance(m, ModeParts) for m in pipe.stage_modules)
        model.eval()
        with torch.no_grad():
            want = model(x)
        # The stages once kept the training mode they were traced in: random outputs.
        torch.testing.assert_close(pipe.forward(x), want, rtol=1e-12, atol=1e-12)
        want_loss, want_grads = reference(model, x, y, loss_fn)
        loss = pipe.train_step(x, y)
        torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
        assert_grads_equal(model, want_grads)
        # Training mode again: dropout again.
        model.train()
        assert not torch.allclose(pipe.forward(x), want)
        pipe.train_step(x, y)
        # Monte Carlo dropout: a dropout layer (not traced through) switched on alone.
        model.eval()
        model.drop.train()
        assert not torch.allclose(pipe.forward(x), want)


def test_a_mode_dependent_branch_is_refused_in_the_other_mode() -> None:
    torch.manual_seed(0)
    model = _Branching()
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    with Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss(), timeout=30) as pipe:
        pipe.train_step(x, y)
        model.eval()
        with pytest.raises(
            PipelineConfigError,
            match=r"split _Branching by tracing it with torch\.fx in training mode, and its "
            r"forward reads self\.training.*now _Branching\.training=False, block\.training="
            r"False.*differs in its operations.*second Pipeline after model\.eval\(\)",
        ):
            pipe.forward(x)
        model.train()
        pipe.train_step(x, y)  # the mode it was traced in still works
    # Built in eval mode, it runs in eval mode, as one device does.
    model.eval()
    with Pipeline(model, stages=2, microbatches=2, timeout=30) as pipe, torch.no_grad():
        torch.testing.assert_close(pipe.forward(x), model(x))


def test_mixed_modes_between_root_and_block_are_refused() -> None:
    model = _FunctionalDropoutOuter()
    x = torch.randn(4, 4)
    with Pipeline(model, stages=2, microbatches=2, timeout=30) as pipe:
        model.eval()
        model.inner.train()
        with pytest.raises(PipelineConfigError, match=r"not in these mixed modes"):
            pipe.forward(x)


class _FunctionalDropoutOuter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _FunctionalDropout()
        self.head = nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(F.dropout(self.inner(x), 0.1, self.training))
        return out


def test_models_that_do_not_read_their_mode_get_plain_parts() -> None:
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.drop, self.b = nn.Linear(4, 4), nn.Dropout(0.1), nn.Linear(4, 2)

        def forward(self, x: Tensor) -> Tensor:
            out: Tensor = self.b(self.drop(self.a(x)))
            return out

    with Pipeline(Plain(), stages=2, microbatches=2, timeout=30) as pipe:
        assert all(isinstance(m, fx.GraphModule) for m in pipe.stage_modules)


def test_mode_parts_move_with_their_stage() -> None:
    model = _FunctionalDropout()
    x = torch.randn(4, 4, dtype=torch.float64)
    with Pipeline(model, stages=2, microbatches=2, devices=["cpu", "cpu"], timeout=30) as pipe:
        for part in pipe.stage_modules:
            part.double()  # converts both traced parts' tensors (and the shared layers)
        model.eval()
        out = pipe.forward(x)
    assert isinstance(out, Tensor) and out.dtype == torch.float64
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))
