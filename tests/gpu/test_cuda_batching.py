"""Batching on CUDA: the same equality with eager as on CPU (skipped without CUDA)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import batchgraph as bg
from batchgraph.testing import assert_batched_matches_eager
from tests.property.models import TreeModel

pytestmark = pytest.mark.gpu


class CudaTreeModel(TreeModel):
    """Token constants are created on the model's device, one copy per batch."""

    def encode(self, tree: Any) -> Any:
        if isinstance(tree, int):
            token = bg.batched_value(tree, device=self.out.weight.device)
            return self.leaf(self.embed(token))
        return super().encode(tree)


def test_tree_model_on_cuda_matches_eager() -> None:
    model = CudaTreeModel().double().cuda()
    trees = [(1, (2, 3)), ((4, 5), (6, (7, 8))), 9, (1, 2), ((3, 3), 3)]
    report = assert_batched_matches_eager(model.logits, trees, rtol=0, atol=1e-10)
    assert report.stats is not None and report.stats.launches == report.stats.lower_bound


def test_outputs_stay_on_the_device() -> None:
    lin = bg.batched_func(torch.nn.Linear(3, 3).cuda())
    with bg.BatchingPolicy():
        hs = [lin(torch.randn(3, device="cuda")) for _ in range(4)]
    assert all(t.is_cuda for t in bg.compute(hs))


def test_training_gradients_on_cuda_equal_eager_through_pools_and_reductions() -> None:
    torch.manual_seed(0)
    model = CudaTreeModel().double().cuda()
    trees = [(1, (2, 3)), ((4, 5), (6, (7, 8))), 9, ((3, 3), (3, (1, 2))), (2, (4, (6, 8)))]

    def loss_of(tree: Any) -> Any:
        return model.logits(tree).logsumexp(0) - model.logits(tree).amax()

    eager = torch.stack([loss_of(t) for t in trees]).sum()
    want = torch.autograd.grad(eager, list(model.parameters()))
    with bg.BatchingPolicy() as policy:
        handles = [loss_of(t) for t in trees]
    got = torch.stack(bg.compute(handles)).sum()
    have = torch.autograd.grad(got, list(model.parameters()))
    torch.testing.assert_close(got, eager, rtol=0, atol=1e-10)
    for a, b in zip(have, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert policy.stats is not None and policy.stats.launches == policy.stats.lower_bound


def test_a_batch_crosses_to_the_host_in_one_copy() -> None:
    lin = bg.batched_func(torch.nn.Linear(3, 5).cuda())
    xs = [torch.randn(3, device="cuda") for _ in range(6)]
    with bg.BatchingPolicy() as policy:
        hs = [lin(x).argmax().cpu() for x in xs]
    got = bg.compute(hs)
    assert [int(t) for t in got] == [int(lin(x).argmax()) for x in xs]
    assert all(t.device.type == "cpu" for t in got)
    assert policy.stats is not None and policy.stats.launches == 3  # linear, argmax, copy


def test_a_0d_cpu_tensor_goes_with_cuda_values_as_eagerly() -> None:
    # A scale made inline on the CPU: eagerly torch reads a 0-d CPU tensor as a number
    # beside tensors on any device; stacked it has a dimension, and moves first.
    xs = [torch.randn(3, device="cuda") for _ in range(3)]
    with bg.BatchingPolicy():
        hs = [bg.batched_value(x) * torch.tensor(0.5) + torch.tensor(2.0, dtype=torch.float64)
              for x in xs]
    for x, got in zip(xs, bg.compute(hs), strict=True):
        want = x * torch.tensor(0.5) + torch.tensor(2.0, dtype=torch.float64)
        assert got.is_cuda and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)
