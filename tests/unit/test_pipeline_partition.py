"""Partitioning: the DP equals brute force; splits share the original layers; fx split is exact."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from batchgraph.pipeline import (
    Pipeline,
    balanced_partition,
    layer_costs,
    partition_graph,
    partition_sequential,
)
from batchgraph.pipeline.errors import PipelineConfigError


def _brute_force(costs: list[float], parts: int) -> float:
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@given(
    costs=st.lists(st.integers(0, 20).map(float), min_size=1, max_size=9),
    parts=st.integers(1, 9),
)
def test_dp_equals_brute_force(costs: list[float], parts: int) -> None:
    parts = min(parts, len(costs))
    bounds = balanced_partition(costs, parts)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == len(costs)
    assert all(a < b for a, b in bounds)
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(bounds))
    assert max(sum(costs[a:b]) for a, b in bounds) == _brute_force(costs, parts)


def test_partition_errors() -> None:
    with pytest.raises(PipelineConfigError, match="cannot split 2 layers into 3 stages"):
        balanced_partition([1.0, 1.0], 3)
    for bad in (-1.0, float("nan"), float("inf")):  # `nan < 0` is False: nan went through
        with pytest.raises(PipelineConfigError, match="costs must be finite and >= 0"):
            balanced_partition([1.0, bad, 1.0], 2)
    with pytest.raises(PipelineConfigError, match="unknown cost"):
        layer_costs([nn.ReLU()], "flops")
    with pytest.raises(PipelineConfigError, match="pass sample="):
        layer_costs([nn.ReLU()], "profile")


def test_sequential_split_shares_layers_and_balances_params() -> None:
    net = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 2), nn.ReLU(), nn.Linear(2, 2))
    stages = partition_sequential(net, 2, cost="params")
    assert [len(s) for s in stages] == [1, 4]  # costs 111 | 1 + 23 + 1 + 7
    assert stages[0][0] is net[0]
    x = torch.randn(3, 10)
    torch.testing.assert_close(stages[1](stages[0](x)), net(x))


def test_profile_restores_grads_and_buffers() -> None:
    net = [nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU()]
    stats = net[1].running_mean.clone()  # type: ignore[union-attr]
    costs = layer_costs(net, "profile", torch.randn(8, 4), repeat=2)
    assert len(costs) == 3 and all(c > 0 for c in costs)
    assert all(p.grad is None for layer in net for p in layer.parameters())
    torch.testing.assert_close(net[1].running_mean, stats)


def test_profile_runs_in_place_layers_and_leaves_the_sample() -> None:
    # ReLU(inplace=True) on a leaf that requires grad failed ("a leaf Variable that
    # requires grad is being used in an in-place operation"); a first in-place layer
    # would have changed the caller's sample.
    net = [nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)]
    sample = torch.randn(8, 4)
    before = sample.clone()
    costs = layer_costs(net, "profile", sample, repeat=2)
    assert len(costs) == 4 and all(c > 0 for c in costs)
    torch.testing.assert_close(sample, before, rtol=0, atol=0)
    assert [len(s) for s in partition_sequential(net, 2, cost="profile", sample=sample)]


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        left = self.b(h)
        right = self.c(torch.tanh(h)) * self.scale
        return self.out(left + right + h) + bias


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_graph_split_equals_original(parts: int) -> None:
    net = Branchy()
    x, bias = torch.randn(5, 4), torch.randn(5, 3)
    pieces = partition_graph(net, parts, cost="params")
    assert len(pieces) == parts
    values: tuple[torch.Tensor, ...] = (x, bias)
    for piece in pieces:
        result = piece(*values)
        values = result if isinstance(result, tuple) else (result,)
    torch.testing.assert_close(values[0], net(x, bias))
    # Parameters are shared, never copied.
    own = {id(p) for p in net.parameters()}
    assert all(id(p) in own for piece in pieces for p in piece.parameters())


@pytest.mark.parametrize(
    ("sample", "match"),
    [
        (
            torch.randn(3, 5),
            r"could not time layer 0 \(Linear\) on sample= \(\(3, 5\) torch.float32\): "
            r"RuntimeError: mat1 and mat2 shapes cannot be multiplied",
        ),
        (
            torch.randn(3, 4, dtype=torch.float64),
            r"could not time layer 0 \(Linear\) on sample= \(\(3, 4\) torch.float64\)",
        ),
    ],
)
def test_profile_names_the_layer_a_wrong_sample_fails_in(sample: torch.Tensor, match: str) -> None:
    # The layer's own error came out bare ("mat1 and mat2 shapes cannot be multiplied"),
    # from Pipeline(..., cost="profile"), with nothing saying it was the profiling sample.
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(PipelineConfigError, match=match) as info:
        Pipeline(net, stages=2, cost="profile", sample=sample)
    assert "give sample= one microbatch of the model's inputs" in str(info.value)
    narrow = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(4, 2))  # 3 -> 4 breaks
    with pytest.raises(PipelineConfigError, match=r"layer 2 \(Linear\) on what layers 0\.\.1"):
        layer_costs(list(narrow), "profile", torch.randn(2, 4))
