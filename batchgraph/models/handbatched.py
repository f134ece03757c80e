"""``HandBatchedTreeLSTM``: the TreeLSTM batched by hand — the ceiling for autobatching.

It runs the very modules (and parameters) of a ``TreeLSTMClassifier`` over a whole
batch of trees with the fewest calls a level-by-level schedule allows:

1. one ``embed`` + one ``leaf`` call for all leaves of the batch;
2. one ``cell`` call per tree level (height 1, 2, ...), every node of that height in
   the batch at once;
3. one ``out`` call on the roots.

**State table.** States live in a *pool*: one ``(rows, 2 * hidden)`` tensor holding
``[h | c]`` of every computed node whose parent has not run yet. Each level does one
``index_select`` that puts the level's left children, then its right children, then
the still-pending rows in order, and one ``cat`` that appends the level's new states
to the pending rows::

    pool ──index_select(idx_k)──▶ [ left kids | right kids | pending ]
                                      │            │           │
                                      └── cell ────┘           │
                                           │                   │
    new pool = cat([ pending , [h|c] of level k ]) ◀───────────┘

Consumed rows leave the pool, so each level copies (and its backward zero-fills) only
the frontier, not every state computed so far. All index tensors are built by one
pass of plain Python over the trees and converted with a single ``torch.tensor`` call;
no tensor op is ever issued per node.

**Deduplication** (on by default, like ``bg.BatchingPolicy(dedupe=True)``): leaves
with the same token, and subtrees with the same children, are computed once — the
embedding and both cells are functions of their inputs only, so this changes no value
and, through autograd, no gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from batchgraph.data.trees import Tree
from batchgraph.models.treelstm import BinaryTreeLSTMCell, LeafCell, TreeLSTMClassifier

__all__ = ["HandBatchedTreeLSTM", "TreeBatchPlan"]


@dataclass(frozen=True)
class TreeBatchPlan:
    """Index tensors for one batch of trees (see the module docstring).

    Attributes:
        leaf_tokens: ``(U,)`` token ids of the distinct leaves, in pool order.
        levels: per tree level ``(n, idx)``: ``n`` nodes run, and the ``index_select``
            index ``[left children (n), right children (n), pending rows]`` into the pool.
        roots: ``(B,)`` pool rows of the trees' roots after the last level.
        cells: number of cell evaluations (distinct internal nodes).
    """

    leaf_tokens: torch.Tensor
    levels: tuple[tuple[int, torch.Tensor], ...]
    roots: torch.Tensor
    cells: int


class HandBatchedTreeLSTM(nn.Module):
    """The modules of ``model``, run level by level over a batch of trees.

    The modules are shared, not copied: training this trains ``model`` too.

    Args:
        model: the per-example classifier whose ``embed``, ``leaf``, ``cell`` and ``out``
            are used.
        dedupe: compute identical leaves and subtrees once.

    Example:
        >>> model = TreeLSTMClassifier(vocab_size=10, classes=3, hidden=8)
        >>> trees = [Tree.from_nested(((1, 2), 3)), Tree.leaf(5)]
        >>> logits = HandBatchedTreeLSTM(model)(trees)
        >>> logits.shape
        torch.Size([2, 3])
        >>> torch.allclose(logits[0], model.logits(trees[0]), atol=1e-6)
        True
    """

    def __init__(self, model: TreeLSTMClassifier, dedupe: bool = True) -> None:
        super().__init__()
        self.embed = _submodule(model, "embed", nn.Embedding)
        self.leaf = _submodule(model, "leaf", LeafCell)
        self.cell = _submodule(model, "cell", BinaryTreeLSTMCell)
        self.out = _submodule(model, "out", nn.Linear)
        self.hidden = model.hidden
        self.dedupe = dedupe

    def plan(self, trees: Sequence[Tree]) -> TreeBatchPlan:
        """Build the index tensors for ``trees`` (plain Python, O(nodes + frontier)).

        Args:
            trees: the batch (at least one tree).

        Returns:
            A ``TreeBatchPlan`` to pass to ``forward`` (possibly more than once).

        Raises:
            ValueError: for an empty batch.
        """
        if not trees:
            raise ValueError("HandBatchedTreeLSTM needs at least one tree, got an empty batch")
        return _plan(trees, self.dedupe)

    def forward(self, trees: Sequence[Tree] | TreeBatchPlan) -> torch.Tensor:
        """Logits ``(B, classes)`` of a batch of trees (or of a prebuilt plan).

        Args:
            trees: the trees, or ``self.plan(trees)``.

        Returns:
            The class scores, row ``b`` for tree ``b``.
        """
        plan = trees if isinstance(trees, TreeBatchPlan) else self.plan(trees)
        d = self.hidden
        h, c = self.leaf(self.embed(plan.leaf_tokens))
        pool = torch.cat([h, c], dim=1)
        for n, idx in plan.levels:
            rows = pool.index_select(0, idx)
            left, right = rows[:n], rows[n : 2 * n]
            h, c = self.cell(left[:, :d], left[:, d:], right[:, :d], right[:, d:])
            pool = torch.cat([rows[2 * n :], torch.cat([h, c], dim=1)])
        root_h = pool.index_select(0, plan.roots)[:, :d]
        out: torch.Tensor = self.out(root_h)
        return out


_M = TypeVar("_M", bound=nn.Module)


def _submodule(model: TreeLSTMClassifier, name: str, kind: type[_M]) -> _M:
    # Read from _modules: outside any policy that is what attribute access returns
    # anyway, and it never hands out a recording stub, even inside a policy.
    module = model._modules.get(name)
    if not isinstance(module, kind):
        raise TypeError(
            f"model.{name} must be a {kind.__name__} to be hand-batched, got {module!r}"
        )
    return module


def _plan(trees: Sequence[Tree], dedupe: bool) -> TreeBatchPlan:
    # 1. Entries: one per distinct computation (with dedupe) or per node (without).
    #    While visiting, leaf entries are negative (~0, ~1, ...) and internal ones count
    #    up from 0; afterwards leaf ~k becomes pool row k and internal i row U + i, so
    #    the U leaves come first, then internal nodes in creation order.
    tokens: list[int] = []
    pending: list[tuple[int, int]] = []  # (left, right) per internal entry
    heights: list[int] = []
    leaf_entry: dict[int, int] = {}
    node_entry: dict[tuple[int, int], int] = {}
    leaf_get, node_get = leaf_entry.get, node_entry.get

    def visit(node: Tree) -> int:
        # Recursion (depth = tree height) is the cheapest traversal in CPython here.
        token = node.token
        if token is not None:
            e = leaf_get(token) if dedupe else None
            if e is None:
                e = ~len(tokens)
                tokens.append(token)
                if dedupe:
                    leaf_entry[token] = e
            return e
        assert node.left is not None and node.right is not None
        key = (visit(node.left), visit(node.right))
        e = node_get(key) if dedupe else None
        if e is None:
            e = len(pending)
            pending.append(key)
            heights.append(node.depth)
            if dedupe:
                node_entry[key] = e
        return e

    root_entries = [visit(t) for t in trees]
    u = len(tokens)
    total = u + len(pending)

    # 2. Uses (how many reads each row still awaits) and the nodes of each height.
    uses = [0] * total
    by_height: list[list[int]] = [[] for _ in range(max(heights, default=0))]
    kids: list[tuple[int, int]] = []
    for i, (left, right) in enumerate(pending):
        left = left + u if left >= 0 else ~left
        right = right + u if right >= 0 else ~right
        kids.append((left, right))
        uses[left] += 1
        uses[right] += 1
        by_height[heights[i] - 1].append(u + i)
    roots = [e + u if e >= 0 else ~e for e in root_entries]
    for e in roots:
        uses[e] += 1

    # 3. Simulate the pool level by level to get each level's gather index.
    pos = list(range(total))  # leaves start at rows 0..U-1, where pos[e] == e
    pool = list(range(u))
    flat: list[int] = []
    sizes: list[int] = []
    for level in by_height:
        first = len(flat)
        pairs = [kids[e - u] for e in level]
        flat += [pos[left] for left, _ in pairs]
        flat += [pos[right] for _, right in pairs]
        for left, right in pairs:
            uses[left] -= 1
            uses[right] -= 1
        pool = [e for e in pool if uses[e]]
        flat += [pos[e] for e in pool]
        pool += level
        for p, e in enumerate(pool):
            pos[e] = p
        sizes.append(len(flat) - first)
    flat += [pos[e] for e in roots]

    # 4. One tensor for all indices; each level's index is a view into it.
    index = torch.tensor(flat, dtype=torch.long)
    levels: list[tuple[int, torch.Tensor]] = []
    start = 0
    for level, size in zip(by_height, sizes):
        levels.append((len(level), index[start : start + size]))
        start += size
    return TreeBatchPlan(
        leaf_tokens=torch.tensor(tokens, dtype=torch.long),
        levels=tuple(levels),
        roots=index[start:],
        cells=len(pending),
    )
