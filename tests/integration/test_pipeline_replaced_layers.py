"""A layer replaced in the model after the pipeline was built is refused at the next step.

The stages hold the layer objects the model had when the pipeline was built. A layer
replaced in the model (``model[4] = nn.Linear(...)``, ``model.head = ...``) never reached
them: the steps went on training the old layer, ``pipe.state_dict()`` saved it under the
new one's name, and ``model(x)`` ran the new, untrained one, without a word. Changes inside
a layer reach the stages and are not refused.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from batchgraph.pipeline import Pipeline, PipelineConfigError
from tests.pipeline_models import assert_grads_equal, mlp, reference

_SCHEDULES = ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"]


def _data(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 5, dtype=torch.float64), torch.randn(n, 3, dtype=torch.float64)


@settings(max_examples=10, deadline=None)
@given(schedule=st.sampled_from(_SCHEDULES), index=st.integers(0, 7), delete=st.booleans())
def test_a_replaced_layer_of_a_sequential_is_refused(
    schedule: str, index: int, delete: bool
) -> None:
    model = mlp(layers=4)  # 7 layers: Linear, Tanh, ...; index 7 is the last but deleted
    x, y = _data()
    chunks = 2 if schedule == "interleaved-1f1b" else 1
    with Pipeline(
        model, stages=2, microbatches=3, schedule=schedule, chunks=chunks,
        loss_fn=nn.MSELoss(), cost="uniform", timeout=30,
    ) as pipe:  # fmt: skip
        pipe.train_step(x, y)
        index = min(index, len(model) - 1)
        if delete:
            del model[len(model) - 1]
            index = len(model)
        else:
            model[index] = nn.Linear(6, 6) if index % 2 == 0 else nn.ReLU()
        calls = [
            lambda: pipe.train_step(x, y),
            lambda: pipe.forward(x),
            pipe.state_dict,
            lambda: pipe.load_state_dict(model.state_dict(), strict=False),
        ]
        for call in calls:
            with pytest.raises(PipelineConfigError, match=rf"layer '{index}' was replaced"):
                call()


def test_a_replaced_layer_or_parameter_of_a_traced_model_is_refused() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = mlp(layers=3)
            self.scale = nn.Parameter(torch.ones(3, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x) * self.scale

    model = Net()
    x, y = _data()
    with Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss(), timeout=30) as pipe:
        pipe.train_step(x, y)
        model.scale = nn.Parameter(torch.full((3,), 2.0, dtype=torch.float64))
        with pytest.raises(PipelineConfigError, match=r"parameter 'scale' was replaced"):
            pipe.train_step(x, y)
    with Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss(), timeout=30) as pipe:
        model.body[4] = nn.Linear(6, 3, dtype=torch.float64)
        with pytest.raises(PipelineConfigError, match=r"layer 'body.4' was replaced"):
            pipe.forward(x)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_changes_inside_layers_are_not_refused_and_train_exactly(schedule: str) -> None:
    model = mlp(layers=4)
    x, y = _data()
    with Pipeline(
        model, stages=2, microbatches=3, schedule=schedule, loss_fn=nn.MSELoss(), timeout=30
    ) as pipe:
        pipe.train_step(x, y)
        # A parameter of a layer replaced, values changed in place, a layer frozen, and a
        # module added to the model beside the split ones: all reach the stages.
        model[0].weight = nn.Parameter(torch.randn(6, 5, dtype=torch.float64))
        with torch.no_grad():
            model[2].bias.add_(1.0)
        model[4].requires_grad_(False)
        model.add_module("extra", nn.Linear(2, 2))
        want_loss, want = reference(model[:7], x, y, nn.MSELoss())
        loss = pipe.train_step(x, y)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model[:7], want)
