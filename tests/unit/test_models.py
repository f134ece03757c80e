"""The TreeLSTM models: the hand-batched ceiling equals the eager per-example run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from batchgraph.data import Nested, Tree
from batchgraph.models import (
    BinaryTreeLSTMCell,
    HandBatchedTreeLSTM,
    LeafCell,
    TreeLSTMClassifier,
)
from batchgraph.testing.strategies import trees

VOCAB, CLASSES = 9, 4


def _logits_and_grads(
    model: TreeLSTMClassifier, batch: list[Tree], run: str
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    if run == "eager":
        logits = torch.stack([model.logits(t) for t in batch])
    else:
        logits = HandBatchedTreeLSTM(model, dedupe=run == "hand-dedupe")(batch)
    labels = torch.tensor([t.label for t in batch])
    F.cross_entropy(logits, labels, reduction="sum").backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@given(
    batch=st.lists(trees(max_leaves=10, vocab_size=VOCAB, labels=CLASSES), min_size=1,
                   max_size=8),
    dedupe=st.booleans(),
)
def test_hand_batched_equals_eager_float64(batch: list[Tree], dedupe: bool) -> None:
    torch.manual_seed(0)
    model = TreeLSTMClassifier(VOCAB, CLASSES, hidden=5, embed_dim=3).double()
    eager, eager_grads = _logits_and_grads(model, batch, "eager")
    hand, hand_grads = _logits_and_grads(model, batch, "hand-dedupe" if dedupe else "hand")
    torch.testing.assert_close(hand, eager, rtol=0, atol=1e-10)
    assert hand_grads.keys() == eager_grads.keys()
    assert {"embed.weight", "leaf.proj.weight", "out.weight"} <= eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(hand_grads[name], grad, rtol=0, atol=1e-10, msg=name)


def test_plan_counts_one_call_per_level_and_dedupes() -> None:
    model = TreeLSTMClassifier(VOCAB, CLASSES, hidden=4)
    shared: Nested = (1, (2, 3))
    nested: list[Nested] = [(shared, shared), shared, 4, ((1, 1), (1, 1))]
    batch = [Tree.from_nested(n) for n in nested]
    plain = HandBatchedTreeLSTM(model, dedupe=False).plan(batch)
    assert plain.cells == sum(t.size - t.num_leaves for t in batch) == 5 + 2 + 0 + 3
    assert plain.leaf_tokens.tolist() == [1, 2, 3, 1, 2, 3, 1, 2, 3, 4, 1, 1, 1, 1]
    assert len(plain.levels) == max(t.depth for t in batch) == 3
    deduped = HandBatchedTreeLSTM(model).plan(batch)
    # distinct: (2,3), (1,(2,3)), (shared,shared), (1,1), ((1,1),(1,1))
    assert deduped.cells == 5
    assert deduped.leaf_tokens.tolist() == [1, 2, 3, 4]
    assert [n for n, _ in deduped.levels] == [2, 2, 1]
    # The pool only holds pending states: at the last level nothing else is pending
    # but the roots finished earlier (shared, 4 and ((1,1),(1,1))).
    n_last, idx_last = deduped.levels[-1]
    assert len(idx_last) == 2 * n_last + 3
    assert deduped.roots.tolist() == [3, 1, 0, 2]  # pool after the last level: 4, shared, ((1,1),(1,1)), root 0


def test_hand_batched_gives_deduped_trees_equal_rows() -> None:
    torch.manual_seed(0)
    model = TreeLSTMClassifier(VOCAB, CLASSES, hidden=4)
    t = Tree.from_nested(((1, 2), (1, 2)))
    out = HandBatchedTreeLSTM(model)([t, t, Tree.leaf(3)])
    assert torch.equal(out[0], out[1]) and not torch.equal(out[0], out[2])


def test_cells_work_on_one_example_and_on_batches() -> None:
    torch.manual_seed(0)
    leaf, cell = LeafCell(3, 5), BinaryTreeLSTMCell(5)
    x = torch.randn(4, 3)
    h, c = leaf(x)
    assert h.shape == c.shape == (4, 5)
    torch.testing.assert_close(leaf(x[2])[0], h[2])
    states = [torch.randn(4, 5) for _ in range(4)]
    bh, bc = cell(*states)
    one_h, one_c = cell(*(s[1] for s in states))
    torch.testing.assert_close(one_h, bh[1])
    torch.testing.assert_close(one_c, bc[1])
    # Forget gates act per child: a zero left memory leaves only the right one's trace.
    hl, cl, hr, cr = states
    _, c_zero = cell(hl, torch.zeros_like(cl), hr, cr)
    assert not torch.allclose(c_zero, bc)


def test_hand_batched_rejects_empty_batch_and_shares_parameters() -> None:
    model = TreeLSTMClassifier(VOCAB, CLASSES, hidden=4)
    hand = HandBatchedTreeLSTM(model)
    with pytest.raises(ValueError, match="at least one tree, got an empty batch"):
        hand([])
    assert {id(p) for p in hand.parameters()} == {id(p) for p in model.parameters()}
