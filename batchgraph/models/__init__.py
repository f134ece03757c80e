"""Example models for batchgraph: a binary TreeLSTM classifier and its hand-batched twin.

Example:
    >>> from batchgraph.data import Tree
    >>> from batchgraph.models import HandBatchedTreeLSTM, TreeLSTMClassifier
    >>> model = TreeLSTMClassifier(vocab_size=10, classes=2, hidden=4)
    >>> HandBatchedTreeLSTM(model)([Tree.from_nested((1, 2))]).shape
    torch.Size([1, 2])
"""

from __future__ import annotations

from batchgraph.models.handbatched import HandBatchedTreeLSTM, TreeBatchPlan
from batchgraph.models.treelstm import BinaryTreeLSTMCell, LeafCell, TreeLSTMClassifier

__all__ = [
    "BinaryTreeLSTMCell",
    "HandBatchedTreeLSTM",
    "LeafCell",
    "TreeBatchPlan",
    "TreeLSTMClassifier",
]
