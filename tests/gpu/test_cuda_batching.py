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
