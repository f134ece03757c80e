"""A stage built on meta is allocated and initialised by its modules' resets.

``to_empty`` allocates uninitialised memory; a parameter or buffer that no
``reset_parameters`` sets kept it (a ones mask read as zeros, a scale of -3.8e30) and
trained on it, silently. Now a floating one is NaN until loaded, and a warning names them.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from batchgraph.pipeline import make_schedule
from batchgraph.pipeline.dist_build import build_local_stages, materialise

CPU = torch.device("cpu")


class Scale(nn.Module):
    """A layer whose parameter and buffers are set in __init__ only (no reset_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((4,), 1e-5))
        self.register_buffer("mask", torch.ones(4))
        self.register_buffer("ids", torch.arange(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma * self.mask


class Block(nn.Module):
    """A block whose own reset_parameters initialises its child's parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Module()
        self.inner.weight = nn.Parameter(torch.ones(4))
        self.bias = nn.Parameter(torch.zeros(4))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.inner.weight.fill_(2.0)
            self.bias.fill_(0.5)


def test_a_tensor_no_reset_sets_is_nan_and_named() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.warns(RuntimeWarning, match=r"^stage 1 \(Sequential\) was built on meta") as info:
        got = materialise(model, CPU, "stage 1 (Sequential)")
    message = str(info[0].message)
    for name in ("1.gamma (Scale)", "1.mask (Scale)", "1.ids (Scale)"):
        assert name in message, message
    assert "0.weight" not in message and "reset_parameters()" in message
    assert got[1].gamma.isnan().all() and got[1].mask.isnan().all()
    assert not got[0].weight.isnan().any()
    # Loaded from a state_dict, they train as given.
    got.load_state_dict(nn.Sequential(nn.Linear(4, 4), Scale()).state_dict())
    assert not got(torch.ones(2, 4)).isnan().any()


def test_build_local_stages_names_the_stage() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), Scale())
    schedule = make_schedule("1f1b", stages=2, microbatches=2)
    with pytest.warns(RuntimeWarning, match=r"^stage 1 \(\w+\) was built on meta.* 1.mask"):
        stages = build_local_stages(model, schedule, 1, CPU, set())
    assert stages[1].module(torch.ones(2, 4)).isnan().all()  # loud, not garbage


def test_a_parent_reset_may_set_its_childrens_tensors() -> None:
    with torch.device("meta"):
        block = Block()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = materialise(block, CPU)
    assert torch.equal(got.inner.weight, torch.full((4,), 2.0))
    assert torch.equal(got.bias, torch.full((4,), 0.5))


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Linear(4, 4),
        lambda: nn.BatchNorm1d(4),
        lambda: nn.MultiheadAttention(4, 2),  # _reset_parameters
        lambda: nn.Embedding(5, 4, padding_idx=0),
        lambda: nn.LSTM(4, 4),
        lambda: nn.TransformerEncoderLayer(4, 2, 8),
        lambda: nn.RMSNorm(4),
    ],
    ids=[
        "Linear",
        "BatchNorm1d",
        "MultiheadAttention",
        "Embedding",
        "LSTM",
        "Transformer",
        "RMSNorm",
    ],
)
def test_torch_layers_are_initialised_by_their_resets(make: object) -> None:
    assert callable(make)
    with torch.device("meta"):
        layer = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = materialise(layer, CPU)
    for name, t in [*got.named_parameters(), *got.named_buffers()]:
        assert not t.is_meta, name
        if t.is_floating_point():
            assert not t.isnan().any(), f"{name} left uninitialised"
    if isinstance(got, nn.MultiheadAttention):  # set by _reset_parameters, not left as memory
        assert torch.equal(got.in_proj_bias, torch.zeros(12))
        assert got.in_proj_weight.abs().min() > 0
    if isinstance(got, nn.BatchNorm1d):  # buffers as a fresh layer's
        fresh = nn.BatchNorm1d(4)
        assert torch.equal(got.running_var, fresh.running_var)
        assert torch.equal(got.num_batches_tracked, fresh.num_batches_tracked)
