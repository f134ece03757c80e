"""batchgraph on the TreeLSTM: batched logits and gradients equal the eager run.

On real trees (stdlib function ASTs) and on SST-like random trees, with both
schedulers, in float64 (1e-10) and float32 (1e-5); the hand-batched ceiling agrees too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import batchgraph as bg
from batchgraph.data import Tree, sst_like_trees, stdlib_function_trees
from batchgraph.models import HandBatchedTreeLSTM, TreeLSTMClassifier


def _stdlib_batch() -> tuple[list[Tree], int, int]:
    # Default arguments: the parse is cached in-process and shared with other tests.
    data = stdlib_function_trees()
    small = [t for t in data.train if t.size <= 95][:20]
    return small, len(data.vocab), len(data.classes)


def _sst_batch() -> tuple[list[Tree], int, int]:
    return sst_like_trees(20, seed=5, vocab_size=60, classes=5), 60, 5


def _run(
    model: TreeLSTMClassifier, batch: list[Tree], how: str
) -> tuple[torch.Tensor, dict[str, torch.Tensor], bg.ScheduleStats | None]:
    model.zero_grad()
    stats = None
    if how == "eager":
        logits = torch.stack([model.logits(t) for t in batch])
    elif how == "hand":
        logits = HandBatchedTreeLSTM(model)(batch)
    else:
        with bg.BatchingPolicy(scheduler=how) as policy:
            handles = [model.logits(t) for t in batch]
        logits = torch.stack(bg.compute(handles))
        stats = policy.stats
    labels = torch.tensor([t.label for t in batch])
    F.cross_entropy(logits, labels, reduction="sum").backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads, stats


@pytest.mark.parametrize("data", [_stdlib_batch, _sst_batch], ids=["stdlib", "sst-like"])
@pytest.mark.parametrize("how", ["agenda", "depth", "hand"])
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["f64", "f32"]
)
def test_batched_equals_eager(data, how: str, dtype: torch.dtype, tol: float) -> None:  # type: ignore[no-untyped-def]
    batch, vocab, classes = data()
    torch.manual_seed(0)
    model = TreeLSTMClassifier(vocab, classes, hidden=12, embed_dim=8).to(dtype)
    eager, eager_grads, _ = _run(model, batch, "eager")
    out, grads, stats = _run(model, batch, how)
    torch.testing.assert_close(out, eager, rtol=tol, atol=tol)
    assert grads.keys() == eager_grads.keys() == {n for n, _ in model.named_parameters()}
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=tol, atol=tol, msg=name)
    if stats is not None:
        # It really batched: far fewer launches than calls, never below the bound.
        assert stats.lower_bound <= stats.launches < stats.nodes / 4
        assert stats.unbatched_calls == 0
